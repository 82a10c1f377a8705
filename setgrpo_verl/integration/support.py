"""Settings of a verl run that the sketch pass supports, checked before Ray starts (docs/sketch.md#supported-settings).

:func:`check_sketch_support` runs inside :func:`setgrpo_verl.integration.config.check_run_config` (the Hydra
callback, before Ray): it refuses, in one line naming the fix, the verl settings the sketch pass cannot run under,
and builds the policy on the meta device (its HF configuration only, no weights) the way verl 0.9.1's
``FSDPEngine._build_module`` / ``_build_lora_module`` do, to check that the sketch covers every parameter the update
trains (:func:`setgrpo_verl.sketch.sketch_coverage`): a model with trainable parameters outside ``nn.Linear``
(3-D MoE experts) is refused here rather than after the first rollout.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from setgrpo_verl.sketch import SketchConfig, SketchCoverage, sketch_coverage

logger = logging.getLogger(__name__)

__all__ = ["check_sketch_support", "check_sketch_settings", "build_meta_policy"]


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def check_sketch_settings(config: Any) -> None:
    """Refuse the verl actor settings under which the sketch pass cannot run (docs/sketch.md#supported-settings).

    Args:
        config: the composed verl config (``main_ppo``'s), DictConfig or nested dicts.

    Raises:
        ValueError: one line naming the setting and its fix, for ``actor_rollout_ref.model.use_fused_kernels=true``
            (verl's fused forward returns log-probs, not the ``.logits`` the sketch pass differentiates),
            ``ulysses_sequence_parallel_size > 1`` (each rank would see a slice of every sequence), or FSDP2
            ``offload_policy=true`` (the parameters stay on the CPU during the pass).
    """
    if bool(_get(config, "actor_rollout_ref.model.use_fused_kernels", False)):
        raise ValueError(
            "actor_rollout_ref.model.use_fused_kernels=true: verl's fused-kernel forward returns log-probs without "
            "the logits that the SetGRPO sketch pass differentiates; set actor_rollout_ref.model.use_fused_kernels=false"
        )
    for key in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"):
        sp = int(_get(config, key, 1))
        if sp > 1:
            raise ValueError(
                f"{key}={sp}: SetGRPO's sketch pass needs whole sequences on each rank and does not support Ulysses "
                f"sequence parallelism; set {key}=1"
            )
    strategies = {str(_get(config, "actor_rollout_ref.actor.strategy", "")),
                  str(_get(config, "actor_rollout_ref.actor.fsdp_config.strategy", ""))}
    if "fsdp2" in strategies and bool(_get(config, "actor_rollout_ref.actor.fsdp_config.offload_policy", False)):
        raise ValueError(
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true: FSDP2's CPU offload policy keeps the actor's "
            "parameters on the CPU during the SetGRPO sketch pass, which is not supported; set "
            "actor_rollout_ref.actor.fsdp_config.offload_policy=false (actor_rollout_ref.actor.fsdp_config."
            "param_offload=true offloads between passes and is supported)"
        )


def _hf_config(model_cfg: Any):
    """The policy's HF configuration as verl's ``HFModelConfig`` reads it (``hf_config_path`` or ``path``, then
    ``override_config``); None for a remote path (``hdfs://`` ...) that verl copies to local only on the workers."""
    from transformers import AutoConfig

    from verl.utils.import_utils import import_external_libs
    from verl.utils.model import update_model_config
    from verl.utils.py_functional import convert_to_regular_types

    import_external_libs(_get(model_cfg, "external_lib"))
    path = str(_get(model_cfg, "hf_config_path") or _get(model_cfg, "path"))
    if "://" in path:
        return None
    local = os.path.expanduser(path)
    try:
        hf_config = AutoConfig.from_pretrained(local if os.path.isdir(local) else path,
                                               trust_remote_code=bool(_get(model_cfg, "trust_remote_code", False)))
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError for unreadable configs
        raise ValueError(
            f"cannot read the model configuration of actor_rollout_ref.model.path={path}: {exc}"
        ) from exc
    override = convert_to_regular_types(_get(model_cfg, "override_config", {})) or {}
    override = override.get("model_config", override)
    update_model_config(hf_config, override_config_kwargs={k: v for k, v in override.items()
                                                           if k != "attn_implementation"})
    return hf_config


def build_meta_policy(model_cfg: Any) -> Optional[torch.nn.Module]:
    """The actor's module as verl 0.9.1 builds it (``get_hf_auto_model_class`` + ``from_config``, then peft LoRA when
    ``lora_rank > 0``), on the meta device: parameter names, shapes and ``requires_grad``, no weights.

    Args:
        model_cfg: ``config.actor_rollout_ref.model`` (keys ``path``, ``hf_config_path``, ``trust_remote_code``,
            ``override_config``, ``external_lib``, ``lora_rank``, ``lora_alpha``, ``target_modules``,
            ``target_parameters``, ``exclude_modules``, ``lora_adapter_path``).

    Returns:
        The meta-device module, or None when ``path`` is a remote URL (checked on the workers instead).

    Raises:
        ValueError: the model configuration or the LoRA adapter's configuration cannot be read.
    """
    from verl.utils.model import get_hf_auto_model_class
    from verl.utils.py_functional import convert_to_regular_types

    hf_config = _hf_config(model_cfg)
    if hf_config is None:
        return None
    trust = bool(_get(model_cfg, "trust_remote_code", False))
    with torch.device("meta"):
        module = get_hf_auto_model_class(hf_config).from_config(hf_config, trust_remote_code=trust)
        if int(_get(model_cfg, "lora_rank", 0)) > 0:
            from peft import LoraConfig, PeftConfig, TaskType, get_peft_model

            adapter = _get(model_cfg, "lora_adapter_path")
            if adapter is not None:
                try:
                    peft_config = PeftConfig.from_pretrained(os.path.expanduser(str(adapter)))
                except Exception as exc:  # peft raises ValueError / OSError for a missing adapter_config.json
                    raise ValueError(
                        f"cannot read the LoRA adapter configuration of actor_rollout_ref.model.lora_adapter_path="
                        f"{adapter}: {exc}"
                    ) from exc
                peft_config.inference_mode = False  # verl loads the adapter with is_trainable=True
            else:
                peft_config = LoraConfig(
                    task_type=TaskType.CAUSAL_LM,
                    r=int(_get(model_cfg, "lora_rank")),
                    lora_alpha=_get(model_cfg, "lora_alpha", 16),
                    target_modules=convert_to_regular_types(_get(model_cfg, "target_modules")),
                    target_parameters=convert_to_regular_types(_get(model_cfg, "target_parameters")),
                    exclude_modules=convert_to_regular_types(_get(model_cfg, "exclude_modules")),
                    bias="none",
                )
            module = get_peft_model(module, peft_config)
    return module


def check_sketch_support(config: Any, sketch: SketchConfig) -> Optional[SketchCoverage]:
    """Everything about the actor that the sketch pass needs, checked before Ray (docs/sketch.md#supported-settings).

    Args:
        config: the composed verl config (``main_ppo``'s).
        sketch: the run's :class:`~setgrpo_verl.sketch.SketchConfig` (``include_embeddings`` / ``include_norms``
            decide which parameters are sketched).

    Returns:
        The policy's :class:`~setgrpo_verl.sketch.SketchCoverage`, or None when its configuration sits at a remote
        URL (the workers' sketcher makes the same check when it starts).

    Raises:
        ValueError: from :func:`check_sketch_settings`; a trainable parameter that the sketch cannot cover
            (naming it; :meth:`SketchCoverage.check`); an unreadable model or adapter configuration.
    """
    check_sketch_settings(config)
    model_cfg = _get(config, "actor_rollout_ref.model")
    module = build_meta_policy(model_cfg)
    path = _get(model_cfg, "path")
    if module is None:
        logger.warning("setgrpo: sketch coverage of %s is checked on the workers (remote path)", path)
        return None
    coverage = sketch_coverage(module, sketch)
    coverage.check(f"actor_rollout_ref.model.path={path}")
    total = coverage.sketched_numel + coverage.left_out_numel
    logger.info(
        "setgrpo: the sketch covers %d of %d trainable text-model parameters (%.4f%% left out: %s)",
        coverage.sketched_numel, total, 100.0 * coverage.left_out_numel / max(total, 1),
        "input embedding / norms / per-channel vectors" if coverage.left_out else "none",
    )
    return coverage
