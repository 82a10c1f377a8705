"""End to end on the embedded defaults (SmolLM2-135M policy + local judge, IFBench rubrics), smoke profile.

Runs the real command line in a subprocess: ``quickstart`` launches verl's ``main_ppo`` twice on the CPU backend
(SetGRPO: calibration, then training with the frozen record, in one process; then verl's stock GRPO baseline) and
reports. Checks the record against its own definition (docs/algorithm.md#4-srgo, #7-record), an offline re-fit
from the stored paired scores, and the per-step ``setgrpo/*`` metrics in verl's metrics file against the per-group
log.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import beta as beta_dist

from setgrpo_verl.core import CalibrationRecord, calibrate
from setgrpo_verl.report import load_metrics

from ..verl_cpu.conftest import tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


@pytest.fixture(scope="module", autouse=True)
def _one_main_ppo_at_a_time(serial_main_ppo):
    yield


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("smoke") / "run"
    started_in = tmp_path_factory.mktemp("cwd")  # the directory the command runs from, which it must leave as it was
    proc = subprocess.run([sys.executable, "-m", "setgrpo_verl", "quickstart", "--profile", "smoke", "--judge", "local",
                           "--baseline", "--run-dir", str(run)], capture_output=True, text=True, timeout=1500, cwd=started_in)
    assert proc.returncode == 0, tail(proc)
    assert not (started_in / "outputs").exists()  # Hydra's output goes to each stage directory
    return run, proc.stdout


def _paired(run):
    z = np.load(run / "calibration" / "paired_scores.npz")
    return torch.from_numpy(z["point"]), torch.from_numpy(z["reference"]), torch.from_numpy(z["gram"])


def _steps(path):
    return [m for m in load_metrics(path) if "timing_s/step" in m]


def test_run_directory_is_complete(smoke_run):
    run, stdout = smoke_run
    assert "Backbone" in stdout and "plots:" in stdout
    for marker in ("calibration/COMPLETE", "train_setgrpo/COMPLETE", "train_grpo/COMPLETE", "report/COMPLETE"):
        assert (run / marker).is_file(), marker
    assert not list(run.rglob("FAILED"))
    for stage in ("train_setgrpo", "train_grpo"):
        assert "verl.trainer.main_ppo" in (run / stage / "command.sh").read_text()
    for stage in ("train_setgrpo", "train_grpo"):  # one main_ppo process each (calibration runs in the first)
        assert (run / stage / "hydra" / ".hydra" / "config.yaml").is_file(), stage
    for png in ("risk_vs_threshold", "coverage", "training_dynamics", "projections"):
        assert (run / "report" / f"{png}.png").stat().st_size > 20_000
    setgrpo, grpo = _steps(run / "train_setgrpo" / "metrics.jsonl"), _steps(run / "train_grpo" / "metrics.jsonl")
    assert [m["training/global_step"] for m in setgrpo] == [1, 2] == [m["training/global_step"] for m in grpo]
    for key in ("critic/score/mean", "response_length/mean", "timing_s/gen", "setgrpo/timing_s/sketch",
                "setgrpo/accepted_ratio", "setgrpo/online_coverage", "actor/update_skipped"):
        assert all(key in m for m in setgrpo), key
    # verl's entropy: from its own old-log-prob pass for GRPO, from the same logits in SetGRPO's fused pass
    assert all("actor/entropy" in m for m in grpo) and all("actor/entropy" in m for m in setgrpo)
    # the baseline's graded sync trainer logs the grading metrics and nothing else of SetGRPO's; it calls the grader
    # once per response (3 groups of K a step), SetGRPO twice
    assert {k for m in grpo for k in m if k.startswith("setgrpo/")} == {
        "setgrpo/grading/calls_per_step", "setgrpo/grading/unparsed_ratio", "setgrpo/grading/no_answer_ratio",
        "setgrpo/grading/reasks_per_step", "setgrpo/grading/failed_responses", "setgrpo/grading/failed_groups"}
    # every response of every group came back graded, with no re-ask
    for key in ("setgrpo/grading/reasks_per_step", "setgrpo/grading/failed_responses", "setgrpo/grading/failed_groups"):
        assert [m[key] for m in grpo + setgrpo] == [0.0] * 4, key
    # SmolLM2 does not think: every response has an answer to grade
    assert all(m["setgrpo/grading/no_answer_ratio"] == 0.0 for m in grpo + setgrpo)
    from omegaconf import OmegaConf

    k = OmegaConf.load(run / "train_grpo" / "hydra" / ".hydra" / "config.yaml").actor_rollout_ref.rollout.n
    assert [m["setgrpo/grading/calls_per_step"] for m in grpo] == [3.0 * k] * 2
    assert [m["setgrpo/grading/calls_per_step"] for m in setgrpo] == [2 * 3.0 * k] * 2
    groups = [json.loads(line) for line in (run / "train_setgrpo" / "groups.jsonl").read_text().splitlines()]
    assert len(groups) == 2 * 3
    for m in setgrpo:  # per-step ratio == share of that step's groups with status accepted
        step = [g for g in groups if g["step"] == m["training/global_step"]]
        assert m["setgrpo/accepted_ratio"] == pytest.approx(sum(g["status"] == "accepted" for g in step) / 3)
        assert m["actor/update_skipped"] == float(not any(g["accepted"] for g in step))


def test_record_names_its_calibration_prompts(smoke_run):
    """Inside verl the calibration rows' ids and rubrics reach the record: exactly data/calibration.parquet's."""
    import pandas as pd

    from setgrpo_verl.core.record import prompt_fingerprint
    from setgrpo_verl.integration.prompts import prompt_identity

    run, _ = smoke_run
    rec = CalibrationRecord.from_json(run / "calibration" / "record.json")
    rows = pd.read_parquet(run / "data" / "calibration.parquet").to_dict("records")
    expected = [prompt_fingerprint(*prompt_identity(r["reward_model"], r["extra_info"], r["prompt"])) for r in rows]
    assert sorted(rec.calibration_prompts, key=lambda p: p["id"]) == sorted(expected, key=lambda p: p["id"])
    assert len({p["id"] for p in rec.calibration_prompts}) == len(rows) == 12


def test_record_is_consistent(smoke_run):
    run, stdout = smoke_run
    rec = CalibrationRecord.from_json(run / "calibration" / "record.json")
    point, reference, gram = _paired(run)
    if rec.tau_sel is None:  # the smoke profile's 12 groups may certify no threshold: a reject-all record
        assert rec.settings.on_infeasible == "reject_all" and rec.N == 0 and rec.U == 0.0
        assert all(u > rec.settings.beta for u, n in zip(rec.ucb, rec.n_accepted) if n > 0)
        return
    j = rec.settings.tau_grid.index(rec.tau_sel)
    n, f = rec.n_accepted[j], rec.n_reversals[j]
    assert (rec.N, rec.F) == (n, f) and n > 0
    assert rec.ecr == pytest.approx(f / n)
    m = len(rec.settings.tau_grid)
    ucb = 1.0 if f == n else float(beta_dist.ppf(1 - rec.settings.delta / m, f + 1, n - f))
    assert rec.ucb_sel == pytest.approx(ucb, rel=1e-9) and ucb <= rec.settings.beta
    assert rec.n_cov + rec.n_risk + rec.n_degenerate == 12
    row = stdout.split("Backbone", 1)[1].splitlines()[1].split()
    assert row[-5:] == [f"{rec.tau_sel:.2f}", str(n), str(f), f"{rec.ecr:.4f}", f"{rec.U:.3f}"]
    # the stored paired scores re-fit offline to the very same record
    refit = calibrate(point, reference, gram, rec.settings, split_seed=rec.split_seed)
    assert (refit.q_alpha, refit.tau_sel, refit.N, refit.F, refit.U) == (rec.q_alpha, rec.tau_sel, n, f, rec.U)
