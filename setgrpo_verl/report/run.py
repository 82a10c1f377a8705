"""Report of a run directory: the paper's calibration and training figures as PNG files plus a text summary.

``make_report(run_dir)`` reads what the stages of :mod:`setgrpo_verl.runner.launch` wrote (``calibration/record.json``,
``calibration/paired_scores.npz``, verl's file-logger ``train_<estimator>/metrics.jsonl`` and the trainer's
``train_setgrpo/groups.jsonl``) and writes ``<run_dir>/report/``:

* ``risk_vs_threshold.png`` (paper Figure 4): empirical conditional risk F_j/N_j and its Clopper-Pearson UCB per
  threshold, beta and tau_sel marked; accepted risk groups N_j and normalised cumulative recovery U_j.
* ``coverage.png``: empirical coverage of the coefficient set on held-out groups versus the nominal 1 - alpha
  (re-calibrating the stored paired scores over alphas and split seeds), and the online coverage per step.
* ``training_dynamics.png`` (paper Figure 3): reward (point score), policy entropy, accepted-group ratio and mean
  recovery ratio per step, SetGRPO next to the GRPO baseline when present.
* ``projections.png`` (paper Figure 6): full-geometry vs reward-space minimum projections of accepted and
  rejected groups, distributions and the joint plane with the acceptance region shaded.
* ``table4.txt`` (paper Table 4 row) and ``summary.txt`` (everything above as text). ``COMPLETE`` is written last.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np

from ..atomic import atomic_file, write_atomic
from ..core.record import version_mismatch
from ..core.record_text import selection_text, start_text, table4_row, threshold_test_lines
from .regime import regime_report

__all__ = ["ReportError", "format_table4", "inspect_record", "load_metrics", "make_report"]

_COLORS = {"setgrpo": "tab:blue", "grpo": "tab:gray"}


class ReportError(ValueError):
    """A run directory or record that cannot be reported on; the message names the fix."""


def load_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file: verl's file logger (``{"step": n, "data": {...}}`` per line, flattened to the metrics
    dict with ``training/global_step``), or plain objects (``groups.jsonl``). Null means "not defined"."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            if set(row) == {"step", "data"} and isinstance(row["data"], dict):
                row = {"training/global_step": row["step"], **row["data"]}
            rows.append(row)
    return rows


def _training_rows(path: Path) -> list[dict]:
    """verl's per-step metric rows of a training stage (the calibration summary line has no step metrics), one per
    step in step order; a step logged twice (trained again after a resume from an earlier checkpoint,
    docs/cli.md#resuming-a-run) counts with its last row."""
    rows = {r["training/global_step"]: r for r in load_metrics(path) if "timing_s/step" in r}
    return [rows[step] for step in sorted(rows)]


def _group_rows(path: Path) -> list[dict]:
    """The per-group rows of ``groups.jsonl``, one per (step, group), the last written of a step trained again."""
    rows = {(r.get("step"), r.get("group"), i if r.get("group") is None else None): r
            for i, r in enumerate(load_metrics(path))}
    return list(rows.values())


def policy_label(record) -> str:
    """Short name of a record's policy for tables: the embedded model's name, else the model directory's name."""
    from ..models import EMBEDDED_MODEL_NAME, cache_dir

    model = str(record.policy.get("model", "policy"))
    if model.startswith(str(cache_dir())):
        return EMBEDDED_MODEL_NAME.split(" (")[0]
    return Path(model).name or model


#: What each Table 4 column of :func:`format_table4` is (docs/record.md#table-4-summary), printed by inspect-record.
TABLE4_COLUMNS = (
    "Cov.: coverage groups (fit q_alpha)",
    "Risk: risk groups (fit tau_sel)",
    "Qα: the conformal quantile of the nonconformity scores",
    "τsel: the selected full-geometry threshold (none: reject-all)",
    "N: accepted risk groups at τsel",
    "F: reversals among them",
    "ECR: empirical conditional risk F/N",
    "U: normalised cumulative recovery",
)


def format_table4(record, label: str = "this run") -> str:
    """The paper's Table 4 row (Cov., Risk, Q_alpha, tau_sel, N, F, ECR, U) of a record, as a fixed-width table."""
    row = table4_row(record)
    cells = [label, str(row["Cov."]), str(row["Risk"]), f"{row['Qα']:.3f}",
             "none" if row["τsel"] is None else f"{row['τsel']:.2f}", str(row["N"]), str(row["F"]),
             "nan" if math.isnan(row["ECR"]) else f"{row['ECR']:.4f}", f"{row['U']:.3f}"]
    head = ["Backbone", "Cov.", "Risk", "Qα", "τsel", "N", "F", "ECR", "U"]
    widths = [max(len(h), len(c)) for h, c in zip(head, cells)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    return fmt.format(*head) + "\n" + fmt.format(*cells)


def _record_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "calibration" / "record.json" if (p / "calibration").is_dir() else p / "record.json"
    if not p.is_file():
        raise ReportError(f"{path}: no calibration record there; pass a record.json or a run directory "
                             "made by `setgrpo-verl calibrate`")
    return p


def _guarantees(record, paired_path: Path, seeds: int) -> list[str]:
    """The record's coverage and risk against their bands under exchangeability (docs/record.md#reading-the-guarantees),
    with ``seeds`` re-splits of the paired scores at ``paired_path`` when that file exists."""
    from ..core.bands import guarantee_lines, resplit

    if not paired_path.is_file():
        return guarantee_lines(record) + [f"(no {paired_path.name} next to the record: no re-splits)"]
    with np.load(paired_path) as z:
        arrays = [z[name] for name in ("point", "reference", "gram")]
    try:
        return guarantee_lines(record, resplit(*arrays, record, seeds=seeds))
    except ValueError as exc:
        raise ReportError(f"{paired_path}: {exc}") from None


def inspect_record(path: str | os.PathLike, *, thresholds: bool = False, resplits: int = 200) -> str:
    """Text view of a frozen record: its Table 4 row, levels and identities (and, optionally, the threshold grid),
    and its coverage and risk against their bands, with ``resplits`` re-splits of the ``paired_scores.npz`` next to
    the record when there is one (docs/record.md#reading-the-guarantees).

    Raises:
        ReportError: no record at ``path`` or the record does not validate (edited, wrong schema).
    """
    from ..core import CalibrationRecord
    from ..core.record import RecordVersionWarning

    p = _record_path(path)
    try:
        with warnings.catch_warnings():  # the version warning is printed once, below
            warnings.simplefilter("ignore", RecordVersionWarning)
            rec = CalibrationRecord.from_json(p)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    label = policy_label(rec)
    versions = "  ".join(f"{k} {v}" for k, v in rec.package_versions.items()) or "not recorded"
    lines = [format_table4(rec, label), "columns: " + "; ".join(TABLE4_COLUMNS), "",
             f"alpha={rec.settings.alpha}  beta={rec.settings.beta}  delta={rec.settings.delta}  "
             f"rho={rec.settings.rho}  K={rec.K}  norm_by_std={rec.settings.norm_by_std}  "
             f"loss_agg_mode={rec.loss_agg_mode}  ablation={rec.settings.ablation}",
             selection_text(rec), *threshold_test_lines(rec), f"degenerate groups dropped={rec.n_degenerate}",
             *_guarantees(rec, p.parent / "paired_scores.npz", resplits), *regime_report(p.parent, rec),
             f"grader: {rec.grader}", f"policy: {rec.policy}", f"created {rec.created_at}, file {p}",
             f"written by: {versions}; {len(rec.calibration_prompts)} calibration prompts recorded"]
    mismatch = version_mismatch(rec)
    if mismatch:
        lines.append(f"warning: {mismatch}")
    if thresholds:
        lines += ["", f"{'tau':>6} {'N_j':>5} {'F_j':>5} {'UCB_j':>8} {'U_j':>7}"]
        for t, nj, fj, u, uu in zip(rec.settings.tau_grid, rec.n_accepted, rec.n_reversals, rec.ucb, rec.utility):
            mark = "  <- tau_sel" if t == rec.tau_sel else ""
            lines.append(f"{t:6.2f} {nj:5d} {fj:5d} {u:8.4f} {uu:7.3f}{mark}")
    return "\n".join(lines)





def _series(rows: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------------ figures
def plot_risk_vs_threshold(record, path: Path) -> None:
    """Paper Figure 4: per-threshold risk F_j/N_j, UCB_j (Bonferroni Clopper-Pearson), beta, tau_sel; N_j, U_j."""
    plt = _plt()
    tau = np.array(record.settings.tau_grid)
    n = np.array(record.n_accepted, dtype=float)
    f = np.array(record.n_reversals, dtype=float)
    risk = np.divide(f, n, out=np.full_like(f, np.nan), where=n > 0)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(tau, record.ucb, "o-", color="tab:red", label=f"UCB$_j$ (Clopper-Pearson, 1-δ/m, δ={record.settings.delta})")
    ax.plot(tau, risk, "s--", color="tab:blue", label="empirical risk F$_j$/N$_j$")
    ax.axhline(record.settings.beta, color="k", ls=":", label=f"β = {record.settings.beta}")
    if record.tau_sel is not None:
        ax.axvline(record.tau_sel, color="tab:green", lw=2, alpha=0.7, label=f"τ_sel = {record.tau_sel:.2f}")
    ax.set_xlabel("full-geometry threshold τ")
    ax.set_ylabel("conditional reversal risk of accepted groups")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Risk calibration ({record.n_risk} risk groups)")
    ax.legend(fontsize=8, loc="upper right")
    ax2.bar(tau, n, width=0.8 * (tau[1] - tau[0]) if len(tau) > 1 else 0.04, color="tab:cyan", alpha=0.6,
            label="accepted risk groups N$_j$")
    ax2.set_xlabel("full-geometry threshold τ")
    ax2.set_ylabel("N$_j$")
    ax3 = ax2.twinx()
    ax3.plot(tau, record.utility, "o-", color="tab:purple", label="cumulative recovery U$_j$")
    ax3.set_ylabel("U$_j$ (normalised cumulative recovery)")
    ax3.set_ylim(0, 1.02)
    if record.tau_sel is not None:
        ax2.axvline(record.tau_sel, color="tab:green", lw=2, alpha=0.7)
    feasible = [t for t, u, nj in zip(tau, record.ucb, n) if u <= record.settings.beta and nj > 0]
    if feasible:
        ax2.axvspan(min(feasible) - 0.02, max(feasible) + 0.02, color="tab:green", alpha=0.08,
                    label="risk-feasible (UCB ≤ β)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    ax2.set_title(f"Retained updates (Table 4: N={record.N}, F={record.F}, U={record.U:.3f})")
    fig.tight_layout()
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)


def coverage_curve(point, reference, gram, record, *, alphas=None, seeds: int = 10) -> list[tuple[float, float, float]]:
    """Empirical coverage of the coefficient set on held-out groups vs nominal level (docs/algorithm.md#2-jrsc).

    For each alpha (and ``seeds`` coverage/risk splits) the stored paired scores are re-calibrated with the
    record's settings; the record's ``coverage_risk_set`` is the share of held-out (risk) groups whose reference
    coefficients T(r') fall in their set. Alphas that the coverage split cannot support are skipped.

    Returns:
        ``[(1 - alpha, mean coverage, std over splits)]``.
    """
    import torch

    from ..core import calibrate
    from ..core.grpo import degenerate_groups
    from ..core.jrsc import min_calibration_groups

    n_live = int((~degenerate_groups(torch.as_tensor(point))).sum())
    alphas = alphas or [0.05, 0.1, 0.2, 0.3, 0.4, 0.5]
    out = []
    for alpha in alphas:
        if min_calibration_groups(alpha) > n_live - round(n_live * 0.5):
            continue
        settings = record.settings.replace(alpha=alpha, on_infeasible="reject_all")
        cov = [calibrate(torch.as_tensor(point), torch.as_tensor(reference), torch.as_tensor(gram), settings,
                         split_seed=s).coverage_risk_set for s in range(seeds)]
        out.append((1 - alpha, float(np.mean(cov)), float(np.std(cov))))
    return out


def plot_coverage(curve, record, setgrpo_rows: list[dict], path: Path) -> None:
    """Empirical vs nominal coverage (held-out calibration groups) and online coverage per training step."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot([0.4, 1], [0.4, 1], "k:", label="nominal = empirical")
    if curve:
        nom, mean, std = map(np.array, zip(*curve))
        ax.errorbar(nom, mean, yerr=std, fmt="o-", color="tab:blue", capsize=3,
                    label="held-out coverage (10 random splits)")
    ax.plot([1 - record.settings.alpha], [record.coverage_risk_set], "*", ms=14, color="tab:red",
            label=f"frozen record: α={record.settings.alpha}, coverage {record.coverage_risk_set:.2f}")
    ax.set_xlabel("nominal coverage 1 - α")
    ax.set_ylabel("empirical coverage  P(T(r') ∈ C)")
    ax.set_xlim(0.4, 1.0)
    ax.set_ylim(0.0, 1.05)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Coefficient-set coverage on held-out calibration groups")
    steps = _series(setgrpo_rows, "training/global_step")
    cov = _series(setgrpo_rows, "setgrpo/online_coverage")
    cum = _series(setgrpo_rows, "setgrpo/online_coverage_cum")
    if len(steps) and not np.all(np.isnan(cov)):
        ax2.plot(steps, cov, "o-", color="tab:blue", label="online coverage (step)")
        ax2.plot(steps, cum, "-", color="tab:purple", label="online coverage (cumulative)")
    else:
        ax2.text(0.5, 0.5, "no online coverage recorded\n(run train without --no-online-monitor)",
                 ha="center", va="center", transform=ax2.transAxes)
    ax2.axhline(1 - record.settings.alpha, color="k", ls=":", label=f"1 - α = {1 - record.settings.alpha:.2f}")
    ax2.set_xlabel("training step")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("share of groups with T(r') ∈ C")
    ax2.set_ylim(0.0, 1.05)
    ax2.legend(fontsize=8, loc="lower right")
    ax2.set_title("Coverage during SetGRPO training (reference scores)")
    fig.tight_layout()
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)


def plot_training_dynamics(runs: dict[str, list[dict]], path: Path) -> None:
    """Paper Figure 3: reward, entropy, accepted-group ratio and mean recovery ratio per step (per estimator)."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator
    panels = [("critic/score/mean", "reward (point score, mean)"), ("actor/entropy", "policy entropy (nats/token)"),
              ("setgrpo/accepted_ratio", "accepted-group ratio"), ("setgrpo/recovery_ratio/mean",
                                                                   "mean recovery ratio η* (accepted)")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, title) in zip(axes, panels):
        for name, rows in runs.items():
            if not rows:
                continue
            steps = _series(rows, "training/global_step")
            y = _series(rows, key)
            if np.all(np.isnan(y)):
                continue
            ax.plot(steps, y, "o-", color=_COLORS.get(name), label="SetGRPO" if name == "setgrpo" else "GRPO")
        if key.startswith("setgrpo/"):
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        all_steps = [r.get("training/global_step") for rows in runs.values() for r in rows]
        if all_steps:
            ax.set_xlim(min(all_steps) - 0.25, max(all_steps) + 0.25)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Training dynamics (paper Figure 3)", fontsize=11)
    fig.tight_layout()
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)


def plot_projections(groups: list[dict], tau_sel: float | None, path: Path) -> None:
    """Paper Figure 6: distributions of M_full and M_reward for accepted / rejected groups and their joint plane
    with the acceptance region (M_full >= tau_sel and M_reward > 0) shaded."""
    plt = _plt()
    live = [g for g in groups if g.get("m_full") is not None and g.get("m_reward") is not None]
    acc = [g for g in live if g["status"] == "accepted"]
    rej = [g for g in live if g["status"] != "accepted"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    bins = np.linspace(-1, 1, 21)
    for ax, key, name in ((ax1, "m_full", "full-geometry projection M_full"),
                          (ax2, "m_reward", "reward-space projection M_reward")):
        ax.hist([g[key] for g in acc], bins=bins, alpha=0.6, color="tab:green", label=f"accepted ({len(acc)})")
        ax.hist([g[key] for g in rej], bins=bins, alpha=0.6, color="tab:red", label=f"rejected ({len(rej)})")
        if key == "m_full" and tau_sel is not None:
            ax.axvline(tau_sel, color="k", ls="--", label=f"τ_sel = {tau_sel:.2f}")
        if key == "m_reward":
            ax.axvline(0, color="k", ls="--", label="0")
        ax.set_xlabel(name)
        ax.set_ylabel("groups")
        ax.legend(fontsize=8)
    if tau_sel is not None:
        ax3.fill_between([tau_sel, 1.0], 0, 1.0, color="tab:green", alpha=0.1,
                         label="M_full ≥ τ_sel and M_reward > 0")
    ax3.scatter([g["m_full"] for g in acc], [g["m_reward"] for g in acc], s=18, color="tab:green", label="accepted")
    ax3.scatter([g["m_full"] for g in rej], [g["m_reward"] for g in rej], s=18, color="tab:red", marker="x",
                label="rejected")
    ax3.axhline(0, color="k", lw=0.8)
    ax3.set_xlim(-1.02, 1.02)
    ax3.set_ylim(-1.02, 1.02)
    ax3.set_xlabel("M_full (min over the set, at b(η*) or the anchor)")
    ax3.set_ylabel("M_reward")
    ax3.legend(fontsize=8, loc="lower left")
    null = sum(1 for g in groups if g.get("status") == "null_anchor")
    fig.suptitle(f"Projection diagnostics (paper Figure 6): {len(live)} groups with projections (calibration + "
                 f"training){f'; {null} null-anchor rejections have none' if null else ''}", fontsize=11)
    fig.tight_layout()
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- report
def _calibration_groups(point, gram, record) -> list[dict]:
    """GGSR status and projections of the calibration groups under the frozen record (for Figure 6)."""
    import torch

    from ..core import setgrpo_coefficients

    res = setgrpo_coefficients(torch.as_tensor(point), torch.as_tensor(gram), record)
    return [{"status": s, "m_full": None if math.isnan(mf) else mf, "m_reward": None if math.isnan(mr) else mr,
             "source": "calibration"} for s, mf, mr in zip(res.status, res.m_full.tolist(), res.m_reward.tolist())]


#: The training metric of a batch's mean noise-free score (setgrpo_verl.integration.reward_manager.TRUTH_METRIC).
_TRUTH = "setgrpo/grading/truth_score/mean"


def _truth_mean(rows: list[dict]) -> str:
    """``", truth reward 0.512 [0.47, 0.55] (95 % t-band over 3 steps)"``, or "" without the truth metric."""
    values = _series(rows, _TRUTH)
    values = values[~np.isnan(values)]
    if not len(values):
        return ""
    mean = float(values.mean())
    if len(values) < 2:
        return f", truth reward {mean:.3f} (one step)"
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))
    return f", truth reward {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}] (95 % t-band over {len(values)} steps)"


def _fmt(x, spec: str = ".3f") -> str:
    return "  n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def make_report(run_dir: str | os.PathLike, *, resplits: int = 200, truth: list[str] | None = None,
                out: str | os.PathLike | None = None) -> str:
    """Write ``<run_dir>/report/`` (or ``out``: PNG figures, ``table4.txt``, ``summary.txt``, ``COMPLETE``) and return the
    summary text; coverage and risk come with their bands and ``resplits`` re-splits of the stored paired scores
    (docs/record.md#reading-the-guarantees), then the ``truth`` lines (the check against the noise-free score of
    docs/cli.md#what-the-main-job-prints) where the grader knew it, and per training step the truth reward of its
    batch (``setgrpo/grading/truth_score/mean``) with the mean over the steps and its 95 % band.

    Raises:
        ReportError: ``run_dir`` has no finished calibration stage.
    """
    from ..core import CalibrationRecord
    from ..rundir import COMPLETE

    run_dir = Path(run_dir)
    calib = run_dir / "calibration"
    if not (calib / COMPLETE).exists():
        raise ReportError(f"{run_dir}: no finished calibration stage ({calib}/{COMPLETE} missing); run "
                             "`setgrpo-verl calibrate --run-dir ...` (or quickstart) first")
    record = CalibrationRecord.from_json(calib / "record.json")
    paired = np.load(calib / "paired_scores.npz")
    out = run_dir / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPLETE).unlink(missing_ok=True)
    runs = {}
    for name in ("setgrpo", "grpo"):
        stage = run_dir / f"train_{name}"
        runs[name] = _training_rows(stage / "metrics.jsonl") if (stage / COMPLETE).exists() else []
    train_groups = _group_rows(run_dir / "train_setgrpo" / "groups.jsonl") if runs["setgrpo"] else []
    groups = _calibration_groups(paired["point"], paired["gram"], record) + train_groups

    files = {"risk_vs_threshold.png": lambda p: plot_risk_vs_threshold(record, p),
             "coverage.png": lambda p: plot_coverage(coverage_curve(paired["point"], paired["reference"],
                                                                    paired["gram"], record), record,
                                                     runs["setgrpo"], p),
             "training_dynamics.png": lambda p: plot_training_dynamics(runs, p),
             "projections.png": lambda p: plot_projections(groups, record.tau_sel, p)}
    for fname, fn in files.items():
        fn(out / fname)
    label = policy_label(record)
    table = format_table4(record, label)
    guarantees = _guarantees(record, calib / "paired_scores.npz", resplits)
    write_atomic(out / "table4.txt", table + "\n\n" + "\n".join(guarantees) + "\n")

    lines = ["Table 4 row (frozen calibration record):", table, "",
             f"alpha={record.settings.alpha} beta={record.settings.beta} delta={record.settings.delta}; "
             f"{selection_text(record)}",
             *([start_text(record)] if start_text(record) else []), *guarantees, *regime_report(calib, record),
             *(truth or []), ""]
    if runs["setgrpo"]:
        lines.append("SetGRPO per step: accepted-group ratio, mean recovery ratio, reward (point), truth reward, "
                     "entropy")
        lines.append(f"{'step':>4} {'accepted':>9} {'recovery':>9} {'reward':>8} {'truth':>8} {'entropy':>8} "
                     f"{'online cov':>10}")
        for r in runs["setgrpo"]:
            lines.append(f"{r['training/global_step']:>4} {_fmt(r.get('setgrpo/accepted_ratio')):>9} "
                         f"{_fmt(r.get('setgrpo/recovery_ratio/mean')):>9} {_fmt(r.get('critic/score/mean')):>8} "
                         f"{_fmt(r.get(_TRUTH)):>8} {_fmt(r.get('actor/entropy')):>8} "
                         f"{_fmt(r.get('setgrpo/online_coverage')):>10}")
        skipped = sum(int(r.get("actor/update_skipped") or 0) for r in runs["setgrpo"])
        lines.append(f"steps without an optimizer step (every group rejected or degenerate): {skipped}")
    if runs["grpo"]:
        lines += ["", "GRPO baseline (same seeds) per step: reward (point), truth reward, entropy"]
        for r in runs["grpo"]:
            lines.append(f"{r['training/global_step']:>4} {_fmt(r.get('critic/score/mean')):>8} "
                         f"{_fmt(r.get(_TRUTH)):>8} {_fmt(r.get('actor/entropy')):>8}")
    for name, rows in runs.items():
        if rows:
            lines.append(f"{name}: mean reward over steps {np.nanmean(_series(rows, 'critic/score/mean')):.4f}"
                         f"{_truth_mean(rows)}, mean step time {np.nanmean(_series(rows, 'timing_s/step')):.1f} s")
    lines += ["", f"plots: {', '.join(str(out / f) for f in files)}"]
    text = "\n".join(lines)
    write_atomic(out / "summary.txt", text + "\n")
    write_atomic(out / COMPLETE, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
    return text
