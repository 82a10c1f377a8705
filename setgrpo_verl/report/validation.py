"""Tables and the figure of a validation (docs/validation.md#outputs): the summary table with the coverage band and
sample-size lines, ``validation.png``, and the ``validation/`` folder written from a
:class:`setgrpo_verl.runner.validate.ValidationResult`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..atomic import atomic_file, write_atomic
from ..core.bands import coverage_band, risk_share_floor

__all__ = ["plot_validation", "summary_table", "truth_lines", "write_validation"]


def summary_table(report: Mapping[str, Any]) -> str:
    """A plain-text table of the summary: one row per method, mean over splits (docs/validation.md#outputs)."""
    def fmt(v, pct=True):
        if v is None:
            return "-"
        return f"{100 * v:.1f}" if pct else f"{v:.3f}"

    lv = report["levels"]
    head = (f"alpha={lv['alpha']} beta={lv['beta']} delta={lv['delta']}, {report['n_splits']} splits, "
            f"{report['data']['groups']} groups (K={report['data']['K']}), held out {report['holdout_fraction']:.3g}")
    cols = ("method", "cov r' %", "cov r* %", "rev r' %", "rev r* %", "noise-only %", "risk<=beta", "accepted %",
            "NUR %", "CR", "recovery", "no tau")
    lines = [head, " | ".join(cols)]
    for method in report["methods"]:
        s = report["summary"][method]
        share = s["share_risk_at_most_beta"]
        lines.append(" | ".join([
            method,
            fmt(s["coverage_reference"]["mean"]), fmt(s["coverage_truth"]["mean"]),
            fmt(s["reversal_rate_reference"]["mean"]), fmt(s["reversal_rate_truth"]["mean"]),
            fmt(s["noise_only_share"]["mean"]),
            "-" if share is None else f"{share:.2f} ({s['splits_with_accepted']})",
            fmt(s["accepted_ratio"]["mean"]), fmt(s["accepted_ratio_live"]["mean"]),
            fmt(s["cumulative_recovery"]["mean"], pct=False), fmt(s["mean_recovery_ratio"]["mean"], pct=False),
            str(s.get("splits_without_threshold", "-")),
        ]))
    return "\n".join(lines + _band_lines(report) + _sample_size_lines(report))


def truth_lines(check: Mapping[str, Any], bands: Mapping[str, tuple[float, float] | None]) -> list[str]:
    """The main job's lines against the truth (docs/cli.md#what-the-main-job-prints) from the counts of
    :func:`setgrpo_verl.runner.truth.truth_check` and the 95 % bands of its rates (``bands``: ``coverage``,
    ``grpo``, ``setgrpo``, ``trained``, each ``(lo, hi)`` or None).

    SetGRPO's coverage is shown with its 5-95 % band under exchangeability for one calibration of ``n_cov`` groups
    (wider than the pooled folds need); what SetGRPO buys is the reversed updates it avoids, what it costs the
    groups it does not train whose GRPO update pointed the truth's way.
    """
    def pct(count: int, total: int, band) -> str:
        if not total:
            return "n/a (no group)"
        lo, hi = band
        return f"{100 * count / total:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] of {total}"

    live, cov = check["live"], bands.get("coverage")
    band = coverage_band(check["n_cov"], live, check["alpha"]) if live and check["n_cov"] else None
    thresholds = " ".join("none" if t is None else f"{t:.2f}" for t in check["tau_sel"])
    lines = [f"held out ({check['groups']} calibration groups, each held out once in {check['folds']} folds; 95 % "
             "bands; the truth is the noise-free score):",
             f"  coverage of a re-scoring {pct(check['covered'], live, cov)} groups (guarantee >= {1 - check['alpha']:.2f}"
             + (f"; single calibration {band.lo:.2f}-{band.hi:.2f} under exchangeability)" if band else ")"),
             f"  updates reversing the truth: GRPO {pct(check['grpo_reversals'], check['grpo_judged'], bands['grpo'])}"
             f" groups, SetGRPO {pct(check['setgrpo_reversals'], check['setgrpo_judged'], bands['setgrpo'])} "
             "accepted groups",
             f"  SetGRPO trains {pct(check['accepted'], live, bands['trained'])} groups (thresholds per fold: "
             f"{thresholds})",
             f"  what SetGRPO buys: {check['grpo_reversals'] - check['setgrpo_reversals']} fewer reversed updates "
             f"({check['setgrpo_reversals']} instead of {check['grpo_reversals']}); what it costs: {check['dropped']} "
             f"groups not trained, whose GRPO update pointed the truth's way in "
             f"{check['dropped'] - check['dropped_grpo_reversals']}"]
    return lines


def _sample_size_lines(report: Mapping[str, Any]) -> list[str]:
    """What certifying beta at these levels would take (:func:`sample_size_plan`)."""
    plan = report.get("sample_size")
    if not plan:
        return []
    lv = report["levels"]
    line = (f"sample size for beta={lv['beta']} (delta={lv['delta']}, {len(lv['tau_grid'])} thresholds): "
            f">= {plan['accepted_no_reversal']} accepted risk groups even with no reversal "
            f"(>= {plan['groups_no_reversal']} groups at this run's degenerate share and hold-out)")
    best = plan["plan"]
    if best is None:
        return [line, "  no threshold's measured reversal rate is below beta: more groups alone cannot certify it"]
    return [line, f"  at the measured rates, tau={best['tau']:.2f} (reversal rate {best['reversal_rate']:.3f}, "
                  f"{best['accepted_share']:.2f} of risk groups accepted) needs {best['accepted_needed']} accepted "
                  f"groups: about {best['groups_needed']} groups in one run"] + [
        f"  to certify with probability 0.9 ({name}{' from tau_start=' + format(p['tau'], '.2f') if name != 'bonferroni' else ''}): "
        f"tau={p['tau']:.2f} needs {p['risk_groups']} risk groups, about {p['groups_needed']} groups in one run"
        for name, p in plan.get("at_power", {}).items() if p is not None]


def _band_lines(report: Mapping[str, Any]) -> list[str]:
    """SetGRPO's per-split coverage and risk against their bands under exchangeability
    (docs/record.md#reading-the-guarantees); a figure outside its band gets a ``WARNING:`` line."""
    lv, splits = report["levels"], [s["methods"]["setgrpo"] for s in report["splits"]]
    numbered = [(e["split"], e["methods"]["setgrpo"]) for e in report["splits"]
                if e["methods"]["setgrpo"]["coverage_reference"] is not None]
    if not numbered:
        return []
    judged = [s for _, s in numbered]
    bands = [coverage_band(s["record"]["n_cov"], s["n_live"], lv["alpha"]) for s in judged]
    where = [b.position(s["coverage_reference"]) for s, b in zip(judged, bands)]
    below = [i for (i, _), w in zip(numbered, where) if w == "below"]
    above = [i for (i, _), w in zip(numbered, where) if w == "above"]
    b0, mean = bands[0], float(np.mean([s["coverage_reference"] for s in judged]))
    lines = [f"setgrpo held-out coverage: mean {mean:.3f} over {len(judged)} splits; under exchangeability "
             f"mean {b0.mean:.2f}, single splits in {b0.lo:.2f}-{b0.hi:.2f} (5-95 % band, n_cov={b0.n_cov}, "
             f"{b0.n_held_out} held-out groups); splits below the band: {below or 'none'}, above: {above or 'none'} "
             "(about 5 % of splits on each side by chance)"]
    if b0.position(mean) != "inside":
        why = ("calibration and held-out groups do not behave as exchangeable" if mean < b0.lo
               else "tied scores make the sets wider than 1 - alpha needs")
        lines.append(f"WARNING: the mean held-out coverage {mean:.3f} is outside the band of a single split "
                     f"[{b0.lo:.2f}, {b0.hi:.2f}]: {why}")
    floor = risk_share_floor([s["n_accepted"] for s in splits], lv["beta"], lv["delta"])
    share = report["summary"]["setgrpo"]["share_risk_at_most_beta"]
    if floor is not None and share is not None:
        lines.append(f"setgrpo realised risk <= beta in {share:.2f} of splits with an accepted group (guarantee >= "
                     f"{1 - lv['delta']:.2f} for the true risk, >= {floor:.2f} expected for the realised rate)")
        if share < floor:
            lines.append(f"WARNING: realised risk <= beta in only {share:.2f} of splits, below the {floor:.2f} "
                         "expected if the risk guarantee holds")
    return lines


def plot_validation(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """PNG of coverage and realised risk per split against their nominal levels (docs/validation.md#outputs).

    Left: SetGRPO's held-out coverage of the re-scoring (and of the truth) per split, with the line 1 - alpha.
    Right: the reversal rate of accepted updates per split against the re-scoring (and the truth), with the line
    beta, and plain GRPO's reversal rate for comparison.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = report["splits"]
    x = [s["split"] for s in splits]
    lv = report["levels"]

    def series(method, key):
        return [np.nan if s["methods"][method][key] is None else s["methods"][method][key] for s in splits]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(x, series("setgrpo", "coverage_reference"), "o", label="re-scoring r'")
    if report["data"]["truth"]:
        ax1.plot(x, series("setgrpo", "coverage_truth"), "s", mfc="none", label="truth r*")
    ax1.axhline(1 - lv["alpha"], color="k", ls="--", label=f"1 - alpha = {1 - lv['alpha']:.2f}")
    ax1.set(xlabel="split", ylabel="held-out coverage", title="coverage of the coefficient sets")
    ax1.legend(loc="lower left")
    ax2.plot(x, series("setgrpo", "reversal_rate_reference"), "o", label="SetGRPO vs r' (realised risk)")
    if report["data"]["truth"]:
        ax2.plot(x, series("setgrpo", "reversal_rate_truth"), "s", mfc="none", label="SetGRPO vs r*")
    if "grpo" in report["methods"]:
        ax2.plot(x, series("grpo", "reversal_rate_reference"), "x", color="gray", label="GRPO vs r'")
    ax2.axhline(lv["beta"], color="k", ls="--", label=f"beta = {lv['beta']}")
    if all(s["methods"]["setgrpo"]["n_accepted"] == 0 for s in splits):
        ax2.text(0.5, 0.5, "SetGRPO accepted no held-out group in any split", transform=ax2.transAxes,
                 ha="center", va="center", color="C0")
    ax2.set(xlabel="split", ylabel="reversal rate of accepted updates", title="direction-reversal risk")
    ax2.legend(loc="upper left")
    grader = report.get("metadata", {}).get("grader", {})
    noise = f", flip_prob {grader['flip_prob']}" if "flip_prob" in grader else ""
    fig.suptitle(f"SetGRPO validation: {report['data']['groups']} groups, {report['n_splits']} splits{noise}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)
    return path


def write_validation(result: Any, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write a :class:`setgrpo_verl.runner.validate.ValidationResult` as ``validation.json`` (figures),
    ``validation.png``, ``groups.jsonl`` (per split, method and held-out group) and
    ``records/split<s>_<method>.json`` (each split's frozen record) into ``out_dir``.

    Returns:
        ``{"json", "png", "groups", "records"}`` paths.
    """
    out = Path(out_dir)
    (out / "records").mkdir(parents=True, exist_ok=True)
    for (s, method), record in result.records.items():
        record.to_json(out / "records" / f"split{s}_{method}.json")
    with atomic_file(out / "groups.jsonl", "w") as fh:
        for row in result.rows:
            fh.write(json.dumps(row) + "\n")
    path = out / "validation.json"
    write_atomic(path, json.dumps(_finite(result.report), indent=1) + "\n")
    png = plot_validation(result.report, out / "validation.png")
    return {"json": path, "png": png, "groups": out / "groups.jsonl", "records": out / "records"}


def _finite(value):
    """JSON-safe copy: NaN / inf floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
