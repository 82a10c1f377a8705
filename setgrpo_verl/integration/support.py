"""Settings of a verl run that the sketch pass supports, checked before Ray starts (docs/sketch.md#supported-settings).

:func:`check_sketch_support` runs inside :func:`setgrpo_verl.integration.run_check.check_run_config` (the Hydra
callback, before Ray): it refuses, in one line naming the fix, the verl settings the sketch pass cannot run under,
and builds the policy on the meta device (its HF configuration only, no weights) the way verl 0.9.1's
``FSDPEngine._build_module`` / ``_build_lora_module`` do, to check that the sketch covers every parameter the update
trains (:func:`setgrpo_verl.sketch.sketch_coverage`): a model with trainable parameters outside ``nn.Linear``
(3-D MoE experts) is refused here rather than after the first rollout.  With packed sequences
(``use_remove_padding=true``) a model with linear-attention layers is refused when its forward, after verl's monkey
patch, takes no ``cu_seqlens`` (the packed responses would run as one sequence through those layers).

:func:`check_attention_kernels` refuses an ``attn_implementation`` whose kernel package is not importable (verl's
FSDP workers would fail in ``from_pretrained``), and :func:`check_trainer_settings` the settings that pass
composition but stop a SetGRPO run after Ray started: verl's v0 trainer and a sketch token budget below one
full-length sequence (docs/verl_integration.md#gpu-runs-of-the-recipes).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from inspect import signature
from typing import Any, Iterator, Optional

import torch
from packaging.requirements import Requirement

from setgrpo_verl.sketch import (
    SketchConfig,
    SketchCoverage,
    packed_linear_attention_error,
    packed_needs_cu_seqlens,
    sketch_coverage,
)

from .dotted import config_value

logger = logging.getLogger(__name__)

__all__ = ["check_sketch_support", "check_sketch_settings", "build_meta_policy", "verl_monkey_patched",
           "check_attention_kernels", "attention_kernel_error", "check_trainer_settings", "verl_extra_requirements",
           "SKETCH_STRATEGIES"]

#: Modules whose classes verl 0.9.1's ``apply_monkey_patch`` patches besides the model's own modeling module.
_PATCHED_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                    "transformers.integrations.flash_attention")


#: verl 0.9.1's default ``attn_implementation`` (``HFModelConfig``: ``override_config.get("attn_implementation",
#: "flash_attention_2")``), which the FSDP engine's ``from_pretrained`` loads the actor and the reference with.
VERL_DEFAULT_ATTENTION = "flash_attention_2"
ATTENTION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
#: attn_implementation -> (the module transformers imports for it, the distribution that provides it).
_ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}
#: Qwen3.5's linear-attention kernels (transformers uses them when ``fla`` imports).
_LINEAR_ATTENTION_PACKAGE = ("fla", "flash-linear-attention")


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
    if bool(config_value(config, "actor_rollout_ref.model.use_fused_kernels", False)):
        raise ValueError(
            "actor_rollout_ref.model.use_fused_kernels=true: verl's fused-kernel forward returns log-probs without "
            "the logits that the SetGRPO sketch pass differentiates; set actor_rollout_ref.model.use_fused_kernels=false"
        )
    for key in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"):
        sp = int(config_value(config, key, 1))
        if sp > 1:
            raise ValueError(
                f"{key}={sp}: SetGRPO's sketch pass needs whole sequences on each rank and does not support Ulysses "
                f"sequence parallelism; set {key}=1"
            )
    strategies = {str(config_value(config, "actor_rollout_ref.actor.strategy", "")),
                  str(config_value(config, "actor_rollout_ref.actor.fsdp_config.strategy", ""))}
    if "fsdp2" in strategies and bool(config_value(config, "actor_rollout_ref.actor.fsdp_config.offload_policy", False)):
        raise ValueError(
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true: FSDP2's CPU offload policy keeps the actor's "
            "parameters on the CPU during the SetGRPO sketch pass, which is not supported; set "
            "actor_rollout_ref.actor.fsdp_config.offload_policy=false (actor_rollout_ref.actor.fsdp_config."
            "param_offload=true offloads between passes and is supported)"
        )


def model_config_error(path: str, exc: Exception) -> str:
    """The message for a policy whose configuration transformers cannot read: for a hub id that is neither
    reachable nor in the Hugging Face cache (``HF_HUB_OFFLINE=1`` or no network), the id, the cache and the fix."""
    if not os.path.exists(os.path.expanduser(path)) and isinstance(exc, OSError) and (
            "cached files" in str(exc) or "offline" in str(exc).lower()):
        from huggingface_hub import constants

        how = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        return (f"actor_rollout_ref.model.path={path}: not a local directory, and the hub model {path!r} is not in "
                f"the Hugging Face cache ({constants.HF_HUB_CACHE}) while {how}. Pass a local model directory, or "
                f"download the model first where the hub is reachable (`hf download {path}`, the same HF_HOME), "
                "then run again (a cached model works with HF_HUB_OFFLINE=1)")
    return f"cannot read the model configuration of actor_rollout_ref.model.path={path}: {exc}"


def _hf_config(model_cfg: Any):
    """The policy's HF configuration as verl's ``HFModelConfig`` reads it (``hf_config_path`` or ``path``, then
    ``override_config``); None for a remote path (``hdfs://`` ...) that verl copies to local only on the workers."""
    from transformers import AutoConfig

    from verl.utils.import_utils import import_external_libs
    from verl.utils.model import update_model_config
    from verl.utils.py_functional import convert_to_regular_types

    import_external_libs(config_value(model_cfg, "external_lib"))
    path = str(config_value(model_cfg, "hf_config_path") or config_value(model_cfg, "path"))
    if "://" in path:
        return None
    local = os.path.expanduser(path)
    try:
        hf_config = AutoConfig.from_pretrained(local if os.path.isdir(local) else path,
                                               trust_remote_code=bool(config_value(model_cfg, "trust_remote_code", False)))
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError for unreadable configs
        raise ValueError(model_config_error(path, exc)) from exc
    override = convert_to_regular_types(config_value(model_cfg, "override_config", {})) or {}
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
    trust = bool(config_value(model_cfg, "trust_remote_code", False))
    with torch.device("meta"):
        module = get_hf_auto_model_class(hf_config).from_config(hf_config, trust_remote_code=trust)
        if int(config_value(model_cfg, "lora_rank", 0)) > 0:
            from peft import LoraConfig, PeftConfig, TaskType, get_peft_model

            adapter = config_value(model_cfg, "lora_adapter_path")
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
                    r=int(config_value(model_cfg, "lora_rank")),
                    lora_alpha=config_value(model_cfg, "lora_alpha", 16),
                    target_modules=convert_to_regular_types(config_value(model_cfg, "target_modules")),
                    target_parameters=convert_to_regular_types(config_value(model_cfg, "target_parameters")),
                    exclude_modules=convert_to_regular_types(config_value(model_cfg, "exclude_modules")),
                    bias="none",
                )
            module = get_peft_model(module, peft_config)
    return module


