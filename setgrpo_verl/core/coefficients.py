"""GGSR at a record's threshold: the SetGRPO training coefficients of a batch (docs/algorithm.md#3-ggsr)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ._checks import check_gram, check_scores
from .ggsr import group_geometry, GroupGeometry, path_point, projections, recovery_ratios
from .grpo import degenerate_groups
from .compatibility import check_compatible
from .record import CalibrationRecord
from .settings import ABLATIONS

STATUSES = ("accepted", "infeasible", "null_anchor", "degenerate", "discarded")


def _check_ablation(ablation: str | None) -> None:
    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"ablation must be None or one of {ABLATIONS}, got {ablation!r}")


@dataclass(frozen=True)
class SetGRPOResult:
    """Per-group output of :func:`setgrpo_coefficients` (all tensors on CPU).

    Attributes:
        coefficients: ``[G, K]`` float64 training coefficients (verl's response-level advantages);
            zero rows for rejected and degenerate groups; not renormalised.
        accepted: ``[G]`` bool.
        status: length-G list, each one of ``accepted``, ``infeasible``, ``null_anchor``,
            ``degenerate`` (and ``discarded`` under the ``random_discard`` ablation).
        recovery_ratio: ``[G]`` float64 eta* in [0, 1] (0 unless accepted).
        m_full, m_reward: ``[G]`` float64 minimum projections at b(eta*) for accepted groups and at
            the anchor b0 for rejected ones; NaN for degenerate and null-anchor groups.
        anchor: ``[G, K]`` float64 safe anchors b0 (zeros for degenerate groups).
        grpo: ``[G, K]`` float64 plain GRPO coefficients T(r) (zeros for degenerate groups).
        point: ``[G, K]`` float64 the point scores the coefficients were computed from.
        kkt_residual: ``[G]`` float64 anchor-solve KKT residual (0 for degenerate groups).
        timings: seconds spent in ``geometry`` (sets + anchors) and ``recovery``.
    """

    coefficients: torch.Tensor
    accepted: torch.Tensor
    status: list
    recovery_ratio: torch.Tensor
    m_full: torch.Tensor
    m_reward: torch.Tensor
    anchor: torch.Tensor
    grpo: torch.Tensor
    kkt_residual: torch.Tensor
    point: torch.Tensor
    timings: dict = field(default_factory=dict)

    def metrics(self, prefix: str = "setgrpo/") -> dict[str, float]:
        """Step diagnostics of docs/algorithm.md#6-diagnostics as ``{name: float}`` for verl's tracker.

        Ratios are over all G groups; means ``*_accepted`` over accepted groups (NaN if none),
        ``*_all`` over groups with a defined projection.
        """
        g = len(self.status)
        acc = self.accepted

        def ratio(s: str) -> float:
            return sum(1 for x in self.status if x == s) / g

        def mean(x: torch.Tensor, mask: torch.Tensor) -> float:
            return float(x[mask].mean()) if bool(mask.any()) else math.nan

        defined = ~torch.isnan(self.m_full)
        norms = self.coefficients.norm(dim=-1)
        out = {
            "accepted_ratio": float(acc.double().mean()),
            "rejected_ratio/infeasible": ratio("infeasible"),
            "rejected_ratio/null_anchor": ratio("null_anchor"),
            "rejected_ratio/discarded": ratio("discarded"),
            "degenerate_ratio": ratio("degenerate"),
            "recovery_ratio/mean": mean(self.recovery_ratio, acc),
            "m_full/mean_accepted": mean(self.m_full, acc),
            "m_full/mean_all": mean(self.m_full, defined),
            "m_reward/mean_accepted": mean(self.m_reward, acc),
            "m_reward/mean_all": mean(self.m_reward, defined),
            "coefficient_norm/mean": float(norms.mean()),
            "coefficient_norm/max": float(norms.max()),
            "anchor_kkt_residual/max": float(self.kkt_residual.max()) if g else 0.0,
        }
        out.update({f"timing_s/{k}": float(v) for k, v in self.timings.items()})
        return {prefix + k: v for k, v in out.items()}


def setgrpo_coefficients(
    point: torch.Tensor,
    gram: torch.Tensor,
    record: CalibrationRecord,
    *,
    ablation: str | None = None,
    seed: int = 0,
) -> SetGRPOResult:
    """SetGRPO training coefficients of G groups under a frozen calibration record.

    Implements docs/algorithm.md#3-ggsr at the record's threshold ``tau_sel``: coefficient sets with
    radius ``q_alpha`` around ``a_hat = T(r)``, safe anchor b0, largest safe recovery ratio eta* on
    ``b(eta) = b0 + eta (a_hat - b0)``; accepted groups train with ``b* = b(eta*)``, rejected
    (``infeasible``, ``null_anchor``) and ``degenerate`` groups (decided with the record's
    ``degenerate_rtol``, exactly as in calibration) get zero coefficients. With
    ``q_alpha = 0`` every non-degenerate group with ``a_hat^T M a_hat > 0`` gets exactly the GRPO
    coefficients. A record with ``tau_sel = None`` (``reject_all``) rejects every group.

    Args:
        point: ``[G, K]`` float point scores (reward units).
        gram: ``[G, K, K]`` float Gram matrices of per-response gradients (symmetric PSD).
        record: the frozen :class:`CalibrationRecord`.
        ablation: must be None or equal the record's ablation (a record certifies one variant).
        seed: RNG seed of the ``random_discard`` ablation.

    Returns:
        :class:`SetGRPOResult`.

    Raises:
        ValueError: bad shapes/values, K different from the record's, or an ablation that differs
            from the one the record was calibrated for.
    """
    check_scores(point, "point")
    g, k = point.shape
    check_compatible(record, K=k)
    rs = record.settings
    ablation = _record_ablation(record, ablation)
    m_all = check_gram(gram, g, k)
    t0 = time.perf_counter()
    p64 = point.to(torch.float64)
    degenerate = degenerate_groups(point, record.degenerate_rtol)
    keep = (~degenerate).nonzero().flatten()
    nan = torch.full((g,), math.nan, dtype=torch.float64)
    coefficients, anchor, grpo = (torch.zeros(g, k, dtype=torch.float64) for _ in range(3))
    eta_all, kkt = torch.zeros(g, dtype=torch.float64), torch.zeros(g, dtype=torch.float64)
    m_full, m_reward = nan, nan.clone()
    status = ["degenerate"] * g
    accepted = torch.zeros(g, dtype=torch.bool)
    t1 = t0
    if keep.numel():
        geo = group_geometry(p64[keep], m_all[keep], q=record.q_alpha, rho=rs.rho, norm_by_std=rs.norm_by_std,
                             eps=rs.eps, ablation=ablation)
        t1 = time.perf_counter()
        eta, feasible = _recovery_at_tau(geo, record, anchor_only=ablation == "safe_anchor_only")
        acc = feasible & ~geo.null
        b = path_point(geo.anchor, geo.sets.center, eta)
        mf_b, mr_b = projections(b, geo.sets, geo.gram)
        mf_0, mr_0 = projections(geo.anchor, geo.sets, geo.gram)
        anchor[keep], grpo[keep], kkt[keep] = geo.anchor, geo.sets.center, geo.kkt
        m_full[keep] = torch.where(geo.null, math.nan, torch.where(acc, mf_b, mf_0))
        m_reward[keep] = torch.where(geo.null, math.nan, torch.where(acc, mr_b, mr_0))
        coefficients[keep] = torch.where(acc[:, None], b, 0.0)
        eta_all[keep] = torch.where(acc, eta, 0.0)
        accepted[keep] = acc
        for i, a_j, n_j in zip(keep.tolist(), acc.tolist(), geo.null.tolist()):
            status[i] = "accepted" if a_j else ("null_anchor" if n_j else "infeasible")
        if ablation == "random_discard":
            accepted, coefficients, eta_all, status = _random_discard(keep, int(acc.sum()), degenerate, grpo, seed)
    t2 = time.perf_counter()
    return SetGRPOResult(coefficients=coefficients, accepted=accepted, status=status, recovery_ratio=eta_all,
                         m_full=m_full, m_reward=m_reward, anchor=anchor, grpo=grpo, kkt_residual=kkt, point=p64,
                         timings={"geometry": t1 - t0, "recovery": t2 - t1})


def _record_ablation(record: CalibrationRecord, ablation: str | None) -> str | None:
    """The record's ablation, after refusing a requested one that differs (a record certifies one variant)."""
    rs = record.settings
    if ablation is not None and ablation != rs.ablation:
        _check_ablation(ablation)
        raise ValueError(
            f"ablation {ablation!r} differs from the record's ({rs.ablation!r}); the record certifies the variant "
            "it was calibrated with - recalibrate with calibrate(..., settings.replace(ablation=...))"
        )
    return rs.ablation


def _recovery_at_tau(geo: GroupGeometry, record: CalibrationRecord, *,
                     anchor_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """eta* ``[n]`` float64 and feasibility ``[n]`` bool of the kept groups at the record's ``tau_sel``; a
    ``reject_all`` record (``tau_sel = None``) makes none feasible."""
    n = geo.anchor.shape[0]
    if record.tau_sel is None:
        return torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)
    eta, feasible = recovery_ratios(geo.sets, geo.gram, geo.anchor, torch.tensor([record.tau_sel]),
                                    grid_size=record.settings.grid_size, anchor_only=anchor_only)
    return eta[0], feasible[0]


def _random_discard(keep: torch.Tensor, n_acc: int, degenerate: torch.Tensor, grpo: torch.Tensor,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """The ``random_discard`` ablation: as many groups as SetGRPO accepted, drawn at random among the kept ones,
    train with their GRPO coefficients; returns accepted, coefficients, recovery ratio and status over all G."""
    g = degenerate.shape[0]
    chosen = keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(seed))[:n_acc]]
    accepted = torch.zeros(g, dtype=torch.bool)
    accepted[chosen] = True
    coefficients = torch.where(accepted[:, None], grpo, 0.0)
    status = ["accepted" if bool(accepted[i]) else ("degenerate" if bool(degenerate[i]) else "discarded")
              for i in range(g)]
    return accepted, coefficients, accepted.to(torch.float64), status

