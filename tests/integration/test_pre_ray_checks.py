"""Settings that would fail after Ray started (in core after the calibration rollouts, in verl's reward worker, in the
sketch pass) are refused by the pre-Ray check `check_run_config`, on configs composed by verl's own `main_ppo`."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest
from omegaconf import OmegaConf

import verl.trainer.main_ppo as main_ppo

from setgrpo_verl import launch
from setgrpo_verl.core import CalibrationSettings
from setgrpo_verl.integration.config import check_run_config, sketch_micro_batch_error
from setgrpo_verl.models import embedded_model_dir

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hydra_configs")  # the YAML sources
LOCAL = "+reward.reward_kwargs.grader.type=local_hf"
SKETCH_4 = ("actor_rollout_ref.rollout.n=3", "data.train_batch_size=3", "algorithm.setgrpo.calibration.batch_size=35",
            "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4")
OPENAI_TYPO = "+reward.reward_kwargs.grader={type:openai,base_url:'http://127.0.0.1:9/v1',model:m,max_token:2048}"


def _compose(*overrides: str, config: str = "setgrpo_trainer", cfg: str = "job"):
    """verl's `main_ppo --cfg job` in this process (composition only: no callback, no Ray)."""
    old = sys.argv
    path = ["--config-path", CONFIG_DIR] if config == "setgrpo_trainer" else []  # ppo_trainer: main_ppo's own
    # a policy whose configuration exists (the check before Ray builds it on the meta device), overridable
    policy = [f"actor_rollout_ref.model.path={embedded_model_dir()}"] if config == "setgrpo_trainer" else []
    sys.argv = ["main_ppo", *path, "--config-name", config, *policy, *overrides, "--cfg", cfg]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main_ppo.main()
    except SystemExit as exc:
        assert not exc.code, exc.code
    finally:
        sys.argv = old
    return OmegaConf.create(out.getvalue())


@pytest.mark.parametrize(("overrides", "message"), [
    ((OPENAI_TYPO,), "reward.reward_kwargs.grader: unknown keys for a openai grader: ['max_token']"),
    ((LOCAL, "+reward.reward_kwargs.grader.temprature=0.5"), "unknown keys for a local_hf grader: ['temprature']"),
    ((LOCAL, "algorithm.setgrpo.rho=0"), "algorithm.setgrpo.rho=0.0 must be > 0"),
    ((LOCAL, "algorithm.setgrpo.tau_grid=[0.5,0.2]"), "algorithm.setgrpo.tau_grid=[0.5, 0.2] must be non-empty, "
                                                       "strictly increasing and strictly inside (-1, 1)"),
    ((LOCAL, "algorithm.setgrpo.tau_grid=[0.0,1.0]"), "strictly inside (-1, 1)"),
    ((LOCAL, "algorithm.setgrpo.recovery_grid=0"), "algorithm.setgrpo.recovery_grid=0 must be an integer >= 1"),
    ((LOCAL, "+reward.reward_kwargs.reference_score_key=r2"), "the reference-score key is set once, as "
                                                              "algorithm.setgrpo.reference_score_key"),
    ((LOCAL, *SKETCH_4, "trainer.n_gpus_per_node=1"),
     "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4 does not divide the 9 responses that each of the 1 actor "
     "rank(s) gets in a training step (data.train_batch_size=3)"),
    # verl pads a calibration batch of 37 x 3 = 111 responses to 117 (a multiple of 3 prompts x 3)
    ((LOCAL, *SKETCH_4[:2], "algorithm.setgrpo.calibration.batch_size=37", SKETCH_4[3], "trainer.n_gpus_per_node=1",
      "algorithm.setgrpo.calibration.only=true"),
     "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4 does not divide the 117 responses that each of the 1 actor "
     "rank(s) gets in a calibration batch (algorithm.setgrpo.calibration.batch_size=37) (37 prompts x "
     "actor_rollout_ref.rollout.n=3, padded to 117)"),
    ((LOCAL, *SKETCH_4, "trainer.n_gpus_per_node=1", "algorithm.setgrpo.calibration.only=true",
      "algorithm.setgrpo.calibration.batch_size=36", "algorithm.setgrpo.calibration.num_prompts=50"),
     "does not divide the 45 responses that each of the 1 actor rank(s) gets in the last calibration batch"),
])
def test_check_before_ray_refuses(overrides, message):
    """Each of these passed the pre-Ray check and failed later, after Ray and the models had started."""
    cfg = _compose(*overrides)
    with pytest.raises(ValueError) as exc:
        check_run_config(cfg)
    assert message in str(exc.value), str(exc.value)


