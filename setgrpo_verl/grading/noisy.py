"""A grader with known noise: random, independent flips of each criterion verdict (docs/validation.md#noisy-grader).

:class:`NoisyGrader` wraps any rubric grader. In every scoring it takes the base grader's verdicts and flips each
parsed one (``met`` <-> ``unmet``) independently with probability ``flip_prob``, then recomputes the rubric score
(:func:`~.rubric.rubric_score`). It simulates an LLM judge that makes random verdict errors at a rate the user sets;
it does not model a real judge's systematic errors (errors that depend on the response, the criterion or each
other).

The flip of criterion j of a response in scoring i is decided by ``u < flip_prob`` with ``u`` uniform in [0, 1) from
``sha256("noisy-flip", seed, i, nonce, question, response, j, criterion)``, ``nonce`` being the item's
:attr:`~.rubric.GradingItem.nonce`, which names one rollout sample (in verl: step, dataset row, rollout session).
The flips are fresh per call, as a judge sampling at a temperature above 0 draws its errors: two samples with the
same response text get independent flips, so a policy that repeats a response does not meet the same error again
(without the nonce, the noise of a repeated response is a fixed bias). They are reproducible (the same nonces give
the same flips, whatever the batch composition or order), independent between scorings (the point and reference
scorings of the dual scorer) and between criteria, and independent of the base grader's own verdict seeds (another
hash domain). The identity says so (``noise: per_call``); an identity without ``noise`` is one of the earlier
scheme, whose hash had no nonce.

When the base grader is deterministic (a rubric whose every criterion is a rule checked by code: the ``rules``
grader), the base score is the noise-free **truth**; it is returned as ``GradeResult.truth``. A stochastic base (an
LLM judge) has no truth, and ``truth`` stays ``None``.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Sequence

from .rubric import GradeResult, GradingError, GradingItem, Verdict, rubric_score

__all__ = ["NOISE_SCHEME", "NoisyGrader", "check_flip_prob", "flip_uniform", "noisy_identity"]

#: How the flips are drawn (the identity's ``noise``): fresh per call, from each item's nonce.
NOISE_SCHEME = "per_call"
_FLIPPED = {"met": "unmet", "unmet": "met"}


def check_flip_prob(flip_prob) -> float:
    """``flip_prob`` as a float after checking it is a number in [0, 1).

    Raises:
        ValueError: a bool, a non-number, NaN or a value outside [0, 1).
    """
    if isinstance(flip_prob, bool) or not isinstance(flip_prob, (int, float)) or not math.isfinite(flip_prob) \
            or not 0.0 <= float(flip_prob) < 1.0:
        raise ValueError(f"flip_prob must be a number in [0, 1), got {flip_prob!r}")
    return float(flip_prob)


def noisy_identity(base_identity: dict, flip_prob: float, seed: int) -> dict:
    """The identity of a noisy grader: the base's, with ``name`` prefixed by ``noisy+`` and ``flip_prob``,
    ``noise_seed`` and ``noise`` (:data:`NOISE_SCHEME`) added; all enter the calibration record's grader identity
    (docs/record.md#run-identity), so a record of the earlier scheme (no ``noise``) does not pass for this one."""
    ident = dict(base_identity)
    ident["name"] = f"noisy+{ident['name']}"
    ident["flip_prob"] = float(flip_prob)
    ident["noise_seed"] = int(seed)
    ident["noise"] = NOISE_SCHEME
    return ident


def flip_uniform(seed: int, scoring_index: int, nonce: str, question: str, response: str, j: int,
                 criterion: str) -> float:
    """The uniform number in [0, 1) that decides the flip of criterion ``j`` in scoring ``scoring_index`` of the
    grading call named by ``nonce`` (docs/validation.md#noisy-grader).

    53 bits of ``sha256(["noisy-flip", seed, scoring_index, nonce, question, response, j, criterion])`` (as JSON)
    divided by 2**53.
    """
    payload = json.dumps(["noisy-flip", int(seed), int(scoring_index), str(nonce), question, response, int(j),
                          criterion])
    return (int.from_bytes(hashlib.sha256(payload.encode()).digest()[:8], "big") >> 11) / float(2**53)


class NoisyGrader:
    """Flip every criterion verdict of ``base`` independently with probability ``flip_prob`` in each scoring, drawn
    fresh per grading call (each item's ``nonce``).

    Implements docs/validation.md#noisy-grader.

    Args:
        base: a rubric grader whose results carry one verdict per rubric criterion (a :class:`~.graders.RubricGrader`;
            a function grader only if it returns such verdicts).
        flip_prob: flip probability of each verdict, in [0, 1).
        seed: seed of the flips (enters every flip's hash and the grader identity).

    Raises:
        ValueError: ``flip_prob`` outside [0, 1) or not a number.
    """

    def __init__(self, base, *, flip_prob: float, seed: int = 0):
        self.base = base
        self.flip_prob = check_flip_prob(flip_prob)
        self.seed = int(seed)

    @property
    def deterministic(self) -> bool:
        """False: the flips make every scoring a random draw."""
        return False

    @property
    def has_truth(self) -> bool:
        """True when the base grader is deterministic, so that its score is the noise-free truth."""
        return bool(getattr(self.base, "deterministic", False))

    @property
    def identity(self) -> dict:
        """:func:`noisy_identity` of the base grader's identity."""
        return noisy_identity(self.base.identity, self.flip_prob, self.seed)

    async def agrade(self, items: Sequence[GradingItem], *, scoring_index: int) -> list[GradeResult]:
        """Grade ``items`` with the base grader, then flip each parsed verdict with probability ``flip_prob``, the
        flips drawn from each item's ``nonce`` (:func:`flip_uniform`).

        Returns:
            One :class:`GradeResult` per item: the score of the flipped verdicts, the flipped verdicts (source
            ``noisy:<base source>``, so that the dual scorer counts their disagreement), and ``truth`` = the base
            score and ``truth_verdicts`` = the base verdicts when :attr:`has_truth`, else ``None``.

        Raises:
            GradingError: an item without a rubric or without a nonce, or a base result whose verdicts do not
                match the rubric's criteria one to one (the flips need them); whatever the base grader raises.
        """
        for n, item in enumerate(items):
            if item.rubric is None:
                raise GradingError(f"item {n} has no rubric: the noisy grader flips per-criterion verdicts, so each "
                                   "response needs a rubric")
            if item.nonce is None:
                raise GradingError(
                    f"item {n} has no nonce: the noisy grader draws fresh flips per grading call and needs "
                    "GradingItem.nonce naming the sample (verl's reward manager sets it from global_steps, index and "
                    "session_id; DualScorer.score from each item's position)")
        base_results = await self.base.agrade(items, scoring_index=scoring_index)
        out = []
        for item, res in zip(items, base_results):
            criteria = item.rubric.criteria
            if len(res.verdicts) != len(criteria):
                raise GradingError(
                    f"the base grader {self.base.identity.get('name')!r} gave {len(res.verdicts)} verdicts for rubric "
                    f"{item.rubric.id!r} with {len(criteria)} criteria; the noisy grader needs one verdict per "
                    "criterion (use a rubric grader: rules, local_hf or openai)")
            verdicts = []
            for j, (crit, v) in enumerate(zip(criteria, res.verdicts)):
                outcome = v.outcome
                if outcome in _FLIPPED and flip_uniform(self.seed, scoring_index, item.nonce, item.question,
                                                        item.response, j, crit.criterion) < self.flip_prob:
                    outcome = _FLIPPED[outcome]
                verdicts.append(Verdict(outcome, f"noisy:{v.source}", v.p_yes, v.raw))
            out.append(GradeResult(score=rubric_score(item.rubric, verdicts), verdicts=tuple(verdicts),
                                   scoring_index=int(scoring_index), seed=self.seed,
                                   truth=float(res.score) if self.has_truth else None,
                                   truth_verdicts=tuple(res.verdicts) if self.has_truth else None))
        return out

    async def aclose(self) -> None:
        await self.base.aclose()
