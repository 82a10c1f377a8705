"""calibrate / setgrpo_coefficients / CalibrationRecord / OnlineRiskMonitor end to end (docs/algorithm.md)."""

import json
import math
import warnings

import pytest
import torch

from setgrpo_verl.core import (
    ABLATIONS,
    calibrate,
    CalibrationRecord,
    CalibrationSettings,
    grpo_coefficients,
    OnlineRiskMonitor,
    setgrpo_coefficients,
)
from setgrpo_verl.core.jrsc import nonconformity_scores
from setgrpo_verl.core.compatibility import check_compatible
from setgrpo_verl.core.record_text import selection_text, table4_row

from .synthetic import make_groups

GRADER = {"name": "local_hf", "model": "SmolLM2-135M-Instruct", "temperature": 1.0, "template_hash": "abc123"}


@pytest.fixture(scope="module")
def data():
    return make_groups(1200, k=6, dim=4, noise=0.12, seed=21, levels=20)


@pytest.fixture(scope="module")
def record(data):
    p, r, m = data
    return calibrate(p[:800], r[:800], m[:800], CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05),
                     metadata={"grader": GRADER, "loss_agg_mode": "token-mean"})


def test_record_is_consistent_table4(record, data):
    p, r, _ = data
    n_nondeg = int((p[:800].amax(-1) > p[:800].amin(-1)).sum())
    assert record.n_cov + record.n_risk == n_nondeg and record.n_degenerate == 800 - n_nondeg
    assert record.N == record.n_accepted[record.sel_index] and 0 <= record.F <= record.N
    assert record.ecr == pytest.approx(record.F / record.N)
    assert record.ucb_sel <= record.settings.beta and record.tau_sel in record.settings.tau_grid
    assert 0 < record.U <= 1 and record.q_alpha > 0
    row = table4_row(record)
    assert row["N"] == record.N and row["Qα"] == record.q_alpha
    assert record.coverage_risk_set >= 0.8


def test_json_round_trip_and_tamper_detection(record, tmp_path):
    path = tmp_path / "record.json"
    record.to_json(path)
    again = CalibrationRecord.from_json(path)
    assert again == record
    data = json.loads(path.read_text())
    data["q_alpha"] *= 0.5
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="content hash"):
        CalibrationRecord.from_json(path)
    data = json.loads((record.to_json(path), path.read_text())[1])
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version"):
        CalibrationRecord.from_json(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CalibrationRecord.from_json(path)
    with pytest.raises(ValueError, match="does not exist"):
        CalibrationRecord.from_json(tmp_path / "missing.json")


def test_inconsistent_record_values_refused(record):
    import dataclasses

    with pytest.raises(ValueError, match="Clopper-Pearson"):
        dataclasses.replace(record, n_reversals=record.n_accepted)
    grid = record.settings.tau_grid
    with pytest.raises(ValueError, match="not the SRGO selection"):
        dataclasses.replace(record, tau_sel=grid[-1] if record.sel_index != len(grid) - 1 else grid[0])


def test_mismatched_run_refused(record, data):
    p, _, m = data
    with pytest.raises(ValueError, match="mismatch in K"):
        setgrpo_coefficients(p[:, :4], m[:, :4, :4], record)
    with pytest.raises(ValueError, match="mismatch in norm_by_std"):
        check_compatible(record, norm_by_std=False)
    with pytest.raises(ValueError, match="grader.temperature"):
        check_compatible(record, grader={**GRADER, "temperature": 0.7})
    check_compatible(record, K=6, norm_by_std=True, grader=dict(GRADER), loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="differs from the record"):
        setgrpo_coefficients(p[800:], m[800:], record, ablation="identity_geometry")


def test_zero_radius_is_exactly_grpo(data):
    p, _, m = data
    rec = calibrate(p[:800], p[:800].clone(), m[:800], CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05))
    assert rec.q_alpha == 0.0
    res = setgrpo_coefficients(p[800:], m[800:], rec)
    live = torch.tensor([s != "degenerate" for s in res.status])
    assert live.sum() > 300 and res.accepted[live].all()
    assert torch.equal(res.coefficients[live], grpo_coefficients(p[800:].double())[live])
    assert (res.recovery_ratio[live] == 1).all()
    assert (res.coefficients[~live] == 0).all()


def test_degenerate_groups_write_zeros(record):
    p = torch.tensor([[0.5] * 6, [0.1, 0.9, 0.3, 0.3, 0.7, 0.2]], dtype=torch.float64)
    m = torch.eye(6, dtype=torch.float64).expand(2, 6, 6).clone()
    res = setgrpo_coefficients(p, m, record)
    assert res.status[0] == "degenerate" and (res.coefficients[0] == 0).all()
    assert math.isnan(float(res.m_full[0])) and res.status[1] in ("accepted", "infeasible", "null_anchor")
    metrics = res.metrics()
    assert metrics["setgrpo/degenerate_ratio"] == 0.5
    assert set(metrics) >= {"setgrpo/accepted_ratio", "setgrpo/recovery_ratio/mean", "setgrpo/m_full/mean_all",
                            "setgrpo/anchor_kkt_residual/max", "setgrpo/timing_s/recovery"}


def test_accepted_groups_satisfy_the_screening_conditions(record, data):
    p, _, m = data
    res = setgrpo_coefficients(p[800:], m[800:], record)
    acc = res.accepted
    assert acc.any() and (~acc).any()
    assert (res.m_full[acc] >= record.tau_sel - 1e-12).all() and (res.m_reward[acc] > 0).all()
    assert ((res.recovery_ratio[acc] >= 0) & (res.recovery_ratio[acc] <= 1)).all()
    rejected = torch.tensor([s == "infeasible" for s in res.status])
    # a rejected group failed at the anchor too: no feasible eta at all
    bad = (res.m_full[rejected] < record.tau_sel) | (res.m_full[rejected] <= 0) | (res.m_reward[rejected] <= 0)
    assert bad.all()
    assert (res.coefficients[~acc] == 0).all()


