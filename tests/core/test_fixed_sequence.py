"""SRGO's two procedures (docs/algorithm.md#4-srgo), the sample-size plan with power (#44-sample-size), the
anytime-valid online monitor (#6-diagnostics) and the one reversal event: closed forms and simulations."""

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.stats import binom

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings, OnlineRiskMonitor, setgrpo_coefficients
from setgrpo_verl.core.record import content_sha256, pilot_start, prompt_fingerprint
from setgrpo_verl.core.reversal import reversal_events
from setgrpo_verl.core.sequential import risk_evidence
from setgrpo_verl.core.srgo import (
    certification_power,
    clopper_pearson_upper,
    required_accepted_groups,
    required_risk_groups,
    select_threshold,
    threshold_tests,
)
from setgrpo_verl.core.record_text import threshold_test_lines

from .synthetic import make_groups

BETA, DELTA, M = 0.08, 0.05, 20


def test_closed_forms_72_and_36_accepted_groups_with_no_reversal():
    assert required_accepted_groups(BETA, DELTA, M) == 72
    assert required_accepted_groups(BETA, DELTA, M, procedure="fixed_sequence") == 36
    assert math.ceil(math.log(DELTA) / math.log(1 - BETA)) == 36
    # 36 is the floor of any level-delta test: 35 accepted groups without reversal leave the bound above beta
    assert clopper_pearson_upper([0], [36], 1 - DELTA)[0] <= BETA < clopper_pearson_upper([0], [35], 1 - DELTA)[0]
    assert clopper_pearson_upper([0], [72], 1 - DELTA / M)[0] <= BETA < clopper_pearson_upper([0], [71], 1 - DELTA / M)[0]


def test_fixed_sequence_tests_down_from_the_start_and_stops_at_the_first_failure():
    n_acc = [500, 400, 300, 50, 40, 0]
    n_rev = [60, 10, 5, 0, 0, 0]
    util = [0.9, 0.7, 0.5, 0.2, 0.1, 0.0]
    t = threshold_tests(n_acc, n_rev, util, beta=BETA, delta=DELTA, procedure="fixed_sequence", start_index=4)
    assert t.order == (4, 3, 2, 1, 0) and t.levels == (DELTA,) * 5 and t.stopped_at == 0
    assert t.certified.tolist() == [False, True, True, True, True, False] and t.index == 1
    assert np.allclose(t.ucb, clopper_pearson_upper(n_rev, n_acc, 1 - DELTA))
    assert ((t.p_values[1:5] <= DELTA) == (t.ucb[1:5] <= BETA)).all()
    # Bonferroni on the same counts: 40 and 50 accepted groups are too few at delta / m
    ucb, idx = select_threshold(n_acc, n_rev, util, beta=BETA, delta=DELTA)
    assert idx == 1 and ucb[3] > BETA and ucb[4] > BETA
    # a start whose own test fails certifies nothing, however good the thresholds below it are
    t = threshold_tests(n_acc, n_rev, util, beta=BETA, delta=DELTA, procedure="fixed_sequence", start_index=5)
    assert t.order == (5,) and t.stopped_at == 5 and t.index is None
    with pytest.raises(ValueError, match="needs start_index"):
        threshold_tests(n_acc, n_rev, util, beta=BETA, delta=DELTA, procedure="fixed_sequence")
    with pytest.raises(ValueError, match="for procedure='fixed_sequence' only"):
        threshold_tests(n_acc, n_rev, util, beta=BETA, delta=DELTA, start_index=2)


def _profile():
    """Accepted shares and true reversal rates by threshold, shaped like the paper profile's measured ones
    (docs/validation.md#profiles): tau 0 at 6.2 %, 0.05-0.15 above beta (0.15 just above, the hard case), 0.20 at
    2.1 %, none from 0.25 on, where only 1.5 % of the risk groups are accepted."""
    tau = np.arange(M) / M
    share = np.interp(tau, [0, 0.2, 0.25, 0.3, 0.95], [0.108, 0.026, 0.015, 0.008, 0.001])
    rate = np.interp(tau, [0, 0.05, 0.15, 0.2, 0.25, 0.95], [0.062, 0.10, 0.10, 0.021, 0.0, 0.0])
    rate[3] = 0.085
    return share, rate


