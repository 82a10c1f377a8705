"""A calibration record as text (docs/record.md#reading-the-guarantees): SRGO's selection, where a fixed
sequence's start came from, the tests in the order run, and the paper's Table 4 row."""

from __future__ import annotations

from typing import Any

from .record import CalibrationRecord
from .srgo import infeasible_text

__all__ = ["selection_text", "start_text", "table4_row", "threshold_test_lines"]


def selection_text(record: CalibrationRecord) -> str:
    """One line on SRGO's threshold (docs/algorithm.md#4-srgo): the selected tau and its bound, or, for a
    reject-all record, that no threshold is risk-feasible, the smallest bound, and that no group updates."""
    s = record.settings
    if record.tau_sel is not None:
        return f"tau_sel={record.tau_sel:.2f}, UCB {record.ucb_sel:.4f} <= beta={s.beta}"
    why = infeasible_text(s.tau_grid, record.n_accepted, record.n_reversals, record.ucb, beta=s.beta,
                          stopped_at=record.stopped_at if s.srgo_procedure == "fixed_sequence" else None)
    return (f"no risk-feasible threshold: {why}, so this record accepts no group and SetGRPO updates nothing; "
            "more calibration groups or a larger beta may certify one")


def start_text(record: CalibrationRecord) -> str | None:
    """Where a fixed sequence's ``tau_start`` came from and what its certificate assumes of it
    (docs/record.md#fields); None for Bonferroni, which has no start."""
    s, src = record.settings, record.tau_start_source
    if s.srgo_procedure == "bonferroni":
        return None
    if src.get("kind") == "pilot":
        return (f"tau_start={s.tau_start:.2f} is the tau_sel of pilot record {src['record_sha256'][:12]}, "
                "checked to share no prompt with this calibration")
    return (f"tau_start={s.tau_start:.2f} was set by the user: the certificate assumes it was fixed before the "
            "calibration data were seen, which nothing in the record can show (a start chosen from these groups "
            "voids the guarantee, docs/algorithm.md#43-where-the-start-comes-from)")


def threshold_test_lines(record: CalibrationRecord) -> list[str]:
    """SRGO's tests as lines of text (docs/algorithm.md#4-srgo): the procedure, where the start came from, and one
    line per test of a fixed sequence in the order run (threshold, N, F, p-value against its level, passed or
    failed); for Bonferroni the certified thresholds."""
    s = record.settings
    if s.srgo_procedure == "bonferroni":
        head = (f"SRGO procedure: bonferroni, each of the {len(s.tau_grid)} thresholds tested at level "
                f"delta/m = {s.delta / len(s.tau_grid):.4g}")
    else:
        src = record.tau_start_source
        origin = (f"pilot record {src['record_sha256'][:12]}" if src.get("kind") == "pilot" else "set by the user")
        stop = ("every test passed" if record.stopped_at is None
                else f"stopped at tau={s.tau_grid[record.stopped_at]:.2f}")
        head = (f"SRGO procedure: fixed_sequence from tau_start={s.tau_start:.2f} ({origin}) down the grid, "
                f"each test at level delta = {s.delta:g}; {stop}")
    lines = [head]
    if s.srgo_procedure == "bonferroni":  # every threshold is tested; the certified ones say it all
        passed = [f"{s.tau_grid[j]:.2f}" for j in record.test_order
                  if record.n_accepted[j] > 0 and record.ucb[j] <= s.beta]
        return lines + [f"  certified thresholds: {', '.join(passed) if passed else 'none'}"]
    if record.tau_start_source.get("kind") != "pilot":  # the pilot is named in the head line
        lines.append(f"  {start_text(record)}")
    for j, level in zip(record.test_order, record.test_levels):
        ok = record.n_accepted[j] > 0 and record.ucb[j] <= s.beta
        lines.append(f"  tau={s.tau_grid[j]:.2f}: N={record.n_accepted[j]}, F={record.n_reversals[j]}, "
                     f"p={record.p_values[j]:.3g} vs level {level:.4g} -> {'passed' if ok else 'failed'}")
    return lines


def table4_row(record: CalibrationRecord) -> dict[str, Any]:
    """The paper's Table 4 row: Cov., Risk, Q_alpha, tau_sel, N, F, ECR, U."""
    return {"Cov.": record.n_cov, "Risk": record.n_risk, "Qα": record.q_alpha, "τsel": record.tau_sel,
            "N": record.N, "F": record.F, "ECR": record.ecr, "U": record.U}
