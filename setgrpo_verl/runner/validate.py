"""Check SetGRPO's guarantees on held-out groups, against an independent re-scoring and the truth
(docs/validation.md#validation).

Input: the calibration stage's ``paired_scores.npz`` (point ``[G, K]``, reference ``[G, K]``, gram ``[G, K, K]`` and,
with a noisy grader around a deterministic one, truth ``[G, K]``), all at the calibration policy. For each of R
split seeds s, the G groups are split at random into calibration groups and held-out groups; :func:`calibrate`
runs on the calibration groups (its own 50/50 coverage / risk split, seed s) and :func:`setgrpo_coefficients`
applies the record to the held-out groups. On the held-out groups it measures

* coverage: the share of non-degenerate groups whose re-scoring coefficients ``T(r')`` (and truth coefficients
  ``T(r*)``) lie in the group's set (guaranteed: >= 1 - alpha for the re-scoring, on average over splits);
* reversal: the share of accepted groups with ``b*^T M a < 0`` for ``a = T(r')`` and ``a = T(r*)``; the realised
  risk of a split is the re-scoring reversal rate (guaranteed: conditional risk <= beta with probability >= 1 - delta
  over calibration);
* the accepted ratio and the mean recovery ratio of accepted groups;

and the same reversal rates for plain GRPO (every non-degenerate group, ``b = T(r)``) and for the ablations
``spherical_set``, ``identity_geometry`` and ``safe_anchor_only`` (each calibrated on the same groups).

Only :mod:`setgrpo_verl.core`, torch and numpy are used; nothing here runs verl. The table, the figure and the
``validation/`` folder are :mod:`setgrpo_verl.report.validation`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..core import calibrate, CalibrationRecord, CalibrationSettings, setgrpo_coefficients
from ..core.grpo import degenerate_groups, DEGENERATE_RTOL
from ..core.jrsc import nonconformity_scores
from ..core.reversal import reference_coefficients, reversal_events
from ..core.srgo import power_plan, PROCEDURES, required_accepted_groups

__all__ = [
    "ABLATION_METHODS",
    "METHODS",
    "ValidationLevels",
    "ValidationResult",
    "evaluate_grpo",
    "evaluate_method",
    "load_paired",
    "run_validation",
    "sample_size_plan",
    "split_groups",
]

#: The ablations compared with the full method (docs/algorithm.md#6-diagnostics), as in the paper's Table 5.
ABLATION_METHODS = ("spherical_set", "identity_geometry", "safe_anchor_only")
#: Every method of a validation, in report order: plain GRPO, the full method, then the ablations.
METHODS = ("grpo", "setgrpo") + ABLATION_METHODS


#: Calibration settings of every split (docs/algorithm.md#41-defaults; paper levels by default): core's one validated
#: settings object, so a level, grid or rho that calibration would refuse is refused when the levels are built.
ValidationLevels = CalibrationSettings


def load_paired(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The arrays of a ``paired_scores.npz`` as float64 tensors: ``point``, ``reference`` ``[G, K]``, ``gram``
    ``[G, K, K]`` and, when stored, ``truth`` ``[G, K]``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a missing array, shapes that disagree, or non-finite values.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no paired scores; run the calibration stage first")
    with np.load(path) as z:
        arrays = {name: torch.from_numpy(np.asarray(z[name], dtype=np.float64)) for name in z.files}
    missing = [k for k in ("point", "reference", "gram") if k not in arrays]
    if missing:
        raise ValueError(f"{path} lacks {missing}: it is not a calibration stage's paired_scores.npz")
    g, k = arrays["point"].shape
    want = {"point": (g, k), "reference": (g, k), "gram": (g, k, k), "truth": (g, k)}
    for name, value in arrays.items():
        if name in want and tuple(value.shape) != want[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, expected {want[name]}")
        if not torch.isfinite(value).all():
            raise ValueError(f"{path}: {name} holds NaN or inf")
    return {k: v for k, v in arrays.items() if k in want}


def split_groups(degenerate: torch.Tensor, holdout_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random split of G groups into ``(calibration, held_out)`` int64 index tensors (sorted), stratified by
    degeneracy.

    Within the non-degenerate groups and within the degenerate ones separately, ``round(n * holdout_fraction)``
    are held out, chosen by ``torch.randperm`` with a generator seeded with ``seed``. Every split then has the same
    number of non-degenerate calibration groups (the ones calibration uses). Degeneracy depends only on a group's
    own point scores, so the split keeps calibration and held-out groups exchangeable
    (docs/algorithm.md#11-degenerate-groups).

    Args:
        degenerate: ``[G]`` bool, degenerate groups (:func:`~setgrpo_verl.core.grpo.degenerate_groups` of the point
            scores).
        holdout_fraction: in (0, 1).
        seed: seed of the split.

    Raises:
        ValueError: ``holdout_fraction`` outside (0, 1), or no non-degenerate group left on either side.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    generator = torch.Generator().manual_seed(int(seed))
    cal, hold = [], []
    for stratum in (~degenerate, degenerate):
        idx = stratum.nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=generator)]
        n_hold = int(round(idx.numel() * holdout_fraction))
        hold.append(idx[:n_hold])
        cal.append(idx[n_hold:])
    n_live = int((~degenerate).sum())
    if hold[0].numel() < 1 or cal[0].numel() < 1:
        raise ValueError(f"{n_live} non-degenerate groups with holdout_fraction={holdout_fraction} leave "
                         f"{hold[0].numel()} held-out and {cal[0].numel()} calibration groups; both need at least one")
    return torch.cat(cal).sort().values, torch.cat(hold).sort().values


def _coefficients(scores: torch.Tensor, levels: ValidationLevels, degenerate_rtol: float) -> torch.Tensor:
    """``T(scores)`` ``[G, K]`` float64 with degenerate rows set to exactly zero (no direction, never a reversal)."""
    return reference_coefficients(scores, norm_by_std=levels.norm_by_std, eps=levels.eps,
                                  degenerate_rtol=degenerate_rtol)


def _rate(count: int, total: int) -> float | None:
    return count / total if total else None


def _targets(paired: Mapping[str, torch.Tensor], held_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scores ``[H, K]`` a method's update is checked against: ``reference`` (r') and, when known, ``truth``."""
    targets = {"reference": paired["reference"][held_out]}
    if paired.get("truth") is not None:
        targets["truth"] = paired["truth"][held_out]
    return targets


