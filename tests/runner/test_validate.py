"""The offline analysis of ``setgrpo-verl validate`` (docs/validation.md#validation) on hand-computable and synthetic
groups, and the command on a run directory holding a calibration stage."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from setgrpo_verl.runner import cli
from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.runner.validate import (
    ValidationLevels,
    evaluate_grpo,
    evaluate_method,
    load_paired,
    run_validation,
    split_groups,
)
from setgrpo_verl.report import summary_table, write_validation

LOOSE = ValidationLevels(alpha=0.2, beta=0.5, delta=0.2, tau_grid=(0.0, 0.3))


def _synthetic(n: int, k: int = 4, noise: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """Exchangeable groups: truth mu ~ U(0, 1), two scorings mu + N(0, noise^2), correlated gradients."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.rand(n, k, generator=g, dtype=torch.float64)
    point = mu + noise * torch.randn(n, k, generator=g, dtype=torch.float64)
    reference = mu + noise * torch.randn(n, k, generator=g, dtype=torch.float64)
    grads = 0.8 * torch.randn(n, 1, 4, generator=g, dtype=torch.float64) + torch.randn(n, k, 4, generator=g,
                                                                                       dtype=torch.float64)
    return {"point": point, "reference": reference, "gram": grads @ grads.transpose(1, 2), "truth": mu}


def test_split_groups_is_stratified_by_degeneracy():
    degenerate = torch.tensor([False] * 9 + [True] * 6)
    cal, hold = split_groups(degenerate, 1 / 3, seed=4)
    assert sorted(cal.tolist() + hold.tolist()) == list(range(15))
    assert int((~degenerate[hold]).sum()) == 3 and int(degenerate[hold].sum()) == 2  # a third of each stratum
    again = split_groups(degenerate, 1 / 3, seed=4)
    assert torch.equal(cal, again[0]) and torch.equal(hold, again[1])
    assert not torch.equal(hold, split_groups(degenerate, 1 / 3, seed=5)[1])
    for fraction in (0.0, 1.0, 0.01):
        with pytest.raises(ValueError):
            split_groups(degenerate, fraction, seed=0)


def test_grpo_reversals_by_hand():
    """K = 2, M = I: b^T M a < 0 exactly when the re-scoring (or truth) orders the two responses the other way."""
    paired = {
        "point": torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64),
        "reference": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.2, 0.2], [0.0, 1.0]], dtype=torch.float64),
        "truth": torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.3, 0.3], [0.0, 1.0]], dtype=torch.float64),
        "gram": torch.eye(2, dtype=torch.float64).expand(4, 2, 2).clone(),
    }
    summary, rows = evaluate_grpo(paired, torch.arange(4), levels=LOOSE)
    assert [r["status"] for r in rows] == ["grpo", "grpo", "grpo", "degenerate"]
    assert [r["reversal_reference"] for r in rows] == [True, False, False, False]
    assert [r["reversal_truth"] for r in rows] == [False, True, False, False]
    assert [r["truth_degenerate"] for r in rows] == [False, False, True, False]
    assert summary["n_accepted"] == 3 and summary["accepted_ratio"] == 0.75 and summary["accepted_ratio_live"] == 1.0
    assert summary["reversal_rate_reference"] == pytest.approx(1 / 3)
    # group 2's truth has no direction: it counts towards the noise-only share, not towards truth reversals
    assert summary["n_accepted_truth_live"] == 2 and summary["reversal_rate_truth"] == 0.5
    assert summary["noise_only_share"] == pytest.approx(1 / 3)
    assert summary["risk_at_most_beta"] is True and summary["coverage_reference"] is None


def test_zero_radius_is_grpo_and_flipped_held_out_groups_are_all_reversed():
    """Calibration groups scored identically twice give Q_alpha = 0: SetGRPO = GRPO (docs/algorithm.md#24-set).
    Held-out groups whose re-scoring reverses the ordering are then neither covered nor safe: every accepted group
    reverses, coverage is 0, and realised risk 1 > beta."""
    data = _synthetic(40, k=3)
    data["reference"] = data["point"].clone()
    hold = torch.arange(30, 40)
    data["reference"][hold] = -data["point"][hold]
    data["truth"] = data["point"].clone()
    summary, rows, record = evaluate_method(data, torch.arange(30), hold, levels=LOOSE)
    assert record.q_alpha == 0.0 and record.tau_sel == 0.3
    assert summary["n_accepted"] == 10 and summary["mean_recovery_ratio"] == pytest.approx(1.0)
    assert summary["coverage_reference"] == 0.0 and summary["coverage_truth"] == 1.0
    assert summary["reversal_rate_reference"] == 1.0 and summary["reversal_rate_truth"] == 0.0
    assert summary["risk_at_most_beta"] is False and summary["covered_accepted_reversals"] == 0
    grpo, _ = evaluate_grpo(data, hold, levels=LOOSE)
    assert grpo["reversal_rate_reference"] == 1.0


