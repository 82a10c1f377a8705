"""The dual-reward manager ``setgrpo_dual`` for verl 0.9.1's reward loop.

verl's reward loop (``verl.experimental.reward_loop``) resolves ``reward.reward_manager.name`` through the registry
``verl.experimental.reward_loop.reward_manager.get_reward_manager_cls`` (``source: register``) and calls
``await manager.run_single(data_item)`` once per response. This manager scores each response
``reward.reward_kwargs.scorings`` times (:func:`~.reward_config.scorings`: 2, the default, or 1) with the same
grading protocol (:class:`setgrpo_verl.grading.DualScorer`, docs/algorithm.md#0-notation):

* ``reward_score`` = the point score r (verl puts it on the last response token of ``rm_scores``): the first
  scoring, or with ``reward.reward_kwargs.point=mean`` (:func:`~.reward_config.point_mode`) the mean of the two, for
  verl's GRPO on the mean of two scorings (SetGRPO refuses it: it reads the two scorings apart);
* ``reward_extra_info`` (one value per response; the same keys for every response of a run) carries
  ``score`` (= r), ``point_verdicts`` (JSON list of per-criterion verdicts), ``unparsed`` (number of unparsed judge
  verdicts in all scorings), ``judged`` (number of judge verdicts in all scorings) and ``scorings`` (grader calls
  made for the response, 1 or 2) and ``no_answer`` (1 for a response whose thinking block never closes, graded as
  the empty answer: docs/grading.md#thinking-policies) and ``grading_error`` (``""``; for a calibration response
  whose grading failed, the error's message and none of the scores: docs/verl_integration.md#partial-groups); with
  two scorings also ``reference_score`` (r', under the key
  ``algorithm.setgrpo.reference_score_key``, which the SetGRPO trainer reads back; the one source of that key),
  ``reference_verdicts`` and ``judged_disagreement`` (fraction of judged criteria whose verdicts differ between the
  two scorings; undefined with one scoring, which has no reference and no disagreement);
  :func:`grading_metrics` turns a batch's counts into ``setgrpo/grading/unparsed_ratio``
  (docs/grading.md#unparsed-verdicts) and ``setgrpo/grading/calls_per_step`` for verl's tracker;
* with a grader that knows the noise-free score (``type: noisy`` around a deterministic grader,
  docs/validation.md#noisy-grader) also ``truth_score``, which the calibration stage stores as ``truth``, and
  ``truth_verdicts`` (the noise-free verdicts and the criteria's points, :data:`TRUTH_VERDICTS_KEY`), which it
  stores in its shards.

Each response's grading item carries a nonce naming its rollout sample (:func:`sample_nonce`: the step, the
dataset row and the rollout session that verl's v1 agent loop passes with every sample), from which the noisy
grader draws its flips fresh per sample.

Configuration (verl config, next to DAPO's ``reward.reward_kwargs``)::

    reward:
      reward_manager: {source: register, name: setgrpo_dual}
      num_workers: 1                 # each reward worker builds its own grader (a local judge loads a model)
      reward_kwargs:
        scorings: 2                  # 1: the point score alone (the GRPO baseline; SetGRPO refuses it)
        point: first                 # mean: the mean of the two scorings is r (GRPO on it; SetGRPO refuses it)
        grader: {type: local_hf, temperature: 1.0, seed: 0}      # see setgrpo_verl.grading.build_grader
        # or {type: openai, base_url: http://127.0.0.1:8000/v1, model: Qwen/Qwen3-8B, max_concurrency: 64,
        #     chat_template_kwargs: {enable_thinking: false}}   # a reasoning judge: thinking off, or instead
        #     max_tokens: 2048                                  # a token budget that fits its reasoning (default 4)
        # or {type: function, path: my_reward.py, name: compute_score}
        # or {type: noisy, flip_prob: 0.1, seed: 0, base: {type: rules}}   # known verdict noise, truth_score
        # type function without path uses verl's reward.custom_reward_function (path, name)

Hydra overrides for those judge keys: ``+reward.reward_kwargs.grader.max_tokens=2048`` and
``+reward.reward_kwargs.grader.chat_template_kwargs.enable_thinking=false``.

``ground_truth`` of each row is its rubric (RubricHub row as JSON, see :mod:`setgrpo_verl.grading.convert`),
validated by :meth:`setgrpo_verl.grading.Rubric.from_row` (the same validator as the converters and ``--data``).
The module registers the manager on import; :mod:`setgrpo_verl.integration.plugin` imports it right after verl
imports its reward-manager registry. :func:`register` is idempotent.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Optional, Sequence

from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register as _verl_register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

from ..grading import DualScorer, GradingError, GradingItem, Rubric, RubricRowError
from ..grading.answers import prompt_opens_thinking
from .reward_config import (
    CALIBRATION_MARK,
    GRADING_ERROR_KEY,
    REFERENCE_SCORE_KEY,
    REWARD_MANAGER_NAME,
    TRUTH_SCORE_KEY,
    TRUTH_VERDICTS_KEY,
    grader_config,
    grader_identity,
    point_mode,
    reference_score_key,
    scorings,
)

__all__ = [
    "REFERENCE_SCORE_KEY",
    "REWARD_MANAGER_NAME",
    "TRUTH_SCORE_KEY",
    "TRUTH_VERDICTS_KEY",
    "CALLS_METRIC",
    "NO_ANSWER_METRIC",
    "TRUTH_METRIC",
    "SetGRPODualRewardManager",
    "grader_config",
    "GRADING_COUNT_KEYS",
    "UNPARSED_RATIO_METRIC",
    "grader_identity",
    "grading_counts",
    "grading_metrics",
    "register",
    "sample_nonce",
    "unparsed_ratio",
]

logger = logging.getLogger(__name__)

#: verl tracker metric: unparsed judge verdicts / judge verdicts of a batch (all scorings).
UNPARSED_RATIO_METRIC = "setgrpo/grading/unparsed_ratio"
#: verl tracker metric: grader calls of a step's batch (responses x scorings per response).
CALLS_METRIC = "setgrpo/grading/calls_per_step"
#: verl tracker metric: share of a batch's responses whose thinking block never closes, graded as the empty answer
#: (docs/grading.md#thinking-policies).
NO_ANSWER_METRIC = "setgrpo/grading/no_answer_ratio"
#: verl tracker metric: mean noise-free score of a batch's responses, with a grader that knows it
#: (docs/validation.md#noisy-grader): the truth reward of a training step.
TRUTH_METRIC = "setgrpo/grading/truth_score/mean"
#: ``reward_extra_info`` keys that :func:`grading_metrics` reads (per response: counts over all its scorings, its
#: number of scorings, whether it answered, and its truth score where the grader knows it).
GRADING_COUNT_KEYS = ("unparsed", "judged", "scorings", "no_answer", TRUTH_SCORE_KEY)


def _count_rows(data: Any, tags: Optional[Sequence[Mapping[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Each real row's :data:`GRADING_COUNT_KEYS` values (``None`` where absent), or ``None`` when the batch
    carries no counts (arguments: :func:`grading_counts`)."""
    keys = set(data.keys())
    if {"unparsed", "judged"} <= keys:
        columns = {k: list(data[k]) for k in GRADING_COUNT_KEYS if k in keys}
        rows = [{k: columns[k][i] if k in columns else None for k in GRADING_COUNT_KEYS}
                for i in range(len(columns["unparsed"]))]
    elif "extra_fields" in keys:
        extra = data["extra_fields"]
        infos = [(e or {}).get("reward_extra_info") or {} if isinstance(e, Mapping) else {}
                 for e in (extra.tolist() if hasattr(extra, "tolist") else list(extra))]
        rows = [{k: info.get(k) for k in GRADING_COUNT_KEYS} for info in infos]
    else:
        return None
    if tags is not None:
        if len(tags) != len(rows):
            raise ValueError(f"{len(tags)} tags for a batch of {len(rows)} rows")
        rows = [row for row, tag in zip(rows, tags) if not (tag or {}).get("is_padding", False)]
    return rows


