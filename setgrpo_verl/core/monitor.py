"""The online coverage and accepted-reversal monitor of training steps (docs/algorithm.md#6-diagnostics)."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from ._checks import check_gram, check_scores
from .grpo import grpo_coefficients
from .jrsc import mahalanobis, set_shape
from .record import CalibrationRecord
from .reversal import reversal_events
from .sequential import anytime_upper_bound, risk_evidence
from .coefficients import SetGRPOResult

logger = logging.getLogger(__name__)


class OnlineRiskMonitor:
    """Running coverage and accepted-reversal monitor for training steps (docs/algorithm.md#6-diagnostics).

    When reference scores are available during training, each :meth:`update` counts, over the
    step's non-degenerate groups, whether ``a' = T(r')`` lies in the group's coefficient set
    (online coverage) and, over accepted groups, the reversal events of :func:`reversal_events` (the
    event calibration counts). The cumulative counts (F reversals of N accepted groups) are read
    with anytime-valid evidence (:func:`risk_evidence`), so looking after every step keeps the error:

    * ``online_risk_certified`` is 1 while the e-value against "risk >= beta" is at least ``1 / delta``;
      if the risk of accepted groups is above beta throughout, this happens at any step of a run with
      probability at most delta (a fixed-N Clopper-Pearson bound recomputed every step would not:
      it certifies falsely far more often).
    * ``online_reversal_ucb`` is the anytime-valid upper bound (:func:`anytime_upper_bound`); it is
      ``<= beta`` exactly when the flag is 1.
    * Policy drift is signalled (``online_risk_drift`` = 1, a warning through ``warnings.warn`` and
      the ``setgrpo`` logger when it turns on) once the e-value against "risk <= beta" reaches
      ``1 / delta``: evidence at level delta that accepted updates reverse more often than beta.

    The counts pool every step since the monitor started, so a drift late in a long run shows only
    once its reversals outweigh the earlier evidence; the per-step ``online_reversal_rate`` shows it
    without delay, but carries no guarantee.
    """

    def __init__(self, record: CalibrationRecord):
        self.record = record
        self.covered = 0
        self.seen = 0
        self.accepted = 0
        self.reversals = 0
        self.certified = False
        self.drift = False

    def state_dict(self) -> dict[str, Any]:
        """The running counts (ints) and the two flags, JSON-ready, for a training checkpoint."""
        return {"covered": self.covered, "seen": self.seen, "accepted": self.accepted, "reversals": self.reversals,
                "certified": self.certified, "drift": self.drift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (a resumed run, docs/algorithm.md#6-diagnostics); the flags are
        re-derived from the counts (a checkpoint of an older version without them loads the same way).

        Raises:
            ValueError: missing keys, negative counts, or more covered / reversed groups than seen / accepted.
        """
        try:
            counts = {k: int(state[k]) for k in ("covered", "seen", "accepted", "reversals")}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"online monitor state {state!r} is incomplete: {exc}") from None
        if min(counts.values()) < 0 or counts["covered"] > counts["seen"] or counts["reversals"] > counts["accepted"]:
            raise ValueError(f"online monitor state {state!r} is inconsistent")
        self.covered, self.seen = counts["covered"], counts["seen"]
        self.accepted, self.reversals = counts["accepted"], counts["reversals"]
        self.certified, self.drift = self._flags()

    def _flags(self) -> tuple[bool, bool]:
        low, high = risk_evidence([self.reversals], [self.accepted], self.record.settings.beta)
        bar = math.log(1.0 / self.record.settings.delta)
        return bool(low[0] >= bar), bool(high[0] >= bar)

    def update(self, result: SetGRPOResult, reference: torch.Tensor, gram: torch.Tensor,
               prefix: str = "setgrpo/") -> dict[str, float]:
        """Add one step's groups; return ``{name: float}`` metrics.

        Args:
            result: the step's :class:`SetGRPOResult`.
            reference: ``[G, K]`` reference scores of the same responses.
            gram: ``[G, K, K]`` the step's Gram matrices.

        Raises:
            ValueError: shapes that do not match the result.
        """
        check_scores(reference, "reference")
        g, k = reference.shape
        if tuple(result.coefficients.shape) != (g, k):
            raise ValueError(f"reference scores {tuple(reference.shape)} do not match the result's groups "
                             f"{tuple(result.coefficients.shape)}")
        m = check_gram(gram, g, k)
        rec, rs = self.record, self.record.settings
        a_ref = grpo_coefficients(reference.to(torch.float64), rs.norm_by_std, rs.eps)
        live = torch.tensor([s != "degenerate" for s in result.status])
        covered = torch.zeros(g, dtype=torch.bool)
        if live.any():
            shape = "spherical" if rs.ablation == "spherical_set" else "jacobian"
            _, pinv = set_shape(result.point[live], rho=rs.rho, norm_by_std=rs.norm_by_std, eps=rs.eps,
                                shape=shape)
            covered[live] = mahalanobis(a_ref[live] - result.grpo[live], pinv) <= rec.q_alpha
        rev = reversal_events(result.coefficients, m, reference, result.accepted, norm_by_std=rs.norm_by_std,
                              eps=rs.eps, degenerate_rtol=rec.degenerate_rtol)
        n_live, n_acc = int(live.sum()), int(result.accepted.sum())
        self.seen += n_live
        self.covered += int(covered.sum())
        self.accepted += n_acc
        self.reversals += int(rev.sum())
        was_drift = self.drift
        self.certified, self.drift = self._flags()
        ucb = anytime_upper_bound(self.reversals, self.accepted, rs.delta)
        if self.drift and not was_drift:
            msg = (f"SetGRPO online monitor: {self.reversals}/{self.accepted} accepted groups reversed, evidence at "
                   f"level delta={rs.delta} (anytime-valid) that the reversal risk is above beta={rs.beta}; the "
                   "policy may have drifted from the calibration policy - consider recalibrating")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        out = {
            "online_coverage": float(covered[live].double().mean()) if n_live else math.nan,
            "online_coverage_cum": self.covered / self.seen if self.seen else math.nan,
            "online_reversal_rate": float(rev.sum()) / n_acc if n_acc else math.nan,
            "online_reversal_rate_cum": self.reversals / self.accepted if self.accepted else math.nan,
            "online_reversal_ucb": ucb,
            "online_risk_certified": float(self.certified),
            "online_risk_drift": float(self.drift),
        }
        return {prefix + k: v for k, v in out.items()}
