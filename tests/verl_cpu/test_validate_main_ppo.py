"""``setgrpo-verl validate`` end to end through verl's ``main_ppo`` on the CPU backend (tiny random Llama, the noisy
grader around the rules grader, loose levels; a couple of minutes).

What must hold: the calibration stage stores the noise-free truth next to the paired scores; the grader identity of
the record names the noise; the JSON's figures agree with the per-group log and with each split's frozen record,
which re-fits from the stored paired scores; the PNG is written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.runner.validate import split_groups

from .conftest import jsonl, tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]

_FLAGS = ["--flip-prob", "0.2", "--noise-seed", "3", "-K", "3", "--calib-groups", "24", "--calib-batch-size", "24",
          "--groups-per-step", "3", "--max-prompt-length", "128", "--max-response-length", "8", "--alpha", "0.4",
          "--beta", "0.9", "--delta", "0.3", "--tau-grid", "0.0,0.3", "--splits", "3", "--holdout-fraction", "0.25"]


@pytest.fixture(scope="module")
def validated(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("validate") / "run"
    proc = subprocess.run([sys.executable, "-m", "setgrpo_verl", "validate", "--run-dir", str(run), "--model",
                           str(tiny_model), *_FLAGS], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, tail(proc)
    return run, proc.stdout


def test_stage_stores_the_truth_and_the_noise_identity(validated):
    run, _ = validated
    z = np.load(run / "calibration" / "paired_scores.npz")
    assert sorted(z.files) == ["dropped_grading_failed", "dropped_incomplete", "dropped_no_response", "gram", "point",
                               "reference", "truth"]
    assert int(z["dropped_incomplete"]) == 0 and int(z["dropped_no_response"]) == 0
    assert int(z["dropped_grading_failed"]) == 0
    assert z["truth"].shape == z["point"].shape == (24, 3)
    # the validation rubrics: 3-6 rule criteria with distinct points from 1 to 6 (total W in 6..21), so every score
    # is k / W, and the stage holds more than the three values 0, 1/2, 1 of one- or two-criterion rubrics
    for name in ("point", "reference", "truth"):
        values = np.unique(z[name])
        assert ((values >= 0) & (values <= 1)).all()
        assert all(any(abs(v * w - round(v * w)) < 1e-4 for w in range(6, 22)) for v in values), values
        assert len(values) > 3, values
    assert (z["point"] != z["reference"]).any()
    record = CalibrationRecord.from_json(run / "calibration" / "record.json")
    assert record.grader["name"] == "noisy+rubric+rules"
    assert (record.grader["flip_prob"], record.grader["noise_seed"]) == (0.2, 3)
    assert record.settings.on_infeasible == "reject_all"


def test_json_agrees_with_the_group_log_and_the_records(validated):
    run, stdout = validated
    out = run / "validation"
    report = json.loads((out / "validation.json").read_text())
    rows = jsonl(out / "groups.jsonl")
    z = np.load(run / "calibration" / "paired_scores.npz")
    paired = {k: torch.from_numpy(z[k]) for k in z.files}
    assert report["data"]["groups"] == 24 and report["data"]["K"] == 3 and report["data"]["truth"] is True
    assert report["metadata"]["grader"]["flip_prob"] == 0.2
    assert report["levels"]["alpha"] == 0.4 and report["levels"]["tau_grid"] == [0.0, 0.3]
    assert len(report["splits"]) == 3 and (out / "validation.png").stat().st_size > 10_000
    assert "setgrpo |" in stdout and "grpo |" in stdout
    for split in report["splits"]:
        cal, hold = split_groups(degenerate_groups(paired["point"]), 0.25, split["seed"])
        for method, summary in split["methods"].items():
            mine = [r for r in rows if r["split"] == split["split"] and r["method"] == method]
            assert [r["group"] for r in mine] == hold.tolist()
            acc = [r for r in mine if r["accepted"]]
            assert summary["n_accepted"] == len(acc)
            assert summary["reversals_reference"] == sum(r["reversal_reference"] for r in acc)
            assert summary["reversals_truth"] == sum(r["reversal_truth"] for r in acc)
            assert summary["covered_accepted_reversals"] == 0
            # truth-degenerate flags follow the stored truth
            for r in mine:
                t = z["truth"][r["group"]]
                assert r["truth_degenerate"] == bool(t.max() == t.min())
            if method == "grpo":
                continue
            record = CalibrationRecord.from_json(out / "records" / f"split{split['split']}_{method}.json")
            assert summary["record"]["q_alpha"] == record.q_alpha and summary["record"]["tau_sel"] == record.tau_sel
            refit = calibrate(paired["point"][cal], paired["reference"][cal], paired["gram"][cal],
                              CalibrationSettings(alpha=0.4, beta=0.9, delta=0.3, tau_grid=(0.0, 0.3),
                                                  ablation=None if method == "setgrpo" else method,
                                                  on_infeasible="reject_all"),
                              split_seed=split["seed"])
            assert (refit.q_alpha, refit.tau_sel, refit.N, refit.F) == (record.q_alpha, record.tau_sel, record.N,
                                                                        record.F)
            assert record.grader == report["metadata"]["grader"]
    agg = report["summary"]["setgrpo"]
    rates = [s["methods"]["setgrpo"]["coverage_reference"] for s in report["splits"]]
    assert agg["coverage_reference"]["mean"] == pytest.approx(np.mean([r for r in rates if r is not None]))