def _sum(rows: list[dict[str, Any]], *keys: str) -> Optional[tuple[float, ...]]:
    """Sums of ``keys`` over the rows that carry them all, or ``None`` when no row does."""
    carried = [tuple(float(row[k]) for k in keys) for row in rows if all(row[k] is not None for k in keys)]
    return tuple(map(sum, zip(*carried))) if carried else None


def grading_counts(data: Any, tags: Optional[Sequence[Mapping[str, Any]]] = None) -> Optional[tuple[float, float]]:
    """``(unparsed, judged)`` judge verdicts of one scored batch, summed over its responses and their scorings, or
    ``None`` when the batch carries no counts (another reward manager). docs/grading.md#unparsed-verdicts.

    Args:
        data: a TensorDict / mapping with verl's per-sample ``extra_fields`` (each ``{"reward_extra_info": {...}}``,
            the streaming reward loop) or top-level ``unparsed`` and ``judged`` arrays (the colocated path).
        tags: verl's per-sample tags of the batch (``KVBatchMeta.tags``), one per row; rows tagged ``is_padding``
            (verl's copies of a real row that fill a batch up to its divisor) are left out.

    Raises:
        ValueError: ``tags`` has not one tag per row.
    """
    rows = _count_rows(data, tags)
    return None if rows is None else _sum(rows, "unparsed", "judged")