@pytest.fixture(scope="module")
def synthetic_result():
    data = _synthetic(240, noise=0.05)
    return data, run_validation(data, levels=ValidationLevels(alpha=0.1, beta=0.1, delta=0.1,
                                                              tau_grid=(0.0, 0.2, 0.4)),
                                n_splits=6, holdout_fraction=0.5, first_seed=3)


def test_summary_is_consistent_with_rows_and_records(synthetic_result):
    data, result = synthetic_result
    report = result.report
    assert report["methods"] == ["grpo", "setgrpo", "spherical_set", "identity_geometry", "safe_anchor_only"]
    assert [s["seed"] for s in report["splits"]] == list(range(3, 9))
    for split in report["splits"]:
        cal, hold = split_groups(degenerate_groups(data["point"]), 0.5, split["seed"])
        for method, summary in split["methods"].items():
            rows = [r for r in result.rows if r["split"] == split["split"] and r["method"] == method]
            assert [r["group"] for r in rows] == hold.tolist()
            acc = [r for r in rows if r["accepted"]]
            live = [r for r in rows if r["status"] != "degenerate"]
            assert summary["n_accepted"] == len(acc)
            assert summary["reversals_reference"] == sum(r["reversal_reference"] for r in acc)
            if method == "grpo":
                continue
            assert summary["coverage_reference"] == sum(r["covered_reference"] for r in live) / len(live)
            record = result.records[(split["split"], method)]
            refit = calibrate(data["point"][cal], data["reference"][cal], data["gram"][cal],
                              CalibrationSettings(alpha=0.1, beta=0.1, delta=0.1, tau_grid=(0.0, 0.2, 0.4),
                                                  ablation=None if method == "setgrpo" else method,
                                                  on_infeasible="reject_all"),
                              split_seed=split["seed"])
            assert (refit.q_alpha, refit.tau_sel, refit.N) == (record.q_alpha, record.tau_sel, record.N)
            assert summary["record"]["q_alpha"] == record.q_alpha and summary["record"]["tau_sel"] == record.tau_sel
    for method, agg in report["summary"].items():
        per_split = [s["methods"][method] for s in report["splits"]]
        mean = np.mean([s["reversal_rate_reference"] for s in per_split if s["reversal_rate_reference"] is not None])
        assert agg["reversal_rate_reference"]["mean"] == pytest.approx(mean)
        assert agg["covered_accepted_reversals"] == 0  # docs/algorithm.md#4-srgo, consistency


def test_guarantees_hold_on_exchangeable_synthetic_groups(synthetic_result):
    """Split conformal coverage of the re-scoring, on average over splits, is >= 1 - alpha (up to the sampling
    error of 6 splits x 120 held-out groups); the small grader noise lets SetGRPO accept most groups."""
    _, result = synthetic_result
    s = result.report["summary"]["setgrpo"]
    assert s["coverage_reference"]["mean"] >= 0.9 - 0.03
    assert s["coverage_truth"]["mean"] > 0.5
    assert s["accepted_ratio"]["mean"] > 0.5 and s["splits_without_threshold"] == 0
    assert s["share_risk_at_most_beta"] >= 0.9 - 1e-12