def _simulate(n_risk, runs, rng, share, rate):
    n_acc = rng.binomial(n_risk, share, size=(runs, len(share)))
    return n_acc, rng.binomial(n_acc, rate)


def _fixed_sequence_vectorised(n_acc, n_rev, start, delta=DELTA):
    """Grid index selected by the fixed sequence from ``start[r]`` in each run r (-1: none): the utility grows as
    tau falls, so the selection is the last threshold passed before the stop."""
    runs, m = n_acc.shape
    passes = (n_acc > 0) & (clopper_pearson_upper(n_rev, n_acc, 1 - delta) <= BETA)
    idx = np.arange(m)
    tested = idx[None, :] <= start[:, None]
    fail = tested & ~passes
    last_fail = np.where(fail.any(1), np.where(fail, idx[None, :], -1).max(1), -1)
    return np.where(last_fail == start, -1, last_fail + 1)


def _error(sel, rate):
    return float(((sel >= 0) & (rate[np.maximum(sel, 0)] > BETA)).mean())


def _pilot_start(n_acc, n_rev):
    """A pilot's start: its smallest threshold that passes at level delta, else its smallest p-value."""
    ok = (n_acc > 0) & (clopper_pearson_upper(n_rev, n_acc, 1 - DELTA) <= BETA)
    p = np.where(n_acc > 0, binom.cdf(n_rev, n_acc, BETA), 1.0)
    return np.where(ok.any(1), np.argmax(ok, 1), np.argmin(p, 1))


def test_fixed_sequence_type_one_error_is_below_delta_with_a_start_from_disjoint_pilot_data():
    rng = np.random.default_rng(0)
    share, rate = _profile()
    runs = 4000
    n_acc, n_rev = _simulate(3000, runs, rng, share, rate)
    start = _pilot_start(*_simulate(1500, runs, rng, share, rate))  # the pilot: other groups
    sel = _fixed_sequence_vectorised(n_acc, n_rev, start)
    assert _error(sel, rate) <= DELTA
    # the same runs through the library function agree with the vectorised replica
    util = np.linspace(1, 0, M)
    for r in range(40):
        t = threshold_tests(n_acc[r], n_rev[r], util, beta=BETA, delta=DELTA, procedure="fixed_sequence",
                            start_index=int(start[r]))
        assert (-1 if t.index is None else t.index) == sel[r]
    # the worst start, a threshold whose risk is just above beta: the error is its test's level, and no more
    worst = _error(_fixed_sequence_vectorised(n_acc, n_rev, np.full(runs, 3)), rate)
    assert DELTA / 3 < worst <= DELTA, worst
    # every threshold just above beta: a start from a pilot keeps the error <= delta, a start chosen on the
    # calibration groups themselves (their smallest p-value) does not
    null = np.full(M, 0.085)
    n_acc, n_rev = _simulate(3000, runs, rng, share, null)
    assert _error(_fixed_sequence_vectorised(n_acc, n_rev, _pilot_start(*_simulate(1500, runs, rng, share, null))),
                  null) <= DELTA
    own = np.argmin(np.where(n_acc > 0, binom.cdf(n_rev, n_acc, BETA), 1.0), 1)
    assert _error(_fixed_sequence_vectorised(n_acc, n_rev, own), null) > 2 * DELTA