def grading_metrics(data: Any, tags: Optional[Sequence[Mapping[str, Any]]] = None) -> dict[str, float]:
    """The grading metrics of one scored batch (arguments: :func:`grading_counts`; padding rows left out):
    ``UNPARSED_RATIO_METRIC`` (unparsed / judged, 0 when nothing was judged; docs/grading.md#unparsed-verdicts) and
    ``CALLS_METRIC`` (the rows' ``scorings`` summed: responses x scorings; docs/cli.md#metrics) and
    ``NO_ANSWER_METRIC`` (the share of rows without an answer; docs/grading.md#thinking-policies) and
    ``TRUTH_METRIC`` (the rows' mean truth score, with a grader that knows it), each present when the batch carries
    its counts, so ``{}`` for another reward manager.

    Raises:
        ValueError: ``tags`` has not one tag per row.
    """
    rows = _count_rows(data, tags)
    if rows is None:
        return {}
    metrics = {}
    counts = _sum(rows, "unparsed", "judged")
    if counts is not None:
        metrics[UNPARSED_RATIO_METRIC] = unparsed_ratio(*counts)
    calls = _sum(rows, "scorings")
    if calls is not None:
        metrics[CALLS_METRIC] = calls[0]
    answered = [float(row["no_answer"]) for row in rows if row["no_answer"] is not None]
    if answered:
        metrics[NO_ANSWER_METRIC] = sum(answered) / len(answered)
    truth = [float(row[TRUTH_SCORE_KEY]) for row in rows if row[TRUTH_SCORE_KEY] is not None]
    if truth:
        metrics[TRUTH_METRIC] = sum(truth) / len(truth)
    return metrics


# the per-sample fields of verl 0.9.1's v1 agent loop that together name one rollout sample of a run
_NONCE_FIELDS = ("global_steps", "index", "session_id")


def sample_nonce(non_tensor: Mapping[str, Any]) -> Optional[str]:
    """The nonce of one rollout sample (docs/validation.md#noisy-grader): ``"<global_steps>/<index>/<session_id>"``,
    or ``None`` when a field is missing (verl's v0 trainer passes no ``session_id``).

    verl's v1 agent loop passes the prompt's non-tensor fields with each sample: ``global_steps`` (the step whose
    batch it belongs to; the calibration batches share step 0, before training's step 1), ``index`` (the dataset
    row, ``extra_info.index``, which the converters number) and ``session_id`` (which of the prompt's
    ``rollout.n`` responses it is). Together they name one sample, the same in a rerun of the run; verl's ``uid``
    does not serve, being a fresh ``uuid4`` per run.

    Args:
        non_tensor: one sample's non-tensor fields (``DataProto.non_tensor_batch`` of one row).
    """
    values = [non_tensor.get(key) for key in _NONCE_FIELDS]
    if any(v is None for v in values):
        return None
    return "/".join(str(v.item() if hasattr(v, "item") else v) for v in values)


def unparsed_ratio(unparsed: float, judged: float) -> float:
    """``unparsed / judged`` judge verdicts, 0 when none was judged (a rules-only or function grader)."""
    return unparsed / judged if judged else 0.0


