"""Bad input gets a clear ValueError."""

import pytest
import torch

from setgrpo_verl.core import CalibrationSettings, calibrate, grpo_coefficients

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
        calibrate(bad, r, m, CalibrationSettings())
    with pytest.raises(ValueError, match="same shape"):
        calibrate(p, r[:50], m, CalibrationSettings())


def test_gram_errors(data):
    p, r, m = data
    with pytest.raises(ValueError, match=r"\[G, K, K\]"):
        calibrate(p, r, m[:, :3, :3], CalibrationSettings())
    asym = m.clone()
    asym[5, 0, 1] += 1.0
    with pytest.raises(ValueError, match=r"gram\[5\] is not symmetric"):
        calibrate(p, r, asym, CalibrationSettings())
    neg = m.clone()
    neg[7] = -torch.eye(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gram\[7\] is not positive semidefinite"):
        calibrate(p, r, neg, CalibrationSettings())
    inf = m.clone()
    inf[2, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN/inf"):
        calibrate(p, r, inf, CalibrationSettings())


@pytest.mark.parametrize("name", ["alpha", "beta", "delta"])
@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5])
def test_levels_outside_unit_interval(data, name, value):
    p, r, m = data
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a number in the open interval \(0, 1\)"):
        CalibrationSettings(**{name: value})


def test_too_few_groups_and_bad_options(data):
    p, r, m = data
    with pytest.raises(ValueError, match="at least 19 coverage groups"):
        calibrate(p[:30], r[:30], m[:30], CalibrationSettings(alpha=0.05))
    with pytest.raises(ValueError, match="ablation='nope': choose None"):
        calibrate(p, r, m, CalibrationSettings(ablation="nope"))
    with pytest.raises(ValueError, match="fixed_tau"):
        calibrate(p, r, m, CalibrationSettings(ablation="fixed_threshold"))
    with pytest.raises(ValueError, match="metadata keys"):
        calibrate(p, r, m, CalibrationSettings(), metadata={"temperature": 1})
    with pytest.raises(ValueError, match="tau_grid"):
        calibrate(p, r, m, CalibrationSettings(tau_grid=[0.5, 0.2]))
    with pytest.raises(ValueError, match="on_infeasible"):
        calibrate(p, r, m, CalibrationSettings(on_infeasible="ignore"))


@pytest.mark.parametrize("grid", [[0.5, 0.2], [0.0, 0.0, 0.3], [0.0, 1.0], [-1.0, 0.2], [], [0.1, float("nan")]])
def test_tau_grid_ordered_and_strictly_inside(data, grid):
    """Unordered grids and thresholds reaching +-1 are refused by the settings object, with calibrate's message."""
    p, r, m = data
    with pytest.raises(ValueError, match="tau_grid=") as from_settings:
        CalibrationSettings(tau_grid=grid)
    with pytest.raises(ValueError, match="tau_grid=") as from_calibrate:
        calibrate(p, r, m, CalibrationSettings(tau_grid=grid))
    assert str(from_settings.value) == str(from_calibrate.value)


def test_rho_zero_needs_dr_grpo_or_spherical_set(data):
    """rho = 0 leaves the GRPO Jacobian's set shape singular: refused up front; Dr.GRPO and the spherical set accept it."""
    p, r, m = data
    with pytest.raises(ValueError, match=r"rho=0.0 must be > 0") as exc:
        CalibrationSettings(rho=0.0)
    with pytest.raises(ValueError, match=r"rho=0.0 must be > 0") as again:
        calibrate(p, r, m, CalibrationSettings(rho=0.0))
    assert str(exc.value) == str(again.value)
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rho="):
            CalibrationSettings(rho=bad)
    assert CalibrationSettings(rho=0.0, norm_by_std=False).rho == 0.0
    assert CalibrationSettings(rho=0.0, ablation="spherical_set").rho == 0.0
    record = calibrate(p, r, m,
                       CalibrationSettings(rho=0.0, norm_by_std=False, alpha=0.2, beta=0.5, delta=0.2,
                                           on_infeasible="reject_all"))
    assert record.settings.rho == 0.0 and record.settings.norm_by_std is False


def test_settings_normalise_and_insert_fixed_tau():
    s = CalibrationSettings(tau_grid=[0, 0.5], ablation="fixed_threshold", fixed_tau=0.25, grid_size=7)
    assert s.tau_grid == (0.0, 0.25, 0.5) and s.fixed_tau == 0.25
    assert s.replace(grid_size=3).grid_size == 3
    with pytest.raises(ValueError, match="grid_size=0 must be an integer >= 1"):
        s.replace(grid_size=0)
    with pytest.raises(ValueError, match="fixed_tau=1.0 must be a number strictly inside"):
        CalibrationSettings(ablation="fixed_threshold", fixed_tau=1.0)
    assert CalibrationSettings().to_dict()["tau_grid"][-1] == 0.95
