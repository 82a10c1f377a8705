"""The main job's check against the truth: every group held out once, reversals of GRPO and of SetGRPO's accepted
updates counted against the noise-free score, with binomial bands."""

from __future__ import annotations

import pytest
import torch

from setgrpo_verl.core import CalibrationSettings
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.report.validation import truth_lines
from setgrpo_verl.runner.truth import binomial_band, check_bands, fold_groups, truth_check

LEVELS = CalibrationSettings(alpha=0.2, beta=0.3, delta=0.05, tau_grid=(0.0, 0.2, 0.4, 0.6),
                             on_infeasible="reject_all")


def _paired(g=96, k=4, noise=0.1, seed=0, flip_point=False):
    gen = torch.Generator().manual_seed(seed)
    truth = torch.rand(g, k, generator=gen, dtype=torch.float64)
    point = truth + noise * torch.randn(g, k, generator=gen, dtype=torch.float64)
    reference = truth + noise * torch.randn(g, k, generator=gen, dtype=torch.float64)
    s = torch.randn(g, k, 12, generator=gen, dtype=torch.float64)
    return {"point": -point if flip_point else point, "reference": reference, "truth": truth,
            "gram": s @ s.transpose(-1, -2)}


def test_binomial_band_is_the_two_sided_clopper_pearson_interval():
    lo, hi = binomial_band(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 10), rel=1e-9)
    lo, hi = binomial_band(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.025 ** (1 / 10), rel=1e-9)
    assert binomial_band(0, 0) is None


def test_folds_hold_every_group_out_exactly_once_with_the_degenerate_ones_spread():
    degenerate = torch.zeros(50, dtype=torch.bool)
    degenerate[[3, 7, 11, 20]] = True
    parts = fold_groups(degenerate, 4, seed=1)
    assert sorted(torch.cat(parts).tolist()) == list(range(50))
    assert [int(degenerate[p].sum()) for p in parts] == [1, 1, 1, 1]
    assert sorted(len(p) for p in parts) == [12, 12, 13, 13]
    with pytest.raises(ValueError, match="folds must be >= 2"):
        fold_groups(degenerate, 1, seed=0)


def test_a_noise_free_grader_reverses_nothing_and_every_group_is_counted_once():
    paired = _paired(noise=0.0)
    paired["reference"] = paired["point"].clone()
    check = truth_check(paired, LEVELS)
    assert check["live"] == 96 and check["grpo_judged"] == 96 and check["covered"] == 96
    assert check["grpo_reversals"] == 0 and check["setgrpo_reversals"] == 0 and check["dropped_grpo_reversals"] == 0
    assert check["accepted"] + check["dropped"] == 96 and len(check["tau_sel"]) == 4


def test_a_grader_that_inverts_the_truth_reverses_every_grpo_update():
    paired = _paired(noise=0.0, flip_point=True)
    paired["reference"] = paired["point"].clone()
    check = truth_check(paired, LEVELS)
    assert check["grpo_reversals"] == check["grpo_judged"] == 96
    # the re-scoring agrees with the inverted point, so SetGRPO cannot tell: its accepted updates reverse too
    assert check["setgrpo_reversals"] == check["setgrpo_judged"] == check["accepted"]
    assert check["dropped_grpo_reversals"] == check["dropped"]


def test_truth_lines_state_what_setgrpo_buys_and_costs():
    paired = _paired(noise=0.12, seed=3)
    check = truth_check(paired, LEVELS)
    assert check["live"] == int((~degenerate_groups(paired["point"])).sum())
    bands = check_bands(check)
    text = "\n".join(truth_lines(check, bands))
    assert f"GRPO {100 * check['grpo_reversals'] / check['grpo_judged']:.1f} %" in text
    assert f"of {check['grpo_judged']} groups" in text and "held out once in 4 folds" in text
    assert (f"{check['grpo_reversals'] - check['setgrpo_reversals']} fewer reversed updates "
            f"({check['setgrpo_reversals']} instead of {check['grpo_reversals']})") in text
    assert f"{check['dropped']} groups not trained" in text
    lo, hi = bands["trained"]
    assert f"[{100 * lo:.1f}, {100 * hi:.1f}] of {check['live']} groups" in text


def test_a_run_without_truth_is_refused():
    paired = _paired()
    del paired["truth"]
    with pytest.raises(ValueError, match="no truth"):
        truth_check(paired, LEVELS)