def test_write_validation(tmp_path, synthetic_result):
    _, result = synthetic_result
    paths = write_validation(result, tmp_path / "v")
    report = json.loads(paths["json"].read_text())
    assert report["summary"]["setgrpo"]["accepted_ratio"]["n"] == 6
    assert paths["png"].stat().st_size > 10_000
    rows = [json.loads(x) for x in paths["groups"].read_text().splitlines()]
    assert len(rows) == 6 * 5 * 120
    assert CalibrationRecord.from_json(paths["records"] / "split0_setgrpo.json") == result.records[(0, "setgrpo")]
    table = summary_table(report)
    lines = table.splitlines()
    assert lines[2].startswith("grpo |") and lines[6].startswith("safe_anchor_only |")
    # below the table: SetGRPO's coverage band and realised-risk share (docs/record.md#reading-the-guarantees)
    assert lines[7].startswith("setgrpo held-out coverage: mean") and "5-95 % band" in lines[7]
    assert lines[8].startswith("setgrpo realised risk <= beta in 1.00 of splits")
    assert lines[9].startswith("sample size for beta=") and "at the measured rates, tau=" in lines[10]
    assert lines[11].startswith("  to certify with probability 0.9 (bonferroni): tau=")
    assert lines[12].startswith("  to certify with probability 0.9 (fixed_sequence from tau_start=")
    assert len(lines) == 13


def test_cumulative_recovery_and_nonzero_update_rate(synthetic_result):
    """Table 5's CR is the held-out analogue of the record's U (sum of accepted recovery ratios over the
    non-degenerate groups) and NUR the accepted share of the non-degenerate groups; for GRPO both are 1."""
    _, result = synthetic_result
    for split in result.report["splits"]:
        for method, summary in split["methods"].items():
            rows = [r for r in result.rows if r["split"] == split["split"] and r["method"] == method]
            live = [r for r in rows if r["status"] != "degenerate"]
            cr = sum(r["recovery_ratio"] for r in rows if r["accepted"]) / len(live)
            assert summary["cumulative_recovery"] == pytest.approx(cr)
            assert summary["accepted_ratio_live"] == pytest.approx(sum(r["accepted"] for r in rows) / len(live))
            if method == "grpo":
                assert summary["cumulative_recovery"] == pytest.approx(1.0)
            else:
                assert summary["cumulative_recovery"] <= summary["accepted_ratio_live"] + 1e-12


def test_sample_size_plan_from_the_records(synthetic_result):
    """Pooled per-threshold counts of the splits' records, and the group count that N(p) accepted groups imply."""
    from setgrpo_verl.core.srgo import required_accepted_groups
    from setgrpo_verl.runner.validate import sample_size_plan

    _, result = synthetic_result
    records = [result.records[(s, "setgrpo")] for s in range(6)]
    plan = sample_size_plan(records, holdout_fraction=0.5, live_share=1.0)
    r0 = records[0]
    levels = r0.settings
    assert plan["accepted_no_reversal"] == required_accepted_groups(levels.beta, levels.delta, len(levels.tau_grid))
    for row in plan["thresholds"]:
        j = levels.tau_grid.index(row["tau"])
        assert row["accepted"] == sum(r.n_accepted[j] for r in records)
        assert row["reversals"] == sum(r.n_reversals[j] for r in records)
        if row["accepted_needed"] is not None:
            share = row["accepted"] / sum(r.n_risk for r in records)
            risk_share = sum(r.n_risk for r in records) / sum(r.n_risk + r.n_cov for r in records)
            assert row["groups_needed"] == math.ceil(row["accepted_needed"] / (share * risk_share * 0.5))
    assert plan["plan"]["groups_needed"] == min(r["groups_needed"] for r in plan["thresholds"]
                                                 if r["groups_needed"] is not None)
    assert result.report["sample_size"] == sample_size_plan(records, holdout_fraction=0.5, live_share=1.0)
    # at 0.9 power both procedures are planned; the fixed sequence (level delta, not delta / m) needs fewer groups
    bonf, fixed = plan["at_power"]["bonferroni"], plan["at_power"]["fixed_sequence"]
    assert bonf["power"] == fixed["power"] == 0.9 and fixed["groups_needed"] <= bonf["groups_needed"]
    assert bonf["groups_needed"] == math.ceil(bonf["calibration_groups"] / 0.5)
    with pytest.raises(ValueError):
        sample_size_plan([], holdout_fraction=0.5, live_share=1.0)