def test_fixed_sequence_certifies_far_more_often_than_bonferroni():
    rng = np.random.default_rng(1)
    share, rate = _profile()
    runs, start = 4000, 5  # tau 0.25, the first threshold without reversals, e.g. from a pilot record
    n_acc, n_rev = _simulate(3000, runs, rng, share, rate)
    fixed = _fixed_sequence_vectorised(n_acc, n_rev, np.full(runs, start))
    bonf_ok = (n_acc > 0) & (clopper_pearson_upper(n_rev, n_acc, 1 - DELTA / M) <= BETA)
    power_fixed, power_bonf = float((fixed >= 0).mean()), float(bonf_ok.any(1).mean())
    assert power_fixed >= 0.9 and power_bonf <= 0.25, (power_fixed, power_bonf)
    assert _error(fixed, rate) <= DELTA and float((bonf_ok & (rate > BETA)).any(1).mean()) <= DELTA
    # the planner's 0.9-power sizes at this threshold's share: the fixed sequence needs about half the groups,
    # and that many certify in 90 % of simulated runs
    n_fixed = required_risk_groups(BETA, DELTA, M, share[start], rate[start], procedure="fixed_sequence")
    n_bonf = required_risk_groups(BETA, DELTA, M, share[start], rate[start])
    assert 0.45 < n_fixed / n_bonf < 0.6, (n_fixed, n_bonf)
    a = rng.binomial(n_fixed, share[start], size=20_000)
    assert (clopper_pearson_upper(np.zeros_like(a), a, 1 - DELTA) <= BETA).mean() == pytest.approx(0.9, abs=0.01)


@pytest.fixture(scope="module")
def groups():
    return make_groups(800, k=5, dim=3, noise=0.15, seed=5)


def test_fixed_sequence_record_round_trips_and_its_check_rederives_the_tests(groups, tmp_path):
    p, r, m = groups
    grid = (0.0, 0.2, 0.4, 0.6)
    rec = calibrate(p, r, m,
                    CalibrationSettings(alpha=0.2, beta=0.2, delta=0.1, tau_grid=grid, srgo_procedure="fixed_sequence",
                                        tau_start=0.4, on_infeasible="reject_all"))
    assert rec.settings.srgo_procedure == "fixed_sequence" and rec.tau_start_source == {"kind": "user"}
    assert rec.test_order[0] == 2 and set(rec.test_levels) == {0.1} and len(rec.p_values) == 4
    path = tmp_path / "record.json"
    rec.to_json(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 6 and data["test_order"] == list(rec.test_order)
    assert CalibrationRecord.from_json(path) == rec
    assert "fixed_sequence from tau_start=0.40 (set by the user)" in "\n".join(threshold_test_lines(rec))
    from setgrpo_verl.report import inspect_record
    shown = inspect_record(path)
    assert "fixed_sequence from tau_start=0.40 (set by the user)" in shown and "vs level 0.1 -> passed" in shown
    # a start the record cannot check is shown with what its certificate assumes of it
    assert ("tau_start=0.40 was set by the user: the certificate assumes it was fixed before the calibration data "
            "were seen") in shown
    for edit, needle in ((dict(stopped_at=3), "stopped_at"), (dict(test_order=(3, 2, 1, 0)), "test_order"),
                         (dict(p_values=(0.5,) * 4), "p_values"),
                         (dict(settings=rec.settings.replace(tau_start=0.2)), "test_order"),
                         (dict(tau_start_source={"kind": "pilot"}), "tau_start_source")):
        with pytest.raises(ValueError, match=needle):
            dataclasses.replace(rec, **edit)
    # a pilot record on other groups gives the start and is named by its content hash
    pilot_settings = CalibrationSettings(alpha=0.2, beta=0.2, delta=0.1, tau_grid=grid, on_infeasible="reject_all")
    others = [prompt_fingerprint(f"pilot-{i}", f"pilot question {i}", []) for i in range(800)]
    pilot = calibrate(*make_groups(800, k=5, dim=3, noise=0.15, seed=6), pilot_settings,
                      metadata={"calibration_prompts": others})
    mine = [prompt_fingerprint(f"cal-{i}", f"calibration question {i}", []) for i in range(3)]
    tau, source = pilot_start(pilot, grid, calibration_prompts=mine)
    assert tau == pilot.tau_sel and source == {"kind": "pilot", "record_sha256": content_sha256(pilot)}
    # the same pilot without its prompts shows nothing about them: refused, its start offered as the user's
    blind = calibrate(*make_groups(800, k=5, dim=3, noise=0.15, seed=6), pilot_settings)
    with pytest.raises(ValueError, match=rf"lists no calibration prompts.*tau_start={blind.tau_sel} without a pilot"):
        pilot_start(blind, grid, calibration_prompts=mine)
    from_pilot = calibrate(p, r, m,
                           CalibrationSettings(alpha=0.2, beta=0.2, delta=0.1, tau_grid=grid,
                                               srgo_procedure="fixed_sequence", tau_start=tau,
                                               on_infeasible="reject_all"),
                           tau_start_source=source)
    assert CalibrationRecord.from_dict(from_pilot.to_dict()).tau_start_source == source
    with pytest.raises(ValueError, match="tau_start=0.3 must be one of the thresholds"):
        calibrate(p, r, m,
                  CalibrationSettings(alpha=0.2, tau_grid=grid, srgo_procedure="fixed_sequence", tau_start=0.3))


def test_a_schema_3_record_reads_as_a_bonferroni_record(groups):
    p, r, m = groups
    rec = calibrate(p, r, m,
                    CalibrationSettings(alpha=0.2, beta=0.2, delta=0.1, tau_grid=(0.0, 0.3),
                                        on_infeasible="reject_all"))
    data = rec.to_dict()
    # schema 3: the flat settings fields of its time, no SRGO procedure fields
    flat = {k: data["settings"][k] for k in ("alpha", "beta", "delta", "rho", "tau_grid", "norm_by_std", "eps",
                                             "grid_size", "ablation", "on_infeasible")}
    old = {k: v for k, v in data.items() if k not in ("settings", "tau_start_source", "test_order", "test_levels",
                                                      "p_values", "stopped_at", "content_sha256")}
    old.update(flat, schema_version=3)
    from setgrpo_verl.core.record import _content_hash
    old["content_sha256"] = _content_hash(old)
    back = CalibrationRecord.from_dict(old)
    assert back.settings.srgo_procedure == "bonferroni" and back.test_order == (0, 1) and back.tau_sel == rec.tau_sel
    assert back.test_levels == (0.05, 0.05) and back.settings == rec.settings


def test_coverage_set_is_capped_and_the_rest_goes_to_risk():
    p, r, m = make_groups(700, k=4, seed=2)
    rec = calibrate(p, r, m,
                    CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, tau_grid=(0.0, 0.3), coverage_groups=100,
                                        on_infeasible="reject_all"))
    assert rec.n_cov == 100 and rec.n_risk == 700 - 100 - rec.n_degenerate
    even = calibrate(p, r, m,
                     CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, tau_grid=(0.0, 0.3),
                                         on_infeasible="reject_all"))
    assert abs(even.n_cov - even.n_risk) <= 1  # below the default cap of 1,000: the 50/50 split
    with pytest.raises(ValueError, match="coverage_groups=0 must be an integer >= 1"):
        calibrate(p, r, m, CalibrationSettings(coverage_groups=0))


