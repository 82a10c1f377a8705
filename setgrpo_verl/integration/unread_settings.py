"""Settings that verl would accept and then not use, or use only after Ray started, refused before Ray
(docs/verl_integration.md#settings-refused-before-ray).

:func:`check_unread_settings` runs inside :func:`setgrpo_verl.integration.run_check.check_run_config` (the Hydra
callback and every command's pre-Ray check, dry runs included), for every trainer mode:

* SetGRPO's own keys where nothing reads them: an ``algorithm.setgrpo`` block on verl's GRPO estimator (the
  reliability variant and every other SetGRPO setting run only with ``algorithm.adv_estimator=setgrpo``), and the
  dual reward manager's ``reward.reward_kwargs`` keys with another reward manager (verl's managers score once);
* verl's ``reward.custom_reward_function`` with the ``setgrpo_dual`` manager, whose rewards come from its grader
  (the function is read only by a grader of type ``function``);
* an actor mini-batch larger than the batch (verl refuses it only inside the TaskRunner, after Ray started, and
  not at all with dynamic batch sizes);
* a ``CUDA_VISIBLE_DEVICES`` that lists fewer devices than the GPUs the run asks Ray for (``ray.init`` then stops:
  the CPU backend asks Ray for one logical GPU, so an empty ``CUDA_VISIBLE_DEVICES`` stops every CPU run).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from .dotted import config_value
from .reward_config import REWARD_MANAGER_NAME

__all__ = ["DUAL_REWARD_KWARGS", "check_unread_settings", "check_mini_batch", "check_ray_gpus",
           "check_reward_function", "check_setgrpo_keys"]

#: ``reward.reward_kwargs`` keys only the ``setgrpo_dual`` reward manager reads (docs/verl_integration.md).
DUAL_REWARD_KWARGS = ("grader", "point", "scorings")
#: ``algorithm.setgrpo`` keys that verl's GRPO reads too: the reference score's name, which the reward manager
#: writes under in every trainer mode (:func:`~.reward_config.reference_score_key`).
_READ_BY_GRPO = ("reference_score_key", "max_failed_group_ratio")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: leaf value}`` of a nested mapping."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_setgrpo_keys(config: Any, *, setgrpo: bool, defaults: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse SetGRPO keys that a run would not read.

    Args:
        config: the composed verl config.
        setgrpo: whether the run uses SetGRPO (``algorithm.adv_estimator=setgrpo``).
        defaults: the ``algorithm.setgrpo`` block's defaults (a mapping, nested); a key at its default is not
            refused (``setgrpo_trainer.yaml`` carries the whole block). None: every key set is refused.

    Raises:
        ValueError: without SetGRPO, an ``algorithm.setgrpo`` key other than ``reference_score_key`` that differs
            from its default; with a reward manager other than ``setgrpo_dual``, a ``reward.reward_kwargs`` key of
            :data:`DUAL_REWARD_KWARGS`. The message names the key, why it is not read and what to set.
    """
    if not setgrpo:
        block = _flat(_plain(config_value(config, "algorithm.setgrpo")) or {})
        base = _flat(dict(defaults or {}))
        unread = sorted(k for k, v in block.items() if k.split(".")[0] not in _READ_BY_GRPO
                        and k.split(".")[-1] != "_target_" and (k not in base or base[k] != v))
        if unread:
            estimator = config_value(config, "algorithm.adv_estimator")
            raise ValueError(
                f"algorithm.setgrpo.{unread[0]}={block[unread[0]]!r} is not read with "
                f"algorithm.adv_estimator={estimator}: verl's {estimator} computes its own advantages, and every "
                "SetGRPO setting (the reliability variant included) runs only in SetGRPO's trainer: set "
                "algorithm.adv_estimator=setgrpo and trainer.v1.trainer_mode=setgrpo (`setgrpo-verl train`, or "
                "compare's setgrpo_paper / setgrpo_reliability arms), or remove "
                + ", ".join(f"algorithm.setgrpo.{k}" for k in unread))
    name = str(config_value(config, "reward.reward_manager.name", "") or "")
    if name == REWARD_MANAGER_NAME:
        return
    kwargs = _plain(config_value(config, "reward.reward_kwargs")) or {}
    unread = [k for k in DUAL_REWARD_KWARGS if isinstance(kwargs, Mapping) and kwargs.get(k) is not None]
    if unread:
        raise ValueError(
            f"reward.reward_kwargs.{unread[0]} is read only by the {REWARD_MANAGER_NAME} reward manager, but "
            f"reward.reward_manager.name={name}: verl's {name} manager scores each response once with "
            f"reward.custom_reward_function; set reward.reward_manager.name={REWARD_MANAGER_NAME} (with "
            "reward.reward_manager.source=register), or remove "
            + ", ".join(f"reward.reward_kwargs.{k}" for k in unread))