def test_summary_table_shows_the_coverage_band_and_flags_splits_outside_it(synthetic_result):
    """docs/record.md#reading-the-guarantees: each split's held-out coverage against the beta-binomial band of its
    n_cov and held-out groups; splits outside it are named, a mean or risk share outside its band is a WARNING."""
    import copy

    from setgrpo_verl.core.bands import coverage_band

    _, result = synthetic_result
    report = copy.deepcopy(result.report)
    first = report["splits"][0]["methods"]["setgrpo"]
    band = coverage_band(first["record"]["n_cov"], first["n_live"], report["levels"]["alpha"])
    assert (band.n_cov, band.n_held_out) == (60, 120)
    line = summary_table(report).splitlines()[7]
    assert f"single splits in {band.lo:.2f}-{band.hi:.2f} (5-95 % band, n_cov=60, 120 held-out groups)" in line
    inside = [s["methods"]["setgrpo"]["coverage_reference"] for s in report["splits"]]
    assert all(band.position(c) == "inside" for c in inside) and "below the band: none, above: none" in line
    assert "WARNING" not in summary_table(report)
    report["splits"][2]["methods"]["setgrpo"]["coverage_reference"] = 0.5
    assert "splits below the band: [2], above: none" in summary_table(report)
    for s in report["splits"]:
        s["methods"]["setgrpo"]["coverage_reference"] = 0.5
    report["summary"]["setgrpo"]["share_risk_at_most_beta"] = 0.0
    text = summary_table(report)
    assert "splits below the band: [0, 1, 2, 3, 4, 5]" in text
    assert f"WARNING: the mean held-out coverage 0.500 is outside the band of a single split [{band.lo:.2f}" in text
    assert "WARNING: realised risk <= beta in only 0.00 of splits" in text


def test_paper_levels_with_too_few_groups_name_the_split(synthetic_result):
    data, _ = synthetic_result
    small = {k: v[:30] for k, v in data.items()}
    with pytest.raises(ValueError, match=r"split 0 \(seed 0, 15 calibration groups\), setgrpo: too few"):
        run_validation(small, n_splits=1)


def _run_dir(tmp_path, data, **record_kw) -> str:
    """A run directory with a finished calibration stage made from ``data``."""
    run = tmp_path / "run"
    (run / "calibration").mkdir(parents=True)
    np.savez(run / "calibration" / "paired_scores.npz", **{k: v.numpy() for k, v in data.items()})
    record = calibrate(data["point"], data["reference"], data["gram"],
                       CalibrationSettings(on_infeasible="reject_all", **record_kw),
                       metadata={"grader": {"name": "noisy+rubric+rules", "flip_prob": 0.1, "noise_seed": 0}})
    record.to_json(run / "calibration" / "record.json")
    (run / "calibration" / "COMPLETE").write_text("12.5 s\n")
    return str(run)


def test_command_analysis_only(tmp_path, capsys):
    data = _synthetic(120)
    run = _run_dir(tmp_path, data, alpha=0.2, beta=0.4, delta=0.2, tau_grid=(0.0, 0.5))
    assert cli.main(["validate", "--run-dir", run, "--analysis-only", "--splits", "3"]) == 0
    out = capsys.readouterr().out
    assert "alpha=0.2 beta=0.4 delta=0.2, 3 splits, 120 groups (K=4)" in out and "setgrpo |" in out
    report = json.loads((tmp_path / "run" / "validation" / "validation.json").read_text())
    assert report["levels"]["tau_grid"] == [0.0, 0.5]  # from the stage's record
    assert report["metadata"]["grader"]["flip_prob"] == 0.1 and report["calibration_stage_seconds"] == 12.5
    assert cli.main(["validate", "--run-dir", run, "--analysis-only", "--splits", "3"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # levels given as flags win over the record's
    assert cli.main(["validate", "--run-dir", run, "--analysis-only", "--splits", "2", "--overwrite",
                     "--beta", "0.3"]) == 0
    report = json.loads((tmp_path / "run" / "validation" / "validation.json").read_text())
    assert report["levels"]["beta"] == 0.3 and report["levels"]["alpha"] == 0.2 and report["n_splits"] == 2


def test_command_needs_a_finished_calibration_stage(tmp_path, capsys):
    assert cli.main(["validate", "--run-dir", str(tmp_path), "--analysis-only"]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_load_paired_checks_shapes(tmp_path):
    np.savez(tmp_path / "p.npz", point=np.zeros((3, 2)), reference=np.zeros((3, 2)), gram=np.zeros((3, 2, 2)),
             truth=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="truth has shape"):
        load_paired(tmp_path / "p.npz")
    np.savez(tmp_path / "q.npz", point=np.zeros((3, 2)))
    with pytest.raises(ValueError, match="lacks"):
        load_paired(tmp_path / "q.npz")
