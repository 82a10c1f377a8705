"""Dual scorer: every response scored twice, independently, by the same grading protocol (docs/algorithm.md#0-notation).

The point scores ``r`` (scoring index 0) train the policy; the reference scores ``r'`` (scoring index 1)
calibrate the coefficient set (JRSC) and the risk gate (SRGO). Both scorings run concurrently; they differ only in
their verdict seeds (see :func:`setgrpo_verl.grading.graders.verdict_seed`). A scorer with one scoring index gives
the point scores alone (the GRPO baseline, which has no use for r').
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .answers import DEFAULT_RESPONSE_PART, check_response_part, graded_text, split_response_part, with_response_part
from .graders import as_rubric, build_grader, describe_item
from .protocol import gather_or_cancel
from .rubric import GradeResult, GradingError, GradingItem, Rubric

__all__ = ["DualScorer", "DualScores"]


@dataclass(frozen=True)
class DualScores:
    """One or two scorings of N responses.

    Attributes:
        point: float64 ``[N]`` point scores r (scoring ``scoring_indices[0]``).
        reference: float64 ``[N]`` reference scores r' (scoring ``scoring_indices[1]``), ``None`` with one scoring.
        point_results / reference_results: the :class:`GradeResult` of each scoring (verdicts, seeds);
            ``reference_results`` is ``None`` with one scoring.
        truth: float64 ``[N]`` noise-free scores when the grader knows them (a noisy grader around a deterministic
            one, docs/validation.md#noisy-grader), else ``None``.
        no_answer: bool ``[N]``: True for a response whose thinking block never closes, graded as the empty answer
            (docs/grading.md#thinking-policies); ``None`` when not known (scores built elsewhere).
    """

    point: np.ndarray
    reference: np.ndarray | None
    point_results: tuple[GradeResult, ...]
    reference_results: tuple[GradeResult, ...] | None
    truth: np.ndarray | None = None
    no_answer: np.ndarray | None = None

    @property
    def scorings(self) -> int:
        """Scorings per response: 2, or 1 without a reference."""
        return 1 if self.reference_results is None else 2

    def metrics(self, prefix: str = "grading/") -> dict[str, float]:
        """Per-batch grading metrics: mean point score, the number of judged verdicts, unparsed verdict count and rate
        (over the judged verdicts of every scoring), the judge's re-asks (docs/grading.md#reading-a-verdict); with two scorings also the mean reference score, mean |r - r'|
        and the fraction of judged criteria whose verdicts differ between the scorings (undefined with one scoring,
        so absent); ``no_answer``, the number of responses without an answer, when known."""
        scorings = (self.point_results,) if self.reference_results is None else (self.point_results,
                                                                                  self.reference_results)
        judged = disagree = unparsed = reasks = 0
        for results in zip(*scorings):
            for verdicts in zip(*(r.verdicts for r in results)):
                if verdicts[0].source == "rule":
                    continue
                judged += 1
                reasks += sum(int(getattr(v, "reasks", 0) or 0) for v in verdicts)
                disagree += len({v.outcome for v in verdicts}) > 1
                unparsed += sum(v.outcome == "unparsed" for v in verdicts)
        n = len(self.point)
        out = {
            f"{prefix}point_mean": float(self.point.mean()) if n else float("nan"),
            f"{prefix}judged": float(len(scorings) * judged),
            f"{prefix}unparsed": float(unparsed),
            f"{prefix}unparsed_rate": unparsed / (len(scorings) * judged) if judged else 0.0,
            f"{prefix}reasks": float(reasks),
        }
        if self.no_answer is not None:
            out[f"{prefix}no_answer"] = float(np.count_nonzero(self.no_answer))
        if self.reference is not None:
            out[f"{prefix}reference_mean"] = float(self.reference.mean()) if n else float("nan")
            out[f"{prefix}abs_diff_mean"] = float(np.abs(self.point - self.reference).mean()) if n else float("nan")
            out[f"{prefix}judged_disagreement_rate"] = disagree / judged if judged else 0.0
        return out


class DualScorer:
    """Score each response twice with one grader (point = scoring ``scoring_indices[0]``, reference = ``[1]``), or
    once (point only) with one scoring index.

    Every scoring grades the same text of each response: the answer after its thinking block by default, or the
    whole response (:func:`~.answers.graded_text`, docs/grading.md#thinking-policies).

    Args:
        grader: a grader (:class:`~.graders.RubricGrader`, :class:`~.graders.FunctionGrader`) or a config
            mapping for :func:`~.graders.build_grader`, whose ``response`` key (answer | full) sets
            ``response_part``.
        scoring_indices: the scoring indices, two distinct ones (default ``(0, 1)``) or one (``(0,)``: point
            scores alone).
        response_part: ``answer`` (default) or ``full``, for a grader object; with a mapping, its ``response`` key.

    Raises:
        ValueError: ``scoring_indices`` is neither two distinct integers nor one; an unknown response part, or
            one given both as the argument and in the mapping.

    Use :meth:`ascore` from async code (verl's reward loop) or :meth:`score` from sync code (a script, the command line's judge probe).
    """

    def __init__(self, grader, scoring_indices: tuple[int, ...] = (0, 1), response_part: str | None = None):
        if isinstance(grader, Mapping):
            if response_part is not None and "response" in grader:
                raise ValueError("the response part is given twice: as response_part and as the mapping's 'response'")
            grader, part = split_response_part(grader)
            grader = build_grader(grader)
            response_part = response_part or part
        self.response_part = check_response_part(response_part or DEFAULT_RESPONSE_PART)
        if len(scoring_indices) not in (1, 2) or len(set(scoring_indices)) != len(scoring_indices):
            raise ValueError(f"scoring_indices must be two distinct integers or one, got {scoring_indices!r}")
        self.grader = grader
        self.scoring_indices = tuple(int(i) for i in scoring_indices)

    @property
    def identity(self) -> dict:
        """The grader identity ``{name, model, temperature, template_hash}`` (for the calibration record), a
        non-default response part folded into ``template_hash``."""
        return with_response_part(dict(self.grader.identity), self.response_part)

    async def ascore(self, items: Sequence[GradingItem], *, opened: Sequence[bool] | None = None) -> DualScores:
        """Every scoring of ``items`` (``len(scoring_indices)`` grader calls per item), concurrently, on the text
        :func:`~.answers.graded_text` picks of each response.

        Args:
            items: the responses to grade.
            opened: per item, whether its prompt opened the thinking block (:func:`~.answers.prompt_opens_thinking`);
                ``None``: none did.

        Raises:
            GradingError: a grading failure, a non-finite score from the grader (naming the response), or a truth
                that only some results carry or that differs between the two scorings of a response.
            ValueError: ``opened`` not one flag per item; whatever else the grader raises for bad input.
        """
        opened = [False] * len(items) if opened is None else list(opened)
        if len(opened) != len(items):
            raise ValueError(f"got {len(opened)} opened flags for {len(items)} items")
        chosen = [graded_text(item.response, self.response_part, opened=o) for item, o in zip(items, opened)]
        items = [dataclasses.replace(item, response=text) for item, (text, _) in zip(items, chosen)]
        scorings = await gather_or_cancel(
            [self.grader.agrade(items, scoring_index=i) for i in self.scoring_indices]
        )
        for results, index in zip(scorings, self.scoring_indices):
            for item, res in zip(items, results):
                if not math.isfinite(res.score):  # any grader, also a duck-typed one: never a non-finite reward
                    raise GradingError(f"grader {self.identity.get('name')!r} gave the non-finite score {res.score!r} "
                                       f"in scoring {index} for {describe_item(item)}; a reward must be a finite number")
        point = scorings[0]
        reference = scorings[1] if len(scorings) > 1 else None
        return DualScores(
            point=np.array([r.score for r in point], dtype=np.float64),
            reference=None if reference is None else np.array([r.score for r in reference], dtype=np.float64),
            point_results=tuple(point),
            reference_results=None if reference is None else tuple(reference),
            truth=self._truth(items, point, point if reference is None else reference),
            no_answer=np.array([missing for _, missing in chosen], dtype=bool),
        )

    def _truth(self, items, point, reference) -> np.ndarray | None:
        """The noise-free scores ``[N]`` when every result carries the same one in both scorings, else ``None``."""
        have = [r.truth is not None for r in (*point, *reference)]
        if not any(have):
            return None
        name = self.identity.get("name")
        if not all(have):
            raise GradingError(f"grader {name!r} gave a truth score for {sum(have)} of {len(have)} results; a truth "
                               "is known for every response or for none")
        for item, a, b in zip(items, point, reference):
            if a.truth != b.truth or not math.isfinite(a.truth):
                raise GradingError(f"grader {name!r} gave the truth scores {a.truth!r} and {b.truth!r} in the two "
                                   f"scorings of {describe_item(item)}; a truth must be finite and the same in both")
        return np.array([r.truth for r in point], dtype=np.float64)

    def score(
        self,
        prompts: Sequence[str | None],
        responses: Sequence[str],
        rubrics: Sequence[Rubric | Mapping[str, Any] | str],
    ) -> DualScores:
        """Sync entry point: score ``responses[i]`` (answering ``prompts[i]``, ``None`` = the rubric's question)
        against ``rubrics[i]`` (Rubric, RubricHub dict or JSON string) twice; ``i`` is the item's nonce (a grader
        drawing fresh noise per call gives equal responses independent draws). Runs its own event loop and closes
        the grader's connections before returning, so do not call it from inside a running event loop.

        Raises:
            ValueError: the three sequences differ in length.
        """
        if not (len(prompts) == len(responses) == len(rubrics)):
            raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses, {len(rubrics)} rubrics")
        items = [
            GradingItem(response=str(resp), rubric=as_rubric(rub), prompt=prompt, nonce=str(n))
            for n, (prompt, resp, rub) in enumerate(zip(prompts, responses, rubrics))
        ]

        async def run():
            try:
                return await self.ascore(items)
            finally:
                await self.aclose()

        return asyncio.run(run())

    async def aclose(self) -> None:
        """Release the grader's per-loop resources (HTTP connections)."""
        await self.grader.aclose()
