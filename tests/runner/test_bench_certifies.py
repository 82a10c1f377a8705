"""benchmarks/bench_quickstart_certifies.py: the posterior-predictive probability that a fresh run certifies, checked
on synthetic runs whose true fresh-run rate is known exactly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binom

from setgrpo_verl.core import calibrate, CalibrationSettings
from setgrpo_verl.core.srgo import threshold_tests

from ..core.synthetic import make_groups

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quickstart_certifies.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_quickstart_certifies", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, groups: int = 120):
    point, reference, gram = make_groups(groups, k=4, noise=0.2, seed=5, levels=3)
    rec = calibrate(point, reference, gram,
                    CalibrationSettings(alpha=0.3, beta=0.6, delta=0.2, on_infeasible="reject_all"), split_seed=2)
    cal = tmp_path / "run" / "calibration"
    cal.mkdir(parents=True)
    rec.to_json(cal / "record.json")
    np.savez(cal / "paired_scores.npz", point=point.numpy(), reference=reference.numpy(), gram=gram.numpy())
    return {"point": point, "reference": reference, "gram": gram}, rec


@pytest.mark.parametrize("procedure, start", [("bonferroni", None), ("fixed_sequence", 2)])
def test_certifies_is_the_srgo_selection_for_many_runs_at_once(procedure, start):
    rng = np.random.default_rng(0)
    n_acc = rng.integers(0, 40, size=(300, 4))
    n_rev = rng.binomial(n_acc, 0.3)
    got = _bench().certifies(n_acc, n_rev, beta=0.5, delta=0.2, procedure=procedure, start_index=start)
    want = [threshold_tests(a, f, np.zeros(4), beta=0.5, delta=0.2, procedure=procedure,
                            start_index=start).index is not None for a, f in zip(n_acc, n_rev)]
    assert got.tolist() == want and 0 < sum(want) < 300


def test_group_outcomes_are_the_record_counts_group_by_group(tmp_path):
    bench = _bench()
    paired, rec = _run(tmp_path)
    coverage, risk = bench.run_split(paired["point"], rec)
    assert (coverage.size, risk.size) == (rec.n_cov, rec.n_risk) and not set(coverage) & set(risk)
    accepted, reversed_ = bench.group_outcomes(paired, rec, risk)
    assert accepted.shape == reversed_.shape == (rec.n_risk, len(rec.settings.tau_grid))
    assert tuple(accepted.sum(0)) == rec.n_accepted and tuple(reversed_.sum(0)) == rec.n_reversals
    assert not (reversed_ & ~accepted).any()
    assert sum(rec.n_accepted) > 0
    with pytest.raises(SystemExit, match="differ from the record's"):  # scores that are not the record's
        bench.group_outcomes({**paired, "reference": -paired["reference"]}, rec, risk)


def _true_rate(n: int, accept: float, reverse: float, test) -> float:
    """P(a fresh run of n risk groups certifies) when each group is accepted with probability ``accept`` and an
    accepted one reverses with probability ``reverse``: exact, summed over N ~ Bin(n, accept), F ~ Bin(N, reverse)."""
    total = 0.0
    for n_acc in range(n + 1):
        f = np.arange(n_acc + 1)
        passes = test(np.full((n_acc + 1, 1), n_acc), f[:, None])
        total += binom.pmf(n_acc, n, accept) * float((binom.pmf(f, n_acc, reverse) * passes).sum())
    return total


def test_the_interval_covers_the_true_fresh_run_rate_of_synthetic_runs():
    """Runs of 48 risk groups from a population whose fresh runs certify in 0.77 of runs (one threshold, level 0.05,
    beta 0.65, as the quickstart's tau 0): one run's estimate varies, but its 90 % interval holds the true rate in
    most runs."""
    bench = _bench()
    n, accept, reverse = 48, 0.8, 0.45

    def test(n_acc, n_rev):
        return bench.certifies(n_acc, n_rev, beta=0.65, delta=0.05, procedure="bonferroni")

    truth = _true_rate(n, accept, reverse, test)
    assert truth == pytest.approx(0.766, abs=0.001)
    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(60):
        kind = rng.choice(3, size=n, p=[1 - accept, accept * (1 - reverse), accept * reverse])
        probs = bench.fresh_run_certify((kind > 0)[:, None], (kind == 2)[:, None], n, test, draws=100, runs=100,
                                        rng=rng)
        lo, hi = np.quantile(probs, [0.05, 0.95])
        covered += lo <= truth <= hi
    # a credible interval, not a confidence interval: it held the truth in 48 of these 60 runs (nominal 54)
    assert covered >= 45
    # a run's own counts, taken as the truth (what resampling the run's groups estimates), miss by far more than
    # the interval allows: the plug-in rate of a run with F/N = 0.33 and of one with 0.55
    assert _true_rate(n, accept, 0.33, test) > 0.98 and _true_rate(n, accept, 0.55, test) < 0.35


def test_the_benchmark_prints_its_estimate_last(tmp_path):
    _run(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(tmp_path / "run"), "--draws", "20",
                          "--runs", "20"], check=True, capture_output=True, text=True).stdout.strip().splitlines()
    assert out[-1].startswith("fresh runs certify with probability ") and "(90% interval " in out[-1]


def test_paired_scores_of_another_calibration_are_refused(tmp_path):
    bench = _bench()
    paired, rec = _run(tmp_path)
    with pytest.raises(SystemExit, match="pass the run's own calibration directory"):
        bench.run_split(torch.cat([paired["point"], paired["point"]]), rec)