@contextlib.contextmanager
def verl_monkey_patched(model: torch.nn.Module, **kwargs: Any) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s classes carry verl 0.9.1's ``apply_monkey_patch(model, **kwargs)`` (what
    ``FSDPEngine._build_module`` runs on the workers); on exit every patched module and class is restored, so the
    process that checks a config (or a test) keeps transformers unpatched.

    Args:
        model: an HF model (meta device is enough: the patch replaces class attributes only).
        **kwargs: ``apply_monkey_patch``'s keywords (``use_remove_padding``, ``ulysses_sp_size``,
            ``use_fused_kernels``, ...).

    Yields:
        ``model``, patched.
    """
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    saved = []
    for name in {type(model).__module__, *_PATCHED_MODULES}:
        module = sys.modules.get(name)
        if module is None:
            continue
        saved.append((module, dict(vars(module))))
        saved.extend((obj, dict(vars(obj))) for obj in list(vars(module).values())
                     if isinstance(obj, type) and obj.__module__ == name)
    try:
        apply_monkey_patch(model, **kwargs)
        yield model
    finally:
        for obj, before in saved:
            current = vars(obj)
            for key in [k for k in current if k not in before]:
                delattr(obj, key)
            for key, value in before.items():
                if current.get(key, None) is not value and key not in ("__dict__", "__weakref__"):
                    setattr(obj, key, value)


def _check_packed_layout(config: Any, module: torch.nn.Module) -> None:
    """Refuse packed sequences on a linear-attention model whose forward, as verl patches it, takes no
    ``cu_seqlens`` (verl 0.9.1 passes them only then: ``FSDPEngine.pass_packed_cu_seqlens``)."""
    if not bool(config_value(config, "actor_rollout_ref.model.use_remove_padding", True)):
        return
    base = module.get_base_model() if hasattr(module, "get_base_model") else module  # verl patches before peft
    if not packed_needs_cu_seqlens(base):
        return
    with verl_monkey_patched(base, use_remove_padding=True):
        takes = "cu_seqlens" in signature(base.forward).parameters
    if not takes:
        raise ValueError(
            f"actor_rollout_ref.model.use_remove_padding=true on {type(base).__name__}, a model with linear-attention "
            "layers whose forward takes no cu_seqlens: the packed responses would run as one sequence through those "
            "layers; set actor_rollout_ref.model.use_remove_padding=false (or load the model as "
            "Qwen3_5ForConditionalGeneration, whose verl forward takes cu_seqlens)"
        )
    reason = packed_linear_attention_error(base)
    if reason is not None:
        raise ValueError(reason)


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
            (naming it; :meth:`SketchCoverage.check`); packed sequences on a linear-attention model whose verl
            forward takes no ``cu_seqlens``; an unreadable model or adapter configuration.
    """
    check_sketch_settings(config)
    model_cfg = config_value(config, "actor_rollout_ref.model")
    module = build_meta_policy(model_cfg)
    path = config_value(model_cfg, "path")
    if module is None:
        logger.warning("setgrpo: sketch coverage of %s is checked on the workers (remote path)", path)
        return None
    coverage = sketch_coverage(module, sketch)
    coverage.check(f"actor_rollout_ref.model.path={path}")
    _check_packed_layout(config, module)
    _warn_linear_attention_kernels(config, module)
    total = coverage.sketched_numel + coverage.left_out_numel
    logger.info(
        "setgrpo: the sketch covers %d of %d trainable text-model parameters (%.4f%% left out: %s)",
        coverage.sketched_numel, total, 100.0 * coverage.left_out_numel / max(total, 1),
        "input embedding / norms / per-channel vectors" if coverage.left_out else "none",
    )
    return coverage