def check_reward_function(config: Any) -> None:
    """Refuse ``reward.custom_reward_function.path`` with the ``setgrpo_dual`` manager unless its grader is that
    function (docs/grading.md): the manager's rewards come from its grader, and verl's function would never be
    called.

    Raises:
        ValueError: naming the path, the grader type and the two fixes.
    """
    if str(config_value(config, "reward.reward_manager.name", "") or "") != REWARD_MANAGER_NAME:
        return
    path = config_value(config, "reward.custom_reward_function.path")
    if not path:
        return
    grader = _plain(config_value(config, "reward.reward_kwargs.grader")) or {}
    kind = grader.get("type") if isinstance(grader, Mapping) else None
    if kind == "function" and not grader.get("path"):
        return  # the grader reads the function (reward_config.grader_config)
    raise ValueError(
        f"reward.custom_reward_function.path={path} is never called: the {REWARD_MANAGER_NAME} reward manager "
        f"scores with its grader (reward.reward_kwargs.grader.type={kind}); to score with the function, set "
        "+reward.reward_kwargs.grader.type=function (it reads reward.custom_reward_function.path and .name), or "
        "remove reward.custom_reward_function.path")


def check_mini_batch(config: Any) -> None:
    """Refuse an actor mini-batch larger than the batch (verl 0.9.1's ``ActorConfig.validate`` refuses it only
    inside the TaskRunner, after Ray started, and not with ``use_dynamic_bsz``).

    Both are counted in prompts: ``actor_rollout_ref.actor.ppo_mini_batch_size`` and ``data.train_batch_size``.

    Raises:
        ValueError: naming both values and the fix.
    """
    mini = config_value(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    batch = config_value(config, "data.train_batch_size")
    if mini is None or batch is None or int(mini) <= int(batch):
        return
    raise ValueError(
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} is larger than data.train_batch_size={batch} (both in "
        f"prompts): a step's batch cannot fill one mini-batch; set actor_rollout_ref.actor.ppo_mini_batch_size to "
        f"at most {batch} ({batch}: one update per step, as GRPO's default), or raise data.train_batch_size "
        "(--groups-per-step)")


def _visible_devices(value: str) -> int:
    """How many devices a ``CUDA_VISIBLE_DEVICES`` value lists (Ray counts its comma-separated entries)."""
    return len([v for v in value.split(",") if v.strip()])


def check_ray_gpus(config: Any, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a ``CUDA_VISIBLE_DEVICES`` that lists fewer devices than the GPUs the run asks Ray for
    (``ray_kwargs.ray_init.num_gpus``; the CPU backend asks for one logical GPU): ``ray.init`` stops with
    "Attempting to start raylet with N GPU, but CUDA_VISIBLE_DEVICES contains [...]".

    Args:
        environ: the environment ``main_ppo`` starts Ray in (default: this process's).

    Raises:
        ValueError: naming the variable, its value, the GPUs asked for and the fix.
    """
    from .gpu_env import in_ray_actor

    if environ is None and in_ray_actor():  # Ray 2.41-2.55 set "" in actors without GPUs (the TaskRunner)
        return
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    wanted = config_value(config, "ray_kwargs.ray_init.num_gpus")
    if value is None or wanted is None or float(wanted) <= _visible_devices(value):
        return
    cpu = str(environ.get("VERL_PLATFORM", "")).lower() == "cpu" or config_value(config, "trainer.device") == "cpu"
    raise ValueError(
        f"CUDA_VISIBLE_DEVICES={value!r} lists {_visible_devices(value)} device(s), but the run asks Ray for "
        f"ray_kwargs.ray_init.num_gpus={wanted}" + (" (the CPU backend's logical GPU)" if cpu else "")
        + ", and ray.init refuses that: " + ("unset CUDA_VISIBLE_DEVICES (`unset CUDA_VISIBLE_DEVICES`, or "
                                             "`env -u CUDA_VISIBLE_DEVICES setgrpo-verl ...`); the CPU backend "
                                             "uses no CUDA device either way" if cpu else
                                             "list the GPUs the run may use in CUDA_VISIBLE_DEVICES, or lower "
                                             "ray_kwargs.ray_init.num_gpus"))


def check_unread_settings(config: Any, *, setgrpo: bool, defaults: Optional[Mapping[str, Any]] = None) -> bool:
    """Every check of this module (module docstring), in order: SetGRPO keys, verl's reward function, the
    mini-batch, the GPUs asked of Ray.

    Returns:
        ``setgrpo``, unchanged (the caller branches on it).

    Raises:
        ValueError: the first refusal (see each check).
    """
    check_setgrpo_keys(config, setgrpo=setgrpo, defaults=defaults)
    check_reward_function(config)
    check_mini_batch(config)
    check_ray_gpus(config)
    return setgrpo
