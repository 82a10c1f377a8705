"""What one calibration split's figures look like under exchangeability (docs/record.md#reading-the-guarantees).

A record's held-out coverage and its risk figures come from one random split of the calibration groups. With a few
dozen groups a single split swings widely even when every guarantee holds; these functions give the band such a
figure falls in, and the same figures over repeated re-splits of the stored paired scores, so a report can show a
guarantee as what it is: a statement about the distribution over splits, not about one split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.stats import betabinom, binom

from .calibration import calibrate
from .coefficients import setgrpo_coefficients
from .grpo import degenerate_groups
from .record import CalibrationRecord
from .reversal import reversal_events

#: Default share of exchangeable splits a band holds: its ends are the 5 % and 95 % quantiles.
BAND_LEVEL = 0.90
#: Default number of re-splits of the stored paired scores.
RESPLITS = 200


def _conformal_index(n_cov: int, alpha: float) -> int:
    """``ceil((n+1)(1-alpha))``, the order statistic :func:`conformal_radius` takes (same rounding guard)."""
    return math.ceil((n_cov + 1) * (1 - alpha) - 1e-12)


@dataclass(frozen=True)
class CoverageBand:
    """Band of a single split's held-out coverage under exchangeability (docs/record.md#reading-the-guarantees).

    Attributes:
        n_cov: coverage-calibration groups the radius was taken from.
        n_held_out: held-out groups the coverage is measured on.
        alpha: miscoverage level.
        level: share of exchangeable splits inside ``[lo, hi]`` (at least, the count being discrete).
        lo, hi: band ends as shares of held-out groups (the ``(1-level)/2`` and ``(1+level)/2`` quantiles).
        mean: expected coverage ``k / (n_cov + 1)``, ``k = ceil((n_cov+1)(1-alpha))`` (>= 1 - alpha).
    """

    n_cov: int
    n_held_out: int
    alpha: float
    level: float
    lo: float
    hi: float
    mean: float

    def position(self, coverage: float) -> str:
        """``"below"``, ``"inside"`` or ``"above"``: where a held-out coverage (a share) lies against the band."""
        # counts are integers; compare on the count scale so 11/24 is not missed by rounding of the share
        count = round(coverage * self.n_held_out)
        if count < round(self.lo * self.n_held_out):
            return "below"
        if count > round(self.hi * self.n_held_out):
            return "above"
        return "inside"

    def tail(self, coverage: float) -> float:
        """Share of exchangeable splits as far out as ``coverage`` (a share): ``P(X <= count)`` at or below the mean,
        ``P(X >= count)`` above it, X the beta-binomial count of covered held-out groups."""
        k = _conformal_index(self.n_cov, self.alpha)
        dist = betabinom(self.n_held_out, k, self.n_cov + 1 - k)
        count = round(coverage * self.n_held_out)
        return float(dist.cdf(count) if coverage <= self.mean else dist.sf(count - 1))


def coverage_band(n_cov: int, n_held_out: int, alpha: float, *, level: float = BAND_LEVEL) -> CoverageBand:
    """Band of the held-out coverage of one split-conformal split (docs/record.md#reading-the-guarantees).

    With continuous nonconformity scores and exchangeable groups, the coverage of the radius taken from ``n_cov``
    groups is ``Beta(k, n_cov + 1 - k)`` given those groups, ``k = ceil((n_cov+1)(1-alpha))``; the number of
    ``n_held_out`` held-out groups it covers is binomial on it, i.e. beta-binomial. The band holds that count's
    ``(1-level)/2`` and ``(1+level)/2`` quantiles, divided by ``n_held_out``. Ties among the scores (discrete rubric
    scores) only raise coverage, so a figure below the band is never explained by ties.

    Args:
        n_cov: coverage groups, >= 1 and large enough for alpha (``k <= n_cov``).
        n_held_out: held-out groups, >= 1.
        alpha: miscoverage level in (0, 1).
        level: share of splits the band holds, in (0, 1).

    Returns:
        :class:`CoverageBand` (shares in [0, 1]).

    Raises:
        ValueError: counts below 1, alpha or level outside (0, 1), or ``n_cov`` too small for alpha.
    """
    if isinstance(n_cov, bool) or isinstance(n_held_out, bool) or int(n_cov) != n_cov or int(n_held_out) != n_held_out \
            or n_cov < 1 or n_held_out < 1:
        raise ValueError(f"n_cov={n_cov!r} and n_held_out={n_held_out!r} must be integers >= 1")
    if not (0.0 < alpha < 1.0) or not (0.0 < level < 1.0):
        raise ValueError(f"alpha={alpha} and level={level} must lie in (0, 1)")
    n_cov, n_held_out = int(n_cov), int(n_held_out)
    k = _conformal_index(n_cov, alpha)
    if k > n_cov:
        raise ValueError(f"n_cov={n_cov} coverage groups are too few for alpha={alpha}: the conformal index "
                         f"ceil((n+1)(1-alpha)) = {k} exceeds n (no finite radius)")
    dist = betabinom(n_held_out, k, n_cov + 1 - k)
    lo, hi = dist.ppf((1 - level) / 2), dist.ppf((1 + level) / 2)
    return CoverageBand(n_cov=n_cov, n_held_out=n_held_out, alpha=float(alpha), level=float(level),
                        lo=float(lo) / n_held_out, hi=float(hi) / n_held_out, mean=k / (n_cov + 1))


def risk_share_floor(n_accepted: Sequence[int], beta: float, delta: float) -> float | None:
    """Least expected share of splits with realised risk <= beta when the risk guarantee holds
    (docs/record.md#reading-the-guarantees).

    A split's realised risk is the reversal rate of its ``n`` accepted held-out groups. If the true conditional risk
    is at most beta (probability >= 1 - delta over calibration), the reversals are at most binomial(n, beta), so the
    rate is <= beta with probability >= ``P(Bin(n, beta) <= floor(beta n))``. The floor is ``1 - delta`` times the
    mean of that probability over the splits: few accepted groups make realised rates noisy, and the floor says how
    far below ``1 - delta`` the share may fall for that reason alone.

    Args:
        n_accepted: accepted held-out groups per split (splits with none are skipped).
        beta, delta: the record's levels, in (0, 1).

    Returns:
        The floor in [0, 1], or None when no split accepted a group.

    Raises:
        ValueError: beta or delta outside (0, 1), or a negative count.
    """
    if not (0.0 < beta < 1.0) or not (0.0 < delta < 1.0):
        raise ValueError(f"beta={beta} and delta={delta} must lie in (0, 1)")
    counts = np.asarray([int(n) for n in n_accepted], dtype=np.int64)
    if (counts < 0).any():
        raise ValueError("accepted counts must be >= 0")
    counts = counts[counts > 0]
    if counts.size == 0:
        return None
    return float((1 - delta) * binom.cdf(np.floor(beta * counts + 1e-9), counts, beta).mean())


@dataclass(frozen=True)
class Resplits:
    """A record's figures over repeated re-splits of its stored paired scores (docs/record.md#reading-the-guarantees).

    Attributes:
        seeds: the split seeds used (``0 .. S-1``).
        coverage: ``[S]`` float64 held-out coverage per re-split, from :func:`calibrate` with the record's settings
            and ``split_seed=s`` on all stored groups (same ``n_cov`` and ``n_risk`` as the record).
        risk: ``[S]`` float64 realised risk per re-split: half of the non-degenerate groups held out, calibration
            on the rest, the reversal rate (against the reference scoring) of accepted held-out groups; NaN where
            none was accepted.
        n_accepted: ``[S]`` int64 accepted held-out groups per risk re-split.
        n_held_out: non-degenerate held-out groups per risk re-split.
    """

    seeds: int
    coverage: np.ndarray
    risk: np.ndarray
    n_accepted: np.ndarray
    n_held_out: int

    @property
    def coverage_mean(self) -> float:
        """Mean held-out coverage over the re-splits."""
        return float(self.coverage.mean())

    def share_risk_at_most(self, beta: float) -> float | None:
        """Share of risk re-splits with an accepted held-out group whose realised risk is <= beta (None if none)."""
        judged = self.risk[~np.isnan(self.risk)]
        return float((judged <= beta).mean()) if judged.size else None


def resplit(point: torch.Tensor, reference: torch.Tensor, gram: torch.Tensor, record: CalibrationRecord, *,
            seeds: int = RESPLITS) -> Resplits:
    """Re-fit a record's calibration on ``seeds`` random re-splits of its paired scores
    (docs/record.md#reading-the-guarantees).

    Coverage: ``calibrate(..., split_seed=s)`` with the record's settings on all groups, so each re-split has the
    record's ``n_cov`` coverage and ``n_risk`` held-out groups. Risk: the non-degenerate groups are split in half at
    random (seed s); calibration on one half (``on_infeasible="reject_all"``), :func:`setgrpo_coefficients` on the
    other, realised risk = share of accepted held-out groups with ``b*^T M T(r') < 0``.

    Args:
        point, reference: ``[G, K]`` float tensors or arrays (cast to float64), the paired scorings the record was
            calibrated on (reward units).
        gram: ``[G, K, K]`` float Gram matrices (same cast).
        record: the frozen record.
        seeds: number of re-splits S >= 1.

    Returns:
        :class:`Resplits`.

    Raises:
        ValueError: ``seeds < 1``, point scores that are not ``[G, K]``, paired scores whose group counts do not
            match the record (other scores than the ones it was calibrated on), or bad shapes and values
            (from :func:`calibrate`).
    """
    if isinstance(seeds, bool) or int(seeds) != seeds or seeds < 1:
        raise ValueError(f"seeds={seeds!r} must be an integer >= 1")
    point, reference, gram = (torch.as_tensor(x, dtype=torch.float64) for x in (point, reference, gram))
    if point.ndim != 2:
        raise ValueError(f"point scores must be [G, K], got shape {tuple(point.shape)}")
    live = ~degenerate_groups(point, record.degenerate_rtol)
    n_live = int(live.sum())
    if (n_live, point.shape[0] - n_live, point.shape[1]) != (record.n_cov + record.n_risk, record.n_degenerate,
                                                                record.K):
        raise ValueError(
            f"paired scores with {point.shape[0]} groups of K={point.shape[1]} ({n_live} non-degenerate) are not the "
            f"ones this record was calibrated on ({record.n_cov} + {record.n_risk} non-degenerate, "
            f"{record.n_degenerate} degenerate, K={record.K}); pass the calibration stage's own paired_scores.npz")
    # the record's split sizes exactly, whatever its split shares were
    same_split = record.settings.replace(risk_fraction=record.n_risk / n_live, coverage_groups=record.n_cov,
                                         on_infeasible="reject_all")
    coverage = np.array([calibrate(point, reference, gram, same_split, split_seed=s,
                                   degenerate_rtol=record.degenerate_rtol).coverage_risk_set for s in range(seeds)])
    live_idx = live.nonzero().flatten()
    n_hold = n_live // 2
    half = record.settings.replace(on_infeasible="reject_all")
    risk, n_acc = np.full(seeds, np.nan), np.zeros(seeds, dtype=np.int64)
    for s in range(seeds):
        perm = live_idx[torch.randperm(n_live, generator=torch.Generator().manual_seed(s))]
        hold, cal = perm[:n_hold], perm[n_hold:]
        try:
            rec = calibrate(point[cal], reference[cal], gram[cal], half, split_seed=s,
                            degenerate_rtol=record.degenerate_rtol)
        except ValueError:  # half the groups are too few for alpha: this re-split has no risk figure
            continue
        res = setgrpo_coefficients(point[hold], gram[hold], rec)
        rev = reversal_events(res.coefficients, gram[hold], reference[hold], res.accepted,
                              norm_by_std=record.settings.norm_by_std, eps=record.settings.eps,
                              degenerate_rtol=record.degenerate_rtol)
        n_acc[s] = int(res.accepted.sum())
        if n_acc[s]:
            risk[s] = int(rev.sum()) / n_acc[s]
    return Resplits(seeds=int(seeds), coverage=coverage, risk=risk, n_accepted=n_acc, n_held_out=n_hold)


def guarantee_lines(record: CalibrationRecord, resplits: Resplits | None = None, *,
                    level: float = BAND_LEVEL) -> list[str]:
    """Report lines that show a record's coverage and risk against what exchangeability predicts
    (docs/record.md#reading-the-guarantees).

    The held-out coverage comes with its :func:`coverage_band` and, when ``resplits`` is given, the mean and spread
    over re-splits and the share of risk re-splits with realised risk <= beta (against :func:`risk_share_floor`).
    A figure outside its band gets an indented ``WARNING:`` line that says what it means.

    Args:
        record: the frozen record.
        resplits: :func:`resplit` of the record's paired scores, or None when they are not at hand.
        level: share of exchangeable splits the band holds.

    Returns:
        Lines of text (no trailing newlines).
    """
    levels = record.settings
    band = coverage_band(record.n_cov, record.n_risk, levels.alpha, level=level)
    pct = f"{100 * (1 - level) / 2:g}-{100 * (1 + level) / 2:g} %"
    cov = record.coverage_risk_set
    where = band.position(cov)
    lines = [f"held-out coverage {cov:.3f} on {record.n_risk} held-out groups ({round(cov * record.n_risk)} covered; "
             f"guarantee: >= {1 - levels.alpha:.2f} on average over splits)",
             f"  expected under exchangeability: mean {band.mean:.2f}, single splits {band.lo:.2f}-{band.hi:.2f} "
             f"({pct} band, n_cov={record.n_cov}) -> {where} the band"]
    if where == "below":
        lines.append(f"  WARNING: held-out coverage {cov:.3f} is below its {pct} band [{band.lo:.2f}, {band.hi:.2f}]: "
                     f"{100 * band.tail(cov):.2g} % of exchangeable splits go this low. If the re-split mean is near "
                     f"{band.mean:.2f} this split was unlucky; if not, calibration and held-out groups are not "
                     "exchangeable (the two scorings differ in kind, or groups are duplicated)")
    elif where == "above":
        lines.append(f"  WARNING: held-out coverage {cov:.3f} is above its {pct} band [{band.lo:.2f}, {band.hi:.2f}]: "
                     f"{100 * band.tail(cov):.2g} % of exchangeable splits go this high, and ties among the "
                     "nonconformity scores (coarse rubric scores) raise coverage further: the sets may be wider than "
                     "needed, which costs accepted updates but does not break the guarantee")
    if resplits is not None:
        q5, q95 = np.quantile(resplits.coverage, [(1 - level) / 2, (1 + level) / 2])
        mean = resplits.coverage_mean
        lines.append(f"  over {resplits.seeds} re-splits of the stored paired scores: held-out coverage mean "
                     f"{mean:.3f}, {pct} of re-splits {q5:.2f}-{q95:.2f}")
        if band.position(mean) != "inside":
            lines.append(f"  WARNING: the mean held-out coverage over re-splits {mean:.3f} is outside the {pct} band "
                         f"[{band.lo:.2f}, {band.hi:.2f}] of a single split: "
                         + ("calibration and held-out groups do not behave as exchangeable"
                            if mean < band.lo else "the sets are wider than 1 - alpha needs (tied scores)"))
        share = resplits.share_risk_at_most(levels.beta)
        judged = int((~np.isnan(resplits.risk)).sum())
        if share is None:
            lines.append(f"risk: none of {resplits.seeds} re-splits accepted a held-out group (each calibrated on half "
                         f"the groups, {resplits.n_held_out} held out; too few for a risk-feasible threshold): the "
                         "realised risk is not measurable on these paired scores")
        else:
            floor = risk_share_floor(resplits.n_accepted, levels.beta, levels.delta)
            lines.append(f"risk: realised risk <= beta={levels.beta} in {share:.2f} of the {judged} re-splits with an "
                         "accepted held-out group")
            lines.append(f"  (each calibrated on half the groups, {resplits.n_held_out} held out; guarantee >= "
                         f"{1 - levels.delta:.2f} for the true risk, >= {floor:.2f} expected for the realised rate on "
                         f"{np.mean(resplits.n_accepted[resplits.n_accepted > 0]):.1f} accepted groups)")
            if share < floor:
                lines.append(f"  WARNING: realised risk <= beta in only {share:.2f} of re-splits, below the "
                             f"{floor:.2f} "
                             "expected if the risk guarantee holds: reversals are more frequent than beta allows; "
                             "use more calibration groups or a smaller beta, and check the grader")
    return lines
