"""Rollout settings that would silently change what is sampled, refused before Ray
(docs/verl_integration.md#refused-before-ray, #cpu-backend).

* ``actor_rollout_ref.rollout.full_determinism=true`` with ``rollout.n > 1``, on any rollout and in every trainer
  mode: verl 0.9.1's vLLM server then gives every request of a replica the same seed
  (``sampling_params.setdefault("seed", replica_rank + rollout.seed)``) and turns on vLLM's batch-invariant mode, so
  the K requests of a prompt sample K identical responses and every group is degenerate (GRPO's advantages are 0,
  SetGRPO's coefficients 0, calibration infeasible).
* On the CPU backend's ``transformers`` rollout, the settings of verl's rollout config that change the responses or
  their log-probs on vLLM and that this rollout does not implement (:data:`CPU_UNSUPPORTED`): a CPU run would ignore
  them silently.
"""

from __future__ import annotations

from typing import Any

from .dotted import config_value

__all__ = ["CPU_UNSUPPORTED", "check_rollout_settings"]

ROLLOUT = "actor_rollout_ref.rollout"
#: ``rollout.name`` of the CPU backend's rollout (:data:`setgrpo_verl.verl_cpu.ROLLOUT_NAME`).
_CPU_ROLLOUT = "transformers"

#: Key under ``actor_rollout_ref.rollout`` -> (its value in verl 0.9.1's rollout config, what vLLM does with another
#: value): the settings that change the sampled tokens or their log-probs on vLLM and that the CPU backend's
#: ``transformers`` rollout does not implement.
CPU_UNSUPPORTED = {
    "ignore_eos": (False, "vLLM keeps sampling past the end-of-sequence token up to the response length"),
    "full_determinism": (False, "vLLM seeds every request of a replica alike and runs batch-invariant kernels"),
    "logprobs_mode": ("processed_logprobs", "vLLM returns the log-probs of that stage of its sampler"),
    "quantization": (None, "vLLM serves the policy quantized"),
    "qat.enable": (False, "vLLM serves the policy with quantization-aware-training weights"),
    "enable_rollout_routing_replay": (False, "vLLM records the MoE router's choices for the actor to replay"),
}


def check_rollout_settings(config: Any) -> None:
    """Refuse, before Ray, rollout settings whose effect would be silent (module docstring).

    Args:
        config: the composed verl config (``actor_rollout_ref.rollout``).

    Raises:
        ValueError: ``full_determinism=true`` with ``n > 1`` (naming the identical responses and the fix), or, with
            ``rollout.name=transformers`` (the CPU backend), a :data:`CPU_UNSUPPORTED` key set away from verl's
            default (naming the key, what vLLM would do and that the CPU rollout does not).
    """
    n = int(config_value(config, f"{ROLLOUT}.n", 1))
    if bool(config_value(config, f"{ROLLOUT}.full_determinism", False)) and n > 1:
        raise ValueError(
            f"{ROLLOUT}.full_determinism=true with {ROLLOUT}.n={n}: verl 0.9.1 then gives every request of a vLLM "
            f"replica the same seed ({ROLLOUT}.seed + the replica's rank), so the {n} responses of a prompt are "
            "identical and every group is degenerate (GRPO's advantages and SetGRPO's coefficients are 0); remove "
            f"{ROLLOUT}.full_determinism (runs are reproducible through {ROLLOUT}.seed, data.seed and the judge's "
            "seeds)")
    if str(config_value(config, f"{ROLLOUT}.name", "")) != _CPU_ROLLOUT:
        return
    for key, (default, vllm) in CPU_UNSUPPORTED.items():
        value = config_value(config, f"{ROLLOUT}.{key}", default)
        if value != default:
            raise ValueError(
                f"{ROLLOUT}.{key}={value}: the CPU backend's transformers rollout does not implement it ({vllm}) and "
                f"would ignore it; remove the key (verl's default is {default}) or run the vLLM rollout on GPUs "
                "(docs/verl_integration.md#cpu-backend)")