def _reversals(b: torch.Tensor, accepted: torch.Tensor, gram: torch.Tensor, targets: Mapping[str, torch.Tensor],
               levels: ValidationLevels, degenerate_rtol: float) -> dict[str, torch.Tensor]:
    """Per target, bool ``[H]``: the group is accepted and ``b^T M T(target) < 0`` (docs/validation.md#what-is-measured).
    A target with constant scores has zero coefficients, so it is never a reversal."""
    return {name: reversal_events(b, gram, scores, accepted, norm_by_std=levels.norm_by_std, eps=levels.eps,
                                  degenerate_rtol=degenerate_rtol) for name, scores in targets.items()}


def _group_rows(held_out: torch.Tensor, status: Sequence[str], accepted: torch.Tensor, recovery_ratio: torch.Tensor,
                live: torch.Tensor | None, covered: Mapping[str, torch.Tensor] | None,
                reversal: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
                degenerate_rtol: float) -> list[dict[str, Any]]:
    """One row per held-out group (the keys of :func:`evaluate_method`). ``covered`` is None for a method without a
    set (coverage fields None); otherwise coverage fields are None for degenerate (not ``live``) groups."""
    has_truth = "truth" in targets
    truth_degenerate = degenerate_groups(targets["truth"], degenerate_rtol) if has_truth else None
    rows = []
    for i, g in enumerate(held_out.tolist()):
        has_cov = covered is not None and bool(live[i])
        rows.append({
            "group": int(g),
            "status": status[i],
            "accepted": bool(accepted[i]),
            "recovery_ratio": float(recovery_ratio[i]),
            "covered_reference": bool(covered["reference"][i]) if has_cov else None,
            "covered_truth": bool(covered["truth"][i]) if has_cov and has_truth else None,
            "reversal_reference": bool(reversal["reference"][i]),
            "reversal_truth": bool(reversal["truth"][i]) if has_truth else None,
            "truth_degenerate": bool(truth_degenerate[i]) if has_truth else None,
        })
    return rows


