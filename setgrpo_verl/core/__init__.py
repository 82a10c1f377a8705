"""SetGRPO mathematics (docs/algorithm.md): no verl import, float64, batched over groups.

Public API::

    grpo_coefficients(scores [G,K], norm_by_std=True, eps=1e-6) -> [G,K]
    grpo_jacobian(scores [G,K], norm_by_std=True, eps=1e-6)     -> [G,K,K]
    CalibrationSettings(alpha, beta, delta, tau_grid, rho, ...)  -> the one validated settings object
    calibrate(point, reference, gram, settings, *, split_seed, metadata, ...) -> CalibrationRecord (.settings)
    setgrpo_coefficients(point, gram, record, *, ablation=None) -> SetGRPOResult
    OnlineRiskMonitor(record).update(result, reference, gram)   -> metrics dict
    reliability_coefficients(point [G,K], reference [G,K])      -> [G,K] (the reliability-weighted variant)

Building blocks (for diagnostics and tests): ``degenerate_groups``, ``coverage_risk_split``, ``set_shape``,
``nonconformity_scores``, ``conformal_radius``, ``CoefficientSets``, ``safe_anchor``,
``projections``, ``recovery_ratios``, ``reversal_events``, ``clopper_pearson_upper``, ``binomial_p_values``,
``threshold_tests``, ``select_threshold``, ``certification_power``, ``required_accepted_groups``, ``pilot_start``,
``risk_evidence``, ``anytime_upper_bound``.

Calibration shards (docs/record.md#calibration-shards): ``shard_identity``, ``write_shard``, ``read_shard``,
``load_shards``, ``record_from_shards``, ``in_part`` / ``parse_part``; ``check_identity`` is the one compatibility
check of records and shards.

Reading a record's figures (docs/record.md#reading-the-guarantees): ``coverage_band``, ``risk_share_floor``,
``resplit`` and ``guarantee_lines``.
"""

from ._api import STATUSES, OnlineRiskMonitor, SetGRPOResult, calibrate, coverage_risk_split, setgrpo_coefficients
from ._bands import CoverageBand, Resplits, coverage_band, guarantee_lines, resplit, risk_share_floor
from ._ggsr import path_point, projections, recovery_ratios, safe_anchor
from ._grpo import DEGENERATE_RTOL, degenerate_groups, grpo_coefficients, grpo_jacobian
from ._jrsc import CoefficientSets, conformal_radius, min_calibration_groups, nonconformity_scores, set_shape
from ._identity import IdentityWarning, check_identity
from ._record import (
    SCHEMA_VERSION,
    CalibrationRecord,
    RecordVersionWarning,
    content_sha256,
    package_versions,
    pilot_start,
    prompt_fingerprint,
    question_key,
)
from ._shards import (
    DROP_REASONS,
    SHARD_DIR,
    CalibrationShard,
    TornShardError,
    in_part,
    load_shards,
    parse_part,
    pilot_source,
    read_shard,
    record_from_shards,
    shard_identity,
    shard_name,
    shard_start_source,
    shard_versions,
    write_calibration,
    write_shard,
)
from ._reliability import reliability_coefficients, reliability_weights
from ._reversal import reference_coefficients, reversal_events
from ._sequential import anytime_upper_bound, risk_evidence
from ._settings import ABLATIONS, COVERAGE_GROUPS, ON_INFEASIBLE, VARIANTS, CalibrationSettings
from ._srgo import (
    DEFAULT_TAU_GRID,
    PROCEDURES,
    ThresholdTests,
    binomial_p_values,
    certification_power,
    calibration_groups_needed,
    clopper_pearson_upper,
    power_plan,
    required_accepted_groups,
    required_risk_groups,
    risk_group_power,
    select_threshold,
    threshold_tests,
)

__all__ = [
    "ABLATIONS", "COVERAGE_GROUPS", "VARIANTS", "DEFAULT_TAU_GRID", "PROCEDURES", "ThresholdTests", "anytime_upper_bound",
    "binomial_p_values", "certification_power", "content_sha256", "pilot_start", "reference_coefficients",
    "reversal_events", "risk_evidence", "threshold_tests", "calibration_groups_needed", "power_plan",
    "required_risk_groups", "risk_group_power", "DEGENERATE_RTOL", "ON_INFEASIBLE", "SCHEMA_VERSION", "STATUSES",
    "CalibrationRecord", "CalibrationSettings", "CoefficientSets", "CoverageBand", "OnlineRiskMonitor",
    "IdentityWarning", "RecordVersionWarning", "Resplits", "SetGRPOResult",
    "calibrate", "clopper_pearson_upper", "conformal_radius", "coverage_band", "guarantee_lines", "resplit",
    "risk_share_floor", "degenerate_groups", "grpo_coefficients",
    "grpo_jacobian", "min_calibration_groups", "nonconformity_scores", "package_versions", "path_point",
    "projections", "prompt_fingerprint", "question_key", "recovery_ratios", "required_accepted_groups", "safe_anchor", "select_threshold", "set_shape",
    "setgrpo_coefficients", "coverage_risk_split", "check_identity", "DROP_REASONS", "SHARD_DIR", "CalibrationShard", "TornShardError", "in_part",
    "load_shards", "parse_part", "pilot_source", "read_shard", "record_from_shards", "shard_identity", "shard_name", "shard_start_source", "shard_versions", "write_calibration",
    "write_shard", "reliability_coefficients", "reliability_weights",
]
