"""SetGRPO mathematics (docs/algorithm.md): no verl import, float64, batched over groups.

The documented API (docs/algorithm.md#8-core-api)::

    grpo_coefficients(scores [G,K], norm_by_std=True, eps=1e-6) -> [G,K]
    grpo_jacobian(scores [G,K], norm_by_std=True, eps=1e-6)     -> [G,K,K]
    CalibrationSettings(alpha, beta, delta, tau_grid, rho, ...)  -> the one validated settings object
    calibrate(point, reference, gram, settings, *, split_seed, metadata, ...) -> CalibrationRecord (.settings)
    setgrpo_coefficients(point, gram, record, *, ablation=None) -> SetGRPOResult
    OnlineRiskMonitor(record).update(result, reference, gram)   -> metrics dict
    reliability_coefficients(point [G,K], reference [G,K])      -> [G,K] (the reliability-weighted variant)
    check_identity(...)                                          -> the one compatibility check of records and shards

The building blocks live in public submodules, for diagnostics and tests: ``core.grpo``, ``core.jrsc`` (coefficient
sets), ``core.ggsr`` (safe anchor, recovery), ``core.srgo`` (threshold tests, sample size), ``core.sequential``
(anytime-valid evidence), ``core.reversal``, ``core.calibration``, ``core.coefficients``, ``core.monitor``,
``core.settings``, ``core.record`` (docs/record.md), ``core.record_text``, ``core.compatibility``,
``core.identity``, ``core.shards`` (docs/record.md#calibration-shards), ``core.bands``
(docs/record.md#reading-the-guarantees), ``core.reliability`` and ``core.regime``
(docs/record.md#the-judges-regime).
"""

from .calibration import calibrate
from .coefficients import SetGRPOResult, setgrpo_coefficients
from .grpo import grpo_coefficients, grpo_jacobian
from .identity import check_identity
from .monitor import OnlineRiskMonitor
from .record import SCHEMA_VERSION, CalibrationRecord
from .reliability import reliability_coefficients, reliability_weights
from .settings import ABLATIONS, VARIANTS, CalibrationSettings

__all__ = [
    "ABLATIONS",
    "SCHEMA_VERSION",
    "VARIANTS",
    "CalibrationRecord",
    "CalibrationSettings",
    "OnlineRiskMonitor",
    "SetGRPOResult",
    "calibrate",
    "check_identity",
    "grpo_coefficients",
    "grpo_jacobian",
    "reliability_coefficients",
    "reliability_weights",
    "setgrpo_coefficients",
]
