"""Rubric data model (RubricHub format) and rubric score arithmetic (docs/algorithm.md#0-notation).

A rubric row, in our layout::

    {"question": "...", "id": "...", "rubrics": [{"criterion": "...", "points": 5}, {"criterion": "...", "points": -3}]}

Rows as the RubricHub_v1 release ships them (``prompt`` chat messages, ``Rubrics``, criteria with ``tags``, no id)
are read too (:mod:`.rubrichub`).

A criterion may additionally name a deterministic rule checker, checked by code instead of the judge::

    {"criterion": "Uses the word 'nebula' twice", "points": 3,
     "rule": {"id": "ifbench:count:keywords_multiple", "kwargs": {"keyword1": "nebula", ...}}}

Score (docs/algorithm.md#0-notation): ``r = sum_j w_j b_j / W`` with ``b_j`` in {0, 1} the verdict on criterion j and
``W = sum_{j: w_j > 0} w_j`` (RubricHub convention). Range: ``[-N/W, 1]`` with ``N = sum_{j: w_j < 0} |w_j|``.
An all-negative rubric (only penalties, ``W = 0``) is normalised by ``N`` instead, so its score lies in
``[-1, 0]`` (0 = no penalty met). Criteria whose verdict is ``unparsed`` (an HTTP judge answer that stayed
unparseable after its retries, only kept when the grader's ``max_unparsed_ratio`` allows it; by default any
unparsed verdict stops grading, docs/grading.md#unparsed-verdicts) are left out of BOTH the sum and the
normaliser -- the score is the rubric score over the criteria that were actually judged, and the count is
reported as ``unparsed`` in the metrics; if no criterion with non-zero normaliser is left, scoring fails with
:class:`GradingError` (never a silent 0).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..core.record import question_key
from .rubrichub import release_row, rule_from_tags
from .rules import UnknownRuleError, validate_rule
from .types import GradingError, RubricRowError, Rule, Verdict

__all__ = [
    "Criterion",
    "GradeResult",
    "GradingError",
    "GradingItem",
    "Rubric",
    "RubricRowError",
    "Rule",
    "Verdict",
    "question_id",
    "rubric_score",
]

_CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Criterion:
    """One rubric criterion: its text, its points (may be negative: a penalty when met) and an optional rule."""

    criterion: str
    points: float
    rule: Rule | None = None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"criterion": self.criterion, "points": self.points}
        if self.rule is not None:
            out["rule"] = self.rule.to_dict()
        return out



def question_id(question: str) -> str:
    """The id of a rubric row that has none: ``q-`` and the first 16 hex digits of the SHA-256 of its question
    text after :func:`setgrpo_verl.core.record.question_key`, so that rows without ids stay distinct prompts and a row
    given twice keeps one id (docs/grading.md#rubric-rows)."""
    return "q-" + hashlib.sha256(question_key(question).encode("utf-8")).hexdigest()[:16]

@dataclass(frozen=True)
class Rubric:
    """A RubricHub row: ``question`` (the prompt text shown to the judge), ``id`` and the criteria; ``messages``
    is the row's own chat ``prompt`` for the policy (e.g. with a system turn), or ``None`` when the question is the
    one user turn. ``messages`` is not part of the rubric: it takes no part in comparisons and :meth:`to_row`
    leaves it out.

    Build from a row with :meth:`from_row` (accepts a dict or its JSON string); :meth:`to_row` inverts it.
    """

    question: str
    id: str
    criteria: tuple[Criterion, ...]
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, compare=False)

    def __post_init__(self):
        if not self.criteria:
            raise ValueError(f"rubric {self.id!r} has no criteria: every rubric row needs a non-empty 'rubrics' list")
        if all(c.points == 0 for c in self.criteria):
            raise ValueError(f"rubric {self.id!r}: all criteria have 0 points, its score would be undefined")

    @classmethod
    def from_row(cls, row: Mapping[str, Any] | str, *, location: str | None = None) -> "Rubric":
        """Parse and validate a RubricHub row ``{question, id, rubrics: [{criterion, points[, rule]}]}``.

        This is the single validator of rubric rows: the file reader (:func:`~.convert.read_rubric_rows`, what the
        CLI's ``--data`` uses), the verl converters, the verl dataset check and the verl reward manager all call it,
        so a row is accepted or refused identically wherever it enters.

        A row in the RubricHub_v1 release layout (``prompt`` chat messages, ``Rubrics`` or ``reward_model.rubrics``,
        criteria with ``tags``, no id) is read through :func:`~.rubrichub.release_row` first; a criterion whose
        ``tags.verifier`` is ``rule`` becomes a rule criterion (:func:`~.rubrichub.rule_from_tags`), never a judged
        one. A row in verl's RL layout (the rubric in ``reward_model.ground_truth``) is read through
        :func:`~.rubrichub.verl_row` the same way.

        Checks: the row is a mapping (or its JSON string); ``question`` is a non-blank string; ``id`` (optional) is a
        string or integer; ``rubrics`` is a non-empty list (or its JSON string); every criterion is a mapping whose
        ``criterion`` is a non-blank string and whose ``points`` is a finite real number (not a string, not a bool,
        not null); an optional ``rule`` is ``{id, kwargs}`` whose id names an if-verifiable instruction and whose
        kwargs are complete (:func:`~.rules.validate_rule`); not every criterion has 0 points.

        Args:
            row: a dict or its JSON string (verl's ``reward_model.ground_truth``).
            location: where the row came from (e.g. ``"train.jsonl, line 6"``), prefixed to error messages.

        Returns:
            The :class:`Rubric` (points as float, ``None``-valued rule kwargs dropped).

        Raises:
            RubricRowError: (a ``ValueError``) naming the location, the row id, the criterion index and the field
                that is wrong, and how to fix it. Nothing is defaulted silently.
        """
        def fail(message: str, field: str | None = None, index: int | None = None, row_id: str | None = None):
            raise RubricRowError(message, row_id=row_id, location=location, criterion_index=index, field=field)

        if isinstance(row, (str, bytes)):
            try:
                row = json.loads(row)
            except json.JSONDecodeError as exc:
                fail(f"not valid JSON ({exc.msg} at char {exc.pos}); a rubric row is a JSON object")
        if not isinstance(row, Mapping):
            fail(f"must be a mapping (JSON object) with question, id, rubrics, got {type(row).__name__}")
        try:
            row = release_row(row)
        except ValueError as exc:
            fail(str(exc), row_id=None if row.get("id") is None else str(row.get("id")))
        raw_id = row.get("id")
        if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, numbers.Integral))):
            fail(f"of type {type(raw_id).__name__} ({raw_id!r}); use a string", field="id")
        rid = "<no id>" if raw_id is None else str(raw_id)
        for key in ("question", "rubrics"):
            if row.get(key) is None:
                what = "missing" if key not in row else "null"
                fail(f"{what}; a RubricHub row has question (text), id and rubrics (list of criteria)", field=key,
                     row_id=rid)
        question = row["question"]
        if not isinstance(question, str) or not question.strip():
            fail(f"must be a non-blank string, got {question!r}", field="question", row_id=rid)
        messages = _chat_messages(row.get("prompt"), functools.partial(fail, field="prompt", row_id=rid))
        items = _rubric_items(row["rubrics"], functools.partial(fail, field="rubrics", row_id=rid))
        criteria = [_criterion(item, functools.partial(fail, index=j, row_id=rid)) for j, item in enumerate(items)]
        if all(c.points == 0 for c in criteria):
            fail("all criteria have 0 points, so the score would be undefined; give at least one criterion "
                 "non-zero points", field="rubrics", row_id=rid)
        return cls(question=question, id=rid if raw_id is not None else question_id(question), criteria=tuple(criteria),
                   messages=messages)

    def duplicate_criteria(self) -> tuple[tuple[int, int], ...]:
        """``(j, i)`` for each criterion ``j`` that repeats an earlier criterion ``i``: the same text (whitespace
        runs collapsed, ends stripped) and the same rule. A repeated criterion is judged and counted once per copy
        (docs/grading.md#rubric-rows)."""
        first: dict[tuple, int] = {}
        out = []
        for j, c in enumerate(self.criteria):
            key = (" ".join(c.criterion.split()), None if c.rule is None else repr(c.rule))
            if key in first:
                out.append((j, first[key]))
            else:
                first[key] = j
        return tuple(out)

    def keep_one_copy(self) -> "Rubric":
        """This rubric with each repeated criterion (:meth:`duplicate_criteria`) left out; its first copy stays."""
        repeated = {j for j, _ in self.duplicate_criteria()}
        if not repeated:
            return self
        return Rubric(question=self.question, id=self.id, messages=self.messages,
                      criteria=tuple(c for j, c in enumerate(self.criteria) if j not in repeated))

    def to_row(self) -> dict:
        """The RubricHub row (a plain dict, JSON-serialisable)."""
        return {"question": self.question, "id": self.id, "rubrics": [c.to_dict() for c in self.criteria]}

    def to_json(self) -> str:
        return json.dumps(self.to_row(), ensure_ascii=False, sort_keys=True)

    @property
    def score_range(self) -> tuple[float, float]:
        """``(min, max)`` of :func:`rubric_score` for this rubric when every verdict is parsed."""
        pos = sum(c.points for c in self.criteria if c.points > 0)
        neg = sum(-c.points for c in self.criteria if c.points < 0)
        return (-neg / pos, 1.0) if pos > 0 else (-1.0, 0.0)