def test_rho_zero_is_admissible_for_dr_grpo():
    cfg = _compose(LOCAL, "algorithm.setgrpo.rho=0", "algorithm.norm_adv_by_std_in_grpo=false")
    setgrpo = check_run_config(cfg)
    assert setgrpo.calibration_settings(norm_by_std=False) == CalibrationSettings(rho=0.0, norm_by_std=False)


def test_reference_score_key_has_one_source():
    """The reward manager writes r' under the key the trainer reads: algorithm.setgrpo.reference_score_key."""
    from setgrpo_verl.integration.reward_config import reference_score_key

    cfg = _compose(LOCAL, "algorithm.setgrpo.reference_score_key=r_prime")
    assert check_run_config(cfg).reference_score_key == reference_score_key(cfg) == "r_prime"
    assert reference_score_key(_compose(LOCAL, config="ppo_trainer")) == "reference_score"


def test_grpo_stage_runs_the_same_check_before_ray():
    """verl's stock ppo_trainer has no callback: the GRPO stage adds ours, so a grader typo stops it before Ray."""
    overrides = [o for o in launch.stage_overrides("grpo", "/tmp/run") if o.startswith("+hydra.")]
    hydra = _compose(*overrides, config="ppo_trainer", cfg="hydra")
    assert hydra.hydra.callbacks.setgrpo_check._target_ == "setgrpo_verl.integration.config.SetGRPOConfigCheck"
    cfg = _compose(OPENAI_TYPO, "reward.reward_manager.name=setgrpo_dual", config="ppo_trainer")
    with pytest.raises(ValueError, match=r"unknown keys for a openai grader: \['max_token'\]"):
        check_run_config(cfg)


def test_sketch_micro_batch_arithmetic():
    fits = dict(k=3, ranks=1, micro=3, source="m")
    assert sketch_micro_batch_error(prompts={"a step": 4, "a calibration batch": 12}, **fits) is None
    text = sketch_micro_batch_error(prompts={"a step": 3, "the last calibration batch": 5}, k=3, ranks=1, micro=4,
                                    source="m")
    assert text.startswith("m=4 does not divide the 9 responses") and "e.g. 3" in text
    # two ranks: 4 prompts x 3 = 12 responses, 6 per rank; micro 4 does not divide 6, micro 3 does
    assert "6 responses" in sketch_micro_batch_error(prompts={"a step": 4}, k=3, ranks=2, micro=4, source="m")
    assert sketch_micro_batch_error(prompts={"a step": 4}, k=3, ranks=2, micro=3, source="m") is None


def test_reward_manager_writes_the_reference_score_under_the_trainers_key():
    from setgrpo_verl.integration.reward_manager import SetGRPODualRewardManager

    cfg = OmegaConf.create({"algorithm": {"setgrpo": {"reference_score_key": "r_prime"}},
                            "reward": {"reward_kwargs": {"grader": {"type": "rules"}}}})
    assert SetGRPODualRewardManager(cfg, tokenizer=None).reference_key == "r_prime"
    cfg.reward.reward_kwargs.reference_score_key = "r2"  # the second source it used to read
    with pytest.raises(ValueError, match="reward.reward_kwargs.reference_score_key is not read"):
        SetGRPODualRewardManager(cfg, tokenizer=None)


def test_verls_calibration_batches_carry_each_rows_identity(tmp_path):
    """The trainer fingerprints calibration prompts from verl's own dataset batches (reward_model, extra_info,
    raw_prompt): they give back exactly the ids and questions of data/calibration.parquet."""
    import json

    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer

    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    from setgrpo_verl.integration.prompts import prompt_identity, read_prompt_identities

    rows = [{"id": f"q{i}", "question": f"Say the number {i}.", "rubrics": [{"criterion": "Says it.", "points": 1}]}
            for i in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = launch.split_data(data=str(data), model_path=embedded_model_dir(), max_prompt_length=64,
                              calibration_prompts=5, seed=0)
    paths = launch.write_data(tmp_path / "run", split)
    cfg = _compose(LOCAL, f"data.train_files={paths['train']}", "data.max_prompt_length=64")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    dataset = create_rl_dataset(str(paths["calibration"]), cfg.data, tokenizer, None, is_train=True, max_samples=5)
    seen = []
    for batch in StatefulDataLoader(dataset=dataset, batch_size=2, collate_fn=collate_fn):
        seen += [prompt_identity(rm, info, raw)[:2] for rm, info, raw in
                 zip(batch["reward_model"], batch["extra_info"], batch["raw_prompt"])]
    expected = [(r["extra_info"]["id"], rows[int(r["extra_info"]["id"][1:])]["question"]) for r in split["calibration"]]
    assert sorted(seen) == sorted(expected) == sorted(read_prompt_identities(paths["calibration"]))
