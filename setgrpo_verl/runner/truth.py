"""The main job's check against the truth (docs/cli.md#what-the-main-job-prints): SetGRPO and GRPO on the
calibration's own groups, each group held out once.

The calibration stage of a run with a grader that knows the noise-free score stores it next to the paired scores
(``truth`` in ``calibration/paired_scores.npz``, docs/validation.md#noisy-grader). :func:`truth_check` splits the
groups into ``folds`` parts (stratified by degeneracy, as :func:`~setgrpo_verl.runner.validate.split_groups`);
each part is held out once while SetGRPO is calibrated on the others at the run's levels
(:func:`~setgrpo_verl.runner.validate.evaluate_method`), and GRPO updates every non-degenerate held-out group
(:func:`~setgrpo_verl.runner.validate.evaluate_grpo`). Every group is then counted once, so the pooled counts are
binomial and carry Clopper-Pearson bands. The table lines are :func:`setgrpo_verl.report.validation.truth_lines`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..core import CalibrationRecord, CalibrationSettings
from ..core.grpo import degenerate_groups, DEGENERATE_RTOL
from ..core.srgo import clopper_pearson_upper
from .validate import evaluate_grpo, evaluate_method, load_paired

__all__ = ["binomial_band", "check_bands", "fold_groups", "truth_check", "truth_check_of_run", "truth_report_lines"]


def binomial_band(successes: int, trials: int, level: float = 0.95) -> tuple[float, float] | None:
    """Two-sided Clopper-Pearson band ``(lo, hi)`` of a rate ``successes / trials`` at ``level``; None without a
    trial."""
    if trials <= 0:
        return None
    tail = (1.0 + level) / 2.0
    hi = float(clopper_pearson_upper(successes, trials, tail))
    lo = 1.0 - float(clopper_pearson_upper(trials - successes, trials, tail))
    return lo, hi


def fold_groups(degenerate: torch.Tensor, folds: int, seed: int) -> list[torch.Tensor]:
    """``folds`` disjoint int64 index tensors covering the G groups, each with its share of the non-degenerate and of
    the degenerate groups (a seeded permutation of each stratum, dealt out in turn).

    Raises:
        ValueError: ``folds < 2`` or fewer non-degenerate groups than folds.
    """
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    if int((~degenerate).sum()) < folds:
        raise ValueError(f"{int((~degenerate).sum())} non-degenerate groups cannot fill {folds} folds")
    generator = torch.Generator().manual_seed(int(seed))
    parts: list[list[torch.Tensor]] = [[] for _ in range(folds)]
    for stratum in (~degenerate, degenerate):
        idx = stratum.nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=generator)]
        for f in range(folds):
            parts[f].append(idx[f::folds])
    return [torch.cat(p).sort().values for p in parts]


def truth_check(paired: Mapping[str, torch.Tensor], levels: CalibrationSettings, *, folds: int = 4,
                seed: int = 0) -> dict[str, Any]:
    """SetGRPO's held-out coverage and both methods' reversals against the truth, every group held out once.

    Args:
        paired: float64 ``point``, ``reference``, ``truth`` ``[G, K]`` and ``gram`` ``[G, K, K]``
            (:func:`~setgrpo_verl.runner.validate.load_paired`).
        levels: the run's calibration settings (its record's).
        folds: parts of the groups, each held out once.
        seed: seed of the parts and of each calibration's coverage / risk split (``seed + fold``).

    Returns:
        Counts over all held-out groups: ``groups``, ``folds``, ``n_cov`` (coverage groups of each calibration, the
        smallest), ``live`` (non-degenerate), ``covered`` (SetGRPO's sets holding the re-scoring's coefficients),
        ``accepted`` (groups SetGRPO trains), ``tau_sel`` (each calibration's threshold, None: none certified),
        ``grpo_judged`` / ``setgrpo_judged`` (updated groups whose truth is not constant) with ``grpo_reversals``
        / ``setgrpo_reversals`` among them (update against the truth's direction, docs/validation.md#what-is-measured),
        ``dropped`` (non-degenerate groups SetGRPO does not train) and ``dropped_grpo_reversals`` (of those, GRPO's
        update reverses against the truth), ``alpha``.

    Raises:
        ValueError: no truth in ``paired``, too few groups for the folds or for alpha.
    """
    if "truth" not in paired:
        raise ValueError("the paired scores hold no truth: the grader knew no noise-free score")
    degenerate = degenerate_groups(paired["point"], DEGENERATE_RTOL)
    out = {"groups": int(paired["point"].shape[0]), "folds": folds, "alpha": levels.alpha, "n_cov": None,
           "live": 0, "covered": 0, "accepted": 0, "tau_sel": [], "grpo_judged": 0, "grpo_reversals": 0,
           "setgrpo_judged": 0, "setgrpo_reversals": 0, "dropped": 0, "dropped_grpo_reversals": 0}
    parts = fold_groups(degenerate, folds, seed)
    for f, held in enumerate(parts):
        rest = torch.cat([p for g, p in enumerate(parts) if g != f]).sort().values
        summary, rows, record = evaluate_method(paired, rest, held, levels=levels, split_seed=seed + f)
        grpo, grpo_rows = evaluate_grpo(paired, held, levels=levels, degenerate_rtol=record.degenerate_rtol)
        out["n_cov"] = record.n_cov if out["n_cov"] is None else min(out["n_cov"], record.n_cov)
        out["tau_sel"].append(record.tau_sel)
        out["live"] += summary["n_live"]
        out["covered"] += sum(1 for r in rows if r["covered_reference"])
        out["accepted"] += summary["n_accepted"]
        out["setgrpo_judged"] += summary["n_accepted_truth_live"]
        out["setgrpo_reversals"] += summary["reversals_truth"]
        out["grpo_judged"] += grpo["n_accepted_truth_live"]
        out["grpo_reversals"] += grpo["reversals_truth"]
        for mine, theirs in zip(rows, grpo_rows):  # both in held-out order
            if theirs["accepted"] and not mine["accepted"]:
                out["dropped"] += 1
                out["dropped_grpo_reversals"] += int(theirs["reversal_truth"])
    return out


def truth_check_of_run(run_dir: str | Path, *, folds: int = 4) -> dict[str, Any] | None:
    """:func:`truth_check` of a run directory's calibration at its record's levels, or None when its paired scores
    hold no truth (a judge without a known noise-free score).

    Raises:
        FileNotFoundError, ValueError: no calibration, or paired scores that do not load
            (:func:`~setgrpo_verl.runner.validate.load_paired`).
    """
    calibration = Path(run_dir) / "calibration"
    paired = load_paired(calibration / "paired_scores.npz")
    if "truth" not in paired:
        return None
    record = CalibrationRecord.from_json(calibration / "record.json")
    return truth_check(paired, record.settings, folds=folds, seed=record.split_seed)


def check_bands(check: Mapping[str, Any], level: float = 0.95) -> dict[str, tuple[float, float] | None]:
    """Clopper-Pearson bands at ``level`` of :func:`truth_check`'s rates: ``coverage`` (covered / live), ``grpo`` and
    ``setgrpo`` (reversals / judged updates), ``trained`` (accepted / live); None where a rate has no trial."""
    return {"coverage": binomial_band(check["covered"], check["live"], level),
            "grpo": binomial_band(check["grpo_reversals"], check["grpo_judged"], level),
            "setgrpo": binomial_band(check["setgrpo_reversals"], check["setgrpo_judged"], level),
            "trained": binomial_band(check["accepted"], check["live"], level)}


def truth_report_lines(run_dir: str | Path) -> list[str]:
    """The report's lines against the truth of a run directory (:func:`truth_check_of_run`, then
    :func:`setgrpo_verl.report.validation.truth_lines`); none when its grader knew no truth.

    Raises:
        FileNotFoundError, ValueError: see :func:`truth_check_of_run`.
    """
    from ..report.validation import truth_lines

    check = truth_check_of_run(run_dir)
    return [] if check is None else truth_lines(check, check_bands(check))