@dataclass(frozen=True)
class GradingItem:
    """One (prompt, response, rubric) to grade. ``prompt`` defaults to ``rubric.question`` when ``None``.

    ``data_source`` and ``extra_info`` are passed through to function graders (verl's ``compute_score`` style).
    ``nonce`` names this grading call among all others of a run (the verl reward manager: training step, dataset
    row and rollout session), so that a grader drawing fresh randomness per call (the noisy grader,
    docs/validation.md#noisy-grader) gives two samples with the same text independent draws; ``None`` when the
    caller has none (graders that need it refuse the item).
    """

    response: str
    rubric: Rubric | None = None
    prompt: str | None = None
    data_source: str = "rubric"
    extra_info: Mapping[str, Any] | None = None
    ground_truth: Any = None
    nonce: str | None = None

    @property
    def question(self) -> str:
        if self.prompt is not None:
            return self.prompt
        if self.rubric is None:
            raise GradingError("a grading item needs a prompt or a rubric (its question)")
        return self.rubric.question


@dataclass(frozen=True)
class GradeResult:
    """One scoring of one response: ``score`` (float, see :func:`rubric_score`), the per-criterion ``verdicts``
    (same order as the rubric's criteria; may be empty for a function grader), ``scoring_index`` and ``seed``;
    ``truth`` is the noise-free score when the grader knows it (a noisy grader around a deterministic one,
    docs/validation.md#noisy-grader), else ``None``, and ``truth_verdicts`` the noise-free verdicts it comes from
    (one per criterion), else ``None``."""

    score: float
    verdicts: tuple[Verdict, ...]
    scoring_index: int
    seed: int
    truth: float | None = None
    truth_verdicts: tuple[Verdict, ...] | None = None

    @property
    def num_unparsed(self) -> int:
        return sum(v.outcome == "unparsed" for v in self.verdicts)

    def verdicts_json(self) -> str:
        """The verdicts as a compact JSON list (what the verl reward manager puts in ``reward_extra_info``)."""
        return json.dumps([v.to_dict() for v in self.verdicts], separators=(",", ":"))


