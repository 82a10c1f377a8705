"""The paper-profile run on record (docs/validation.md#the-paper-profile-run-on-record): its record and its held-out
analysis, rebuilt from the committed shards in ``validation/paper/``, give the page's Tables 4 and 5, the fixed
sequence's tests and data counts it quotes, and the README's figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from setgrpo_verl.runner.merge import merge_calibration
from setgrpo_verl.runner.validate import load_paired, run_validation

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


def _flat(text: str) -> str:
    return " ".join(text.split())


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
    levels = record.settings
    assert (levels.alpha, levels.beta, levels.delta, record.K, len(levels.tau_grid)) == (0.05, 0.08, 0.05, 4, 20)
    assert len(record.calibration_prompts) == 5446 and record.grader["flip_prob"] == 0.1
    assert record.settings.srgo_procedure == "fixed_sequence" and record.settings.tau_start == 0.25
    section = _section()
    ours = next(v for k, v in _rows(section, "backbone").items() if "this run" in k)
    want = [f"{record.n_cov:,}", f"{record.n_risk:,}", f"{record.q_alpha:.3f}", f"{record.tau_sel:.2f}",
            f"{record.N:,}", f"{record.F:,}", f"{record.ecr:.4f}", f"{record.U:.3f}"]
    assert ours == want
    # the fixed sequence's tests as the page quotes them, from tau_start = 0.25 down to the failed test at 0.05
    section = _flat(section)
    at = {round(tau, 2): j for j, tau in enumerate(record.settings.tau_grid)}
    n, f, p = record.n_accepted, record.n_reversals, record.p_values
    s = at[record.tau_sel]
    quoted = [f"0.25 (N = {n[at[0.25]]}, F = {f[at[0.25]]}, p = {p[at[0.25]]:.3f})",
              *(f"{tau:.2f} ({n[at[tau]]}, {f[at[tau]]})" for tau in (0.20, 0.15)),
              f"0.10 ({n[s]}, {f[s]}, p = {p[s]:.3f}; Clopper-Pearson bound {record.ucb[s]:.4f} <= beta = 0.08)",
              f"stopped at 0.05 ({n[at[0.05]]}, {f[at[0.05]]}, p = {p[at[0.05]]:.3f}"]
    assert [q for q in quoted if q not in section] == []
    assert record.test_order[-1] == record.stopped_at == at[0.05]
    assert f"{record.n_degenerate} groups are degenerate" in section


@pytest.mark.slow
def test_table5_is_the_held_out_analysis(rebuilt):
    record, paired = rebuilt
    result = run_validation(paired, levels=record.settings, n_splits=20, holdout_fraction=0.25,
                            first_seed=0)
    summary = result.report["summary"]
    section = _section()
    rows = _rows(section, "method")
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
    data = result.report["data"]
    section = _flat(section)
    assert f"{data['truth_degenerate_groups']} have a constant truth" in section
    assert f"differ by {data['mean_abs_point_minus_reference']:.3f} on average" in section
    readme = _flat((REPO / "README.md").read_text(encoding="utf-8"))
    quoted = (f"held-out coverage is {rows['SetGRPO'][0]}", f"reverse in {rows['SetGRPO'][2]} of groups against "
              f"GRPO's {rows['GRPO'][2]}", f"updates only {rows['SetGRPO'][4]} of them")
    assert all(q in readme for q in quoted), quoted
    # the figures the page's prose quotes: coverage at the nominal level, SetGRPO reverses less than GRPO
    assert abs(summary["setgrpo"]["coverage_reference"]["mean"] - 0.95) < 0.005
    assert summary["setgrpo"]["reversal_rate_reference"]["mean"] < record.settings.beta < \
        summary["grpo"]["reversal_rate_reference"]["mean"]