@pytest.mark.parametrize("k", [3, 5, 6, 4])
def test_constant_reference_scores_are_never_reversals_anywhere(k):
    g = torch.Generator().manual_seed(k)
    n = 400
    point = torch.rand(n, k, generator=g, dtype=torch.float64).round(decimals=2)
    point[:, 0] += 0.5
    a = torch.randn(n, k, 6, generator=g, dtype=torch.float64)
    gram = a @ a.transpose(1, 2) + 1e-3 * torch.eye(k, dtype=torch.float64)
    ref = torch.full((n, k), 0.7, dtype=torch.float64)
    rec = calibrate(point, ref, gram,
                    CalibrationSettings(alpha=0.5, beta=0.3, delta=0.2, tau_grid=[0.0, 0.5],
                                        on_infeasible="reject_all"))
    assert rec.n_accepted[0] > 0 and rec.n_reversals == (0, 0)  # K=3: 25 of 56 counted before
    fixed = calibrate(point, ref, gram,
                      CalibrationSettings(alpha=0.5, beta=0.3, delta=0.2, ablation="fixed_threshold", fixed_tau=0.0,
                                          on_infeasible="reject_all"))
    res = setgrpo_coefficients(point[:64], gram[:64], fixed)
    for dtype in (torch.float64, torch.float32):
        mon = OnlineRiskMonitor(fixed)
        mon.update(res, torch.full((64, k), 0.7, dtype=dtype), gram[:64])
        assert mon.accepted > 0 and mon.reversals == 0
    rev = reversal_events(res.coefficients, gram[:64], ref[:64], res.accepted, norm_by_std=True, eps=1e-6,
                          degenerate_rtol=rec.degenerate_rtol)
    assert not rev.any()
    # a reference with spread that disagrees does reverse
    flipped = reversal_events(res.coefficients, gram[:64], -point[:64], res.accepted, norm_by_std=True, eps=1e-6,
                              degenerate_rtol=rec.degenerate_rtol)
    assert flipped.sum() > 0


