"""Public entry points: ``calibrate`` (JRSC + SRGO -> frozen record) and ``setgrpo_coefficients`` (GGSR)."""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from ._checks import check_gram, check_pair, check_scores
from ._ggsr import NULL_TOL, path_point, projections, recovery_ratios, safe_anchor
from ._grpo import DEGENERATE_RTOL, degenerate_groups, grpo_coefficients
from ._jrsc import (
    CoefficientSets,
    conformal_radius,
    mahalanobis,
    min_calibration_groups,
    nonconformity_scores,
    set_shape,
)
from ._record import CalibrationRecord, package_versions
from ._reversal import reversal_events
from ._sequential import anytime_upper_bound, risk_evidence
from ._settings import ABLATIONS, COVERAGE_GROUPS, CalibrationSettings
from ._srgo import infeasible_text, threshold_tests

logger = logging.getLogger(__name__)

STATUSES = ("accepted", "infeasible", "null_anchor", "degenerate", "discarded")
_METADATA_KEYS = ("loss_agg_mode", "sketch", "grader", "policy", "training", "calibration_prompts")


@dataclass(frozen=True)
class _Geometry:
    """Per-group quantities shared by calibration and application (non-degenerate groups only)."""

    sets: CoefficientSets
    gram: torch.Tensor  # geometry used for recovery (identity under identity_geometry)
    anchor: torch.Tensor
    kkt: torch.Tensor
    null: torch.Tensor


def _geometry(point: torch.Tensor, gram: torch.Tensor, *, q: float, rho: float, norm_by_std: bool, eps: float,
              ablation: str | None) -> _Geometry:
    shape = "spherical" if ablation == "spherical_set" else "jacobian"
    center = grpo_coefficients(point, norm_by_std, eps)
    root, pinv = set_shape(point, rho=rho, norm_by_std=norm_by_std, eps=eps, shape=shape)
    sets = CoefficientSets(center=center, root=root, pinv=pinv, radius=q)
    if ablation == "identity_geometry":
        gram = torch.eye(point.shape[1], dtype=torch.float64).expand_as(gram)
    anchor, kkt = safe_anchor(sets, gram)
    ama = torch.einsum("gi,gij,gj->g", center, gram, center)
    b0mb0 = torch.einsum("gi,gij,gj->g", anchor, gram, anchor)
    null = (ama <= 0) | (b0mb0 <= NULL_TOL * ama)
    return _Geometry(sets=sets, gram=gram, anchor=anchor, kkt=kkt, null=null)


def _check_ablation(ablation: str | None) -> None:
    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"ablation must be None or one of {ABLATIONS}, got {ablation!r}")