def evaluate_method(
    paired: Mapping[str, torch.Tensor],
    calibration: torch.Tensor,
    held_out: torch.Tensor,
    *,
    levels: ValidationLevels,
    ablation: str | None = None,
    split_seed: int = 0,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]], CalibrationRecord]:
    """Calibrate one method on ``calibration`` groups and measure it on ``held_out`` groups.

    Implements docs/validation.md#what-is-measured for SetGRPO (``ablation=None``) or one ablation. The record is
    made with ``on_infeasible="reject_all"``: a split without a risk-feasible threshold accepts no group, and the
    summary shows it (``tau_sel`` None, ``n_accepted`` 0).

    Args:
        paired: float64 tensors ``point``, ``reference`` ``[G, K]``, ``gram`` ``[G, K, K]`` and optionally
            ``truth`` ``[G, K]`` (see :func:`load_paired`).
        calibration, held_out: int64 group indices (disjoint).
        levels: calibration settings.
        ablation: None (full method) or one of :data:`ABLATION_METHODS`.
        split_seed: seed of the coverage / risk split inside :func:`calibrate`.
        metadata: the record's ``loss_agg_mode``, ``sketch``, ``grader``, ``policy`` (copied into the record).

    Returns:
        ``(summary, rows, record)``: the split's figures (keys in docs/validation.md#outputs), one row per held-out
        group (``group``: index into ``paired``; ``status``, ``accepted``, ``recovery_ratio``, ``covered_reference``,
        ``covered_truth``, ``reversal_reference``, ``reversal_truth``, ``truth_degenerate``; coverage fields are None
        for degenerate groups, truth fields None without truth) and the record.

    Raises:
        ValueError: too few calibration groups for alpha (from :func:`calibrate`), overlapping index sets or an
            unknown ablation.
    """
    if ablation is not None and ablation not in ABLATION_METHODS:
        raise ValueError(f"ablation must be None or one of {ABLATION_METHODS}, got {ablation!r}")
    if set(calibration.tolist()) & set(held_out.tolist()):
        raise ValueError("calibration and held-out groups overlap")
    point, reference, gram = paired["point"], paired["reference"], paired["gram"]
    settings = levels.replace(ablation=ablation, fixed_tau=None, on_infeasible="reject_all")
    record = calibrate(point[calibration], reference[calibration], gram[calibration], settings,
                       split_seed=split_seed, metadata=dict(metadata or {}))
    p, m = point[held_out], gram[held_out]
    result = setgrpo_coefficients(p, m, record)
    live = torch.tensor([s != "degenerate" for s in result.status], dtype=torch.bool)
    shape = "spherical" if ablation == "spherical_set" else "jacobian"
    targets = _targets(paired, held_out)
    covered = {}
    for name, scores in targets.items():
        cov = torch.zeros(len(held_out), dtype=torch.bool)
        if live.any():
            s = nonconformity_scores(p[live], scores[live], rho=settings.rho, norm_by_std=settings.norm_by_std,
                                     eps=settings.eps, shape=shape)
            cov[live] = s <= record.q_alpha
        covered[name] = cov
    reversal = _reversals(result.coefficients, result.accepted, m, targets, levels, record.degenerate_rtol)
    rows = _group_rows(held_out, [str(s) for s in result.status], result.accepted, result.recovery_ratio, live,
                       covered, reversal, targets, record.degenerate_rtol)
    summary = _summarise(rows, levels)
    summary["record"] = {"q_alpha": record.q_alpha, "tau_sel": record.tau_sel, "n_cov": record.n_cov,
                         "n_risk": record.n_risk, "n_degenerate": record.n_degenerate, "N": record.N, "F": record.F,
                         "ucb_sel": record.ucb_sel, "U": record.U}
    return summary, rows, record