class SetGRPODualRewardManager(RewardManagerBase):
    """verl reward manager that scores every response twice (point + reference) with one rubric grader, or once
    (point only) with ``reward.reward_kwargs.scorings=1``.

    Constructed by verl (``load_reward_manager``) as ``cls(config, tokenizer, compute_score, **kwargs)``; the
    grader comes from :func:`grader_config`, the reference score's key from :func:`reference_score_key`
    (``algorithm.setgrpo.reference_score_key``), the scorings from :func:`scorings`. One scorer is shared by all
    instances in a process with the same grader config and scorings (a local judge model is loaded once per reward
    worker).

    Raises (at construction):
        ValueError: no grader block, a ``reward.reward_kwargs.reference_score_key``, or scorings other than 1 or 2.
    """

    _scorers: dict[str, DualScorer] = {}

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        self.grader_cfg = grader_config(config)
        self.reference_key = reference_score_key(config)
        self.scorings = scorings(config)
        self.point_mode = point_mode(config)
        key = json.dumps([self.grader_cfg, self.scorings], sort_keys=True, default=str)
        scorer = self._scorers.get(key)
        if scorer is None:
            scorer = DualScorer(self.grader_cfg, scoring_indices=(0, 1)[:self.scorings])
            self._scorers[key] = scorer
        self.scorer = scorer

    @property
    def identity(self) -> dict:
        return self.scorer.identity

    async def run_single(self, data: DataProto) -> dict:
        """Score one response once or twice (:attr:`scorings`). Returns
        ``{"reward_score": r, "reward_extra_info": {...}}`` (module docstring).

        Raises:
            setgrpo_verl.grading.RubricRowError: (a ``ValueError``) the row's ``reward_model.ground_truth`` is not a
                valid rubric (for rubric graders; for function graders when it is a rubric row), naming the row id,
                the criterion index and the field (:meth:`setgrpo_verl.grading.Rubric.from_row`).
            setgrpo_verl.grading.GradingError: grading failed (judge unreachable, a judge reply that is not a chat
                completion, a judge cut off by its token budget, unparsed verdicts above the grader's
                max_unparsed_ratio, a non-finite score from a function grader: the message names the response);
                for a calibration prompt (:data:`~.reward_config.CALIBRATION_MARK`) a row carrying the message under
                ``grading_error`` instead, which calibration counts (docs/verl_integration.md#partial-groups).
        """
        data = data[-1:]
        item = data[0]
        response_ids = item.batch["responses"]
        response_length = response_ids.shape[-1]
        valid = int(item.batch["attention_mask"][-response_length:].sum())
        valid_ids = response_ids[:valid]
        prompt_tail = _prompt_tail(item)
        response, prompt_end = await self.loop.run_in_executor(
            None, lambda: (self.tokenizer.decode(valid_ids, skip_special_tokens=True),
                           self.tokenizer.decode(prompt_tail, skip_special_tokens=True))
        )
        ntb = item.non_tensor_batch
        ground_truth = ntb["reward_model"]["ground_truth"]
        extra_info = dict(ntb.get("extra_info") or {})
        is_function = self.grader_cfg.get("type") == "function"
        rubric = None
        # a function grader may take any ground truth; a rubric (a row with "rubrics") is validated for every grader
        if not is_function or _looks_like_rubric(ground_truth):
            row = extra_info.get("id", extra_info.get("index"))
            try:
                rubric = Rubric.from_row(ground_truth, location=f"verl row {row!r} (reward_model.ground_truth)")
            except RubricRowError as exc:
                raise RubricRowError(
                    f"{exc.reason}; fix the source rows and convert them again with setgrpo_verl.grading.convert",
                    row_id=exc.row_id, location=exc.location, criterion_index=exc.criterion_index, field=exc.field,
                ) from None
        grading_item = GradingItem(
            response=response,
            rubric=rubric,
            data_source=str(ntb.get("data_source", "rubric")),
            extra_info=extra_info,
            ground_truth=ground_truth if is_function else None,
            nonce=sample_nonce(ntb),
        )
        try:
            scores = await self.scorer.ascore([grading_item], opened=[prompt_opens_thinking(prompt_end)])
        except GradingError as exc:
            if not _marked(ntb.get(CALIBRATION_MARK)):
                raise
            return self._grading_failed(exc, rubric is not None)
        point = float(scores.point[0])
        if self.point_mode == "mean":  # GRPO on the mean of the two scorings (the grpo_mean2 baseline)
            point = (point + float(scores.reference[0])) / 2
        metrics = scores.metrics(prefix="")
        extra: dict[str, Any] = {
            "score": point,
            "point_verdicts": scores.point_results[0].verdicts_json(),
            "unparsed": int(metrics["unparsed"]),
            "judged": int(metrics["judged"]),
            "scorings": scores.scorings,
            "no_answer": int(scores.no_answer[0]),
            GRADING_ERROR_KEY: "",
        }
        if scores.reference is not None:
            extra[self.reference_key] = float(scores.reference[0])
            extra["reference_verdicts"] = scores.reference_results[0].verdicts_json()
            extra["judged_disagreement"] = float(metrics["judged_disagreement_rate"])
        if scores.truth is not None:
            extra[TRUTH_SCORE_KEY] = float(scores.truth[0])
        verdicts = scores.point_results[0].truth_verdicts
        if verdicts is not None and rubric is not None:
            extra[TRUTH_VERDICTS_KEY] = json.dumps({"met": [-1 if v.met is None else int(v.met) for v in verdicts],
                                                    "points": [float(c.points) for c in rubric.criteria]})
        return {"reward_score": point, "reward_extra_info": extra}

    def _grading_failed(self, exc: GradingError, has_rubric: bool) -> dict:
        """The row of a calibration response whose grading failed: no score (reward 0, never read: calibration leaves
        its group out and counts it), nothing judged, and the error's message under :data:`GRADING_ERROR_KEY`. It
        carries every key a graded row of this grader carries (None for the scores and verdicts): verl's colocated
        reward path builds the extra fields from the first row's keys."""
        message = str(exc) or type(exc).__name__
        logger.warning("grading a calibration response failed; calibration leaves its group out: %s", message)
        keys = ["score", "point_verdicts"]
        if self.scorings == 2:
            keys += [self.reference_key, "reference_verdicts", "judged_disagreement"]
        if getattr(self.scorer.grader, "has_truth", False):  # a noisy grader over a deterministic one
            keys += [TRUTH_SCORE_KEY] + ([TRUTH_VERDICTS_KEY] if has_rubric else [])
        return {"reward_score": 0.0, "reward_extra_info": {**dict.fromkeys(keys), "unparsed": 0, "judged": 0,
                                                           "scorings": self.scorings, "no_answer": 0,
                                                           GRADING_ERROR_KEY: message}}


