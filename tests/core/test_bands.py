"""Bands of one split's figures under exchangeability (docs/record.md#reading-the-guarantees), against simulation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy.stats import betabinom, binom

from setgrpo_verl.core import calibrate, CalibrationSettings
from setgrpo_verl.core.bands import coverage_band, guarantee_lines, resplit, risk_share_floor

from .synthetic import make_groups


def _simulated_covered_counts(n_cov: int, n_held: int, alpha: float, reps: int, seed: int) -> np.ndarray:
    """Split conformal on exchangeable continuous scores: how many of n_held fresh scores the radius covers."""
    rng = np.random.default_rng(seed)
    scores = rng.exponential(size=(reps, n_cov + n_held))
    k = math.ceil((n_cov + 1) * (1 - alpha) - 1e-12)
    q = np.sort(scores[:, :n_cov], axis=1)[:, k - 1]
    return (scores[:, n_cov:] <= q[:, None]).sum(1)


@pytest.mark.parametrize("n_cov,n_held,alpha", [(24, 24, 0.5), (40, 30, 0.1), (19, 60, 0.05)])
def test_coverage_band_is_the_simulated_5_95_range(n_cov, n_held, alpha):
    reps = 40_000
    counts = _simulated_covered_counts(n_cov, n_held, alpha, reps, seed=n_cov)
    band = coverage_band(n_cov, n_held, alpha)
    lo, hi = round(band.lo * n_held), round(band.hi * n_held)
    se = math.sqrt(0.05 * 0.95 / reps)
    # the band ends are the 5 % and 95 % quantiles of the count: P(X < lo) <= 5 % <= P(X <= lo), likewise for hi
    assert np.mean(counts < lo) <= 0.05 + 4 * se and np.mean(counts <= lo) >= 0.05 - 4 * se
    assert np.mean(counts < hi) <= 0.95 + 4 * se and np.mean(counts <= hi) >= 0.95 - 4 * se
    q05, q95 = np.quantile(counts, [0.05, 0.95], method="inverted_cdf")
    assert abs(q05 - lo) <= 1 and abs(q95 - hi) <= 1
    k = math.ceil((n_cov + 1) * (1 - alpha) - 1e-12)
    assert band.mean == pytest.approx(k / (n_cov + 1)) and band.mean >= 1 - alpha
    assert np.mean(counts) / n_held == pytest.approx(band.mean, abs=4 * np.std(counts / n_held) / math.sqrt(reps))


def test_coverage_band_of_the_issue_example_and_positions():
    band = coverage_band(24, 24, 0.5)
    assert (band.lo, band.hi, round(band.mean, 2)) == (7 / 24, 18 / 24, 0.52)
    assert band.position(3 / 24) == "below" and band.position(7 / 24) == "inside"
    assert band.position(18 / 24) == "inside" and band.position(19 / 24) == "above"
    assert band.tail(3 / 24) == pytest.approx(betabinom(24, 13, 12).cdf(3)) and band.tail(3 / 24) < 0.003
    assert band.tail(20 / 24) == pytest.approx(betabinom(24, 13, 12).sf(19))


def test_coverage_band_refuses_bad_input():
    with pytest.raises(ValueError, match="too few for alpha"):
        coverage_band(10, 10, 0.05)
    with pytest.raises(ValueError, match="integers >= 1"):
        coverage_band(24, 0, 0.5)
    with pytest.raises(ValueError, match="must lie in"):
        coverage_band(24, 24, 1.5)


def test_calibrate_held_out_coverage_stays_in_its_band_on_fresh_exchangeable_data():
    """calibrate's own coverage_risk_set over fresh exchangeable data sets follows the band of its n_cov, n_risk."""
    cov, rec = [], None
    for seed in range(80):
        p, r, m = make_groups(40, k=4, noise=0.3, seed=1000 + seed)
        rec = calibrate(p, r, m,
                        CalibrationSettings(alpha=0.3, beta=0.5, delta=0.1, tau_grid=(0.0, 0.5),
                                            on_infeasible="reject_all"))
        cov.append(rec.coverage_risk_set)
    band = coverage_band(rec.n_cov, rec.n_risk, rec.settings.alpha)
    cov = np.array(cov)
    below = np.mean([band.position(c) == "below" for c in cov])
    above = np.mean([band.position(c) == "above" for c in cov])
    assert below <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(cov)) and above <= 0.05 + 3 * math.sqrt(0.0475 / len(cov))
    assert cov.mean() == pytest.approx(band.mean, abs=3 * cov.std() / math.sqrt(len(cov)))


