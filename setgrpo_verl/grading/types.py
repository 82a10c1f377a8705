"""Shared grading types (a leaf module: it imports nothing from the package).

:class:`GradingError` and :class:`RubricRowError` (the two errors every grading module raises), :class:`Rule` (a
rule criterion's checker id and arguments) and :class:`Verdict` (the outcome on one criterion in one scoring). The
rubric data model (:mod:`.rubric`), the rule checkers (:mod:`.rules`) and the judges use them without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

__all__ = ["GradingError", "Outcome", "RubricRowError", "Rule", "Verdict"]

Outcome = Literal["met", "unmet", "unparsed"]


class GradingError(RuntimeError):
    """A response could not be graded under the configured protocol (the message says why and what to change)."""


class RubricRowError(ValueError):
    """A rubric row that cannot be used; raised by :meth:`Rubric.from_row` before anything is judged.

    Attributes:
        row_id: the row's ``id`` (``"<no id>"`` when the row has none), or ``None`` when the row is not a mapping.
        location: where the row came from (file and line), or ``None``.
        criterion_index: 0-based index into the row's ``rubrics`` list, or ``None`` for a row-level field.
        field: the offending field: ``question``, ``id``, ``rubrics``, ``criterion``, ``points``, ``rule``,
            ``rule.id`` or ``rule.kwargs`` (``None`` when the whole row is malformed).
        reason: the message without the location / row / field prefix.
    """

    def __init__(self, reason: str, *, row_id: str | None = None, location: str | None = None,
                 criterion_index: int | None = None, field: str | None = None):
        self.row_id, self.location, self.criterion_index, self.field, self.reason = (
            row_id, location, criterion_index, field, reason)
        where = "rubric row" if row_id is None else f"rubric row {row_id!r}"
        path = field
        if criterion_index is not None:
            path = f"rubrics[{criterion_index}]" + (f".{field}" if field else "")
        text = f"{where}, {path}: {reason}" if path else f"{where}: {reason}"
        super().__init__(f"{location}: {text}" if location else text)

    def at(self, location: str) -> "RubricRowError":
        """The same error with ``location`` (e.g. ``"data.jsonl, line 6"``) put in front."""
        return RubricRowError(self.reason, row_id=self.row_id, location=location,
                              criterion_index=self.criterion_index, field=self.field)


@dataclass(frozen=True)
class Rule:
    """A deterministic rule checker: ``id`` (``"ifbench:<instruction id>"`` or ``"ifeval:<instruction id>"``) and its
    keyword arguments (those of the if-verifiable instruction checker). See :mod:`setgrpo_verl.grading.rules`."""

    id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "kwargs": dict(self.kwargs)}


@dataclass(frozen=True)
class Verdict:
    """The verdict on one criterion in one scoring.

    ``outcome`` is ``met``, ``unmet`` or ``unparsed``; ``source`` is ``rule``, ``judge`` or ``function``;
    ``p_yes`` is the judge's probability of ``yes`` when known (local judge), else ``None``; ``raw`` the judge's
    answer text (HTTP judge) or ``None``; ``reasks`` how many times the judge was asked again because its reply was
    cut by the token budget or gave no verdict (docs/grading.md#reading-a-verdict); ``failure`` why an ``unparsed``
    verdict stayed unparsed after the last re-ask (``"cut"``: the last reply was cut by the token budget,
    ``"unreadable"``: it gave no verdict), else ``None``.
    """

    outcome: Outcome
    source: str
    p_yes: float | None = None
    raw: str | None = None
    reasks: int = 0
    failure: str | None = None

    @property
    def met(self) -> bool | None:
        return None if self.outcome == "unparsed" else self.outcome == "met"

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"outcome": self.outcome, "source": self.source}
        if self.p_yes is not None:
            out["p_yes"] = round(float(self.p_yes), 6)
        if self.raw is not None:
            out["raw"] = self.raw
        if self.reasks:
            out["reasks"] = int(self.reasks)
        if self.failure is not None:
            out["failure"] = self.failure
        return out
