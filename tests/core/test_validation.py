"""Bad input gets a clear ValueError."""

import pytest
import torch

from setgrpo_verl.core import calibrate, grpo_coefficients

from .synthetic import make_groups


@pytest.fixture(scope="module")
def data():
    return make_groups(100, k=4, seed=1)


def test_score_errors(data):
    p, r, m = data
    with pytest.raises(ValueError, match=r"shape \[G, K\]"):
        grpo_coefficients(p.flatten())
    with pytest.raises(ValueError, match="K >= 2"):
        grpo_coefficients(p[:, :1])
    bad = p.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf .*group 3, response 1"):
        calibrate(bad, r, m)
    with pytest.raises(ValueError, match="same shape"):
        calibrate(p, r[:50], m)


def test_gram_errors(data):
    p, r, m = data
    with pytest.raises(ValueError, match=r"\[G, K, K\]"):
        calibrate(p, r, m[:, :3, :3])
    asym = m.clone()
    asym[5, 0, 1] += 1.0
    with pytest.raises(ValueError, match=r"gram\[5\] is not symmetric"):
        calibrate(p, r, asym)
    neg = m.clone()
    neg[7] = -torch.eye(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gram\[7\] is not positive semidefinite"):
        calibrate(p, r, neg)
    inf = m.clone()
    inf[2, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN/inf"):
        calibrate(p, r, inf)


@pytest.mark.parametrize("name", ["alpha", "beta", "delta"])
@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5])
def test_levels_outside_unit_interval(data, name, value):
    p, r, m = data
    with pytest.raises(ValueError, match=f"{name} must be a number in the open interval"):
        calibrate(p, r, m, **{name: value})


def test_too_few_groups_and_bad_options(data):
    p, r, m = data
    with pytest.raises(ValueError, match="at least 19 coverage groups"):
        calibrate(p[:30], r[:30], m[:30], alpha=0.05)
    with pytest.raises(ValueError, match="ablation must be"):
        calibrate(p, r, m, ablation="nope")
    with pytest.raises(ValueError, match="fixed_tau"):
        calibrate(p, r, m, ablation="fixed_threshold")
    with pytest.raises(ValueError, match="metadata keys"):
        calibrate(p, r, m, metadata={"temperature": 1})
    with pytest.raises(ValueError, match="tau_grid"):
        calibrate(p, r, m, tau_grid=[0.5, 0.2])
    with pytest.raises(ValueError, match="on_infeasible"):
        calibrate(p, r, m, on_infeasible="ignore")
