"""What the trainer reads from a rolled-out TransferQueue batch besides verl's own fields: the reference (and
truth) scores of the dual-reward manager and the actor's gradient sketches with the rows it sketched
(docs/verl_integration.md#trainer-mode). Calibration and the advantage step read them the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from tensordict import TensorDict

from .worker import SKETCH_ROWS_KEY

__all__ = ["dense_sketches", "reference_scores_from", "sketch_rows_field", "sketched_rows"]


def reference_scores_from(data: TensorDict | dict, key: str) -> Optional[torch.Tensor]:
    """Reference scores r' of a batch (docs/algorithm.md#0-notation) as float64 [B] (reward units), or None when the reward
    manager did not return them.

    Looks for a top-level field ``key`` (colocated reward path) and else for ``extra_fields[i]
    ["reward_extra_info"][key]`` (verl's streaming reward loop).

    Raises:
        ValueError: some rows carry the score and others do not, or a value is not a finite number.
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
    if any(v is None for v in values):
        raise ValueError(
            f"score {key!r} of reward_extra_info is missing for {sum(v is None for v in values)} of {len(values)} "
            "responses"
        )
    out = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if not torch.isfinite(out).all():
        raise ValueError(f"score {key!r} of reward_extra_info contains NaN/inf")
    return out


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
