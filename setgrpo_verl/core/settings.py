"""The one validated set of calibration settings (docs/algorithm.md#41-defaults).

:class:`CalibrationSettings` is the only place where the levels, the threshold grid, the ridge, the recovery grid
and the ablation are checked. :func:`setgrpo_verl.core.calibrate` takes one, and the calibration record stores it
(``record.settings``). It is built in one place per source: from the ``algorithm.setgrpo`` block by
``SetGRPOConfig.calibration_settings`` (the run's check before Ray and the command line), and from a JSON dict by
:meth:`CalibrationSettings.from_dict` (shards, records), so that a setting refused by core is refused before any
rollout, with the same message. A leaf module: it imports nothing from the rest of the package but the grid default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from .srgo import DEFAULT_TAU_GRID, PROCEDURES

#: Ablations of docs/algorithm.md#6-diagnostics (``None`` is the full method).
ABLATIONS = ("spherical_set", "identity_geometry", "safe_anchor_only", "fixed_threshold", "random_discard")
#: Variants of the method (docs/algorithm.md#41-defaults): ``paper`` is the method of the paper; further variants
#: are added here, the one list every check reads.
VARIANTS = ("paper",)
#: What calibration does when no threshold is risk-feasible (docs/algorithm.md#4-srgo).
ON_INFEASIBLE = ("error", "reject_all")
#: Default most coverage-calibration groups (docs/algorithm.md#41-defaults): the conformal radius at alpha = 0.05
#: is settled by a few hundred to about 1,000 groups, while the risk tests need thousands; past this count every
#: further group goes to the risk set.
COVERAGE_GROUPS = 1000


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


@dataclass(frozen=True)
class CalibrationSettings:
    """Validated settings of one calibration (docs/algorithm.md#2-jrsc, #3-ggsr, #4-srgo, #41-defaults).

    Attributes:
        alpha, beta, delta: miscoverage, risk level and failure probability, each in the open interval (0, 1).
        tau_grid: SRGO thresholds, strictly increasing, each strictly inside (-1, 1); ``fixed_tau`` is inserted
            when absent. Stored as a tuple of floats.
        rho: scale-free ridge of the set shape; finite, > 0 for the GRPO coefficient map with the Jacobian set
            shape (the Jacobian is singular along the coefficient vector), >= 0 for Dr.GRPO or the
            ``spherical_set`` ablation.
        grid_size: recovery grid intervals N, an integer >= 1.
        ablation: None (the full method) or one of :data:`ABLATIONS`.
        fixed_tau: the threshold of ``ablation="fixed_threshold"`` (strictly inside (-1, 1)); None otherwise.
        risk_fraction: share of the non-degenerate groups used for risk calibration, in (0, 1).
        norm_by_std: the coefficient map: True for GRPO (divide by the group's std), False for Dr.GRPO.
        eps: verl's std epsilon of the coefficient map, finite and >= 0.
        on_infeasible: ``"error"`` or ``"reject_all"`` when no threshold is risk-feasible.
        coverage_groups: most coverage-calibration groups (an integer >= 1, default :data:`COVERAGE_GROUPS`), or
            None for no cap: the coverage set gets ``1 - risk_fraction`` of the groups up to this count, the risk
            set all the rest.
        srgo_procedure: SRGO's test over the grid, one of ``bonferroni`` (the paper's) and ``fixed_sequence``
            (Learn then Test, docs/algorithm.md#4-srgo).
        tau_start: the fixed sequence's first threshold, on ``tau_grid``; required for ``fixed_sequence``, None for
            ``bonferroni``. It must be chosen without the calibration groups (a pilot record or the user).
        variant: the method's variant, one of :data:`VARIANTS` (default ``"paper"``).

    Raises:
        ValueError: on construction, naming the first invalid field as ``<field>=<value>`` followed by the
            admissible range (callers prefix their own key path, e.g. ``algorithm.setgrpo.``).
    """

    alpha: float = 0.05
    beta: float = 0.08
    delta: float = 0.05
    tau_grid: tuple[float, ...] = DEFAULT_TAU_GRID
    rho: float = 0.1
    grid_size: int = 100
    ablation: Optional[str] = None
    fixed_tau: Optional[float] = None
    risk_fraction: float = 0.5
    norm_by_std: bool = True
    eps: float = 1e-6
    on_infeasible: str = "error"
    coverage_groups: Optional[int] = COVERAGE_GROUPS
    srgo_procedure: str = "bonferroni"
    tau_start: Optional[float] = None
    variant: str = "paper"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}: choose one of {VARIANTS}")
        for name in ("alpha", "beta", "delta", "risk_fraction"):
            value = getattr(self, name)
            if not (_is_number(value) and 0.0 < float(value) < 1.0):
                raise ValueError(f"{name}={value!r} must be a number in the open interval (0, 1)")
            object.__setattr__(self, name, float(value))
        if self.ablation is not None and self.ablation not in ABLATIONS:
            raise ValueError(f"ablation={self.ablation!r}: choose None (the full method) or one of {ABLATIONS}")
        if (self.ablation == "fixed_threshold") != (self.fixed_tau is not None):
            raise ValueError(f"fixed_tau={self.fixed_tau!r} must be set exactly when ablation='fixed_threshold' "
                             f"(got ablation={self.ablation!r})")
        if self.fixed_tau is not None and not (_is_number(self.fixed_tau) and -1.0 < float(self.fixed_tau) < 1.0):
            raise ValueError(f"fixed_tau={self.fixed_tau!r} must be a number strictly inside (-1, 1)")
        grid = self.tau_grid if self.tau_grid is not None else DEFAULT_TAU_GRID
        if isinstance(grid, (str, bytes)) or not hasattr(grid, "__iter__") or not all(_is_number(t) for t in grid):
            shown = list(grid) if isinstance(grid, (list, tuple)) else grid
            raise ValueError(f"tau_grid={shown!r} must be a list of finite numbers")
        grid = [float(t) for t in grid]
        if self.fixed_tau is not None and float(self.fixed_tau) not in grid:
            grid = sorted(grid + [float(self.fixed_tau)])
        if not grid or any(b <= a for a, b in zip(grid, grid[1:])) or not all(-1.0 < t < 1.0 for t in grid):
            raise ValueError(f"tau_grid={grid} must be non-empty, strictly increasing and strictly inside (-1, 1) "
                             "(the thresholds are cosines of the recovered direction; the default is 0.00, 0.05, "
                             "..., 0.95)")
        object.__setattr__(self, "tau_grid", tuple(grid))
        if self.fixed_tau is not None:
            object.__setattr__(self, "fixed_tau", float(self.fixed_tau))
        if not isinstance(self.norm_by_std, bool):
            raise ValueError(f"norm_by_std={self.norm_by_std!r} must be True (GRPO) or False (Dr.GRPO)")
        if not (_is_number(self.eps) and float(self.eps) >= 0.0):
            raise ValueError(f"eps={self.eps!r} must be a finite number >= 0")
        object.__setattr__(self, "eps", float(self.eps))
        if not (_is_number(self.rho) and float(self.rho) >= 0.0):
            raise ValueError(f"rho={self.rho!r} must be a finite number > 0 (default 0.1)")
        if float(self.rho) == 0.0 and self.norm_by_std and self.ablation != "spherical_set":
            raise ValueError(f"rho={self.rho!r} must be > 0 (default 0.1) for the GRPO coefficient map: its Jacobian "
                             "is singular along the coefficient vector, so the set shape needs a ridge (rho = 0 is "
                             "admissible only for Dr.GRPO or the spherical_set ablation)")
        object.__setattr__(self, "rho", float(self.rho))
        if isinstance(self.grid_size, bool) or not isinstance(self.grid_size, int) or self.grid_size < 1:
            raise ValueError(f"grid_size={self.grid_size!r} must be an integer >= 1 (default 100)")
        if self.on_infeasible not in ON_INFEASIBLE:
            raise ValueError(f"on_infeasible={self.on_infeasible!r}: choose one of {ON_INFEASIBLE}")
        if self.coverage_groups is not None and (isinstance(self.coverage_groups, bool) or not isinstance(
                self.coverage_groups, int) or self.coverage_groups < 1):
            raise ValueError(f"coverage_groups={self.coverage_groups!r} must be an integer >= 1 (default "
                             f"{COVERAGE_GROUPS}) or None (no cap: the risk_fraction split alone)")
        self._check_procedure()

    def _check_procedure(self) -> None:
        if self.srgo_procedure not in PROCEDURES:
            raise ValueError(f"srgo_procedure={self.srgo_procedure!r}: choose one of {PROCEDURES}")
        if self.srgo_procedure == "bonferroni":
            if self.tau_start is not None:
                raise ValueError(f"tau_start={self.tau_start!r} is for srgo_procedure=fixed_sequence only; leave it "
                                 "null for bonferroni")
            return
        if self.tau_start is None or not _is_number(self.tau_start) or float(self.tau_start) not in self.tau_grid:
            raise ValueError(f"tau_start={self.tau_start!r} must be one of the thresholds of tau_grid "
                             f"{list(self.tau_grid)} for srgo_procedure=fixed_sequence: the first threshold tested, "
                             "chosen before calibration (from a pilot record on disjoint prompts, or by you)")
        object.__setattr__(self, "tau_start", float(self.tau_start))

    def replace(self, **changes: Any) -> CalibrationSettings:
        """A copy with ``changes`` applied, validated again (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (``tau_grid`` as a list): what shards and records store."""
        out = dataclasses.asdict(self)
        out["tau_grid"] = list(self.tau_grid)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CalibrationSettings:
        """The settings of a :meth:`to_dict` dict; a key it lacks takes its default (``variant`` is ``"paper"`` in
        dicts written before variants existed).

        Raises:
            ValueError: not a dict, a key that is no field (named, with the fields), or a value the constructor
                refuses.
        """
        if not isinstance(data, dict):
            raise ValueError(f"calibration settings are a JSON object, got {type(data).__name__} {data!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"calibration settings have unknown keys {unknown}; the fields are {names}")
        return cls(**data)