def test_positive_affine_invariance(data):
    """Table 7: r -> a r + b 1 (a > 0) on both scorings leaves coefficients and decisions unchanged."""
    p, r, m = data
    base = calibrate(p[:800], r[:800], m[:800], CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05))
    res0 = setgrpo_coefficients(p[800:], m[800:], base)
    for a, b in ((0.5, -1.0), (2.0, 1.0), (3.0, -2.0)):
        rec = calibrate(a * p[:800] + b, a * r[:800] + b, m[:800],
                        CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05))
        assert rec.q_alpha == pytest.approx(a * base.q_alpha, rel=1e-4)
        assert rec.tau_sel == base.tau_sel
        res = setgrpo_coefficients(a * p[800:] + b, m[800:], rec)
        assert res.status == res0.status
        cos = torch.nn.functional.cosine_similarity(res.coefficients.flatten(), res0.coefficients.flatten(), dim=0)
        assert cos > 0.9999
        assert (res.recovery_ratio - res0.recovery_ratio).abs().max() < 1e-3


def test_infeasible_risk_is_an_error_or_reject_all(data):
    p, r, m = data
    with pytest.raises(ValueError, match="no risk-feasible threshold.*smallest Clopper-Pearson bound"):
        calibrate(p[:60], r[:60], m[:60], CalibrationSettings(alpha=0.1, beta=0.01, delta=0.05))
    rec = calibrate(p[:60], r[:60], m[:60],
                    CalibrationSettings(alpha=0.1, beta=0.01, delta=0.05, on_infeasible="reject_all"))
    assert rec.tau_sel is None and rec.N == 0
    res = setgrpo_coefficients(p[800:], m[800:], rec)
    assert not res.accepted.any() and (res.coefficients == 0).all()
    # the record says so, with the smallest bound the error would have named
    j = min(range(len(rec.ucb)), key=rec.ucb.__getitem__)
    text = selection_text(rec)
    assert text.startswith("no risk-feasible threshold") and "accepts no group" in text
    tau = rec.settings.tau_grid[j]
    assert f"{rec.ucb[j]:.4f} at tau={tau:.2f} (N={rec.n_accepted[j]}, F={rec.n_reversals[j]})" in text
    feasible = calibrate(p[:800], r[:800], m[:800], CalibrationSettings(alpha=0.1, beta=0.5, delta=0.05))
    assert selection_text(feasible) == (f"tau_sel={feasible.tau_sel:.2f}, UCB {feasible.ucb_sel:.4f} <= beta=0.5")


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_ablations(ablation, data, record):
    p, r, m = data
    kwargs = {"fixed_tau": 0.3} if ablation == "fixed_threshold" else {}
    rec = calibrate(p[:800], r[:800], m[:800], CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05, ablation=ablation,
                                                                   on_infeasible="reject_all", **kwargs))
    assert rec.settings.ablation == ablation
    res = setgrpo_coefficients(p[800:], m[800:], rec, seed=3)
    full = setgrpo_coefficients(p[800:], m[800:], record)
    acc = res.accepted
    if ablation == "spherical_set":
        scores = nonconformity_scores(p[:800][p[:800].amax(-1) > p[:800].amin(-1)], r[:800][p[:800].amax(-1) > p[:800].amin(-1)], rho=0.1, shape="spherical")
        assert rec.q_alpha <= float(scores.max()) and not torch.equal(res.coefficients, full.coefficients)
    elif ablation == "identity_geometry":
        assert not torch.equal(res.accepted, full.accepted) or not torch.allclose(res.coefficients, full.coefficients)
    elif ablation == "safe_anchor_only":
        assert (res.recovery_ratio == 0).all() and acc.any()
        assert torch.equal(res.coefficients[acc], res.anchor[acc])
    elif ablation == "fixed_threshold":
        assert rec.tau_sel == 0.3 and (res.m_full[acc] >= 0.3).all()
    elif ablation == "random_discard":
        ref = setgrpo_coefficients(p[800:], m[800:], calibrate(p[:800], r[:800], m[:800],
                                                               CalibrationSettings(alpha=0.1, beta=0.08, delta=0.05)))
        assert int(acc.sum()) == int(ref.accepted.sum())
        assert not torch.equal(acc, ref.accepted)
        assert torch.equal(res.coefficients[acc], res.grpo[acc]) and (res.coefficients[~acc] == 0).all()
        assert "discarded" in res.status


def test_online_monitor_coverage_and_drift_warning(record, data):
    p, r, m = data
    mon = OnlineRiskMonitor(record)
    res = setgrpo_coefficients(p[800:1000], m[800:1000], record)
    out = mon.update(res, r[800:1000], m[800:1000])
    live = torch.tensor([s != "degenerate" for s in res.status])
    direct = nonconformity_scores(p[800:1000][live], r[800:1000][live], rho=record.settings.rho) <= record.q_alpha
    assert out["setgrpo/online_coverage"] == pytest.approx(float(direct.double().mean()))
    assert out["setgrpo/online_coverage"] > 0.8
    assert out["setgrpo/online_risk_certified"] == 1.0
    # drift: references that flip every ranking make accepted updates reverse
    with pytest.warns(RuntimeWarning, match="anytime-valid. that the reversal risk is above beta"):
        for _ in range(5):
            out = mon.update(res, -r[800:1000], m[800:1000])
    assert out["setgrpo/online_reversal_ucb"] > record.settings.beta and out["setgrpo/online_risk_certified"] == 0.0
    assert out["setgrpo/online_risk_drift"] == 1.0
