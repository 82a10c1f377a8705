"""The paper-profile run on record (docs/validation.md#the-paper-profile-run-on-record): its record and its held-out
analysis, rebuilt from the committed shards in ``validation/paper/``, give every figure the page publishes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from setgrpo_verl.merge import merge_calibration
from setgrpo_verl.validate import ValidationLevels, load_paired, run_validation

REPO = Path(__file__).resolve().parents[1]
SHARDS = REPO / "validation" / "paper"
PAGE = REPO / "docs" / "validation.md"

pytestmark = pytest.mark.skipif(not any(SHARDS.glob("batch_*.npz")), reason="no paper-profile shards in this checkout")


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("### The paper-profile run on record")
    return text[start:text.index("\n### ", start + 1)]


def _rows(section: str, first_header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header starts with ``first_header``, by their first cell."""
    lines = section[section.index(f"| {first_header} |"):].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper") / "calibration"
    record = merge_calibration([SHARDS], out)
    return record, load_paired(out / "paired_scores.npz")


@pytest.mark.slow
def test_table4_row_is_the_records(rebuilt):
    record, _ = rebuilt
    assert (record.alpha, record.beta, record.delta, record.K, len(record.tau_grid)) == (0.05, 0.08, 0.05, 4, 20)
    assert len(record.calibration_prompts) == 5446 and record.grader["flip_prob"] == 0.1
    assert record.srgo_procedure == "fixed_sequence" and record.tau_start == 0.25
    row = _rows(_section(), "backbone")
    ours = next(v for k, v in row.items() if "this run" in k)
    want = [f"{record.n_cov:,}", f"{record.n_risk:,}", f"{record.q_alpha:.3f}", f"{record.tau_sel:.2f}",
            f"{record.N:,}", f"{record.F:,}", f"{record.ecr:.4f}", f"{record.U:.3f}"]
    assert ours == want


@pytest.mark.slow
def test_table5_is_the_held_out_analysis(rebuilt):
    record, paired = rebuilt
    result = run_validation(paired, levels=ValidationLevels.from_record(record), n_splits=20, holdout_fraction=0.25,
                            first_seed=0)
    summary = result.report["summary"]
    rows = _rows(_section(), "method")
    names = {"GRPO": "grpo", "SetGRPO": "setgrpo", "spherical set": "spherical_set",
             "identity geometry": "identity_geometry", "safe anchor only": "safe_anchor_only"}
    assert set(rows) == set(names)
    for label, method in names.items():
        s = summary[method]
        mean = {k: s[k]["mean"] for k in ("coverage_reference", "coverage_truth", "reversal_rate_reference",
                                          "reversal_rate_truth", "accepted_ratio_live", "cumulative_recovery")}
        nur = f"{100 * mean['accepted_ratio_live']:.0f} %" if mean["accepted_ratio_live"] in (0.0, 1.0) \
            else _pct(mean["accepted_ratio_live"])
        risk = "-" if s["splits_with_accepted"] == 0 else f"{s['share_risk_at_most_beta']:.2f}"
        none = "-" if method == "grpo" else f"{s['splits_without_threshold']} of 20"
        want = [_pct(mean["coverage_reference"]), _pct(mean["coverage_truth"]), _pct(mean["reversal_rate_reference"]),
                _pct(mean["reversal_rate_truth"]), nur, f"{mean['cumulative_recovery']:.3f}", risk, none]
        assert rows[label] == want, label
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quoted = (f"held-out coverage is {rows['SetGRPO'][0]}", f"reverse in {rows['SetGRPO'][2]} of groups against "
              f"GRPO's {rows['GRPO'][2]}", f"updates only {rows['SetGRPO'][4]} of them")
    assert all(q in " ".join(readme.split()) for q in quoted), quoted
    # the figures the page's prose quotes: coverage at the nominal level, SetGRPO reverses less than GRPO
    assert abs(summary["setgrpo"]["coverage_reference"]["mean"] - 0.95) < 0.005
    assert summary["setgrpo"]["reversal_rate_reference"]["mean"] < record.beta < \
        summary["grpo"]["reversal_rate_reference"]["mean"]
