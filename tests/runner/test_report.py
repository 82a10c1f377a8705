"""Report from a run directory: Table 4 text, the four figures, and coverage re-fitted from stored paired scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from setgrpo_verl import report
from setgrpo_verl.core import CalibrationSettings, calibrate
from setgrpo_verl.runner.launch import COMPLETE


def _paired(g=80, k=4, noise=0.15, seed=0):
    gen = torch.Generator().manual_seed(seed)
    true = torch.rand(g, k, generator=gen, dtype=torch.float64)
    point = true + noise * torch.randn(g, k, generator=gen, dtype=torch.float64)
    reference = true + noise * torch.randn(g, k, generator=gen, dtype=torch.float64)
    s = torch.randn(g, k, 16, generator=gen, dtype=torch.float64)
    return point, reference, s @ s.transpose(-1, -2)


@pytest.fixture()
def run_dir(tmp_path):
    point, reference, gram = _paired()
    record = calibrate(point, reference, gram,
                       CalibrationSettings(alpha=0.1, beta=0.3, delta=0.1, tau_grid=(0.0, 0.2, 0.4, 0.6, 0.8)))
    calib = tmp_path / "calibration"
    calib.mkdir()
    record.to_json(calib / "record.json")
    np.savez(calib / "paired_scores.npz", point=point.numpy(), reference=reference.numpy(), gram=gram.numpy())
    (calib / COMPLETE).write_text("")
    for name in ("setgrpo", "grpo"):
        stage = tmp_path / f"train_{name}"
        stage.mkdir()
        # verl's file logger: one {"step", "data"} object per step (a step-0 line without step metrics first)
        rows = [{"step": 0, "data": {"setgrpo/calibration/q_alpha": 1.0}}]
        rows += [{"step": s, "data": {"critic/score/mean": 0.1 * s, "actor/entropy": 2.0 - 0.1 * s,
                                      "timing_s/step": 1.0, "setgrpo/accepted_ratio": 0.5 if name == "setgrpo" else None,
                                      "setgrpo/recovery_ratio/mean": 0.7 if name == "setgrpo" else None,
                                      "setgrpo/online_coverage": 0.9 if name == "setgrpo" else None}}
                 for s in (1, 2, 3)]
        (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (stage / "groups.jsonl").write_text(json.dumps({"status": "infeasible", "m_full": 0.1, "m_reward": -0.2})
                                            + "\n")
        (stage / COMPLETE).write_text("")
    return tmp_path, record


def test_report_writes_figures_and_table4(run_dir):
    path, record = run_dir
    text = report.make_report(path, resplits=20)
    for name in ("risk_vs_threshold.png", "coverage.png", "training_dynamics.png", "projections.png"):
        png = path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (path / "report" / COMPLETE).exists()
    table = (path / "report" / "table4.txt").read_text().splitlines()
    assert table[0].split() == ["Backbone", "Cov.", "Risk", "Qα", "τsel", "N", "F", "ECR", "U"]
    assert table[1].split()[-5:] == [f"{record.tau_sel:.2f}", str(record.N), str(record.F), f"{record.ecr:.4f}",
                                     f"{record.U:.3f}"]
    assert "SetGRPO per step" in text and "GRPO baseline" in text
    steps = [line.split()[0] for line in text.split("SetGRPO per step", 1)[1].splitlines()[2:5]]
    assert steps == ["1", "2", "3"]  # the step-0 line is not a training step


def test_report_draws_every_step_once_when_a_step_was_trained_again(run_dir):
    """A metrics file where step 3 was logged, then trained again after a resume from the checkpoint of step 2."""
    path, _ = run_dir
    stage = path / "train_setgrpo"
    rows = [{"step": s, "data": {"critic/score/mean": r, "timing_s/step": 1.0, "setgrpo/accepted_ratio": 0.5}}
            for s, r in ((1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.4))]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report.make_report(path)
    table = text.split("SetGRPO per step", 1)[1].splitlines()[2:6]
    assert [(line.split()[0], line.split()[3]) for line in table] == [("1", "0.100"), ("2", "0.200"),
                                                                     ("3", "0.350"), ("4", "0.400")]


def test_coverage_curve_is_calibrated_on_exchangeable_groups():
    """Held-out coverage of the re-fitted sets tracks the nominal level (split conformal, docs/algorithm.md#2-jrsc)."""
    point, reference, gram = _paired(g=240, seed=1)
    record = calibrate(point, reference, gram, CalibrationSettings(alpha=0.1, beta=0.3, delta=0.1, tau_grid=(0.0, 0.4)))
    curve = report.coverage_curve(point, reference, gram, record, alphas=[0.1, 0.3, 0.5], seeds=6)
    assert [round(c[0], 2) for c in curve] == [0.9, 0.7, 0.5]
    for nominal, mean, _ in curve:
        assert abs(mean - nominal) < 0.08



def test_report_and_inspect_record_show_the_coverage_band_and_flag_a_split_below_it(run_dir, capsys):
    """A held-out coverage below its 5-95 % band under exchangeability is flagged in summary.txt, table4.txt and
    `setgrpo-verl inspect-record`; the re-split mean and the realised-risk share come with it
    (docs/record.md#reading-the-guarantees)."""
    import dataclasses

    from setgrpo_verl.runner import cli
    from setgrpo_verl.core import CalibrationRecord
    from setgrpo_verl.core.bands import coverage_band

    path, record = run_dir
    band = coverage_band(record.n_cov, record.n_risk, record.settings.alpha)
    assert (record.n_cov, record.n_risk) == (40, 40) and band.position(record.coverage_risk_set) == "inside"
    expected = f"expected under exchangeability: mean {band.mean:.2f}, single splits {band.lo:.2f}-{band.hi:.2f}"
    text = report.inspect_record(path, resplits=10)
    assert expected in text and "over 10 re-splits of the stored paired scores" in text and "WARNING" not in text
    assert "risk: realised risk <= beta=0.3 in" in text
    # every Table 4 column is explained under the row
    header = text.splitlines()[0]
    legend = next(line for line in text.splitlines() if line.startswith("columns: "))
    for column in ("Cov.", "Risk", "Qα", "τsel", "N", "F", "ECR", "U"):
        assert column in header and f"{column}: " in legend, column

    low = dataclasses.replace(record, coverage_risk_set=24 / 40)  # 24 of 40 held-out groups, far below 1 - alpha
    assert band.position(low.coverage_risk_set) == "below"
    low.to_json(path / "calibration" / "record.json")
    assert CalibrationRecord.from_json(path / "calibration" / "record.json").coverage_risk_set == 0.6
    text = report.make_report(path, resplits=10)
    warning = f"WARNING: held-out coverage 0.600 is below its 5-95 % band [{band.lo:.2f}, {band.hi:.2f}]"
    assert expected in text and warning in text and "over 10 re-splits" in text
    assert warning in (path / "report" / "summary.txt").read_text()
    table4 = (path / "report" / "table4.txt").read_text()
    assert expected in table4 and warning in table4
    assert cli.main(["inspect-record", str(path)]) == 0  # the command's default: 200 re-splits
    out = capsys.readouterr().out
    assert warning in out and expected in out and "over 200 re-splits" in out

    (path / "calibration" / "paired_scores.npz").unlink()
    bare = report.inspect_record(path / "calibration" / "record.json")
    assert warning in bare and "no paired_scores.npz next to the record: no re-splits" in bare


def test_report_shows_the_truth_lines_and_the_truth_reward_of_each_step(run_dir):
    path, _ = run_dir
    metrics = path / "train_setgrpo" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for row, truth in zip(rows[1:], (0.40, 0.50, 0.60)):
        row["data"]["setgrpo/grading/truth_score/mean"] = truth
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report.make_report(path, resplits=20, truth=["against the truth (a line)"])
    assert "against the truth (a line)" in text
    table = text.split("SetGRPO per step", 1)[1].splitlines()
    assert table[1].split()[:6] == ["step", "accepted", "recovery", "reward", "truth", "entropy"]
    assert [line.split()[4] for line in table[2:5]] == ["0.400", "0.500", "0.600"]
    # mean 0.5, t(0.975, 2) = 4.303 times the standard error 0.1 / sqrt(3)
    assert "truth reward 0.500 [0.252, 0.748] (95 % t-band over 3 steps)" in text