def test_risk_share_floor_is_the_binomial_chance_at_beta():
    assert risk_share_floor([10, 0, 20], 0.2, 0.1) == pytest.approx(
        0.9 * (binom.cdf(2, 10, 0.2) + binom.cdf(4, 20, 0.2)) / 2)
    assert risk_share_floor([0, 0], 0.2, 0.1) is None
    # at true risk beta, the share of realised rates <= beta matches the floor's binomial chance
    rng = np.random.default_rng(0)
    rates = rng.binomial(12, 0.3, size=50_000) / 12
    assert np.mean(rates <= 0.3) == pytest.approx(risk_share_floor([12], 0.3, 0.5) / 0.5, abs=0.01)


def test_resplit_repeats_the_records_split_and_refuses_other_scores():
    p, r, m = make_groups(48, k=4, noise=0.3, seed=3)
    rec = calibrate(p, r, m, CalibrationSettings(alpha=0.5, beta=0.65, delta=0.05), split_seed=0)
    rs = resplit(p, r, m, rec, seeds=100)
    assert rs.coverage[0] == rec.coverage_risk_set and rs.coverage.shape == (100,) and len(set(rs.coverage)) > 2
    # each group's score depends on that group alone: re-splits of one continuous data set follow the band too
    band = coverage_band(rec.n_cov, rec.n_risk, rec.settings.alpha)
    assert np.mean([band.position(c) == "below" for c in rs.coverage]) <= 0.05 + 3 * math.sqrt(0.0475 / 100)
    assert rs.coverage_mean == pytest.approx(band.mean, abs=3 * rs.coverage.std() / 10)
    assert rs.n_held_out == 24 and ((rs.n_accepted > 0) == ~np.isnan(rs.risk)).all()
    assert np.nanmax(rs.risk) <= 1 and rs.share_risk_at_most(0.65) is not None
    with pytest.raises(ValueError, match="not the ones this record was calibrated on"):
        resplit(p[:40], r[:40], m[:40], rec, seeds=2)
    with pytest.raises(ValueError, match="seeds"):
        resplit(p, r, m, rec, seeds=0)


def test_guarantee_lines_flag_a_split_outside_its_band():
    p, r, m = make_groups(48, k=4, noise=0.3, seed=3)
    rec = calibrate(p, r, m, CalibrationSettings(alpha=0.5, beta=0.65, delta=0.05), split_seed=0)
    rs = resplit(p, r, m, rec, seeds=20)
    inside = dataclasses.replace(rec, coverage_risk_set=12 / 24)
    text = "\n".join(guarantee_lines(inside, rs))
    assert "expected under exchangeability: mean 0.52, single splits 0.29-0.75" in text and "WARNING" not in text
    assert "over 20 re-splits of the stored paired scores: held-out coverage mean" in text
    assert "risk: realised risk <= beta=0.65 in" in text
    low = "\n".join(guarantee_lines(dataclasses.replace(rec, coverage_risk_set=3 / 24), rs))
    assert "held-out coverage 0.125 on 24 held-out groups" in low and "below the band" in low
    assert "WARNING: held-out coverage 0.125 is below its 5-95 % band [0.29, 0.75]: 0.25 % of exchangeable" in low
    high = "\n".join(guarantee_lines(dataclasses.replace(rec, coverage_risk_set=1.0)))
    assert "WARNING: held-out coverage 1.000 is above" in high and "re-splits" not in high


def test_guarantee_lines_flag_a_resplit_mean_and_a_risk_share_outside_their_bands():
    p, r, m = make_groups(48, k=4, noise=0.3, seed=3)
    rec = calibrate(p, r, m, CalibrationSettings(alpha=0.5, beta=0.65, delta=0.05), split_seed=0)
    rs = resplit(p, r, m, rec, seeds=4)
    bad = dataclasses.replace(rs, coverage=np.full(4, 0.1), risk=np.full(4, 0.9), n_accepted=np.full(4, 20))
    text = "\n".join(guarantee_lines(rec, bad))
    assert "WARNING: the mean held-out coverage over re-splits 0.100 is outside" in text
    assert "WARNING: realised risk <= beta in only 0.00 of re-splits" in text
