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
from .judge_access import describe_judge

__all__ = [
    "POINT_KEY",
    "POINT_MODES",
    "REFERENCE_SCORE_KEY",
    "REWARD_MANAGER_NAME",
    "SCORINGS_KEY",
    "TRUTH_SCORE_KEY",
    "TRUTH_VERDICTS_KEY",
    "CALIBRATION_MARK",
    "GRADING_ERROR_KEY",
    "check_filter_groups",
    "filter_metrics",
    "grader_config",
    "grader_identity",
    "grader_in_messages",
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
#: ``reward_extra_info`` key of why grading failed: ``""`` for every response graded, the grading error's message
#: for a calibration response whose grading failed (docs/verl_integration.md#partial-groups).
GRADING_ERROR_KEY = "grading_error"
#: Per-prompt field (verl passes a prompt's fields to its reward manager) that marks a calibration prompt: the
#: reward manager answers a grading failure of its responses with a row that says so (:data:`GRADING_ERROR_KEY`),
#: which calibration counts, instead of failing the rollout session.
CALIBRATION_MARK = "setgrpo_calibration"


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


def grader_in_messages(config: Any) -> str:
    """The run's grader as error messages name it (:func:`describe_judge` of ``reward.reward_kwargs.grader``), or
    ``"the reward"`` when the reward manager is not ``setgrpo_dual`` and so has no grader of ours to name."""
    manager = _get(_get(config, "reward") or {}, "reward_manager") or {}
    if str(_get(manager, "name") or "") != REWARD_MANAGER_NAME:
        return "the reward"
    return describe_judge(grader_config(config))


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


#: verl's DAPO filter metric that reads the canonical reward (``rm_scores``, the point score r) instead of a
#: ``reward_extra_info`` key (``verl.trainer.ppo.v1.replay_buffer.FILTER_GROUPS_REWARD_METRIC``).
CANONICAL_REWARD_METRIC = "reward"


def filter_metrics(config: Any) -> tuple[str, ...]:
    """The names ``algorithm.filter_groups.metric`` can take with the ``setgrpo_dual`` manager: verl's canonical
    ``reward`` and the numeric ``reward_extra_info`` keys the manager emits for every response of this config
    (reward_manager.py's module docstring): the point score first, then the reference score and the judges'
    disagreement (two scorings), the noise-free score (a ``noisy`` grader) and the counts.

    Raises:
        ValueError: what :func:`scorings`, :func:`reference_score_key` or :func:`grader_config` refuse.
    """
    names = [CANONICAL_REWARD_METRIC, "score"]
    if scorings(config) == 2:
        names += [reference_score_key(config), "judged_disagreement"]
    if grader_config(config).get("type") == "noisy":
        names.append(TRUTH_SCORE_KEY)
    return tuple(names + ["unparsed", "judged", "scorings"])


def check_filter_groups(config: Any, *, setgrpo: bool, calibration_only: bool) -> None:
    """Refuse, before Ray, verl's DAPO group filter (``algorithm.filter_groups``) where it cannot run or would void
    the record's guarantees (docs/verl_integration.md#dapo-group-filtering).

    Args:
        config: the composed verl config (the metric is checked for the ``setgrpo_dual`` reward manager).
        setgrpo: the run trains with SetGRPO's estimator (the record's guarantees apply to its groups).
        calibration_only: the run calibrates and trains nothing (``algorithm.setgrpo.calibration.only``).

    Raises:
        ValueError: filtering in a calibration-only run (selecting groups by their scores breaks the
            exchangeability the record rests on; calibration never filters); a metric the manager does not emit
            (naming those it emits); for SetGRPO, a metric other than the point score (it would select the
            training groups by their reference or noise-free scores, which the record does not describe).
    """
    block = _get(_get(config, "algorithm"), "filter_groups")
    if not _get(block, "enable"):
        return
    if calibration_only:
        raise ValueError(
            "algorithm.filter_groups.enable=true in a calibration run: DAPO's filter drops groups by their scores, "
            "so the calibration groups would no longer be exchangeable with training groups and the record would "
            "certify nothing; calibration never filters: leave algorithm.filter_groups off here and set it on the "
            "training run, where it drops groups with one point score (docs/verl_integration.md#dapo-group-filtering)")
    if str(_get(_get(_get(config, "reward"), "reward_manager"), "name")) != REWARD_MANAGER_NAME:
        return  # another manager's keys are its own
    metric = _get(block, "metric")
    names = filter_metrics(config)
    if metric not in names:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r}: the {REWARD_MANAGER_NAME} reward manager does not emit it "
            f"(verl's DAPO recipes set 'acc' for their math reward); it emits {', '.join(names)}: set "
            f"algorithm.filter_groups.metric={CANONICAL_REWARD_METRIC} (the point score) or turn the filter off")
    if setgrpo and metric not in (CANONICAL_REWARD_METRIC, "score"):
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} selects SetGRPO's training groups by something other than "
            "their point scores, unlike the calibration groups, so the record's coverage and risk bounds would not "
            f"describe them: set algorithm.filter_groups.metric={CANONICAL_REWARD_METRIC} or score (both the point "
            "score r; that filter drops groups whose point scores are all equal, which are degenerate and left "
            "out of calibration too)")