def test_counts_must_be_integers():
    with pytest.raises(ValueError, match="failures must be integer counts, got 1.5"):
        clopper_pearson_upper([1.5], [10], 0.95)
    with pytest.raises(ValueError, match="trials must be integer counts"):
        clopper_pearson_upper([1], [float("nan")], 0.95)
    assert clopper_pearson_upper([1.0], [10.0], 0.95)[0] == clopper_pearson_upper([1], [10], 0.95)[0]


def _anytime_certified(rev, delta=DELTA, beta=BETA):
    """[runs, steps] bool: the monitor's flag after every step, from cumulative counts (G accepted per step)."""
    runs, steps, g = rev.shape
    f = rev.sum(2).cumsum(1)
    n = np.broadcast_to(g * np.arange(1, steps + 1), f.shape)
    return risk_evidence(f, n, beta)[0] >= math.log(1 / delta)


def test_online_certification_is_anytime_valid_over_many_steps():
    rng = np.random.default_rng(3)
    runs, steps, g = 2000, 500, 8
    rev = rng.random((runs, steps, g)) < 0.085  # true risk just above beta at every step
    false_cert = float(_anytime_certified(rev).any(1).mean())
    assert false_cert <= DELTA, false_cert
    # the fixed-N Clopper-Pearson bound recomputed every step certifies falsely far more often
    f = rev.sum(2).cumsum(1)
    n = np.broadcast_to(g * np.arange(1, steps + 1), f.shape)
    assert float((clopper_pearson_upper(f, n, 1 - DELTA) <= BETA).any(1).mean()) > 2 * DELTA
    # and with a true risk well below beta the anytime flag does turn on
    assert float(_anytime_certified(rng.random((500, steps, g)) < 0.04).any(1).mean()) > 0.9


def test_the_monitor_class_follows_the_vectorised_evidence():
    p, r, m = make_groups(400, k=4, seed=9)
    rec = calibrate(p, r, m,
                    CalibrationSettings(alpha=0.3, beta=0.3, delta=0.2, tau_grid=(0.0,), on_infeasible="reject_all"))
    res = setgrpo_coefficients(p[:50], m[:50], rec)
    mon = OnlineRiskMonitor(rec)
    warnings.simplefilter("ignore")
    for step in range(6):
        ref = r[:50] if step < 3 else -p[:50]
        out = mon.update(res, ref, m[:50])
        low, high = risk_evidence([mon.reversals], [mon.accepted], rec.settings.beta)
        assert out["setgrpo/online_risk_certified"] == float(low[0] >= math.log(1 / rec.settings.delta))
        assert out["setgrpo/online_risk_drift"] == float(high[0] >= math.log(1 / rec.settings.delta))
        certified = out["setgrpo/online_risk_certified"] == 1.0
        assert (out["setgrpo/online_reversal_ucb"] <= rec.settings.beta) == certified
    state = mon.state_dict()
    again = OnlineRiskMonitor(rec)
    again.load_state_dict({k: v for k, v in state.items() if k not in ("certified", "drift")})
    assert again.state_dict() == state


def test_certification_power_matches_simulation():
    rng = np.random.default_rng(4)
    n, rate, level = 400, 0.03, DELTA
    f = rng.binomial(n, rate, size=50_000)
    sim = float((clopper_pearson_upper(f, np.full_like(f, n), 1 - level) <= BETA).mean())
    assert certification_power([n], rate, beta=BETA, level=level)[0] == pytest.approx(sim, abs=0.01)
