"""What the trainer reads from a rolled-out TransferQueue batch besides verl's own fields: the reference (and
truth) scores and the truth verdicts of the dual-reward manager and the actor's gradient sketches with the rows
it sketched (docs/verl_integration.md#trainer-mode). Calibration and the advantage step read them the same way.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import torch
from tensordict import TensorDict

from .worker import SKETCH_ROWS_KEY

__all__ = ["dense_sketches", "grading_errors_from", "reference_scores_from", "sketch_rows_field", "sketched_rows",
           "truth_verdicts_from"]


def _extra_values(data: TensorDict | dict, key: str, what: str,
                  skip: Optional[Sequence[bool]] = None) -> Optional[list]:
    """One value per row of ``key``: a top-level field (colocated reward path), else ``extra_fields[i]
    ["reward_extra_info"][key]`` (verl's streaming reward loop); None when no row carries it. Rows flagged in
    ``skip`` (those whose grading failed, which carry no scores) may lack it: their value is None.

    Raises:
        ValueError: some rows carry it and others do not (``what`` names it in the message).
    """
    values: Optional[list] = None
    if key in data.keys():
        values = list(data[key].tolist() if hasattr(data[key], "tolist") else data[key])
    elif "extra_fields" in data.keys():
        extra = data["extra_fields"]
        extra = extra.tolist() if hasattr(extra, "tolist") else list(extra)
        values = [(e or {}).get("reward_extra_info", {}).get(key) if isinstance(e, dict) else None for e in extra]
        if all(v is None for v in values):
            return None
    if values is None:
        return None
    skip = [False] * len(values) if skip is None else list(skip)
    missing = sum(v is None and not s for v, s in zip(values, skip))
    if missing:
        raise ValueError(f"{what} {key!r} of reward_extra_info is missing for {missing} of {len(values)} responses")
    return values


def grading_errors_from(data: TensorDict | dict, key: str) -> Optional[list[str]]:
    """Each row's grading error (``""`` when it was graded) under ``key``
    (:data:`~setgrpo_verl.integration.reward_config.GRADING_ERROR_KEY`), read as :func:`reference_scores_from`
    reads a score; None when the reward manager wrote none."""
    values = _extra_values(data, key, "grading error")
    return None if values is None else [str(v) for v in values]


def reference_scores_from(data: TensorDict | dict, key: str,
                          skip: Optional[Sequence[bool]] = None) -> Optional[torch.Tensor]:
    """Reference scores r' of a batch (docs/algorithm.md#0-notation) as float64 [B] (reward units), or None when the reward
    manager did not return them.

    Looks for a top-level field ``key`` (colocated reward path) and else for ``extra_fields[i]
    ["reward_extra_info"][key]`` (verl's streaming reward loop).

    ``skip``: rows whose grading failed (:func:`grading_errors_from`), which carry no score: NaN there.

    Raises:
        ValueError: some rows carry the score and others do not, or a value is not a finite number.
    """
    values = _extra_values(data, key, "score", skip)
    if values is None:
        return None
    out = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    kept = torch.tensor([not s for s in (skip or [False] * len(values))], dtype=torch.bool)
    if not torch.isfinite(out[kept]).all():
        raise ValueError(f"score {key!r} of reward_extra_info contains NaN/inf")
    return out


def truth_verdicts_from(data: TensorDict | dict, key: str,
                        skip: Optional[Sequence[bool]] = None) -> Optional[list[tuple[list[int], list[float]]]]:
    """Each row's noise-free verdicts and its criteria's points, ``(met, points)`` with ``met`` 1 / 0 / -1 (met,
    unmet, no verdict) per criterion, as the dual-reward manager writes them under ``key``
    (:data:`~setgrpo_verl.integration.reward_config.TRUTH_VERDICTS_KEY`, docs/validation.md#noisy-grader); None
    when the reward manager did not return them. Read as :func:`reference_scores_from` reads a score (rows in
    ``skip`` carry none: ``([], [])`` there).

    Raises:
        ValueError: some rows carry them and others do not, or a row's value is not ``{"met": [...], "points":
            [...]}`` with one verdict in {-1, 0, 1} and one finite number of points per criterion.
    """
    values = _extra_values(data, key, "verdicts", skip)
    if values is None:
        return None
    rows = []
    for n, value in enumerate(values):
        if value is None:  # a skipped row
            rows.append(([], []))
            continue
        row = json.loads(value) if isinstance(value, (str, bytes)) else value
        met, points = (row.get("met"), row.get("points")) if isinstance(row, dict) else (None, None)
        numbers = isinstance(points, list) and all(
            isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) for p in points)
        if not (numbers and isinstance(met, list) and len(met) == len(points) and all(m in (-1, 0, 1) for m in met)):
            raise ValueError(f"verdicts {key!r} of reward_extra_info of response {n} is {str(value)[:200]!r}; "
                             "expected {\"met\": [1, 0 or -1 per criterion], \"points\": [one number per criterion]}")
        rows.append(([int(m) for m in met], [float(p) for p in points]))
    return rows


def dense_sketches(sketches: torch.Tensor) -> torch.Tensor:
    """TransferQueue returns per-sample tensors as a jagged nested tensor: stack them to float32 [B, m]."""
    if sketches.is_nested:
        rows = sketches.unbind()
        if len({int(r.numel()) for r in rows}) != 1:
            raise ValueError("sketch rows differ in length: actor ranks used different sketch settings")
        sketches = torch.stack(rows)
    return sketches.float()


def sketched_rows(data: TensorDict | dict) -> Optional[torch.Tensor]:
    """The rows the actor sketched (bool [B], :data:`SKETCH_ROWS_KEY`), or None when every row was sketched."""
    if SKETCH_ROWS_KEY not in data.keys():
        return None
    rows = data[SKETCH_ROWS_KEY]
    rows = torch.stack(rows.unbind()) if rows.is_nested else torch.as_tensor(rows)
    return rows.reshape(-1).to(torch.bool)


def sketch_rows_field(batch: Any) -> list[str]:
    """``[SKETCH_ROWS_KEY]`` when the sketch pass wrote the row mask for ``batch`` (its fields name it, or are None:
    every field), else ``[]``."""
    return [SKETCH_ROWS_KEY] if batch.fields is None or SKETCH_ROWS_KEY in batch.fields else []
