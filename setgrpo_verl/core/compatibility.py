"""Whether a calibration record applies to a run (docs/record.md#compatibility-with-a-run): its identity against
the run's, and its calibration prompts against the training prompts; the versions that wrote it are
:func:`~setgrpo_verl.core.record.version_mismatch`'s."""

from __future__ import annotations

import dataclasses
from typing import Any

from .identity import check_identity
from .record import CalibrationRecord, question_sha256

__all__ = ["check_compatible", "check_disjoint"]


def check_compatible(record: CalibrationRecord, *, sources: dict[str, str] | None = None, **run: Any) -> None:
    """Refuse to train with a record calibrated for a different run.

    Keyword arguments name record fields (``K``, ``loss_agg_mode``, ``grader``, ``sketch``, ``policy``,
    ``training``, ...) or fields of its ``settings`` (``norm_by_std``, ``eps``, ``alpha``, ``ablation``, ...);
    each given value must equal the record's. Dict fields are compared key by key, and the first differing key
    is named; ``sources`` maps a field (``"policy.top_k"``) to the config key that sets it, named with it.

    Raises:
        ValueError: naming the first mismatched field, both values, and the fix.

    Warns:
        IdentityWarning: the record lacks identity fields added since it was written (:func:`check_identity`).
    """
    own = {f.name for f in dataclasses.fields(record)} - {"settings"}
    setting = {f.name for f in dataclasses.fields(record.settings)}
    for name in run:
        if name not in own | setting:
            raise ValueError(f"calibration record has no field {name!r}")
    stored = {name: getattr(record if name in own else record.settings, name) for name in run}
    check_identity(stored, run, what="calibration record", holder="record", sources=sources)


def check_disjoint(record: CalibrationRecord, prompts: Any, *, source: str = "the training data") -> None:
    """Refuse training prompts that the record was calibrated on (docs/record.md#compatibility-with-a-run).

    Args:
        prompts: iterable of ``(id, question)`` pairs of the training prompts (id may be None).
        source: where they come from, for the message (e.g. a file name).

    Raises:
        ValueError: naming the first calibration prompt found in ``prompts`` (by id or by question text), how
            many there are, and the fix.
    """
    if not record.calibration_prompts:
        return
    ids = {p["id"]: p for p in record.calibration_prompts}
    questions = {p["question_sha256"]: p for p in record.calibration_prompts}
    found = []
    for prompt_id, question in prompts:
        by_id = ids.get(str(prompt_id)) if prompt_id is not None else None
        by_text = questions.get(question_sha256(question)) if question is not None else None
        if by_id is not None or by_text is not None:
            found.append((prompt_id, question, "id" if by_id is not None else "question text",
                          (by_id or by_text)["id"]))
    if found:
        prompt_id, question, how, cal_id = found[0]
        text = " ".join(str(question).split())
        raise ValueError(
            f"{source} contains {len(found)} prompt(s) this record was calibrated on, the first {prompt_id!r} "
            f"(same {how} as calibration prompt {cal_id!r}: {text[:80]!r}); calibration prompts must stay out "
            "of training (their groups certify the guarantees for fresh prompts): remove them from the "
            "training data or recalibrate on disjoint prompts"
        )