def verl_extra_requirements(extra: str) -> list[Requirement]:
    """The requirements of the installed verl's ``extra``, with verl's own sub-extras (``verl[flash-attn-...]``)
    expanded and ``verl[verl-core]`` left as it is (it is verl's base set).

    Args:
        extra: an extra of verl 0.9.1 (``vllm``, ``fsdp``, ...).

    Returns:
        The requirements, markers dropped.

    Raises:
        importlib.metadata.PackageNotFoundError: verl is not installed.
    """
    out: list[Requirement] = []
    for line in importlib.metadata.requires("verl") or []:
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        req.marker = None
        if req.name == "verl" and req.extras - {"verl-core"}:
            for sub in sorted(req.extras - {"verl-core"}):
                out.extend(verl_extra_requirements(sub))
        else:
            out.append(req)
    return out


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _verl_pin(distribution: str) -> str:
    """``name==version`` as verl 0.9.1's ``fsdp`` extra pins ``distribution``, or the bare name."""
    try:
        pins = {r.name: str(r) for r in verl_extra_requirements("fsdp")}
    except importlib.metadata.PackageNotFoundError:
        return distribution
    return pins.get(distribution, distribution)


def attention_kernel_error(attn_implementation: str, *, default: bool = False) -> Optional[str]:
    """Why verl's FSDP workers could not load the policy with ``attn_implementation`` here, or None.

    transformers raises ImportError in ``from_pretrained`` when the kernel package of a FlashAttention
    implementation is missing, and needs the ``kernels`` package for a Hub kernel (``org/name``); ``eager``,
    ``sdpa`` and ``flex_attention`` need torch only.

    Args:
        attn_implementation: the value verl passes to ``AutoConfig.from_pretrained``.
        default: it is verl's default (the run does not set the key), which the message says.

    Returns:
        One line naming the package, where it comes from and the fix, or None when it is importable.
    """
    setting = f"{ATTENTION_KEY}={attn_implementation}" + (" (verl's default)" if default else "")
    sdpa = f"or set +{ATTENTION_KEY}=sdpa (torch's attention, no extra package)"
    if attn_implementation in _ATTENTION_PACKAGES:
        module, distribution = _ATTENTION_PACKAGES[attn_implementation]
        if _importable(module):
            return None
        if distribution == "flash-attn":
            source = (f"{_verl_pin(distribution)}, from verl 0.9.1's fsdp extra: an install step of its own, "
                      "verl's prebuilt wheel or `pip install --no-build-isolation flash-attn==2.8.3` "
                      "(docs/verl_integration.md#installing-on-a-gpu-cluster)")
        else:
            source = ("FlashAttention-3, built from flash-attention's hopper/ folder; in no extra of verl or "
                      "setgrpo-verl")
        return (f"{setting} needs the package {module} ({source}), which is not importable here: verl's FSDP "
                f"workers would fail to load the policy; install it {sdpa}")
    if "/" in attn_implementation and not _importable("kernels"):
        return (f"{setting} is a Hugging Face Hub kernel, which needs the package kernels (pip install kernels; in "
                f"no extra of verl or setgrpo-verl), not importable here; install it {sdpa}")
    return None


