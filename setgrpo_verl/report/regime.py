"""The judge's regime of a calibration, printed by ``report`` and ``inspect-record`` (docs/record.md#the-judges-regime).

Reads the two scorings and the Gram matrices of every calibration group from the calibration's shards
(``<calibration>/shards/``, docs/record.md#calibration-shards), the rubrics' criterion points from the shards (graders
that know the truth store them) or else from the run's calibration prompts (``<run-dir>/data/calibration.parquet``,
matched by each prompt's rubric hash), estimates the regime (:func:`setgrpo_verl.core.regime.judge_regime`) and
places it in the README's decision table with the outcome lab's numbers at the nearest noise level
(docs/outcome.md#the-result-per-regime).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["LAB", "LAB_FLIPS", "LAB_K", "calibration_regime", "regime_lines", "regime_report"]

#: The outcome lab's paired differences in truth-reward gain at K 4 (8 seeds, 150 steps, SGD; mean and 95 %
#: half-width; validation/outcome_lab/full.json, re-read by tests/test_outcome_lab.py): per flip rate,
#: ``mean2_vs_grpo`` GRPO on the mean of two minus plain GRPO at equal steps, ``grpo_vs_mean2_calls`` plain GRPO
#: minus GRPO on the mean of two at equal grader calls, ``reliability_vs_mean2`` and ``paper_vs_mean2`` the
#: reliability weights and SetGRPO's gate at the paper's levels minus GRPO on the mean of two at equal steps.
LAB = {
    0.05: {"mean2_vs_grpo": (-0.001, 0.007), "grpo_vs_mean2_calls": (0.036, 0.008),
           "reliability_vs_mean2": (0.009, 0.010), "paper_vs_mean2": (-0.013, 0.012)},
    0.1: {"mean2_vs_grpo": (0.008, 0.003), "grpo_vs_mean2_calls": (0.031, 0.009),
          "reliability_vs_mean2": (0.001, 0.008), "paper_vs_mean2": (-0.057, 0.013)},
    0.2: {"mean2_vs_grpo": (0.010, 0.005), "grpo_vs_mean2_calls": (0.025, 0.008),
          "reliability_vs_mean2": (0.005, 0.008), "paper_vs_mean2": (-0.336, 0.005)},
    0.3: {"mean2_vs_grpo": (0.028, 0.011), "grpo_vs_mean2_calls": (0.018, 0.012),
          "reliability_vs_mean2": (-0.015, 0.007), "paper_vs_mean2": (-0.325, 0.005)},
}
LAB_FLIPS = tuple(sorted(LAB))
#: The group sizes the lab ran (its table above is K 4's).
LAB_K = (4, 8)


def _signed(pair: tuple[float, float]) -> str:
    return f"{pair[0]:+.3f} ± {pair[1]:.3f}"


def _concentration(calibration: Path, shards: list, groups: int) -> tuple[np.ndarray | None, str]:
    """Each group's rubric concentration (``core.regime.criterion_concentration``) and where it came from."""
    from ..core.regime import criterion_concentration

    if all(s.criterion_points is not None for s in shards):
        h = [criterion_concentration(row) for s in shards for row in s.criterion_points]
        return np.asarray(h), "the shards' criterion points"
    data = calibration.parent / "data" / "calibration.parquet"
    if not data.is_file():
        return None, f"no criterion points in the shards and no {data}"
    from ..core.record import prompt_fingerprint
    from ..integration.prompts import read_prompt_rubrics

    by_hash = {}
    for prompt_id, question, rubric in read_prompt_rubrics(data):
        try:
            by_hash[prompt_fingerprint(prompt_id, question, rubric)["rubric_sha256"]] = criterion_concentration(
                [c["points"] for c in rubric])
        except (TypeError, KeyError, ValueError):
            continue  # not a rubric of criteria with points: no flip rate for it
    h = [by_hash.get(s.prompts[i]["rubric_sha256"]) for s in shards for i in s.prompt_index]
    if any(v is None for v in h) or len(h) != groups:
        return None, f"{sum(v is None for v in h)} calibration groups without a rubric of criterion points in {data}"
    return np.asarray(h), f"the rubrics of {data}"


