"""benchmarks/bench_quickstart_certifies.py: a bootstrap stratified by the run's coverage/risk split."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from setgrpo_verl.core import CalibrationSettings, calibrate, coverage_risk_split

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
    return point, rec


def test_no_resampled_group_is_in_both_parts(tmp_path):
    bench = _bench()
    point, rec = _run(tmp_path)
    paired = dict(zip(("point", "reference", "gram"), make_groups(120, k=4, noise=0.2, seed=5, levels=3)))
    coverage, risk = bench.run_split(point, rec)
    assert (coverage.size, risk.size) == (rec.n_cov, rec.n_risk) and not set(coverage) & set(risk)
    share = rec.n_risk / (rec.n_cov + rec.n_risk)
    rng = np.random.default_rng(0)
    for n in (rec.n_cov + rec.n_risk, 2 * (rec.n_cov + rec.n_risk) + 1):
        rows = bench.stratified_rows(coverage, risk, n, rec.split_seed, share, rng)
        cov_pos, risk_pos = coverage_risk_split(n, split_seed=rec.split_seed, risk_fraction=share,
                                                coverage_groups=None)
        assert set(rows[cov_pos.numpy()]) <= set(coverage) and set(rows[risk_pos.numpy()]) <= set(risk)
        # re-calibration drops none of them and splits them where they were put: its conformal quantile is that of
        # the drawn coverage groups alone, so re-scoring the drawn risk groups leaves it unchanged
        settings = rec.settings.replace(risk_fraction=share, coverage_groups=None, on_infeasible="reject_all")
        again = calibrate(paired["point"][rows], paired["reference"][rows], paired["gram"][rows], settings,
                          split_seed=rec.split_seed)
        assert (again.n_cov, again.n_risk, again.n_degenerate) == (cov_pos.numel(), risk_pos.numel(), 0)
        moved = paired["reference"][rows].clone()
        moved[risk_pos] = moved[risk_pos].flip(1)
        assert calibrate(paired["point"][rows], moved, paired["gram"][rows], settings,
                         split_seed=rec.split_seed).q_alpha == again.q_alpha
        assert bench.certified(paired, rec, rows, share) == (again.tau_sel is not None)


def test_the_benchmark_prints_its_count_last(tmp_path):
    _run(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(tmp_path / "run"), "--resamples", "5"],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()
    assert out[-1].startswith("quickstart certifies in ") and out[-1].endswith(" of 5 resamples")


def test_paired_scores_of_another_calibration_are_refused(tmp_path):
    bench = _bench()
    point, rec = _run(tmp_path)
    with pytest.raises(SystemExit, match="pass the run's own calibration directory"):
        bench.run_split(torch.cat([point, point]), rec)
