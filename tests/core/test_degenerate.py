"""Degeneracy (docs/algorithm.md#1-grpo-map) is decided the same way in calibration and training, whatever the dtype.

Scores that are equal up to float rounding -- fractional rubric points summed in a different order, e.g.
0.1 + 0.2 (= 0.30000000000000004) vs 0.3 -- must be degenerate on float64 calibration scores exactly as on the
float32 token rewards of training, so they neither enter the conformal radius nor change status between phases.
"""

import dataclasses
import json

import pytest
import torch

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings, SCHEMA_VERSION, setgrpo_coefficients
from setgrpo_verl.core.grpo import degenerate_groups, DEGENERATE_RTOL
from setgrpo_verl.core.jrsc import nonconformity_scores

# two rubric scores of equally good responses: (0.1 + 0.2) / 0.6 and 0.3 / 0.6, computed the way rubric_score does
A = (0.1 + 0.2) / (0.1 + 0.2 + 0.3)
B = 0.3 / (0.1 + 0.2 + 0.3)
SETTINGS = CalibrationSettings(alpha=0.2, beta=0.9, delta=0.2, tau_grid=[0.0], on_infeasible="reject_all")


def _ordinary(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(n, 4, generator=gen, dtype=torch.float64)
    return p, (p + 0.3 * torch.randn(n, 4, generator=gen, dtype=torch.float64)).clamp(0, 1)


def _eye(g):
    return torch.eye(4, dtype=torch.float64).expand(g, 4, 4).clone()


def test_rounding_equal_scores_are_degenerate_in_every_dtype():
    assert A != B and abs(A - B) < 1e-15  # the float64 scores differ, by rounding only
    groups = torch.tensor([[A, B, B, B],                      # equal up to rounding
                           [0.0, 0.0, 0.0, 0.0],              # exactly constant
                           [A, B, B, B - 1e-3],               # a real difference of 1e-3
                           [1e-9, 2e-9, 1e-9, 1e-9],          # tiny rewards, but a 2x difference: not degenerate
                           [1e3, 1e3 + 1e-7, 1e3, 1e3],       # 1e-10 relative: rounding at this reward scale
                           [0.5, 0.5 + 2**-24, 0.5, 0.5]],    # one float32 ulp apart (a rounding straddle)
                          dtype=torch.float64)
    expected = [True, True, False, False, True, True]
    for dtype in (torch.float64, torch.float32):
        assert degenerate_groups(groups.to(dtype)).tolist() == expected
    # the decision is relative to the group's reward scale: rescaling the rewards does not change it
    for scale in (1e-6, 1e4):
        assert degenerate_groups(groups * scale).tolist() == expected
    # rtol=0 keeps only float32-equal groups: the one-ulp group then counts as a real difference
    assert degenerate_groups(groups, rtol=0.0).tolist() == [True, True, False, False, True, False]
    with pytest.raises(ValueError, match="rtol"):
        degenerate_groups(groups, rtol=-1e-6)
    with pytest.raises(ValueError, match="float32 range"):
        degenerate_groups(torch.tensor([[0.0, 1e39]], dtype=torch.float64))


def test_rounding_groups_do_not_shrink_the_radius_or_change_status():
    p, r = _ordinary(60, seed=1)
    near = torch.tensor([[A, B, B, B]], dtype=torch.float64)
    ref_near = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # the second scoring disagrees strongly
    base = calibrate(p, r, _eye(60), SETTINGS)
    mixed_p, mixed_r = torch.cat([p, near.expand(40, 4)]), torch.cat([r, ref_near.expand(40, 4)])
    mixed = calibrate(mixed_p, mixed_r, _eye(100), SETTINGS)
    # the 40 rounding groups are left out: the radius is the one of the 60 ordinary groups, exactly
    assert mixed.n_degenerate == 40 and (mixed.n_cov, mixed.n_risk) == (base.n_cov, base.n_risk)
    assert mixed.q_alpha == base.q_alpha and mixed.degenerate_rtol == DEGENERATE_RTOL
    # had they entered, their nonconformity scores (~1e-6, whatever the reference says) would have shrunk it
    assert float(nonconformity_scores(near, ref_near, rho=0.1).max()) < 1e-3 < base.q_alpha
    # held-out ordinary groups keep their coverage (1 - alpha = 0.8, up to sampling) with this radius
    held_p, held_r = _ordinary(400, seed=2)
    s_held = nonconformity_scores(held_p, held_r, rho=0.1)
    assert float((s_held <= mixed.q_alpha).double().mean()) >= 0.75
    # the same scores as float32 (verl's rm_scores) are calibrated identically
    mixed32 = calibrate(mixed_p.float(), mixed_r.float(), _eye(100), SETTINGS)
    assert mixed32.n_degenerate == 40 and mixed32.q_alpha == pytest.approx(base.q_alpha, rel=1e-5)
    # training with the record: the rounding group is degenerate for float64 and float32 rewards alike
    for dtype in (torch.float64, torch.float32):
        res = setgrpo_coefficients(torch.cat([p[:3], near]).to(dtype), _eye(4), mixed)
        assert res.status[3] == "degenerate" and (res.coefficients[3] == 0).all()
        assert "degenerate" not in res.status[:3]


def test_training_applies_the_recorded_tolerance():
    p, r = _ordinary(60, seed=3)
    rec = calibrate(p, r, _eye(60), SETTINGS, degenerate_rtol=1e-2)
    assert rec.degenerate_rtol == 1e-2
    group = torch.tensor([[0.5, 0.501, 0.5, 0.5], [0.5, 0.6, 0.5, 0.5]], dtype=torch.float64)
    res = setgrpo_coefficients(group, _eye(2), rec)
    assert res.status[0] == "degenerate" and res.status[1] != "degenerate"


def test_record_states_the_tolerance_and_validates_it(tmp_path):
    p, r = _ordinary(60, seed=4)
    rec = calibrate(p, r, _eye(60), SETTINGS)
    path = tmp_path / "record.json"
    rec.to_json(path)
    data = json.loads(path.read_text())
    assert data["degenerate_rtol"] == DEGENERATE_RTOL and data["schema_version"] == SCHEMA_VERSION == 6
    assert CalibrationRecord.from_json(path) == rec
    # a record of the previous schema (no tolerance stated) is refused with the fix
    old = {k: v for k, v in data.items() if k != "degenerate_rtol"} | {"schema_version": 1}
    with pytest.raises(ValueError, match="recalibrate"):
        CalibrationRecord.from_dict(old)
    for bad in (-1e-6, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match="degenerate_rtol"):
            dataclasses.replace(rec, degenerate_rtol=bad)