def evaluate_grpo(paired: Mapping[str, torch.Tensor], held_out: torch.Tensor, *,
                  levels: ValidationLevels, degenerate_rtol: float | None = None) -> tuple[dict[str, Any], list[dict]]:
    """Plain GRPO on the held-out groups: every non-degenerate group is updated with ``b = T(r)``.

    Reversals are measured exactly as for SetGRPO (docs/validation.md#what-is-measured); GRPO has no set, so the
    coverage fields are None, and its recovery ratio is 1.

    Returns:
        ``(summary, rows)`` in the format of :func:`evaluate_method` (status ``grpo`` or ``degenerate``).
    """
    rtol = DEGENERATE_RTOL if degenerate_rtol is None else degenerate_rtol
    point, gram = paired["point"][held_out], paired["gram"][held_out]
    live = ~degenerate_groups(point, rtol)
    targets = _targets(paired, held_out)
    reversal = _reversals(_coefficients(point, levels, rtol), live, gram, targets, levels, rtol)
    status = ["grpo" if is_live else "degenerate" for is_live in live.tolist()]
    rows = _group_rows(held_out, status, live, live.to(torch.float64), None, None, reversal, targets, rtol)
    return _summarise(rows, levels), rows


def _summarise(rows: Sequence[Mapping[str, Any]], levels: ValidationLevels) -> dict[str, Any]:
    """One split's figures from its per-group rows (docs/validation.md#outputs)."""
    live = [r for r in rows if r["status"] != "degenerate"]
    acc = [r for r in rows if r["accepted"]]
    n_acc = len(acc)

    def count(rs, key):
        return sum(1 for r in rs if r[key])

    has_cov = bool(live) and live[0]["covered_reference"] is not None
    has_truth = bool(rows) and rows[0]["reversal_truth"] is not None
    out: dict[str, Any] = {
        "n_held_out": len(rows),
        "n_live": len(live),
        "n_accepted": n_acc,
        "accepted_ratio": _rate(n_acc, len(rows)),
        "accepted_ratio_live": _rate(n_acc, len(live)),
        "mean_recovery_ratio": (sum(r["recovery_ratio"] for r in acc) / n_acc) if n_acc else None,
        # the paper's Table 5: normalised cumulative recovery, the held-out analogue of the record's U
        "cumulative_recovery": _rate(sum(r["recovery_ratio"] for r in acc), len(live)),
        "coverage_reference": _rate(count(live, "covered_reference"), len(live)) if has_cov else None,
        "coverage_truth": _rate(count(live, "covered_truth"), len(live)) if has_cov and has_truth else None,
        "reversals_reference": count(acc, "reversal_reference"),
        "reversal_rate_reference": _rate(count(acc, "reversal_reference"), n_acc),
        "reversals_truth": count(acc, "reversal_truth") if has_truth else None,
        # only groups whose truth has a direction can be reversed against it
        "n_accepted_truth_live": n_acc - count(acc, "truth_degenerate") if has_truth else None,
        "reversal_rate_truth": _rate(count(acc, "reversal_truth"), n_acc - count(acc, "truth_degenerate"))
        if has_truth else None,
        "accepted_truth_degenerate": count(acc, "truth_degenerate") if has_truth else None,
        "noise_only_share": _rate(count(acc, "truth_degenerate"), n_acc) if has_truth else None,
        # docs/algorithm.md#4-srgo (consistency): with tau >= 0 a covered group is never an accepted reversal
        "covered_accepted_reversals": sum(1 for r in acc if r["covered_reference"] and r["reversal_reference"]),
    }
    rate = out["reversal_rate_reference"]
    out["risk_at_most_beta"] = None if rate is None else bool(rate <= levels.beta)
    return out


