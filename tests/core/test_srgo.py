"""SRGO: Clopper-Pearson bounds, threshold selection and the risk guarantee (docs/algorithm.md#4-srgo)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import binom

from setgrpo_verl.core import calibrate, CalibrationSettings, grpo_coefficients, setgrpo_coefficients
from setgrpo_verl.core.srgo import (
    certification_power,
    clopper_pearson_upper,
    required_accepted_groups,
    select_threshold,
)

from .synthetic import make_groups


def test_clopper_pearson_is_exact_binomial_tail():
    n = np.array([10, 50, 200, 1000, 7])
    f = np.array([0, 3, 20, 55, 7])
    ucb = clopper_pearson_upper(f, n, 0.95)
    assert ucb[-1] == 1.0
    # the upper bound p solves P(Bin(n, p) <= f) = 1 - confidence
    assert np.allclose(binom.cdf(f[:-1], n[:-1], ucb[:-1]), 0.05, atol=1e-9)
    assert clopper_pearson_upper([0], [0], 0.9)[0] == 1.0
    assert clopper_pearson_upper([0], [59], 0.95)[0] == pytest.approx(1 - 0.05 ** (1 / 59), rel=1e-9)
    with pytest.raises(ValueError, match="failures <= trials"):
        clopper_pearson_upper([3], [2], 0.9)


def test_selection_maximises_utility_with_ties_to_larger_tau():
    n_acc = [500, 400, 400, 100, 0]
    n_rev = [60, 10, 10, 0, 0]
    util = [0.9, 0.6, 0.6, 0.2, 0.0]
    ucb, idx = select_threshold(n_acc, n_rev, util, beta=0.08, delta=0.05)
    assert ucb[0] > 0.08 and idx == 2  # 0 is too risky, 1 and 2 tie on utility -> the larger tau
    assert np.allclose(ucb, clopper_pearson_upper(n_rev, n_acc, 1 - 0.05 / 5))
    _, none = select_threshold([10, 5], [5, 5], [1.0, 0.5], beta=0.08, delta=0.05)
    assert none is None


def test_selected_threshold_controls_conditional_risk_on_fresh_data():
    """Over repeated calibrations, risk at tau_sel on fresh data <= beta in >= 1 - delta of them.

    A large alpha (small sets) makes ungated updates risky: at tau = 0 the accepted-reversal rate
    on fresh data is well above beta, so a selection that ignored the bound would fail here.
    """
    beta, delta, alpha = 0.06, 0.1, 0.6
    fresh_p, fresh_r, fresh_m = make_groups(6000, k=5, dim=3, noise=0.2, seed=999)
    a_ref = grpo_coefficients(fresh_r)

    def fresh_risk(record):
        res = setgrpo_coefficients(fresh_p, fresh_m, record)
        rev = res.accepted & (torch.einsum("gi,gij,gj->g", res.coefficients, fresh_m, a_ref) < 0)
        return float(rev.sum()) / int(res.accepted.sum())

    grid = [0.0, 0.2, 0.4, 0.6, 0.8]  # a coarse grid keeps the Bonferroni correction (delta / m) mild
    ok, risks, reps = 0, [], 15
    for rep in range(reps):
        p, r, m = make_groups(3000, k=5, dim=3, noise=0.2, seed=rep)
        rec = calibrate(p, r, m, CalibrationSettings(alpha=alpha, beta=beta, delta=delta, tau_grid=grid),
                        split_seed=rep)
        risks.append(fresh_risk(rec))
        ok += risks[-1] <= beta
        if rep == 0:
            naive = calibrate(p, r, m,
                              CalibrationSettings(alpha=alpha, beta=beta, delta=delta, tau_grid=grid,
                                                  ablation="fixed_threshold", fixed_tau=0.0))
            assert fresh_risk(naive) > 1.2 * beta
            assert rec.tau_sel > 0.0 and rec.ucb_sel <= beta
    assert ok / reps >= 1 - delta, risks


def test_covered_groups_never_reverse_when_tau_nonnegative():
    p, r, m = make_groups(3000, k=6, dim=3, noise=0.2, seed=3)
    rec = calibrate(p[:1000], r[:1000], m[:1000],
                    CalibrationSettings(alpha=0.1, beta=0.1, delta=0.1, on_infeasible="reject_all",
                                        ablation="fixed_threshold", fixed_tau=0.0))
    res = setgrpo_coefficients(p[1000:], m[1000:], rec)
    from setgrpo_verl.core.jrsc import CoefficientSets, set_shape

    root, pinv = set_shape(p[1000:], rho=rec.settings.rho)
    sets = CoefficientSets(center=grpo_coefficients(p[1000:]), root=root, pinv=pinv, radius=rec.q_alpha)
    a_ref = grpo_coefficients(r[1000:])
    covered = sets.contains(a_ref)
    rev = res.accepted & (torch.einsum("gi,gij,gj->g", res.coefficients, m[1000:], a_ref) < 0)
    assert covered.float().mean() > 0.8 and res.accepted.any()
    assert not (rev & covered).any()


@pytest.mark.parametrize(("beta", "delta", "m"), [(0.08, 0.05, 20), (0.5, 0.05, 20), (0.2, 0.1, 1), (0.01, 0.3, 5)])
def test_required_accepted_groups_with_no_reversal_is_the_closed_form(beta, delta, m):
    n = required_accepted_groups(beta, delta, m)
    assert n == math.ceil(math.log(delta / m) / math.log(1 - beta))
    conf = 1 - delta / m
    assert clopper_pearson_upper([0], [n], conf)[0] <= beta < clopper_pearson_upper([0], [n - 1], conf)[0]


@pytest.mark.parametrize("procedure", ["bonferroni", "fixed_sequence"])
@pytest.mark.parametrize("rate", [0.01, 0.03, 0.05])
def test_required_accepted_groups_certifies_with_the_stated_power(rate, procedure):
    beta, delta, m = 0.08, 0.05, 20
    level = delta / m if procedure == "bonferroni" else delta
    n = required_accepted_groups(beta, delta, m, rate, procedure=procedure)
    assert required_accepted_groups(beta, delta, m, procedure=procedure) < n
    trials = np.arange(n, 2 * n + 1)
    assert (certification_power(trials, rate, beta=beta, level=level) >= 0.9).all()
    assert certification_power([n - 1], rate, beta=beta, level=level)[0] < 0.9
    # simulation: F ~ Bin(N, rate) at the planned N certifies beta in at least 90 % of draws (the old plan at the
    # expected count F = ceil(rate N) certified in only about half of them)
    rng = np.random.default_rng(0)
    f = rng.binomial(n, rate, size=20_000)
    certified = clopper_pearson_upper(f, np.full_like(f, n), 1 - level) <= beta
    assert 0.9 - 0.01 <= certified.mean() <= 0.97
    lower = required_accepted_groups(beta, delta, m, rate, procedure=procedure, power=0.5)
    assert lower < n


def test_required_accepted_groups_refuses_an_uncertifiable_rate():
    with pytest.raises(ValueError, match="reversal_rate must be in"):
        required_accepted_groups(0.08, 0.05, 20, 0.08)
    with pytest.raises(ValueError, match="need beta, delta"):
        required_accepted_groups(1.0, 0.05, 20)