def rubric_score(rubric: Rubric, verdicts: Sequence[Verdict | bool | None]) -> float:
    """Rubric score of one scoring (docs/algorithm.md#0-notation): ``sum_j w_j b_j / W``.

    Args:
        rubric: the rubric (criteria with points ``w_j``).
        verdicts: one per criterion, in order: a :class:`Verdict`, or ``True``/``False`` for met/unmet, ``None`` for
            unparsed.

    Returns:
        The score as a Python float. ``W`` = sum of positive points over the parsed criteria; if the parsed
        criteria have no positive points, ``W`` = sum of their absolute negative points (all-negative rubric,
        score in [-1, 0]). Unparsed criteria are excluded from the sum and from ``W``.

    Raises:
        ValueError: the number of verdicts differs from the number of criteria.
        GradingError: every criterion with non-zero points is unparsed (no score can be formed).
    """
    if len(verdicts) != len(rubric.criteria):
        raise ValueError(f"rubric {rubric.id!r} has {len(rubric.criteria)} criteria but {len(verdicts)} verdicts were given")
    total = pos = neg = 0.0
    for crit, v in zip(rubric.criteria, verdicts):
        met = v.met if isinstance(v, Verdict) else v
        if met is None:
            continue
        if crit.points > 0:
            pos += crit.points
        else:
            neg -= crit.points
        if met:
            total += crit.points
    norm = pos if pos > 0 else neg
    if norm == 0:
        said = next((v.raw for v in verdicts if isinstance(v, Verdict) and v.outcome == "unparsed" and v.raw), None)
        quote = "" if said is None else f" (the judge said {said[:200]!r})"
        raise GradingError(
            f"rubric {rubric.id!r}: every criterion with non-zero points has an unparsed verdict{quote}, so no score "
            "exists; use a judge that answers with one verdict word (yes or no, after any <think> block; "
            "docs/grading.md#unparsed-verdicts lists the words read in other languages) or raise its parse retries"
        )
    return total / norm


