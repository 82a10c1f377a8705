"""Rubric data model (RubricHub format) and rubric score arithmetic (docs/algorithm.md#0-notation).

A rubric row, as RubricHub ships it::

    {"question": "...", "id": "...", "rubrics": [{"criterion": "...", "points": 5}, {"criterion": "...", "points": -3}]}

A criterion may additionally name a deterministic rule checker, checked by code instead of the judge::

    {"criterion": "Uses the word 'nebula' twice", "points": 3,
     "rule": {"id": "ifbench:count:keywords_multiple", "kwargs": {"keyword1": "nebula", ...}}}

Score (docs/algorithm.md#0-notation): ``r = sum_j w_j b_j / W`` with ``b_j`` in {0, 1} the verdict on criterion j and
``W = sum_{j: w_j > 0} w_j`` (RubricHub convention). Range: ``[-N/W, 1]`` with ``N = sum_{j: w_j < 0} |w_j|``.
An all-negative rubric (only penalties, ``W = 0``) is normalised by ``N`` instead, so its score lies in
``[-1, 0]`` (0 = no penalty met). Criteria whose verdict is ``unparsed`` (an HTTP judge answer that stayed
unparseable after its retries, only with ``on_unparsed="unparsed"``) are left out of BOTH the sum and the
normaliser -- the score is the rubric score over the criteria that were actually judged, and the count is
reported as ``unparsed`` in the metrics; if no criterion with non-zero normaliser is left, scoring fails with
:class:`GradingError` (never a silent 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

__all__ = [
    "Criterion",
    "GradeResult",
    "GradingError",
    "GradingItem",
    "Rubric",
    "Rule",
    "Verdict",
    "rubric_score",
]

Outcome = Literal["met", "unmet", "unparsed"]


class GradingError(RuntimeError):
    """A response could not be graded under the configured protocol (the message says why and what to change)."""


@dataclass(frozen=True)
class Rule:
    """A deterministic rule checker: ``id`` (``"ifbench:<instruction id>"`` or ``"ifeval:<instruction id>"``) and its
    keyword arguments (those of the if-verifiable instruction checker). See :mod:`setgrpo_verl.grading.rules`."""

    id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "kwargs": dict(self.kwargs)}


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


@dataclass(frozen=True)
class Rubric:
    """A RubricHub row: ``question`` (the prompt text shown to the judge), ``id`` and the criteria.

    Build from a row with :meth:`from_row` (accepts a dict or its JSON string); :meth:`to_row` inverts it.
    """

    question: str
    id: str
    criteria: tuple[Criterion, ...]

    def __post_init__(self):
        if not self.criteria:
            raise ValueError(f"rubric {self.id!r} has no criteria: every rubric row needs a non-empty 'rubrics' list")
        if all(c.points == 0 for c in self.criteria):
            raise ValueError(f"rubric {self.id!r}: all criteria have 0 points, its score would be undefined")

    @classmethod
    def from_row(cls, row: Mapping[str, Any] | str) -> "Rubric":
        """Parse a RubricHub row ``{question, id, rubrics: [{criterion, points[, rule]}]}`` (dict or JSON string).

        Raises:
            ValueError: a required field is missing or malformed (the message names the row id and field).
        """
        if isinstance(row, (str, bytes)):
            row = json.loads(row)
        if not isinstance(row, Mapping):
            raise ValueError(f"a rubric row must be a mapping or a JSON object string, got {type(row).__name__}")
        rid = str(row.get("id", "<no id>"))
        for key in ("question", "rubrics"):
            if key not in row or row[key] is None:
                raise ValueError(f"rubric row {rid!r} lacks the field {key!r} (RubricHub format: question, id, rubrics)")
        items = row["rubrics"]
        if isinstance(items, (str, bytes)):
            items = json.loads(items)
        criteria = []
        for j, item in enumerate(items):
            if not isinstance(item, Mapping) or "criterion" not in item or "points" not in item:
                raise ValueError(f"rubric row {rid!r}, rubrics[{j}] must be {{criterion, points[, rule]}}, got {item!r}")
            points = float(item["points"])
            if not math.isfinite(points):
                raise ValueError(f"rubric row {rid!r}, rubrics[{j}] has non-finite points {item['points']!r}")
            rule = item.get("rule")
            if rule is not None:
                if not isinstance(rule, Mapping) or "id" not in rule:
                    raise ValueError(f"rubric row {rid!r}, rubrics[{j}].rule must be {{id, kwargs}}, got {rule!r}")
                kwargs = rule.get("kwargs") or {}
                rule = Rule(str(rule["id"]), {k: v for k, v in dict(kwargs).items() if v is not None})
            criteria.append(Criterion(str(item["criterion"]), points, rule))
        return cls(question=str(row["question"]), id=rid, criteria=tuple(criteria))

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
class Verdict:
    """The verdict on one criterion in one scoring.

    ``outcome`` is ``met``, ``unmet`` or ``unparsed``; ``source`` is ``rule``, ``judge`` or ``function``;
    ``p_yes`` is the judge's probability of ``yes`` when known (local judge), else ``None``; ``raw`` the judge's
    answer text (HTTP judge) or ``None``.
    """

    outcome: Outcome
    source: str
    p_yes: float | None = None
    raw: str | None = None

    @property
    def met(self) -> bool | None:
        return None if self.outcome == "unparsed" else self.outcome == "met"

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"outcome": self.outcome, "source": self.source}
        if self.p_yes is not None:
            out["p_yes"] = round(float(self.p_yes), 6)
        if self.raw is not None:
            out["raw"] = self.raw
        return out


@dataclass(frozen=True)
class GradingItem:
    """One (prompt, response, rubric) to grade. ``prompt`` defaults to ``rubric.question`` when ``None``.

    ``data_source`` and ``extra_info`` are passed through to function graders (verl's ``compute_score`` style).
    """

    response: str
    rubric: Rubric | None = None
    prompt: str | None = None
    data_source: str = "rubric"
    extra_info: Mapping[str, Any] | None = None
    ground_truth: Any = None

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
    (same order as the rubric's criteria; may be empty for a function grader), ``scoring_index`` and ``seed``."""

    score: float
    verdicts: tuple[Verdict, ...]
    scoring_index: int
    seed: int

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
        raise GradingError(
            f"rubric {rubric.id!r}: every criterion with non-zero points has an unparsed verdict, so no score exists; "
            "use a judge that follows the answer format, raise its parse retries, or set on_unparsed='error'"
        )
    return total / norm
