"""Names and config readers of the dual reward shared by the reward manager, the trainer and the run check.

A leaf module (no import of the rest of :mod:`setgrpo_verl.integration`): :mod:`.reward_manager` (which imports
verl's reward loop) and :mod:`.config` (the pre-Ray check) both read the grader and the reference-score key
through these functions, so that the check before Ray reads exactly what verl's reward worker will build
(docs/verl_integration.md).
"""

from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from ..grading import grader_identity as _grader_identity

__all__ = [
    "POINT_KEY",
    "POINT_MODES",
    "REFERENCE_SCORE_KEY",
    "REWARD_MANAGER_NAME",
    "SCORINGS_KEY",
    "TRUTH_SCORE_KEY",
    "TRUTH_VERDICTS_KEY",
    "grader_config",
    "grader_identity",
    "point_mode",
    "reference_score_key",
    "scorings",
]

#: Name under which the dual-reward manager is registered (``reward.reward_manager.name``).
REWARD_MANAGER_NAME = "setgrpo_dual"
#: ``reward_extra_info`` key of the reference score r' (default of ``algorithm.setgrpo.reference_score_key``).
REFERENCE_SCORE_KEY = "reference_score"
#: Config key of the scorings per response (1: the point score alone, the GRPO baseline; 2: point and reference, the
#: default, which SetGRPO needs), read by :func:`scorings`.
SCORINGS_KEY = "reward.reward_kwargs.scorings"
#: Config key of what the point score r is with two scorings, read by :func:`point_mode`: ``first`` (the first
#: scoring, the default, which SetGRPO reads) or ``mean`` (the mean of the two: the ``grpo_mean2`` baseline).
POINT_KEY = "reward.reward_kwargs.point"
POINT_MODES = ("first", "mean")
#: ``reward_extra_info`` key of the noise-free score, present when the grader knows it
#: (docs/validation.md#noisy-grader); the calibration stage stores it as ``truth`` in ``paired_scores.npz``.
TRUTH_SCORE_KEY = "truth_score"
#: ``reward_extra_info`` key of the noise-free verdicts, present with ``truth_score``: the JSON object
#: ``{"met": [1 | 0 | -1 per criterion (met, unmet, no verdict)], "points": [the criteria's points]}``; the
#: calibration stage stores them in its shards (docs/record.md#calibration-shards).
TRUTH_VERDICTS_KEY = "truth_verdicts"


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, (DictConfig, Mapping)):
        return node.get(key)
    return getattr(node, key, None)


def grader_config(config: Any) -> dict:
    """The grader mapping from a verl config (``reward.reward_kwargs.grader``), as a plain dict.

    ``type: function`` without ``path`` takes ``reward.custom_reward_function.{path,name}``.

    Raises:
        ValueError: no ``reward.reward_kwargs.grader`` block (the message shows one to add).
    """
    reward = _get(config, "reward") or {}
    kwargs = _get(reward, "reward_kwargs") or {}
    cfg = _get(kwargs, "grader")
    if not cfg:
        raise ValueError(
            f"reward manager {REWARD_MANAGER_NAME!r} needs a grader: add e.g. "
            "+reward.reward_kwargs.grader.type=local_hf (embedded SmolLM2 judge) or "
            "+reward.reward_kwargs.grader={type:openai,base_url:http://127.0.0.1:8000/v1,model:<name>}"
        )
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if cfg.get("type") == "function" and not cfg.get("path"):
        custom = _get(reward, "custom_reward_function") or {}
        if not _get(custom, "path"):
            raise ValueError("grader type 'function' needs grader.path or reward.custom_reward_function.path")
        cfg["path"] = _get(custom, "path")
        cfg.setdefault("name", _get(custom, "name") or "compute_score")
    return cfg


def grader_identity(config: Any) -> dict:
    """Grader identity ``{name, model, temperature, template_hash}`` of a verl config, without building the grader
    (no model load, no connection; for the calibration record, docs/algorithm.md#7-record).

    Raises:
        ValueError: no grader block, or a grader config that :func:`setgrpo_verl.grading.build_grader` would refuse
            (unknown type, unknown or missing key, named).
    """
    return _grader_identity(grader_config(config))


def reference_score_key(config: Any) -> str:
    """The ``reward_extra_info`` key of the reference score: ``algorithm.setgrpo.reference_score_key`` when the run
    has that block (SetGRPO's config), else :data:`REFERENCE_SCORE_KEY` (verl's stock config, the GRPO baseline).

    The key has this one source: the reward manager writes the score under it and the trainer reads it back.

    Raises:
        ValueError: ``reward.reward_kwargs.reference_score_key`` is set (the key is configured once, under
            ``algorithm.setgrpo``).
    """
    reward_kwargs = _get(_get(config, "reward"), "reward_kwargs") or {}
    if _get(reward_kwargs, "reference_score_key") is not None:
        raise ValueError(
            "reward.reward_kwargs.reference_score_key is not read: the reference-score key is set once, as "
            "algorithm.setgrpo.reference_score_key (the reward manager writes and the trainer reads that key); "
            "remove the reward_kwargs entry"
        )
    setgrpo = _get(_get(config, "algorithm"), "setgrpo")
    key = _get(setgrpo, "reference_score_key")
    return REFERENCE_SCORE_KEY if key is None else str(key)


def scorings(config: Any) -> int:
    """Scorings per response (grader calls per response) of a verl config: ``reward.reward_kwargs.scorings``, 1 or
    2, default 2 (docs/verl_integration.md#reward-manager).

    Raises:
        ValueError: a value other than the integers 1 and 2 (the message names the key and both values).
    """
    value = _get(_get(_get(config, "reward"), "reward_kwargs"), "scorings")
    if value is None:
        return 2
    if isinstance(value, bool) or value not in (1, 2) or not isinstance(value, int):
        raise ValueError(f"{SCORINGS_KEY}={value!r}: set 1 (the point score alone, the GRPO baseline) or 2 (point and "
                         "reference scores, the default, which SetGRPO's calibration and training read)")
    return int(value)


def point_mode(config: Any) -> str:
    """What the reward manager returns as the point score r: ``reward.reward_kwargs.point``, ``first`` (the default:
    the first scoring) or ``mean`` (the mean of the two scorings, for GRPO on it; docs/verl_integration.md#reward-manager).

    Raises:
        ValueError: another value, or ``mean`` with one scoring (the message names the keys).
    """
    value = _get(_get(_get(config, "reward"), "reward_kwargs"), "point")
    if value is None:
        return "first"
    if value not in POINT_MODES:
        raise ValueError(f"{POINT_KEY}={value!r}: set first (the first scoring, the default) or mean (the mean of the "
                         "two scorings)")
    if value == "mean" and scorings(config) == 1:
        raise ValueError(f"{POINT_KEY}=mean averages two scorings, but {SCORINGS_KEY}=1: set {SCORINGS_KEY}=2")
    return str(value)