def coverage_risk_split(n: int, *, split_seed: int, risk_fraction: float = 0.5,
                        coverage_groups: int | None = COVERAGE_GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The coverage/risk split :func:`calibrate` makes of its ``n`` non-degenerate groups
    (docs/algorithm.md#4-srgo): a uniformly random permutation (``split_seed``)
    whose first ``round(n * risk_fraction)`` positions are risk groups and the rest coverage groups, with the
    coverage part capped at ``coverage_groups`` (the surplus goes to the risk part). The two parts are disjoint,
    so the conformal quantile of the coverage groups is independent of the risk groups it is tested on.

    Args:
        n: number of non-degenerate groups, >= 0.
        split_seed: seed of the permutation (the record's ``split_seed``).
        risk_fraction: share of the groups used for risk calibration, in (0, 1).
        coverage_groups: most coverage groups, or None for no cap.

    Returns:
        ``(coverage, risk)``: int64 positions in ``0..n-1``, disjoint, together every position once.
    """
    perm = torch.randperm(int(n), generator=torch.Generator().manual_seed(int(split_seed)))
    n_risk = int(round(n * risk_fraction))
    if coverage_groups is not None and n - n_risk > coverage_groups:
        n_risk = n - coverage_groups
    return perm[n_risk:], perm[:n_risk]


def calibrate(
    point: torch.Tensor,
    reference: torch.Tensor,
    gram: torch.Tensor,
    settings: CalibrationSettings,
    *,
    split_seed: int = 0,
    metadata: dict | None = None,
    degenerate_rtol: float = DEGENERATE_RTOL,
    tau_start_source: dict | None = None,
    created_at: str | None = None,
) -> CalibrationRecord:
    """Calibrate SetGRPO on paired scorings: JRSC radius on coverage groups, SRGO threshold on risk groups.

    Implements docs/algorithm.md#2-jrsc and #4-srgo. Degenerate groups (no spread of the point scores
    beyond ``degenerate_rtol`` times the group's largest |score|, see :func:`degenerate_groups`)
    are dropped first; the rest are split at random (``split_seed``) into coverage groups
    (``1 - settings.risk_fraction`` of them, at most ``settings.coverage_groups``) and disjoint risk groups. On
    coverage groups the nonconformity scores give the conformal radius ``Q_alpha``. On risk groups, for every
    threshold tau_j the GGSR recovery gives accepted groups (N_j), their reversals (:func:`reversal_events`:
    ``b*^T M a' < 0`` in the true geometry, never for a reference group without spread) (F_j), and the utility
    ``U_j = sum_accepted eta* / n_risk``. SRGO tests the thresholds (``settings.srgo_procedure``: ``bonferroni``,
    every threshold with the Clopper-Pearson bound at ``1 - delta/m``; ``fixed_sequence``, from ``tau_start`` down
    the grid at ``1 - delta`` each, stopping at the first failure) and ``tau_sel`` maximises U among the certified
    thresholds (ties: larger tau).

    Guarantees (exchangeability): coverage ``P(T(r'_new) in C_new) >= 1 - alpha``; with probability
    ``>= 1 - delta`` the conditional reversal risk of accepted groups at ``tau_sel`` is ``<= beta``.

    What is a setting and what is not: ``settings`` holds what the method is (levels, grid, ridge, coefficient
    map, ablation, procedure, split shares, variant) and is stored whole as ``record.settings``; the keyword
    arguments describe this one calibration (its split seed, degeneracy tolerance, provenance and time) and are
    stored as record fields of their own.

    Args:
        point, reference: ``[G, K]`` float tensors, two independent scorings (reward units).
        gram: ``[G, K, K]`` float tensor, Gram matrices of per-response gradients at the
            calibration policy (symmetric PSD).
        settings: the validated :class:`CalibrationSettings` (docs/algorithm.md#41-defaults), e.g.
            ``CalibrationSettings(alpha=0.05, beta=0.08, delta=0.05)``.
        split_seed: seed of the coverage/risk split (recorded).
        metadata: optional dict with keys ``loss_agg_mode`` (str), ``sketch``, ``grader``, ``policy``
            (dicts) stored in the record for later compatibility checks, and ``calibration_prompts``
            (one :func:`prompt_fingerprint` per calibration prompt: what the record was calibrated on).
        degenerate_rtol: relative tolerance of the degeneracy test (stored in the record; training
            applies the same value, so a group is degenerate in both phases or in neither).
        tau_start_source: where ``settings.tau_start`` came from, stored in the record: ``{"kind": "user"}`` (the
            default for a fixed sequence) or ``{"kind": "pilot", "record_sha256": ...}`` from :func:`pilot_start`.
        created_at: the record's ``created_at`` (ISO 8601, UTC); default now. Calibration from shards passes the
            time its last shard was written, so that one shard set always gives the same record, byte for byte.

    Returns:
        A frozen, validated :class:`CalibrationRecord` whose ``settings`` is ``settings``.

    Raises:
        TypeError: ``settings`` is not a :class:`CalibrationSettings` (build one; it validates its fields).
        ValueError: bad shapes/values (see checks), too few non-degenerate groups for alpha, unknown metadata
            keys, or no risk-feasible threshold with ``on_infeasible="error"`` (the message gives the
            smallest UCB reached).
    """
    if not isinstance(settings, CalibrationSettings):
        raise TypeError(f"settings must be a CalibrationSettings, got {type(settings).__name__}: build one, e.g. "
                        "calibrate(point, reference, gram, CalibrationSettings(alpha=0.05, beta=0.08, delta=0.05))")
    check_pair(point, reference)
    s = settings
    grid = list(s.tau_grid)
    metadata = dict(metadata or {})
    unknown = set(metadata) - set(_METADATA_KEYS)
    if unknown:
        raise ValueError(f"unknown metadata keys {sorted(unknown)}; allowed: {_METADATA_KEYS}")
    g, k = point.shape
    m_true = check_gram(gram, g, k)

    p64, r64 = point.to(torch.float64), reference.to(torch.float64)
    keep = (~degenerate_groups(point, degenerate_rtol)).nonzero().flatten()
    n = int(keep.numel())
    cov_pos, risk_pos = coverage_risk_split(n, split_seed=split_seed, risk_fraction=s.risk_fraction,
                                            coverage_groups=s.coverage_groups)
    cov, risk = keep[cov_pos], keep[risk_pos]
    n_risk = int(risk.numel())
    need = min_calibration_groups(s.alpha)
    if cov.numel() < need or n_risk < 1:
        raise ValueError(
            f"too few calibration groups: {n} of {g} are non-degenerate, giving {cov.numel()} coverage and {n_risk} "
            f"risk groups; alpha={s.alpha} needs at least {need} coverage groups, i.e. about "
            f"{math.ceil(need / (1 - s.risk_fraction))} non-degenerate groups (add calibration prompts or raise alpha)"
        )
    shape = "spherical" if s.ablation == "spherical_set" else "jacobian"
    scores = nonconformity_scores(p64[cov], r64[cov], rho=s.rho, norm_by_std=s.norm_by_std, eps=s.eps, shape=shape)
    q_alpha = conformal_radius(scores, s.alpha)

    geo = _geometry(p64[risk], m_true[risk], q=q_alpha, rho=s.rho, norm_by_std=s.norm_by_std, eps=s.eps,
                    ablation=s.ablation)
    taus = torch.tensor(grid, dtype=torch.float64)
    eta, feasible = recovery_ratios(geo.sets, geo.gram, geo.anchor, taus, grid_size=s.grid_size,
                                    anchor_only=s.ablation == "safe_anchor_only")
    accepted = feasible & ~geo.null[None]
    b_star = path_point(geo.anchor[None], geo.sets.center[None], eta)  # [m, G, K]
    reversal = reversal_events(b_star, m_true[risk], r64[risk], accepted, norm_by_std=s.norm_by_std, eps=s.eps,
                               degenerate_rtol=degenerate_rtol)
    n_acc = accepted.sum(1).tolist()
    n_rev = reversal.sum(1).tolist()
    utility = (torch.where(accepted, eta, 0.0).sum(1) / n_risk).tolist()
    start = None if s.srgo_procedure == "bonferroni" else grid.index(s.tau_start)
    source = {} if s.srgo_procedure == "bonferroni" else dict(tau_start_source or {"kind": "user"})
    tests = threshold_tests(n_acc, n_rev, utility, beta=s.beta, delta=s.delta, procedure=s.srgo_procedure,
                            start_index=start)
    ucb, index = tests.ucb, tests.index
    if s.ablation == "fixed_threshold":
        tau_sel = s.fixed_tau
    elif index is None:
        if s.on_infeasible == "error":
            why = infeasible_text(grid, n_acc, n_rev, ucb, beta=s.beta, stopped_at=tests.stopped_at)
            raise ValueError(
                f"SRGO found no risk-feasible threshold: {why}. Use "
                "more calibration groups (tighter bounds), a larger beta, or on_infeasible='reject_all' to train no "
                "group"
            )
        tau_sel = None
    else:
        tau_sel = grid[index]
    a_ref = grpo_coefficients(r64[risk], s.norm_by_std, s.eps)
    coverage = float((mahalanobis(a_ref - geo.sets.center, geo.sets.pinv) <= q_alpha).double().mean())
    return CalibrationRecord(
        settings=s, q_alpha=q_alpha, n_cov=int(cov.numel()), n_risk=n_risk, n_degenerate=g - n,
        n_accepted=tuple(int(x) for x in n_acc), n_reversals=tuple(int(x) for x in n_rev),
        ucb=tuple(float(x) for x in ucb), utility=tuple(float(x) for x in utility), tau_sel=tau_sel,
        K=k, coverage_risk_set=coverage, split_seed=int(split_seed),
        loss_agg_mode=str(metadata.get("loss_agg_mode", "token-mean")), sketch=dict(metadata.get("sketch", {})),
        grader=dict(metadata.get("grader", {})), policy=dict(metadata.get("policy", {})),
        training=dict(metadata.get("training", {})),
        package_versions=package_versions(),
        created_at=created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        degenerate_rtol=float(degenerate_rtol),
        calibration_prompts=tuple(dict(p) for p in metadata.get("calibration_prompts", ())),
        tau_start_source=source,
    )


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
    record.check_compatible(K=k)
    rs = record.settings
    if ablation is not None and ablation != rs.ablation:
        _check_ablation(ablation)
        raise ValueError(
            f"ablation {ablation!r} differs from the record's ({rs.ablation!r}); the record certifies the variant "
            "it was calibrated with - recalibrate with calibrate(..., settings.replace(ablation=...))"
        )
    ablation = rs.ablation
    m_all = check_gram(gram, g, k)
    t0 = time.perf_counter()
    p64 = point.to(torch.float64)
    degenerate = degenerate_groups(point, record.degenerate_rtol)
    keep = (~degenerate).nonzero().flatten()
    nan = torch.full((g,), math.nan, dtype=torch.float64)
    coefficients, anchor, grpo = (torch.zeros(g, k, dtype=torch.float64) for _ in range(3))
    eta_all, kkt, m_full, m_reward = torch.zeros(g, dtype=torch.float64), torch.zeros(g, dtype=torch.float64), nan, nan.clone()
    status = ["degenerate"] * g
    accepted = torch.zeros(g, dtype=torch.bool)
    t1 = t0
    if keep.numel():
        geo = _geometry(p64[keep], m_all[keep], q=record.q_alpha, rho=rs.rho, norm_by_std=rs.norm_by_std,
                        eps=rs.eps, ablation=ablation)
        t1 = time.perf_counter()
        if record.tau_sel is None:
            eta = torch.zeros(keep.numel(), dtype=torch.float64)
            feasible = torch.zeros(keep.numel(), dtype=torch.bool)
        else:
            eta, feasible = recovery_ratios(geo.sets, geo.gram, geo.anchor, torch.tensor([record.tau_sel]),
                                            grid_size=rs.grid_size, anchor_only=ablation == "safe_anchor_only")
            eta, feasible = eta[0], feasible[0]
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
            n_acc = int(acc.sum())
            chosen = keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(seed))[:n_acc]]
            accepted = torch.zeros(g, dtype=torch.bool)
            accepted[chosen] = True
            coefficients = torch.where(accepted[:, None], grpo, 0.0)
            eta_all = accepted.to(torch.float64)
            status = ["accepted" if bool(accepted[i]) else ("degenerate" if bool(degenerate[i]) else "discarded")
                      for i in range(g)]
    t2 = time.perf_counter()
    return SetGRPOResult(coefficients=coefficients, accepted=accepted, status=status, recovery_ratio=eta_all,
                         m_full=m_full, m_reward=m_reward, anchor=anchor, grpo=grpo, kkt_residual=kkt, point=p64,
                         timings={"geometry": t1 - t0, "recovery": t2 - t1})


class OnlineRiskMonitor:
    """Running coverage and accepted-reversal monitor for training steps (docs/algorithm.md#6-diagnostics).

    When reference scores are available during training, each :meth:`update` counts, over the
    step's non-degenerate groups, whether ``a' = T(r')`` lies in the group's coefficient set
    (online coverage) and, over accepted groups, the reversal events of :func:`reversal_events` (the
    event calibration counts). The cumulative counts (F reversals of N accepted groups) are read
    with anytime-valid evidence (:func:`risk_evidence`), so looking after every step keeps the error:

    * ``online_risk_certified`` is 1 while the e-value against "risk >= beta" is at least ``1 / delta``;
      if the risk of accepted groups is above beta throughout, this happens at any step of a run with
      probability at most delta (a fixed-N Clopper-Pearson bound recomputed every step would not:
      it certifies falsely far more often).
    * ``online_reversal_ucb`` is the anytime-valid upper bound (:func:`anytime_upper_bound`); it is
      ``<= beta`` exactly when the flag is 1.
    * Policy drift is signalled (``online_risk_drift`` = 1, a warning through ``warnings.warn`` and
      the ``setgrpo`` logger when it turns on) once the e-value against "risk <= beta" reaches
      ``1 / delta``: evidence at level delta that accepted updates reverse more often than beta.

    The counts pool every step since the monitor started, so a drift late in a long run shows only
    once its reversals outweigh the earlier evidence; the per-step ``online_reversal_rate`` shows it
    without delay, but carries no guarantee.
    """

    def __init__(self, record: CalibrationRecord):
        self.record = record
        self.covered = 0
        self.seen = 0
        self.accepted = 0
        self.reversals = 0
        self.certified = False
        self.drift = False

    def state_dict(self) -> dict[str, Any]:
        """The running counts (ints) and the two flags, JSON-ready, for a training checkpoint."""
        return {"covered": self.covered, "seen": self.seen, "accepted": self.accepted, "reversals": self.reversals,
                "certified": self.certified, "drift": self.drift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (a resumed run, docs/algorithm.md#6-diagnostics); the flags are
        re-derived from the counts (a checkpoint of an older version without them loads the same way).

        Raises:
            ValueError: missing keys, negative counts, or more covered / reversed groups than seen / accepted.
        """
        try:
            counts = {k: int(state[k]) for k in ("covered", "seen", "accepted", "reversals")}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"online monitor state {state!r} is incomplete: {exc}") from None
        if min(counts.values()) < 0 or counts["covered"] > counts["seen"] or counts["reversals"] > counts["accepted"]:
            raise ValueError(f"online monitor state {state!r} is inconsistent")
        self.covered, self.seen = counts["covered"], counts["seen"]
        self.accepted, self.reversals = counts["accepted"], counts["reversals"]
        self.certified, self.drift = self._flags()

    def _flags(self) -> tuple[bool, bool]:
        low, high = risk_evidence([self.reversals], [self.accepted], self.record.settings.beta)
        bar = math.log(1.0 / self.record.settings.delta)
        return bool(low[0] >= bar), bool(high[0] >= bar)

    def update(self, result: SetGRPOResult, reference: torch.Tensor, gram: torch.Tensor,
               prefix: str = "setgrpo/") -> dict[str, float]:
        """Add one step's groups; return ``{name: float}`` metrics.

        Args:
            result: the step's :class:`SetGRPOResult`.
            reference: ``[G, K]`` reference scores of the same responses.
            gram: ``[G, K, K]`` the step's Gram matrices.

        Raises:
            ValueError: shapes that do not match the result.
        """
        check_scores(reference, "reference")
        g, k = reference.shape
        if tuple(result.coefficients.shape) != (g, k):
            raise ValueError(f"reference scores {tuple(reference.shape)} do not match the result's groups "
                             f"{tuple(result.coefficients.shape)}")
        m = check_gram(gram, g, k)
        rec, rs = self.record, self.record.settings
        a_ref = grpo_coefficients(reference.to(torch.float64), rs.norm_by_std, rs.eps)
        live = torch.tensor([s != "degenerate" for s in result.status])
        covered = torch.zeros(g, dtype=torch.bool)
        if live.any():
            shape = "spherical" if rs.ablation == "spherical_set" else "jacobian"
            _, pinv = set_shape(result.point[live], rho=rs.rho, norm_by_std=rs.norm_by_std, eps=rs.eps,
                                shape=shape)
            covered[live] = mahalanobis(a_ref[live] - result.grpo[live], pinv) <= rec.q_alpha
        rev = reversal_events(result.coefficients, m, reference, result.accepted, norm_by_std=rs.norm_by_std,
                              eps=rs.eps, degenerate_rtol=rec.degenerate_rtol)
        n_live, n_acc = int(live.sum()), int(result.accepted.sum())
        self.seen += n_live
        self.covered += int(covered.sum())
        self.accepted += n_acc
        self.reversals += int(rev.sum())
        was_drift = self.drift
        self.certified, self.drift = self._flags()
        ucb = anytime_upper_bound(self.reversals, self.accepted, rs.delta)
        if self.drift and not was_drift:
            msg = (f"SetGRPO online monitor: {self.reversals}/{self.accepted} accepted groups reversed, evidence at "
                   f"level delta={rs.delta} (anytime-valid) that the reversal risk is above beta={rs.beta}; the "
                   "policy may have drifted from the calibration policy - consider recalibrating")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        out = {
            "online_coverage": float(covered[live].double().mean()) if n_live else math.nan,
            "online_coverage_cum": self.covered / self.seen if self.seen else math.nan,
            "online_reversal_rate": float(rev.sum()) / n_acc if n_acc else math.nan,
            "online_reversal_rate_cum": self.reversals / self.accepted if self.accepted else math.nan,
            "online_reversal_ucb": ucb,
            "online_risk_certified": float(self.certified),
            "online_risk_drift": float(self.drift),
        }
        return {prefix + k: v for k, v in out.items()}
