"""Calibration: JRSC + SRGO on paired scores and Gram matrices -> a frozen record (docs/algorithm.md#4-srgo)."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import torch

from ._checks import check_gram, check_pair
from .ggsr import group_geometry, path_point, recovery_ratios
from .grpo import DEGENERATE_RTOL, degenerate_groups, grpo_coefficients
from .jrsc import conformal_radius, mahalanobis, min_calibration_groups, nonconformity_scores
from .record import CalibrationRecord, package_versions
from .reversal import reversal_events
from .settings import COVERAGE_GROUPS, CalibrationSettings
from .srgo import infeasible_text, threshold_tests

_METADATA_KEYS = ("loss_agg_mode", "sketch", "grader", "policy", "training", "calibration_prompts")


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

    Implements docs/algorithm.md#2-jrsc and #4-srgo. Degenerate groups (:func:`degenerate_groups` at
    ``degenerate_rtol``) are dropped first; the rest are split at random by :func:`coverage_risk_split`
    (``split_seed``, ``settings.risk_fraction``, ``settings.coverage_groups``) into coverage groups and disjoint
    risk groups. On coverage groups the nonconformity scores give the conformal radius ``Q_alpha``. On risk groups,
    for every threshold tau_j the GGSR recovery gives accepted groups (N_j), their reversals
    (:func:`reversal_events`: ``b*^T M a' < 0`` in the true geometry, never for a reference group without spread)
    (F_j), and the utility ``U_j = sum_accepted eta* / n_risk``. SRGO tests the thresholds with Clopper-Pearson
    bounds (``settings.srgo_procedure``: ``bonferroni`` or ``fixed_sequence`` from ``tau_start``) and ``tau_sel``
    maximises U among the certified thresholds (ties: larger tau).

    Guarantees (exchangeability): coverage ``P(T(r'_new) in C_new) >= 1 - alpha``; with probability
    ``>= 1 - delta`` the conditional reversal risk of accepted groups at ``tau_sel`` is ``<= beta``.

    ``settings`` is stored whole as ``record.settings``; the keyword arguments describe this one calibration and
    are record fields of their own (docs/algorithm.md#8-core-api).

    Args:
        point, reference: ``[G, K]`` float tensors, two independent scorings (reward units).
        gram: ``[G, K, K]`` float tensor, Gram matrices of per-response gradients at the calibration policy
            (symmetric PSD).
        settings: the validated :class:`CalibrationSettings` (docs/algorithm.md#41-defaults), e.g.
            ``CalibrationSettings(alpha=0.05, beta=0.08, delta=0.05)``.
        split_seed: seed of the coverage/risk split (recorded).
        metadata: optional dict with keys ``loss_agg_mode`` (str), ``sketch``, ``grader``, ``policy``, ``training``
            (dicts) stored in the record for later compatibility checks, and ``calibration_prompts`` (one
            :func:`prompt_fingerprint` per calibration prompt: what the record was calibrated on).
        degenerate_rtol: relative tolerance of the degeneracy test (stored in the record; training applies the
            same value, so a group is degenerate in both phases or in neither).
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
    metadata, m_true = _checked_inputs(point, reference, gram, settings, metadata)
    s = settings
    g, k = point.shape
    p64, r64 = point.to(torch.float64), reference.to(torch.float64)

    cov, risk = _coverage_and_risk_groups(point, s, split_seed=split_seed, degenerate_rtol=degenerate_rtol)
    shape = "spherical" if s.ablation == "spherical_set" else "jacobian"
    scores = nonconformity_scores(p64[cov], r64[cov], rho=s.rho, norm_by_std=s.norm_by_std, eps=s.eps, shape=shape)
    q_alpha = conformal_radius(scores, s.alpha)
    n_acc, n_rev, utility, coverage = _risk_counts(p64[risk], r64[risk], m_true[risk], q_alpha, s,
                                                   degenerate_rtol=degenerate_rtol)
    tests = _threshold_tests(n_acc, n_rev, utility, s)
    return CalibrationRecord(
        settings=s, q_alpha=q_alpha, n_cov=int(cov.numel()), n_risk=int(risk.numel()),
        n_degenerate=g - int(cov.numel()) - int(risk.numel()),
        n_accepted=tuple(int(x) for x in n_acc), n_reversals=tuple(int(x) for x in n_rev),
        ucb=tuple(float(x) for x in tests.ucb), utility=tuple(float(x) for x in utility),
        tau_sel=_selected_threshold(s, tests, n_acc, n_rev),
        K=k, coverage_risk_set=coverage, split_seed=int(split_seed), **_metadata_fields(metadata),
        package_versions=package_versions(),
        created_at=created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        degenerate_rtol=float(degenerate_rtol),
        tau_start_source=dict(tau_start_source or {"kind": "user"}) if s.srgo_procedure == "fixed_sequence" else {},
    )


def _checked_inputs(point: torch.Tensor, reference: torch.Tensor, gram: torch.Tensor, settings: CalibrationSettings,
                    metadata: dict | None) -> tuple[dict, torch.Tensor]:
    """:func:`calibrate`'s input checks, in order (settings type, score pair, metadata keys, Gram matrices); returns
    the metadata as a dict and the float64 Gram matrices ``[G, K, K]``."""
    if not isinstance(settings, CalibrationSettings):
        raise TypeError(f"settings must be a CalibrationSettings, got {type(settings).__name__}: build one, e.g. "
                        "calibrate(point, reference, gram, CalibrationSettings(alpha=0.05, beta=0.08, delta=0.05))")
    check_pair(point, reference)
    metadata = dict(metadata or {})
    unknown = set(metadata) - set(_METADATA_KEYS)
    if unknown:
        raise ValueError(f"unknown metadata keys {sorted(unknown)}; allowed: {_METADATA_KEYS}")
    g, k = point.shape
    return metadata, check_gram(gram, g, k)


def _metadata_fields(metadata: dict) -> dict:
    """The record fields that ``metadata`` sets (:data:`_METADATA_KEYS`), with their defaults when absent."""
    return {"loss_agg_mode": str(metadata.get("loss_agg_mode", "token-mean")),
            "sketch": dict(metadata.get("sketch", {})), "grader": dict(metadata.get("grader", {})),
            "policy": dict(metadata.get("policy", {})), "training": dict(metadata.get("training", {})),
            "calibration_prompts": tuple(dict(p) for p in metadata.get("calibration_prompts", ()))}


def _coverage_and_risk_groups(point: torch.Tensor, s: CalibrationSettings, *, split_seed: int,
                              degenerate_rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the coverage and risk groups among ``point``'s non-degenerate groups (``[G, K]``); refuses
    too few coverage groups for ``s.alpha`` or no risk group (ValueError naming the fix)."""
    keep = (~degenerate_groups(point, degenerate_rtol)).nonzero().flatten()
    n = int(keep.numel())
    cov_pos, risk_pos = coverage_risk_split(n, split_seed=split_seed, risk_fraction=s.risk_fraction,
                                            coverage_groups=s.coverage_groups)
    cov, risk = keep[cov_pos], keep[risk_pos]
    need = min_calibration_groups(s.alpha)
    if cov.numel() < need or risk.numel() < 1:
        raise ValueError(
            f"too few calibration groups: {n} of {point.shape[0]} are non-degenerate, giving {cov.numel()} coverage "
            f"and {risk.numel()} risk groups; alpha={s.alpha} needs at least {need} coverage groups, i.e. about "
            f"{math.ceil(need / (1 - s.risk_fraction))} non-degenerate groups (add calibration prompts or raise alpha)"
        )
    return cov, risk