def check_attention_kernels(config: Any) -> None:
    """Refuse, before Ray, an actor ``attn_implementation`` whose kernel package is not importable
    (docs/verl_integration.md#gpu-runs-of-the-recipes).

    The check runs where ``main_ppo`` starts (the driver), standing in for the workers of a cluster installed
    alike.

    Args:
        config: the composed verl config (``main_ppo``'s).

    Raises:
        ValueError: :func:`attention_kernel_error`'s message.
    """
    override = config_value(config, "actor_rollout_ref.model.override_config", {}) or {}
    value = override.get("attn_implementation", None) if hasattr(override, "get") else None
    error = attention_kernel_error(str(value or VERL_DEFAULT_ATTENTION), default=value is None)
    if error:
        raise ValueError(error)


def _warn_linear_attention_kernels(config: Any, module: torch.nn.Module) -> None:
    """Say that a padded linear-attention policy runs transformers' torch delta rule when its kernels are missing
    (packed, :func:`_check_packed_layout` has refused it: that rule ignores ``cu_seqlens``)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    module_name, distribution = _LINEAR_ATTENTION_PACKAGE
    if not packed_needs_cu_seqlens(base) or _importable(module_name):
        return
    logger.warning(
        "setgrpo: %s has linear-attention layers but the package %s (%s, from verl 0.9.1's fsdp extra, in "
        "setgrpo-verl's gpu extra) is not importable: transformers then runs its torch gated delta rule, a slow "
        "path for every actor, reference and sketch pass",
        type(base).__name__, module_name, _verl_pin(distribution),
    )


#: ``actor_rollout_ref.actor.strategy`` values whose engine the sketch pass runs on (verl's FSDPEngine).
SKETCH_STRATEGIES = ("fsdp", "fsdp2")
#: verl 0.9.1's other training engines, by strategy (mindspeed is Megatron on Ascend: strategy megatron).
_OTHER_BACKENDS = {"megatron": "Megatron-LM (or MindSpeed)", "veomni": "VeOmni", "torchtitan": "TorchTitan",
                   "automodel": "NeMo AutoModel", "fsdp_turbo": "verl's fsdp_turbo engine"}


def check_trainer_settings(config: Any, setgrpo: Any, *, sketches: bool = True) -> None:
    """Refuse, before Ray, the verl settings under which a SetGRPO run would stop after Ray started
    (docs/verl_integration.md#gpu-runs-of-the-recipes).

    Args:
        config: the composed verl config (``main_ppo``'s) of a SetGRPO run.
        setgrpo: its :class:`~setgrpo_verl.integration.config.SetGRPOConfig`.
        sketches: whether the run sketches (the ``paper`` variant); without, the sketch budget is not checked.

    Raises:
        ValueError: ``trainer.use_v1=false`` (``main_ppo`` then runs verl's v0 trainer, whose workers have no
            sketch RPC); an ``actor_rollout_ref.actor.strategy`` other than :data:`SKETCH_STRATEGIES` (megatron,
            veomni, torchtitan, automodel, mindspeed's megatron, fsdp_turbo: the sketch pass hooks verl's FSDP
            engine); a token budget of the sketch pass's dynamic micro-batches below
            ``data.max_prompt_length + data.max_response_length`` (verl's ``rearrange_micro_batches`` asserts
            ``max_token_len >= max_seq_len`` on every rank, after the calibration rollouts).
    """
    if not bool(config_value(config, "trainer.use_v1", True)):
        raise ValueError(
            "trainer.use_v1=false: main_ppo then runs verl's v0 trainer, whose workers have no SetGRPO sketch RPC "
            "and which ignores trainer.v1.trainer_mode=setgrpo; set trainer.use_v1=true"
        )
    strategy = str(config_value(config, "actor_rollout_ref.actor.strategy", "fsdp"))
    if strategy not in SKETCH_STRATEGIES:
        other = _OTHER_BACKENDS.get(strategy, f"verl's {strategy!r} engine")
        why = ("the SetGRPO sketch pass runs on verl's FSDP engine only (strategy fsdp or fsdp2), not on "
               f"{other}, and would stop at the first sketch, after the calibration rollouts" if sketches else
               "the SetGRPO trainer mode's actor worker extends verl's FSDP engine worker only (strategy fsdp or "
               f"fsdp2), not {other}")
        raise ValueError(f"actor_rollout_ref.actor.strategy={strategy}: {why}; use model_engine=dp with "
                         "actor_rollout_ref.actor.strategy=fsdp2 (or fsdp)")
    if not sketches:
        return
    sketch = setgrpo.sketch
    budget, key = sketch.max_token_len_per_gpu, "algorithm.setgrpo.sketch.max_token_len_per_gpu"
    if budget is None and sketch.micro_batch_size_per_gpu is None and bool(
            config_value(config, "actor_rollout_ref.actor.use_dynamic_bsz", False)):
        budget = config_value(config, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
        key = ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (the sketch pass's token budget when "
               "algorithm.setgrpo.sketch.max_token_len_per_gpu is null)")
    if budget is None:
        return
    prompt, response = int(config_value(config, "data.max_prompt_length")), int(config_value(config, "data.max_response_length"))
    if int(budget) < prompt + response:
        raise ValueError(
            f"{key}={int(budget)} is below one full-length sequence, data.max_prompt_length + "
            f"data.max_response_length = {prompt} + {response} = {prompt + response}: verl's dynamic micro-batching "
            f"asserts max_token_len >= the longest sequence on every rank, after the calibration rollouts; set "
            f"{key.split(' ')[0]}={prompt + response} or more (SKETCH_TOKENS_PER_GPU in recipes/_common.sh)"
        )