def _chat_messages(prompt: Any, fail: Callable[[str], None]) -> tuple[dict[str, str], ...] | None:
    """A row's own chat ``prompt`` as ``{role, content}`` messages, or None when the row has none; ``fail(message)``
    raises the row's error."""
    if prompt is None:
        return None
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    ok = isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, Mapping) and m.get("role") in _CHAT_ROLES and isinstance(m.get("content"), str)
        for m in prompt)
    if not ok:
        fail(f"must be a non-empty list of {{role, content}} chat messages (role in {_CHAT_ROLES}, content "
             f"a string), got {prompt!r}; or leave it out to use the question as one user turn")
    return tuple({"role": m["role"], "content": m["content"]} for m in prompt)


def _rubric_items(items: Any, fail: Callable[[str], None]) -> Sequence:
    """A row's ``rubrics``: a non-empty list (or its JSON string, or a parquet column's array); ``fail(message)``
    raises the row's error."""
    if isinstance(items, (str, bytes)):
        try:
            items = json.loads(items)
        except json.JSONDecodeError as exc:
            fail(f"a string that is not a JSON list ({exc.msg})")
    if hasattr(items, "tolist") and not isinstance(items, Mapping):  # a numpy array from a parquet column
        items = items.tolist()
    if isinstance(items, Mapping) or not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        fail(f"must be a list of {{criterion, points[, rule]}}, got {type(items).__name__}")
    if len(items) == 0:
        fail("empty; every rubric row needs at least one criterion")
    return items


def _criterion(item: Any, fail: Callable[..., None]) -> Criterion:
    """One criterion of a row, checked as :meth:`Rubric.from_row` says; ``fail(message, field=None)`` raises the
    row's error naming the criterion."""
    if not isinstance(item, Mapping):
        fail(f"must be a mapping {{criterion, points[, rule]}}, got {item!r}")
    for key in ("criterion", "points"):
        if key not in item:
            fail("missing; every criterion needs criterion (text) and points (a number)", field=key)
    text = item["criterion"]
    if text is None:
        fail("null; give the criterion text the judge decides (or remove the criterion)", field="criterion")
    if not isinstance(text, str) or not text.strip():
        fail(f"must be a non-blank string, got {text!r}; give the criterion text the judge decides",
             field="criterion")
    points = item["points"]
    if points is None:
        fail("null; give a number (positive: credit when met, negative: penalty when met)", field="points")
    if isinstance(points, bool) or not isinstance(points, numbers.Real):
        fail(f"must be a number, got {type(points).__name__} {points!r}; write it as a JSON number "
             "(positive: credit when met, negative: penalty when met)", field="points")
    points = float(points)
    if not math.isfinite(points):
        fail(f"{points!r}; points must be finite", field="points")
    rule = item.get("rule")
    try:
        tagged = rule_from_tags(item.get("tags"))
    except ValueError as exc:
        fail(str(exc), field="tags")
    if tagged is not None:
        if rule is not None:
            fail("has both a rule and rule tags (tags.verifier 'rule'); keep one of them", field="tags")
        rule = {"id": tagged[0], "kwargs": tagged[1]}
    if rule is not None:
        if not isinstance(rule, Mapping) or not isinstance(rule.get("id"), str) or not rule["id"].strip():
            fail(f"must be {{id, kwargs}} with a string id, got {rule!r}", field="rule")
        kwargs = rule.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            fail(f"must be a mapping, got {type(kwargs).__name__}", field="rule.kwargs")
        rule = Rule(rule["id"], {k: v for k, v in dict(kwargs or {}).items() if v is not None})
        try:
            validate_rule(rule)
        except ValueError as exc:
            field = "rule.id" if isinstance(exc, UnknownRuleError) else "rule.kwargs"
            fail(str(exc), field=field)
    return Criterion(text, points, rule)
