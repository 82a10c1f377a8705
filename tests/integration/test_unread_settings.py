"""Settings verl would accept and then not use, or use only after Ray started, are refused by the pre-Ray check
(check_run_config) on composed configs, naming what to set: SetGRPO keys on verl's own GRPO, verl's reward function
beside the setgrpo_dual manager, a mini-batch larger than the batch, and a CUDA_VISIBLE_DEVICES that lists fewer
devices than the run asks Ray for (the CPU backend's logical GPU), dry run included."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from setgrpo_verl.integration.run_check import check_run_config
from setgrpo_verl.models import embedded_model_dir
from setgrpo_verl.runner import cli
from setgrpo_verl.runner.launch import cpu_overrides

RULES = "+reward.reward_kwargs.grader={type:noisy,flip_prob:0.1,base:{type:rules}}"
DUAL = ("reward.reward_manager.name=setgrpo_dual", "reward.reward_manager.source=register", RULES)
GRPO = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8")
SETGRPO = ("actor_rollout_ref.rollout.n=4", "data.max_response_length=24", RULES,
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
           "+actor_rollout_ref.model.override_config.attn_implementation=eager", "algorithm.setgrpo.calibration.only=true")


def _compose(*overrides: str, config: str = "ppo_trainer"):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config, overrides=[f"actor_rollout_ref.model.path={embedded_model_dir()}", *overrides])


def _refusal(cfg) -> str:
    with pytest.raises(ValueError) as info:
        check_run_config(cfg, environment=False)
    return str(info.value)


def test_verls_grpo_with_the_dual_reward_passes():
    assert check_run_config(_compose(*GRPO, *DUAL, "+reward.reward_kwargs.point=mean"), environment=False) is None


@pytest.mark.parametrize(("overrides", "needle"), [
    (("+algorithm.setgrpo.variant=reliability",),
     "algorithm.setgrpo.variant='reliability' is not read with algorithm.adv_estimator=grpo"),
    (("+algorithm.setgrpo.alpha=0.2",), "set algorithm.adv_estimator=setgrpo and trainer.v1.trainer_mode=setgrpo"),
])
def test_setgrpo_keys_on_verls_grpo_are_refused(overrides, needle):
    assert needle in _refusal(_compose(*GRPO, *DUAL, *overrides))


def test_setgrpo_trainer_config_with_verls_grpo_is_refused_only_for_changed_keys():
    """setgrpo_trainer.yaml carries the whole block at its defaults: only a changed key is not read."""
    base = ("trainer.v1.trainer_mode=sync", *GRPO, *DUAL)
    assert check_run_config(_compose(*base, config="setgrpo_trainer"), environment=False) is None
    assert "algorithm.setgrpo.variant='reliability' is not read" in _refusal(
        _compose(*base, "algorithm.setgrpo.variant=reliability", config="setgrpo_trainer"))


def test_dual_reward_keys_without_the_dual_manager_are_refused():
    text = _refusal(_compose(*GRPO, "+reward.reward_kwargs.point=mean", "+reward.reward_kwargs.scorings=2"))
    assert text.startswith("reward.reward_kwargs.point is read only by the setgrpo_dual reward manager, but "
                           "reward.reward_manager.name=naive"), text
    assert "set reward.reward_manager.name=setgrpo_dual" in text and "reward.reward_kwargs.scorings" in text


def test_verls_reward_function_beside_the_dual_manager_is_refused(tmp_path):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def compute_score(*a, **k):\n    return 0.123\n")
    custom = (f"reward.custom_reward_function.path={fn}",)
    text = _refusal(_compose(*SETGRPO, *custom, config="setgrpo_trainer"))
    assert text.startswith(f"reward.custom_reward_function.path={fn} is never called: the setgrpo_dual reward "
                           "manager scores with its grader (reward.reward_kwargs.grader.type=noisy)"), text
    assert "+reward.reward_kwargs.grader.type=function" in text
    # a function grader reads it
    graded = _compose(*[o for o in SETGRPO if o != RULES], "+reward.reward_kwargs.grader={type:function}", *custom,
                      config="setgrpo_trainer")
    assert check_run_config(graded, environment=False) is not None


def test_a_mini_batch_larger_than_the_batch_is_refused():
    text = _refusal(_compose(*GRPO[:-1], "actor_rollout_ref.actor.ppo_mini_batch_size=16"))
    assert text.startswith("actor_rollout_ref.actor.ppo_mini_batch_size=16 is larger than data.train_batch_size=8"), text
    assert "set actor_rollout_ref.actor.ppo_mini_batch_size to at most 8" in text
    # verl itself does not check it with dynamic batch sizes
    assert "is larger than" in _refusal(_compose(*GRPO[:-1], "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                                 "actor_rollout_ref.actor.use_dynamic_bsz=true"))


@pytest.mark.parametrize("value", ["", "0"])
def test_cuda_visible_devices_without_the_gpu_ray_is_asked_for(monkeypatch, value):
    cfg = _compose(*GRPO, *cpu_overrides())
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    if value:
        assert check_run_config(cfg, environment=False) is None
        return
    text = _refusal(cfg)
    assert text.startswith("CUDA_VISIBLE_DEVICES='' lists 0 device(s), but the run asks Ray for "
                           "ray_kwargs.ray_init.num_gpus=1 (the CPU backend's logical GPU)"), text
    assert "unset CUDA_VISIBLE_DEVICES" in text


def test_the_dry_run_refuses_an_empty_cuda_visible_devices(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = tmp_path / "run"
    assert cli.main(["calibrate", "--profile", "smoke", "--run-dir", str(run), "--judge", "rules", "--flip-prob",
                     "0.06", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "CUDA_VISIBLE_DEVICES='' lists 0 device(s)" in err and "unset CUDA_VISIBLE_DEVICES" in err, err
    assert not run.exists()


def test_ignore_eos_on_the_cpu_backends_rollout_is_refused():
    text = _refusal(_compose(*GRPO, *cpu_overrides(), "actor_rollout_ref.rollout.ignore_eos=true"))
    assert text.startswith("actor_rollout_ref.rollout.ignore_eos=True: the CPU backend's transformers rollout "
                           "does not implement it"), text