def calibration_regime(calibration: str | os.PathLike, *, norm_by_std: bool = True, eps: float = 1e-6,
                       degenerate_rtol: float | None = None):
    """The regime of the calibration directory ``calibration`` (its ``shards/``), and where the rubrics' points came
    from: ``(Regime, source)``, or ``(None, why)`` when the directory holds no shards.

    Raises:
        ValueError: a shard that does not read (naming the file), or what ``judge_regime`` refuses.
    """
    from ..core.grpo import DEGENERATE_RTOL
    from ..core.regime import judge_regime
    from ..core.shards import SHARD_DIR, load_shards

    calibration = Path(calibration)
    found, _ = load_shards(calibration / SHARD_DIR)
    if not found:
        return None, f"no calibration shards in {calibration / SHARD_DIR}"
    shards = [found[i] for i in sorted(found)]
    point = np.concatenate([s.point for s in shards])
    reference = np.concatenate([s.reference for s in shards])
    gram = np.concatenate([s.gram for s in shards])
    h, source = _concentration(calibration, shards, len(point))
    regime = judge_regime(point, reference, gram, h, norm_by_std=norm_by_std, eps=eps,
                          degenerate_rtol=DEGENERATE_RTOL if degenerate_rtol is None else degenerate_rtol)
    return regime, source


def regime_lines(regime, source: str = "") -> list[str]:
    """The regime as the report prints it: the estimates with their bands, then the decision table's rows at the lab's
    nearest flip rate (docs/outcome.md#the-result-per-regime) and a warning where the regime is outside the lab's."""
    lines = [f"judge's regime ({regime.groups} calibration groups of K={regime.k}, every response scored twice; "
             "95 % bands; docs/record.md#the-judges-regime):",
             f"  noise variance of one scoring {regime.noise_var.text('.4f')}, "
             f"{regime.noise_share.text('.1f', 100)} % of one scoring's within-group variance",
             f"  GRPO updates a re-scoring reverses: {regime.reversed_share.text('.1f', 100)} % "
             f"({regime.reversed} of {regime.updates} groups with spread)"]
    if regime.flip_rate is None:
        lines.insert(2, f"  verdict flip rate: not estimated ({source}); the lab's rows are indexed by it")
        return lines
    flip = regime.flip_rate
    lines.insert(2, f"  verdict flip rate {flip.text()} (a rubric grader whose verdicts flip independently; from "
                 f"{source})")
    near = min(LAB_FLIPS, key=lambda f: abs(f - flip.value))
    lab = LAB[near]
    noisy = near >= 0.1  # from flip 0.1 the lab puts the mean of two a whole band above plain GRPO
    lines += [f"  decision table (README), the outcome lab at the nearest flip rate {near}, K 4 (truth-reward gain, "
              "8 seeds):",
              ("    steps scarce: GRPO on the mean of two scorings, "
               f"{_signed(lab['mean2_vs_grpo'])} over plain GRPO [+reward.reward_kwargs.point=mean]" if noisy else
               "    steps scarce: plain GRPO; a second scoring averaged in adds "
               f"{_signed(lab['mean2_vs_grpo'])} [--estimator grpo]"),
              "    grader calls scarce: plain GRPO for more steps, "
              f"{_signed(lab['grpo_vs_mean2_calls'])} over GRPO on the mean of two at equal calls [--estimator grpo]",
              f"    reliability weights: {_signed(lab['reliability_vs_mean2'])} against GRPO on the mean of two "
              "[algorithm.setgrpo.variant=reliability]",
              "    a certificate needed: SetGRPO's gate at the paper's levels, "
              f"{_signed(lab['paper_vs_mean2'])} against GRPO on the mean of two"
              + (" (it trains nothing at this noise)" if lab["paper_vs_mean2"][0] < -0.3 else "")
              + " [algorithm.setgrpo.variant=paper]"]
    outside = []
    if flip.low < LAB_FLIPS[0] or flip.high > LAB_FLIPS[-1]:
        outside.append(f"the flip rate's band reaches outside the lab's {LAB_FLIPS[0]}-{LAB_FLIPS[-1]}")
    if regime.k not in LAB_K:
        outside.append(f"the lab ran K {' and '.join(map(str, LAB_K))}, not K {regime.k}")
    if outside:
        lines.append(f"  warning: {'; '.join(outside)}: the lab's numbers above are the nearest it has, not this "
                     "regime's")
    return lines


def regime_report(calibration: str | os.PathLike, record=None) -> list[str]:
    """:func:`regime_lines` of a calibration directory, or one line saying why there is none."""
    kwargs = {}
    if record is not None:
        kwargs = dict(norm_by_std=record.settings.norm_by_std, eps=record.settings.eps,
                      degenerate_rtol=record.degenerate_rtol)
    try:
        regime, source = calibration_regime(calibration, **kwargs)
    except ValueError as exc:
        return [f"judge's regime: not read ({exc})"]
    if regime is None:
        return [f"judge's regime: not read ({source})"]
    return regime_lines(regime, source)