def _risk_counts(point: torch.Tensor, reference: torch.Tensor, gram: torch.Tensor, q_alpha: float,
                 s: CalibrationSettings, *, degenerate_rtol: float) -> tuple[list, list, list, float]:
    """On the risk groups (float64 ``point``/``reference`` ``[R, K]``, ``gram`` ``[R, K, K]``), per threshold of
    ``s.tau_grid``: accepted groups N_j, their reversals F_j and the utility U_j (docs/algorithm.md#4-srgo); and the
    share of risk groups whose reference coefficients lie in their coefficient set."""
    geo = group_geometry(point, gram, q=q_alpha, rho=s.rho, norm_by_std=s.norm_by_std, eps=s.eps,
                         ablation=s.ablation)
    taus = torch.tensor(list(s.tau_grid), dtype=torch.float64)
    eta, feasible = recovery_ratios(geo.sets, geo.gram, geo.anchor, taus, grid_size=s.grid_size,
                                    anchor_only=s.ablation == "safe_anchor_only")
    accepted = feasible & ~geo.null[None]
    b_star = path_point(geo.anchor[None], geo.sets.center[None], eta)  # [m, R, K]
    reversal = reversal_events(b_star, gram, reference, accepted, norm_by_std=s.norm_by_std, eps=s.eps,
                               degenerate_rtol=degenerate_rtol)
    utility = (torch.where(accepted, eta, 0.0).sum(1) / point.shape[0]).tolist()
    a_ref = grpo_coefficients(reference, s.norm_by_std, s.eps)
    coverage = float((mahalanobis(a_ref - geo.sets.center, geo.sets.pinv) <= q_alpha).double().mean())
    return accepted.sum(1).tolist(), reversal.sum(1).tolist(), utility, coverage


def _threshold_tests(n_acc: list, n_rev: list, utility: list, s: CalibrationSettings):
    """SRGO's tests of ``s.tau_grid``'s thresholds (``s.srgo_procedure``; a fixed sequence from ``s.tau_start``)."""
    start = list(s.tau_grid).index(s.tau_start) if s.srgo_procedure == "fixed_sequence" else None
    return threshold_tests(n_acc, n_rev, utility, beta=s.beta, delta=s.delta, procedure=s.srgo_procedure,
                           start_index=start)


def _selected_threshold(s: CalibrationSettings, tests, n_acc: list, n_rev: list) -> float | None:
    """tau_sel: the fixed threshold of the ``fixed_threshold`` ablation, else the certified threshold of largest
    utility, else None under ``on_infeasible="reject_all"``; ValueError under ``on_infeasible="error"``."""
    grid = list(s.tau_grid)
    if s.ablation == "fixed_threshold":
        return s.fixed_tau
    if tests.index is not None:
        return grid[tests.index]
    if s.on_infeasible == "error":
        why = infeasible_text(grid, n_acc, n_rev, tests.ucb, beta=s.beta, stopped_at=tests.stopped_at)
        raise ValueError(
            f"SRGO found no risk-feasible threshold: {why}. Use more calibration groups (tighter bounds), a larger "
            "beta, or on_infeasible='reject_all' to train no group"
        )
    return None
