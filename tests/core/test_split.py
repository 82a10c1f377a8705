"""The coverage/risk split of calibration (docs/algorithm.md#4-srgo)."""

from __future__ import annotations

import pytest
import torch

from setgrpo_verl.core import calibrate, CalibrationSettings
from setgrpo_verl.core.calibration import coverage_risk_split
from setgrpo_verl.core.grpo import degenerate_groups

from .synthetic import make_groups


@pytest.mark.parametrize("n, risk_fraction, cap, sizes", [(10, 0.5, None, (5, 5)), (9, 0.5, 1000, (5, 4)),
                                                          (100, 0.3, None, (70, 30)), (100, 0.5, 20, (20, 80)),
                                                          (0, 0.5, 10, (0, 0))])
def test_split_is_a_disjoint_cover_of_the_requested_sizes(n, risk_fraction, cap, sizes):
    cov, risk = coverage_risk_split(n, split_seed=3, risk_fraction=risk_fraction, coverage_groups=cap)
    assert (cov.numel(), risk.numel()) == sizes
    assert sorted(torch.cat([cov, risk]).tolist()) == list(range(n))
    again = coverage_risk_split(n, split_seed=3, risk_fraction=risk_fraction, coverage_groups=cap)
    assert torch.equal(cov, again[0]) and torch.equal(risk, again[1])
    if n >= 10:
        assert not torch.equal(cov, coverage_risk_split(n, split_seed=4, risk_fraction=risk_fraction,
                                                 coverage_groups=cap)[0])


def test_calibration_uses_this_split_on_its_non_degenerate_groups():
    point, reference, gram = make_groups(120, k=4, noise=0.2, seed=5, levels=3)
    live = (~degenerate_groups(point)).nonzero().flatten()
    assert 0 < live.numel() < 120  # ties make some groups degenerate
    cov, risk = coverage_risk_split(int(live.numel()), split_seed=7)
    rec = calibrate(point, reference, gram,
                    CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, on_infeasible="reject_all"), split_seed=7)
    assert (rec.n_cov, rec.n_risk, rec.n_degenerate) == (cov.numel(), risk.numel(), 120 - live.numel())
    # the conformal quantile comes from exactly the coverage groups: re-scoring every risk group leaves it, re-scoring
    # the coverage groups moves it
    settings = CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, on_infeasible="reject_all")
    moved_risk, moved_cov = reference.clone(), reference.clone()
    moved_risk[live[risk]] = reference[live[risk]].flip(1)
    moved_cov[live[cov]] = reference[live[cov]].flip(1)
    assert calibrate(point, moved_risk, gram, settings, split_seed=7).q_alpha == rec.q_alpha
    assert calibrate(point, moved_cov, gram, settings, split_seed=7).q_alpha != rec.q_alpha
