"""Rows grouped by uid and their sketches' Gram matrices, read the same way by calibration and the training step
(docs/algorithm.md#0-notation, docs/sketch.md#mechanics, docs/verl_integration.md#partial-groups).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from setgrpo_verl.core.grpo import degenerate_groups, DEGENERATE_RTOL

__all__ = ["complete_group_rows", "group_gram", "rows_to_sketch"]


def complete_group_rows(index: Any, response_mask: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, list[Any], dict[Any, int]]:
    """Group batch rows by ``uid``, setting aside the groups with fewer than ``k`` responses
    (docs/algorithm.md#0-notation, docs/verl_integration.md#partial-groups).

    verl 0.9.1's agent loop keeps a group one of whose sessions failed: it reaches the trainer with fewer than
    ``actor_rollout_ref.rollout.n`` responses (``ReplayBuffer`` marks it ``failure`` and samples it).

    Args:
        index: B group ids (``non_tensor_batch["uid"]``).
        response_mask: [B, T] response-token mask; groups whose rows all have empty masks are verl's synthetic
            padding groups (``trainer/ppo/padding_utils.py``) and are skipped.
        k: the group size K of a complete group.

    Returns:
        ``(groups int64 [G, K], uids list[G], incomplete {uid: responses})``: the complete groups' rows in batch
        order, their uids in order of first appearance, and each incomplete group's response count.

    Raises:
        ValueError: lengths disagree, the batch holds no real group, or a group holds more than ``k`` responses.
    """
    index = list(index)
    if len(index) != response_mask.shape[0]:
        raise ValueError(f"index has {len(index)} entries but response_mask has {response_mask.shape[0]} rows")
    rows: dict[Any, list[int]] = {}
    for i, uid in enumerate(index):
        rows.setdefault(uid, []).append(i)
    nonempty = (response_mask != 0).any(dim=-1).tolist()
    real = {uid: r for uid, r in rows.items() if any(nonempty[i] for i in r)}
    if not real:
        raise ValueError("the batch holds no group with a non-empty response (all rows are padding)")
    larger = {u: len(r) for u, r in real.items() if len(r) > k}
    if larger:
        raise ValueError(f"groups hold more than K={k} responses ({dict(list(larger.items())[:3])}); set "
                         f"actor_rollout_ref.rollout.n={k} (the calibration record's K) or recalibrate")
    uids = [u for u, r in real.items() if len(r) == k]
    groups = torch.tensor([real[u] for u in uids], dtype=torch.int64).reshape(len(uids), k)
    return groups, uids, {u: len(r) for u, r in real.items() if len(r) < k}


def group_gram(sketches: torch.Tensor, groups: torch.Tensor, sketched: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-group Gram matrices ``M_g = S_g S_g^T`` in float64 (docs/sketch.md#mechanics).

    Args:
        sketches: float32/float64 [B, m] sketches of the batch rows.
        groups: int64 [G, K] row indices.
        sketched: optional bool [B], the rows the actor sketched (:func:`rows_to_sketch`); a group none of whose rows
            was sketched gets a zero Gram matrix and its sketch rows are not read (docs/sketch.md#skipped-rows).

    Returns:
        float64 [G, K, K], symmetric positive semi-definite.

    Raises:
        ValueError: ``sketches`` is not 2-D, has the wrong row count or non-finite entries in a row that is read; a
            group with some rows sketched and others not.
    """
    if sketches.dim() != 2:
        raise ValueError(f"sketches must be [B, m], got shape {tuple(sketches.shape)}")
    if int(groups.max()) >= sketches.shape[0]:
        raise ValueError(f"sketches has {sketches.shape[0]} rows but the groups index row {int(groups.max())}")
    read = torch.ones(groups.shape[0], dtype=torch.bool)
    if sketched is not None:
        if tuple(sketched.shape) != (sketches.shape[0],) or sketched.dtype != torch.bool:
            raise ValueError(f"sketched must be bool [B={sketches.shape[0]}], got {sketched.dtype} "
                             f"{tuple(sketched.shape)}")
        in_group = sketched.cpu()[groups]
        mixed = in_group.any(-1) & ~in_group.all(-1)
        if mixed.any():
            raise ValueError(f"group {int(mixed.nonzero()[0])} has some rows sketched and others not: the actor "
                             "sketches whole groups")
        read = in_group.all(-1)
    s = sketches.detach().to(dtype=torch.float64, device="cpu")[groups[read]]  # [G_read, K, m]
    if not torch.isfinite(s).all():
        raise ValueError("sketches contain NaN/inf: the actor's sketch pass diverged (check the model's dtype)")
    gram = torch.zeros(groups.shape[0], groups.shape[1], groups.shape[1], dtype=torch.float64)
    gram[read] = s @ s.transpose(-1, -2)
    return gram


def rows_to_sketch(index: Any, response_mask: torch.Tensor, scores: torch.Tensor, k: int,
                   degenerate_rtol: float = DEGENERATE_RTOL) -> torch.Tensor:
    """The rows whose sketches can be read: those of the complete groups whose point scores are not tied
    (docs/sketch.md#skipped-rows).

    A degenerate group (:func:`setgrpo_verl.core.grpo.degenerate_groups` with ``degenerate_rtol``, the test calibration
    and training apply) gets a zero update from GRPO and SetGRPO and is left out of calibration; a group with fewer
    than ``k`` responses is rejected in training and left out of calibration (:func:`complete_group_rows`). Neither
    reads its Gram matrix, so their rows need old log-probs only.

    Args:
        index: B group ids (``uid``).
        response_mask: [B, T] response-token mask.
        scores: [B] point scores or [B, T] token-level scores (summed over T), reward units.
        k: the group size K.
        degenerate_rtol: relative tolerance of the degeneracy test (the record's in training).

    Returns:
        bool [B], True for the rows to sketch.

    Raises:
        ValueError: as :func:`complete_group_rows` and :func:`setgrpo_verl.core.grpo.degenerate_groups`.
    """
    groups, _, _ = complete_group_rows(index, response_mask, k)
    point = scores.detach().to(dtype=torch.float64, device="cpu")
    point = point.sum(-1) if point.dim() == 2 else point
    rows = torch.zeros(response_mask.shape[0], dtype=torch.bool)
    if groups.shape[0]:
        live = ~degenerate_groups(point[groups], degenerate_rtol)
        rows[groups[live].reshape(-1)] = True
    return rows
