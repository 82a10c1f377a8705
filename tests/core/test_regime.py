"""The judge's regime from two scorings (docs/record.md#the-judges-regime): on the noisy rules grader at known flip
rates the bands cover the truth; the committed comparison calibration reads back at its flip rate; the printed lab
numbers are the committed lab run's."""

from __future__ import annotations

import asyncio
import re
import json
from pathlib import Path

import numpy as np
import pytest

from setgrpo_verl.core.regime import criterion_concentration, flip_from_disagreement, judge_regime
from setgrpo_verl.grading import GradingItem, NoisyGrader, Rubric, RubricGrader, load_ifbench_rubrics
from setgrpo_verl.report.regime import LAB, calibration_regime, regime_lines, regime_report

ROOT = Path(__file__).resolve().parents[2]
RESPONSES = ("Sure. Here is a short answer, in plain words.", "NO", "one two three four five six seven eight",
             "I cannot help with that; however, here are 3 ideas: a, b and c.")


@pytest.fixture(scope="module")
def groups():
    """The rule-only IFBench rubrics, each a group of the four responses above (275 groups of K 4)."""
    rows = load_ifbench_rubrics(rules_only=True)
    items = [GradingItem(text, Rubric.from_row(row), nonce=f"{n}/{k}") for n, row in enumerate(rows)
             for k, text in enumerate(RESPONSES)]
    h = np.array([criterion_concentration([c["points"] for c in row["rubrics"]]) for row in rows])
    return items, h


def _scorings(items, flip: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    grader = NoisyGrader(RubricGrader(None), flip_prob=flip, seed=seed)
    point, reference = (asyncio.run(grader.agrade(items, scoring_index=i)) for i in (0, 1))
    shape = (-1, len(RESPONSES))
    return (np.array([r.score for r in point]).reshape(shape), np.array([r.score for r in reference]).reshape(shape),
            np.array([r.truth for r in point]).reshape(shape))


@pytest.mark.parametrize("flip", [0.03, 0.06, 0.1, 0.2])
def test_bands_cover_the_noisy_rules_graders_flip_rate_and_noise(groups, flip):
    """Ten independent noise draws (seeds 0-9) at a known flip rate: the 95 % bands of the flip rate and of one
    scoring's noise variance (``p (1 - p) h`` per response around the truth's expected score) cover the truth in at
    least 8 of 10, and say something (a flip band narrower than the rate itself)."""
    items, h = groups
    covered = {"flip": 0, "noise": 0}
    for seed in range(10):
        point, reference, _ = _scorings(items, flip, seed=seed)
        regime = judge_regime(point, reference, None, h, resamples=1000)
        covered["flip"] += regime.flip_rate.low <= flip <= regime.flip_rate.high
        covered["noise"] += regime.noise_var.low <= flip * (1 - flip) * h.mean() <= regime.noise_var.high
        assert regime.flip_rate.high - regime.flip_rate.low < 0.6 * flip + 0.01
        assert 0 < regime.noise_share.low <= regime.noise_share.value <= regime.noise_share.high < 1
        assert 0 <= regime.reversed_share.low <= regime.reversed_share.value <= regime.reversed_share.high <= 1
    assert covered["flip"] >= 8 and covered["noise"] >= 8, covered


def test_more_noise_reads_as_more_noise_and_more_reversals(groups):
    items, h = groups
    low, high = (judge_regime(*_scorings(items, f, seed=3)[:2], None, h) for f in (0.03, 0.2))
    assert low.flip_rate.high < high.flip_rate.low
    assert low.noise_share.high < high.noise_share.low
    assert low.reversed_share.value < high.reversed_share.value


def test_no_noise_reads_as_zero_and_bad_input_is_refused(groups):
    items, h = groups
    point, reference, truth = _scorings(items, 0.0, seed=0)
    regime = judge_regime(point, reference, None, h)
    assert (regime.flip_rate.value, regime.flip_rate.high, regime.noise_var.high, regime.reversed) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="same \\[G, K\\] shape"):
        judge_regime(point, reference[:, :3])
    with pytest.raises(ValueError, match="concentration"):
        judge_regime(point, reference, None, h[:-1])
    with pytest.raises(ValueError, match="non-zero"):
        criterion_concentration([0, 0])
    assert flip_from_disagreement(2 * 0.1 * 0.9) == pytest.approx(0.1)
    assert criterion_concentration([1, 1, -2]) == pytest.approx(1.5)  # W: the positive points only


