"""verl's own ``main_ppo`` with stock GRPO on the CPU backend (tiny random Llama, function reward, 2 steps).

Checks what verl computed against what it must be: each response's reward is the function of its decoded text,
the step's advantage range is verl's GRPO map of the dumped group scores (``setgrpo_verl.core.grpo_coefficients``
reproduces verl's ``compute_grpo_outcome_advantage``), and after a large-learning-rate update the rollout samples
from the updated policy: its log-probs agree with the actor's. The same run with the weight sync switched off
disagrees, so the check can fail.

Both runs request float32: the check separates synced from unsynced weights by a margin of 100x in float32 (below
1e-8 against above 1e-6), while bf16 rounding alone gave a synced difference of 1.2e-6 (measured on this model).
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from setgrpo_verl.core import grpo_coefficients

from .conftest import read_metrics, reward_of, run_main_ppo, tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]

#: Loaded by verl in every process (``VERL_USE_EXTERNAL_MODULES``): a rollout ``transformers_nosync`` whose server
#: ignores the weights the actor sends.
_NO_SYNC = '''
from setgrpo_verl.verl_cpu import activate

activate()  # external modules load before verl's plugins; the CPU platform must exist first

from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from setgrpo_verl.verl_cpu.rollout import TransformersReplica, TransformersRolloutServer


class NoSyncServer(TransformersRolloutServer):
    def _load(self, state_dict, global_steps):
        return 0


class NoSyncReplica(TransformersReplica):
    server_cls = NoSyncServer


RolloutReplicaRegistry.register("transformers_nosync", lambda: NoSyncReplica)
base._ROLLOUT_REGISTRY[("transformers_nosync", "async")] = "setgrpo_verl.verl_cpu.rollout.TransformersRolloutAdapter"
'''


def _overrides(tiny_model, rubric_parquet, reward_file, workdir, lr):
    return [
        f"data.train_files={rubric_parquet}",
        f"data.val_files={rubric_parquet}",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"reward.custom_reward_function.path={reward_file}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.total_training_steps=2",
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.rollout_data_dir={workdir / 'rollouts'}",
    ]


@pytest.fixture(scope="module")
def grpo_run(tiny_model, rubric_parquet, reward_file, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpo")
    proc = run_main_ppo(_overrides(tiny_model, rubric_parquet, reward_file, workdir, lr=0.05), workdir=workdir,
                        precision="fp32")
    assert proc.returncode == 0, tail(proc)
    return workdir


def test_two_steps_with_rewards_and_advantages_as_verl_grpo(grpo_run):
    metrics = read_metrics(grpo_run / "metrics.jsonl")
    steps = [m for m in metrics if "timing_s/step" in m]
    assert [m["training/global_step"] for m in steps] == [1, 2]
    for m in steps:
        dump = [json.loads(line) for line in (grpo_run / "rollouts" / f"{m['training/global_step']}.jsonl")
                .read_text().splitlines()]
        assert len(dump) == 8
        for row in dump:  # the reward verl recorded is the function of the decoded response
            assert row["score"] == pytest.approx(reward_of(row["output"]), abs=1e-6)
        assert m["critic/score/mean"] == pytest.approx(sum(r["score"] for r in dump) / 8, abs=1e-6)
        groups = defaultdict(list)
        for row in dump:  # key {prompt uid}_{session}_{sample}
            groups[row["uid"].rsplit("_", 2)[0]].append(row["score"])
        assert sorted(len(g) for g in groups.values()) == [2, 2, 2, 2]
        coefficients = grpo_coefficients(torch.tensor(list(groups.values()), dtype=torch.float32))
        assert m["critic/advantages/max"] == pytest.approx(float(coefficients.max()), abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(float(coefficients.min()), abs=1e-4)


def test_rollout_samples_from_the_updated_policy(grpo_run):
    step2 = [m for m in read_metrics(grpo_run / "metrics.jsonl") if m.get("training/global_step") == 2][0]
    assert step2["training/rollout_probs_diff_valid"] == 1
    # token probabilities of the random model are ~1/vocab (2e-5): synced, rollout and actor agree to float rounding
    assert step2["training/rollout_probs_diff_max"] < 1e-8


def test_the_check_fails_without_weight_sync(tiny_model, rubric_parquet, reward_file, tmp_path):
    (tmp_path / "no_sync.py").write_text(_NO_SYNC)
    env = {"VERL_USE_EXTERNAL_MODULES": "no_sync", "PYTHONPATH": str(tmp_path)}
    overrides = _overrides(tiny_model, rubric_parquet, reward_file, tmp_path, lr=0.05)
    proc = run_main_ppo(overrides, workdir=tmp_path, env=env, rollout="transformers_nosync", precision="fp32")
    assert proc.returncode == 0, tail(proc)
    step2 = [m for m in read_metrics(tmp_path / "metrics.jsonl") if m.get("training/global_step") == 2][0]
    assert step2["training/rollout_probs_diff_max"] > 1e-6
