"""Reports of a run directory: the calibration and training figures and tables (:mod:`.run`) and a validation's
table, figure and folder (:mod:`.validation`)."""

from .run import ReportError, coverage_curve, format_table4, inspect_record, load_metrics, make_report, policy_label
from .validation import plot_validation, summary_table, write_validation

__all__ = ["ReportError", "coverage_curve", "format_table4", "inspect_record", "load_metrics", "make_report",
           "plot_validation", "policy_label", "summary_table", "write_validation"]