def test_the_committed_comparison_calibration_reads_back_at_its_flip_rate():
    """validation/outcome_verl/flip0.06/calibration: 240 groups of the main job's grader (flip 0.06) on real
    SmolLM2 rollouts and Gram matrices."""
    regime, source = calibration_regime(ROOT / "validation/outcome_verl/flip0.06/calibration")
    assert source == "the shards' criterion points"
    assert (regime.groups, regime.k) == (240, 4)
    assert regime.flip_rate.low <= 0.06 <= regime.flip_rate.high
    lines = regime_lines(regime, source)
    text = "\n".join(lines)
    assert "nearest flip rate 0.05" in text and "steps scarce: plain GRPO" in text and "warning" not in text
    # docs/record.md#the-judges-regime quotes exactly what is printed
    assert text in (ROOT / "docs" / "record.md").read_text()


def test_the_printed_lab_numbers_are_the_committed_lab_runs():
    rows = {(r["flip"], r["arm"]): r for r in json.loads(
        (ROOT / "validation/outcome_lab/full.json").read_text())["rows"] if r["grader"] == "flip" and r["K"] == 4}
    for flip, lab in LAB.items():
        read = {"mean2_vs_grpo": rows[flip, "grpo_mean2"]["paired"]["grpo"],
                "grpo_vs_mean2_calls": rows[flip, "grpo"]["paired_calls"]["grpo_mean2"],
                "reliability_vs_mean2": rows[flip, "setgrpo_reliability"]["paired"]["grpo_mean2"],
                "paper_vs_mean2": rows[flip, "setgrpo_paper"]["paired"]["grpo_mean2"]}
        assert {k: (round(v[0], 3), round(v[1], 3)) for k, v in read.items()} == lab, flip


def test_the_readmes_decision_table_quotes_the_lab_numbers_report_prints():
    """Every ``x ± y`` of the README's decision table is one of the lab's paired differences above (so the committed
    run's, by the test before), and the table says where reliability weights lose."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| your regime"):text.index("## Set-up")]
    quoted = {(float(v), float(h)) for v, h in re.findall(r"([+-]?\d\.\d{3}) ± (\d\.\d{3})", table)}
    assert len(quoted) >= 11
    assert quoted <= {pair for lab in LAB.values() for pair in lab.values()}
    assert (-0.015, 0.007) in quoted and LAB[0.3]["reliability_vs_mean2"] == (-0.015, 0.007)


def test_report_prints_the_regime_of_a_run_directorys_calibration(tmp_path):
    """``setgrpo-verl report`` on a run directory whose calibration is the committed comparison calibration."""
    import shutil

    from setgrpo_verl.core.shards import load_shards
    from setgrpo_verl.report import make_report
    from setgrpo_verl.rundir import COMPLETE

    calib = tmp_path / "run" / "calibration"
    shutil.copytree(ROOT / "validation/outcome_verl/flip0.06/calibration", calib)
    shards, _ = load_shards(calib / "shards")
    np.savez(calib / "paired_scores.npz", **{name: np.concatenate([getattr(shards[i], name) for i in sorted(shards)])
                                             for name in ("point", "reference", "gram")})
    (calib / COMPLETE).write_text("done\n")
    text = make_report(tmp_path / "run", resplits=5)
    regime, source = calibration_regime(calib)
    assert "\n".join(regime_lines(regime, source)) in text
    shutil.rmtree(calib / "shards")
    assert regime_report(calib)[0].startswith("judge's regime: not read (no calibration shards in")


def test_a_judge_without_truth_reads_its_rubrics_from_the_calibration_prompts(tmp_path):
    """A real judge's shards hold no criterion points: the flip rate then comes from the rubrics of the run's
    ``data/calibration.parquet``, matched by each prompt's rubric hash, and equals the one from the shards."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    from setgrpo_verl.core.shards import load_shards, write_shard

    shards, _ = load_shards(ROOT / "validation/outcome_verl/flip0.06/calibration/shards")
    calib = tmp_path / "run" / "calibration"
    for shard in shards.values():
        write_shard(calib / "shards", dataclasses.replace(shard, criterion_points=None, truth_verdicts=None))
    assert calibration_regime(calib)[0].flip_rate is None  # no points anywhere: no flip rate, the rest still read
    rows = [json.loads(line) for line in (ROOT / "setgrpo_verl/data/validation_rubrics.jsonl").read_text().splitlines()]
    (tmp_path / "run" / "data").mkdir()
    pq.write_table(pa.table({"reward_model": [{"ground_truth": json.dumps(r)} for r in rows],
                             "extra_info": [{"id": r["id"]} for r in rows]}),
                   tmp_path / "run" / "data" / "calibration.parquet")
    regime, source = calibration_regime(calib)
    assert source.startswith("the rubrics of ") and source.endswith("calibration.parquet")
    committed, _ = calibration_regime(ROOT / "validation/outcome_verl/flip0.06/calibration")
    assert regime.flip_rate == committed.flip_rate and regime.noise_var == committed.noise_var
