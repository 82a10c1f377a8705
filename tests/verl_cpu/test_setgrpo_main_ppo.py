"""SetGRPO through verl's ``main_ppo`` on the CPU backend: calibrate -> record -> train, via the command line and via
a hand-written ``main_ppo`` command (tiny random Llama, function grader, so that each run takes about a minute).

What must hold: the record written by ``calibrate`` is accepted by ``train`` and by a plain ``main_ppo`` run with
``algorithm.setgrpo.record_path``; a record for another K, sketch or grader is refused before Ray starts, naming the
field; every ``setgrpo/*`` metric is logged per step and agrees with the per-group log; a reject-all record makes
a step without an optimizer step that leaves the parameters bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from setgrpo_verl.core import CalibrationRecord, calibrate
from setgrpo_verl.sketch import SketchConfig

from .conftest import read_metrics, tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]

_FLAGS = ["--rollout-n", "3", "--groups-per-step", "3", "--steps", "2", "--calib-groups", "6", "--calib-batch-size",
          "6", "--max-prompt-length", "128", "--max-response-length", "8", "--alpha", "0.5", "--beta", "0.9",
          "--delta", "0.3", "--tau-grid", "0.0,0.3", "--on-infeasible", "reject_all",
          # float32 on every host: the record's identity holds the precision, and the plain command below compares
          # rollout and actor log-probs to float rounding
          "--precision", "fp32"]


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "setgrpo_verl", *args], capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, tail(proc)
    return proc


@pytest.fixture(scope="module")
def calibrated(tiny_model, reward_file, tmp_path_factory):
    run = tmp_path_factory.mktemp("setgrpo") / "run"
    common = ["--model", str(tiny_model), "--judge", "function", "--reward-function", str(reward_file), *_FLAGS]
    _cli("calibrate", "--run-dir", str(run), *common)
    return run, common


def test_calibration_record_and_paired_scores(calibrated):
    run, _ = calibrated
    rec = CalibrationRecord.from_json(run / "calibration" / "record.json")
    assert rec.K == 3 and rec.settings.alpha == 0.5 and rec.settings.tau_grid == (0.0, 0.3)
    assert rec.sketch == dataclasses.asdict(SketchConfig())
    assert rec.grader["name"].startswith("function")
    # the calibration's unparsed-verdict ratio reaches verl's tracker (a function grader: no judge verdicts)
    ratios = [m["setgrpo/grading/unparsed_ratio"] for m in read_metrics(run / "calibration" / "metrics.jsonl")
              if "setgrpo/grading/unparsed_ratio" in m]
    assert ratios == [0.0]
    z = np.load(run / "calibration" / "paired_scores.npz")
    assert z["point"].shape == (6, 3) and z["gram"].shape == (6, 3, 3)
    # the stored paired scores re-fit offline to the very same record
    refit = calibrate(torch.from_numpy(z["point"]), torch.from_numpy(z["reference"]), torch.from_numpy(z["gram"]),
                      rec.settings, split_seed=rec.split_seed)
    assert (refit.q_alpha, refit.tau_sel, refit.N, refit.F) == (rec.q_alpha, rec.tau_sel, rec.N, rec.F)


def test_train_with_the_record_logs_setgrpo_metrics(calibrated):
    run, common = calibrated
    _cli("train", "--run-dir", str(run), *common)
    steps = [m for m in read_metrics(run / "train_setgrpo" / "metrics.jsonl") if "timing_s/step" in m]
    assert [m["training/global_step"] for m in steps] == [1, 2]
    groups = [json.loads(x) for x in (run / "train_setgrpo" / "groups.jsonl").read_text().splitlines()]
    for m in steps:
        for key in ("setgrpo/accepted_ratio", "setgrpo/degenerate_ratio", "actor/update_skipped",
                    "setgrpo/timing_s/sketch", "critic/score/mean", "setgrpo/grading/unparsed_ratio"):
            assert key in m, key
        assert m["setgrpo/grading/unparsed_ratio"] == 0.0  # a function grader: no judge verdict, none unparsed
        step_groups = [g for g in groups if g["step"] == m["training/global_step"]]
        assert len(step_groups) == 3
        assert m["setgrpo/accepted_ratio"] == pytest.approx(sum(g["accepted"] for g in step_groups) / 3)
        assert m["actor/update_skipped"] == float(not any(g["accepted"] for g in step_groups))


def _hand_written(run, tiny_model, reward_file, record, *extra: str, precision: str = "fp32",
                  plain: bool = False) -> list[str]:
    """A ``main_ppo`` command with ``--config-name setgrpo_trainer``, or (``plain``) the documented plain form
    ``python -m verl.trainer.main_ppo algorithm.adv_estimator=setgrpo ...`` on verl's default config."""
    from setgrpo_verl.runner.launch import cpu_overrides, main_ppo_command

    overrides = cpu_overrides(precision=precision) + [
        f"data.train_files={run / 'data' / 'train.parquet'}", f"data.val_files={run / 'data' / 'train.parquet'}",
        "data.train_batch_size=3", "data.max_prompt_length=128", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=9",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=9", "data.seed=1",
        f"+reward.reward_kwargs.grader={{type:function,path:{reward_file},name:compute_score,seed:1}}",
        "algorithm.setgrpo.alpha=0.5", "algorithm.setgrpo.beta=0.9", "algorithm.setgrpo.delta=0.3",
        "algorithm.setgrpo.tau_grid=[0.0,0.3]", f"algorithm.setgrpo.record_path={record}",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.logger=[console]", f"trainer.default_local_dir={run / 'hand'}", *extra,
    ]
    if plain:
        return [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=setgrpo", *overrides]
    return main_ppo_command(overrides)


def _main_ppo(cmd: list[str]) -> subprocess.CompletedProcess:
    from setgrpo_verl.runner.launch import cpu_environment

    # from a temporary folder: Hydra writes its run directory (outputs/) under the working directory
    return subprocess.run(cmd, capture_output=True, text=True, env=cpu_environment(), timeout=900,
                          cwd=tempfile.mkdtemp(prefix="setgrpo_verl_tests_main_ppo_"))


def test_plain_main_ppo_command_accepts_the_record(calibrated, tiny_model, reward_file):
    import re

    from setgrpo_verl.integration.plugin import REDIRECT_MESSAGE

    run, _ = calibrated
    # the plain form on verl's default config, algorithm.setgrpo.* without '+', on the CPU backend
    # float32, as in test_grpo_main_ppo: bf16 rounding alone differs from the rollout by about 1e-6 there
    proc = _main_ppo(_hand_written(run, tiny_model, reward_file, run / "calibration" / "record.json",
                                   "actor_rollout_ref.rollout.calculate_log_probs=true", plain=True))
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    assert out.count(REDIRECT_MESSAGE) == 1
    assert "setgrpo/accepted_ratio" in out
    # the fused old-log-prob + sketch pass (the default) gives the rollout's token probabilities to float rounding,
    # as verl's own old-log-prob pass does (test_grpo_main_ppo)
    (diff,) = re.findall(r"training/rollout_probs_diff_max:([0-9.e+-]+)", out)
    assert float(diff) < 1e-8


@pytest.mark.parametrize(("edit", "needle"), [
    (dict(K=4), "mismatch in K"),
    (dict(sketch={**dataclasses.asdict(SketchConfig()), "copies": 8}), "sketch.copies"),
    (dict(grader={"name": "local_hf", "model": "SmolLM2-135M-Instruct"}), "grader."),
])
def test_other_records_are_refused_before_ray(calibrated, tiny_model, reward_file, tmp_path, edit, needle):
    run, common = calibrated
    rec = CalibrationRecord.from_json(run / "calibration" / "record.json")
    other = dataclasses.replace(rec, **edit)
    other.to_json(tmp_path / "other.json")
    proc = _main_ppo(_hand_written(run, tiny_model, reward_file, tmp_path / "other.json"))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert needle in out and "ray.init" not in out and "Started a local Ray instance" not in out
    # the command line refuses it the same way
    proc = _cli("train", "--run-dir", str(run), "--record", str(tmp_path / "other.json"), "--overwrite", *common,
                check=False)
    assert proc.returncode == 2 and needle in proc.stderr


def test_reject_all_record_leaves_the_policy_bit_identical(calibrated, tiny_model, reward_file, tmp_path):
    from safetensors.torch import load_file

    run, _ = calibrated
    rec = CalibrationRecord.from_json(run / "calibration" / "record.json")
    z = np.load(run / "calibration" / "paired_scores.npz")
    reject_all = calibrate(torch.from_numpy(z["point"]), torch.from_numpy(z["reference"]), torch.from_numpy(z["gram"]),
                           rec.settings.replace(beta=1e-4, on_infeasible="reject_all"),
                           metadata={"loss_agg_mode": rec.loss_agg_mode, "sketch": rec.sketch, "grader": rec.grader,
                                     "policy": rec.policy, "training": rec.training})
    assert reject_all.tau_sel is None
    reject_all.to_json(tmp_path / "reject_all.json")
    ckpt = tmp_path / "ckpt"
    cmd = _hand_written(run, tiny_model, reward_file, tmp_path / "reject_all.json", "algorithm.setgrpo.beta=1e-4",
                        "actor_rollout_ref.actor.optim.lr=0.1", "trainer.save_freq=1",
                        f"trainer.default_local_dir={ckpt}", "trainer.logger=[console,file]",
                        "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]")
    proc = _main_ppo(cmd)
    assert proc.returncode == 0, tail(proc)
    assert "no group accepted, no optimizer step" in proc.stdout + proc.stderr
    before = load_file(str(tiny_model / "model.safetensors"))
    (saved,) = list(ckpt.rglob("huggingface/model.safetensors"))
    after = load_file(str(saved))
    assert before.keys() <= after.keys() or after.keys() <= before.keys()
    common = before.keys() & after.keys()
    assert common and all(torch.equal(before[k], after[k]) for k in common)
