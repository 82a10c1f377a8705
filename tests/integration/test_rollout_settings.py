"""Rollout settings whose effect would be silent are refused before Ray: full determinism with K > 1 (identical
responses on vLLM, for SetGRPO and the GRPO baseline), and on the CPU backend the rollout settings it does not
implement."""

from __future__ import annotations

import pytest

from setgrpo_verl.integration.rollout_settings import CPU_UNSUPPORTED
from setgrpo_verl.integration.run_check import check_run_config
from tests.integration.test_pre_ray_checks import CAL_ONLY, LOCAL, _compose

FULL_DETERMINISM = "actor_rollout_ref.rollout.full_determinism=true"
GRPO = ("algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=graded_sync", "+reward.reward_kwargs.scorings=1")


@pytest.mark.parametrize("arm", ["setgrpo", "grpo"])
def test_full_determinism_with_groups_is_refused(arm):
    """verl seeds every request of a vLLM replica alike under full_determinism: K identical responses per prompt."""
    extra = (CAL_ONLY,) if arm == "setgrpo" else GRPO
    cfg = _compose(LOCAL, *extra, "actor_rollout_ref.rollout.n=4", FULL_DETERMINISM)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.full_determinism=true with "
                                         r"actor_rollout_ref.rollout.n=4: .* the 4 responses of a prompt are identical"):
        check_run_config(cfg)


def test_full_determinism_with_one_response_per_prompt_is_allowed_on_vllm():
    cfg = _compose(LOCAL, *GRPO, "actor_rollout_ref.rollout.n=1", FULL_DETERMINISM)
    assert check_run_config(cfg) is None


@pytest.mark.parametrize(("key", "value"), [
    ("ignore_eos", "true"), ("logprobs_mode", "raw_logprobs"), ("quantization", "fp8"),
    ("enable_rollout_routing_replay", "true"), ("full_determinism", "true"), ("qat.enable", "true"),
])
def test_the_cpu_rollout_refuses_what_it_would_ignore(key, value):
    grpo = (*GRPO, "actor_rollout_ref.rollout.n=1")  # n=1: full_determinism is refused for the CPU rollout only
    # the rollout's qat block is the actor's (verl's rollout.yaml interpolates it)
    setting = f"actor_rollout_ref.{'actor.fsdp_config' if key.startswith('qat') else 'rollout'}.{key}={value}"
    cpu = _compose(LOCAL, *grpo, "actor_rollout_ref.rollout.name=transformers", setting)
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.rollout.{key}=.*: the CPU backend's transformers "
                                         r"rollout does not implement it"):
        check_run_config(cpu)
    assert key in CPU_UNSUPPORTED
    if key != "full_determinism":  # vLLM implements these
        vllm = _compose(LOCAL, *grpo, "actor_rollout_ref.rollout.name=vllm", setting)
        assert check_run_config(vllm) is None


def test_the_cpu_rollout_accepts_verl_defaults():
    assert check_run_config(_compose(LOCAL, *GRPO, "actor_rollout_ref.rollout.name=transformers")) is None