@dataclass
class ValidationResult:
    """Everything a validation produced.

    Attributes:
        report: the JSON-serialisable figures (docs/validation.md#outputs).
        rows: per-group rows, each with ``split`` and ``method`` added.
        records: ``{(split index, method): CalibrationRecord}`` for every calibrated method.
    """

    report: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    records: dict[tuple[int, str], CalibrationRecord] = field(default_factory=dict)


def _stats(values: Sequence[float | None]) -> dict[str, Any]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    arr = np.asarray(vals)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max()), "n": len(vals)}


_STAT_KEYS = ("coverage_reference", "coverage_truth", "reversal_rate_reference", "reversal_rate_truth",
              "noise_only_share", "accepted_ratio", "accepted_ratio_live", "mean_recovery_ratio", "cumulative_recovery")


def _aggregate(per_split: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Figures of one method over the splits: mean / std / min / max per rate, pooled counts and shares."""
    out: dict[str, Any] = {key: _stats([s[key] for s in per_split]) for key in _STAT_KEYS}
    judged = [s["risk_at_most_beta"] for s in per_split if s["risk_at_most_beta"] is not None]
    n_acc = sum(s["n_accepted"] for s in per_split)
    out["splits"] = len(per_split)
    out["splits_with_accepted"] = len(judged)
    out["share_risk_at_most_beta"] = _rate(sum(judged), len(judged))
    out["pooled_reversal_rate_reference"] = _rate(sum(s["reversals_reference"] for s in per_split), n_acc)
    truth = [s["reversals_truth"] for s in per_split]
    out["pooled_reversal_rate_truth"] = None if any(t is None for t in truth) else _rate(
        sum(truth), sum(s["n_accepted_truth_live"] for s in per_split))
    out["covered_accepted_reversals"] = sum(s["covered_accepted_reversals"] for s in per_split)
    if "record" in per_split[0]:
        out["splits_without_threshold"] = sum(1 for s in per_split if s["record"]["tau_sel"] is None)
    return out


def sample_size_plan(records: Sequence[CalibrationRecord], *, holdout_fraction: float,
                     live_share: float) -> dict[str, Any]:
    """How many groups would certify the records' beta, from the reversal rates they measured
    (docs/validation.md#profiles).

    Pooled over the records (one per split, same levels), threshold j has ``N_j`` accepted risk groups with ``F_j``
    reversals out of ``n_risk`` non-degenerate risk groups: a reversal rate ``F_j / N_j`` and an accepted share
    ``N_j / n_risk``. Certifying beta at rate p needs ``N(p) = required_accepted_groups(beta, delta, m, p)`` accepted
    groups, i.e. ``N(p) / (accepted share * risk share * live_share * (1 - holdout_fraction))`` groups in a
    ``validate`` run (risk share = n_risk / (n_cov + n_risk)). The plan is the threshold that needs the fewest.

    Args:
        records: the splits' SetGRPO records (at least one).
        holdout_fraction: the run's share of held-out groups, in [0, 1).
        live_share: share of non-degenerate groups in the run, in (0, 1].

    Returns:
        ``{"accepted_no_reversal": N(0), "groups_no_reversal": groups if every risk group were accepted without a
        reversal, "thresholds": [{"tau", "accepted", "reversals", "reversal_rate", "accepted_share",
        "accepted_needed", "groups_needed"} ...] (thresholds with an accepted group; the last two None where the rate
        reaches beta), "plan": the entry with the fewest groups_needed, or None}``.

    Raises:
        ValueError: no record, or a share outside its range.
    """
    if not records:
        raise ValueError("sample_size_plan needs at least one record")
    if not (0.0 <= holdout_fraction < 1.0 and 0.0 < live_share <= 1.0):
        raise ValueError(f"need holdout_fraction in [0, 1) and live_share in (0, 1], got {holdout_fraction}, "
                         f"{live_share}")
    first = records[0].settings
    m, n_risk = len(first.tau_grid), sum(r.n_risk for r in records)
    risk_share = n_risk / max(sum(r.n_risk + r.n_cov for r in records), 1)
    per_group = risk_share * live_share * (1.0 - holdout_fraction)
    n0 = required_accepted_groups(first.beta, first.delta, m)
    rows = []
    for j, tau in enumerate(first.tau_grid):
        accepted = sum(r.n_accepted[j] for r in records)
        if accepted == 0:
            continue
        reversals = sum(r.n_reversals[j] for r in records)
        rate, share = reversals / accepted, accepted / n_risk
        need = required_accepted_groups(first.beta, first.delta, m, rate) if rate < first.beta else None
        rows.append({"tau": tau, "accepted": accepted, "reversals": reversals, "reversal_rate": rate,
                     "accepted_share": share, "accepted_needed": need,
                     "groups_needed": None if need is None else math.ceil(need / (share * per_group))})
    feasible = [r for r in rows if r["groups_needed"] is not None]
    at_power = {}
    for procedure in PROCEDURES:  # docs/algorithm.md#44-sample-size: certify with probability 0.9
        plan = power_plan(first.tau_grid, [sum(r.n_accepted[j] for r in records) for j in range(m)],
                          [sum(r.n_reversals[j] for r in records) for j in range(m)], n_risk, beta=first.beta,
                          delta=first.delta, power=0.9, procedure=procedure)
        if plan is not None:
            plan["groups_needed"] = math.ceil(plan["calibration_groups"] / (live_share * (1.0 - holdout_fraction)))
        at_power[procedure] = plan
    return {"accepted_no_reversal": n0, "groups_no_reversal": math.ceil(n0 / per_group), "thresholds": rows,
            "plan": min(feasible, key=lambda r: (r["groups_needed"], -r["tau"])) if feasible else None,
            "at_power": at_power}


def run_validation(
    paired: Mapping[str, torch.Tensor],
    *,
    levels: ValidationLevels = ValidationLevels(),
    n_splits: int = 20,
    holdout_fraction: float = 0.5,
    first_seed: int = 0,
    methods: Sequence[str] = METHODS,
    metadata: Mapping[str, Any] | None = None,
) -> ValidationResult:
    """Repeat calibration on random splits and measure every method on the held-out groups.

    Implements docs/validation.md#validation. Split s (seed ``first_seed + s``) holds out a share
    ``holdout_fraction`` of the non-degenerate and of the degenerate groups (:func:`split_groups`, with the
    degeneracy of the point scores); each method in ``methods`` (``grpo``,
    ``setgrpo`` and any of :data:`ABLATION_METHODS`) is calibrated on the rest (coverage / risk split with the same
    seed) and evaluated on the held-out groups.

    Args:
        paired: see :func:`load_paired`.
        levels: calibration settings (paper levels by default).
        n_splits: R >= 1.
        holdout_fraction: share of groups held out, in (0, 1).
        first_seed: seed of the first split.
        methods: methods to evaluate, a subset of :data:`METHODS` that includes ``setgrpo``.
        metadata: record metadata (``loss_agg_mode``, ``sketch``, ``grader``, ``policy``).

    Returns:
        :class:`ValidationResult`.

    Raises:
        ValueError: ``n_splits < 1``, unknown methods or none for ``setgrpo``, or too few calibration groups
            for alpha (the message of :func:`calibrate`, with the split named).
    """
    methods = _checked_methods(n_splits, methods)
    g = paired["point"].shape[0]
    degenerate = degenerate_groups(paired["point"], DEGENERATE_RTOL)
    splits, rows, records = [], [], {}
    per_method: dict[str, list[dict]] = {m: [] for m in methods}
    for s in range(n_splits):
        entry, split_rows, split_records = _run_split(paired, s, first_seed + s, degenerate, levels=levels,
                                                      holdout_fraction=holdout_fraction, methods=methods,
                                                      metadata=metadata)
        rows += split_rows
        records.update(split_records)
        for method in methods:
            per_method[method].append(entry["methods"][method])
        splits.append(entry)
    report = {
        "levels": levels.to_dict(),
        "nominal": {"coverage": 1 - levels.alpha, "risk": levels.beta, "share_risk_at_most_beta": 1 - levels.delta},
        "data": _data_summary(paired, degenerate),
        "n_splits": n_splits,
        "holdout_fraction": holdout_fraction,
        "first_seed": first_seed,
        "methods": methods,
        "metadata": dict(metadata or {}),
        "summary": {m: _aggregate(per_method[m]) for m in methods},
        "sample_size": sample_size_plan([records[(s, "setgrpo")] for s in range(n_splits)],
                                        holdout_fraction=holdout_fraction,
                                        live_share=max(1.0 - float(degenerate.float().mean()), 1.0 / g)),
        "splits": splits,
    }
    return ValidationResult(report=report, rows=rows, records=records)


def _checked_methods(n_splits: int, methods: Sequence[str]) -> list[str]:
    """The requested methods in :data:`METHODS` order, after refusing ``n_splits < 1`` and unknown methods."""
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "setgrpo" not in methods:
        raise ValueError(f"methods must include 'setgrpo' and come from {METHODS}, got {list(methods)}")
    return [m for m in METHODS if m in methods]


def _run_split(paired: Mapping[str, torch.Tensor], s: int, seed: int, degenerate: torch.Tensor, *,
               levels: ValidationLevels, holdout_fraction: float, methods: Sequence[str],
               metadata: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[dict], dict]:
    """Split s: its report entry, its per-group rows and its records keyed ``(s, method)``; GRPO is measured last,
    with the degeneracy tolerance the calibrated methods recorded."""
    cal, hold = split_groups(degenerate, holdout_fraction, seed)
    entry: dict[str, Any] = {"split": s, "seed": seed, "n_calibration": len(cal), "n_held_out": len(hold),
                             "methods": {}}
    rows, records, rtol = [], {}, None
    for method in methods:
        if method == "grpo":
            continue
        ablation = None if method == "setgrpo" else method
        try:
            summary, method_rows, record = evaluate_method(paired, cal, hold, levels=levels, ablation=ablation,
                                                           split_seed=seed, metadata=metadata)
        except ValueError as exc:
            raise ValueError(f"split {s} (seed {seed}, {len(cal)} calibration groups), {method}: {exc}") from None
        rtol = record.degenerate_rtol
        records[(s, method)] = record
        entry["methods"][method] = summary
        rows += [{"split": s, "method": method, **r} for r in method_rows]
    if "grpo" in methods:
        summary, method_rows = evaluate_grpo(paired, hold, levels=levels, degenerate_rtol=rtol)
        entry["methods"]["grpo"] = summary
        rows += [{"split": s, "method": "grpo", **r} for r in method_rows]
    return entry, rows, records


def _data_summary(paired: Mapping[str, torch.Tensor], degenerate: torch.Tensor) -> dict[str, Any]:
    """The report's ``data`` block: group count, K, degenerate groups and the point/reference gap."""
    g, k = paired["point"].shape
    has_truth = "truth" in paired
    return {
        "groups": g,
        "K": k,
        "degenerate_groups": int(degenerate.sum()),
        "truth": has_truth,
        "truth_degenerate_groups": int(degenerate_groups(paired["truth"], DEGENERATE_RTOL).sum())
        if has_truth else None,
        "mean_abs_point_minus_reference": float((paired["point"] - paired["reference"]).abs().mean()),
    }