#: Prompt tokens whose text says whether the chat template opened a thinking block in the generation prompt.
PROMPT_TAIL_TOKENS = 8


def _prompt_tail(item: Any) -> Any:
    """The last :data:`PROMPT_TAIL_TOKENS` valid prompt token ids of one sample (verl's left-padded ``prompts``)."""
    prompt_ids = item.batch["prompts"]
    valid = int(item.batch["attention_mask"][: prompt_ids.shape[-1]].sum())
    return prompt_ids[prompt_ids.shape[-1] - valid:][-PROMPT_TAIL_TOKENS:]


def _marked(value: Any) -> bool:
    """True for a :data:`CALIBRATION_MARK` value that marks a calibration prompt (verl passes it as a scalar, a 0-d
    array or tensor)."""
    if value is None:
        return False
    return bool(value.item() if hasattr(value, "item") else value)


def _looks_like_rubric(ground_truth: Any) -> bool:
    """True for a RubricHub row (a mapping, or a JSON object string, with a ``rubrics`` key)."""
    if isinstance(ground_truth, (str, bytes)):
        text = ground_truth.strip()
        if not text.startswith("{" if isinstance(text, str) else b"{"):
            return False
        try:
            ground_truth = json.loads(text)
        except ValueError:
            return False
    return isinstance(ground_truth, Mapping) and "rubrics" in ground_truth


def register() -> type[SetGRPODualRewardManager]:
    """Register :class:`SetGRPODualRewardManager` as ``setgrpo_dual`` in verl's reward-loop registry (idempotent)."""
    if REWARD_MANAGER.get(REWARD_MANAGER_NAME) is not SetGRPODualRewardManager:
        _verl_register(REWARD_MANAGER_NAME)(SetGRPODualRewardManager)
    return SetGRPODualRewardManager


register()
