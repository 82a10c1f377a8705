"""The noisy grader (docs/validation.md#noisy-grader): flips at the stated rate, fresh per scoring and per call
(each item's nonce), truth = base."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from scipy.stats import binomtest

from setgrpo_verl.grading import (
    DualScorer,
    GradingError,
    GradingItem,
    NoisyGrader,
    Rubric,
    RubricGrader,
    Verdict,
    build_grader,
    grader_identity,
    load_ifbench_rubrics,
)
from setgrpo_verl.core import check_identity
from setgrpo_verl.grading.noisy import NOISE_SCHEME
from setgrpo_verl.grading.rubric import GradeResult

RESPONSES = ("Sure. Here is a short answer, in plain words.", "NO", "one two three four five six seven eight",
             "I cannot help with that; however, here are 3 ideas: a, b and c.")


@pytest.fixture(scope="module")
def items() -> list[GradingItem]:
    """The rule-only IFBench rubrics, each with the four responses above (about 1,300 rule verdicts); nonce = the
    item's position."""
    rows = load_ifbench_rubrics(rules_only=True)
    pairs = [(row, text) for row in rows for text in RESPONSES]
    return [GradingItem(text, Rubric.from_row(row), nonce=str(n)) for n, (row, text) in enumerate(pairs)]


def _renonce(items, prefix: str) -> list[GradingItem]:
    """The same items (same texts) under other nonces, as other rollout samples of the same responses."""
    return [dataclasses.replace(item, nonce=f"{prefix}/{item.nonce}") for item in items]


def _grade(grader, items, index):
    return asyncio.run(grader.agrade(items, scoring_index=index))


def _outcomes(results) -> np.ndarray:
    return np.array([v.outcome == "met" for r in results for v in r.verdicts])


def test_rules_only_rows_have_rule_criteria_only():
    rows = load_ifbench_rubrics(rules_only=True)
    assert len(rows) == 275  # 19 of the 294 IFBench prompts have only NLTK-data (judged) instructions
    assert all(c.get("rule") for row in rows for c in row["rubrics"])


@pytest.mark.parametrize("flip_prob", [0.1, 0.3])
def test_flips_each_verdict_at_the_stated_rate(items, flip_prob):
    base = _grade(RubricGrader(None), items, 0)
    noisy = NoisyGrader(RubricGrader(None), flip_prob=flip_prob, seed=7)
    first, second = _grade(noisy, items, 0), _grade(noisy, items, 1)
    truth = _outcomes(base)
    n = truth.size
    assert n > 1200
    for results in (first, second):
        flips = int((_outcomes(results) != truth).sum())
        assert binomtest(flips, n, flip_prob).pvalue > 0.01, (flips, n)
    # fresh flips per scoring: the two scorings disagree on a verdict with probability 2 p (1 - p)
    disagree = int((_outcomes(first) != _outcomes(second)).sum())
    assert binomtest(disagree, n, 2 * flip_prob * (1 - flip_prob)).pvalue > 0.01, (disagree, n)
    # both flips are not the same draw: some verdicts flip in one scoring only
    assert 0 < disagree < n


def test_truth_is_the_base_score_and_scores_follow_the_flipped_verdicts(items):
    base = _grade(RubricGrader(None), items, 0)
    scores = DualScorer(NoisyGrader(RubricGrader(None), flip_prob=0.2, seed=1)).score(
        [None] * len(items), [i.response for i in items], [i.rubric for i in items])
    np.testing.assert_array_equal(scores.truth, [r.score for r in base])
    assert (scores.point != scores.truth).any() and (scores.reference != scores.truth).any()
    for item, res in zip(items[:40], scores.point_results):
        met = [v.outcome == "met" for v in res.verdicts]
        points = [c.points for c in item.rubric.criteria]
        assert res.score == pytest.approx(sum(p for p, m in zip(points, met) if m) / sum(points))
        assert all(v.source == "noisy:rule" for v in res.verdicts)
    # the dual scorer counts the flipped verdicts' disagreement (rule verdicts alone never disagree)
    assert scores.metrics()["grading/judged_disagreement_rate"] > 0.2


def test_zero_flip_prob_is_the_base_grader(items):
    scores = DualScorer(NoisyGrader(RubricGrader(None), flip_prob=0.0)).score(
        [None] * 40, [i.response for i in items[:40]], [i.rubric for i in items[:40]])
    np.testing.assert_array_equal(scores.point, scores.truth)
    np.testing.assert_array_equal(scores.reference, scores.truth)


def test_flips_are_reproducible_and_seeded(items):
    a = [r.score for r in _grade(NoisyGrader(RubricGrader(None), flip_prob=0.3, seed=3), items[:80], 0)]
    b = [r.score for r in _grade(NoisyGrader(RubricGrader(None), flip_prob=0.3, seed=3), items[:80][::-1], 0)][::-1]
    c = [r.score for r in _grade(NoisyGrader(RubricGrader(None), flip_prob=0.3, seed=4), items[:80], 0)]
    assert a == b  # independent of batch order
    assert a != c


@pytest.mark.parametrize("flip_prob", [0.1, 0.3])
def test_identical_responses_in_one_call_get_independent_flips(items, flip_prob):
    """Two copies of every item in one call, under other nonces (two rollout samples with the same text): each copy
    flips at the stated rate, and the copies flip together at rate p**2, as independent draws do."""
    noisy = NoisyGrader(RubricGrader(None), flip_prob=flip_prob, seed=7)
    truth = _outcomes(_grade(RubricGrader(None), items, 0))
    n = truth.size
    a, b = _renonce(items, "step 1"), _renonce(items, "step 2")
    results = _grade(noisy, a + b, 0)
    flips_a = _outcomes(results[:len(items)]) != truth
    flips_b = _outcomes(results[len(items):]) != truth
    for flips in (flips_a, flips_b):
        assert binomtest(int(flips.sum()), n, flip_prob).pvalue > 0.01, (int(flips.sum()), n)
    both = int((flips_a & flips_b).sum())
    assert binomtest(both, n, flip_prob ** 2).pvalue > 0.01, (both, n)  # a shared draw would give n p
    assert abs(np.corrcoef(flips_a, flips_b)[0, 1]) < 4 / np.sqrt(n)


def test_same_nonce_same_flips_other_nonce_other_flips(items):
    noisy = NoisyGrader(RubricGrader(None), flip_prob=0.3, seed=3)
    first, again = _grade(noisy, items, 0), _grade(noisy, items, 0)
    np.testing.assert_array_equal(_outcomes(first), _outcomes(again))
    assert [r.score for r in first] == [r.score for r in again]
    other = _outcomes(_grade(noisy, _renonce(items, "x"), 0))
    # independent draws at p = 0.3 differ on a verdict with probability 2 p (1 - p) = 0.42
    disagree = int((other != _outcomes(first)).sum())
    assert binomtest(disagree, other.size, 0.42).pvalue > 0.01, (disagree, other.size)


def test_an_item_without_a_nonce_is_refused(items):
    noisy = NoisyGrader(RubricGrader(None), flip_prob=0.1)
    with pytest.raises(GradingError, match="item 1 has no nonce: .*GradingItem.nonce"):
        _grade(noisy, [items[0], dataclasses.replace(items[1], nonce=None)], 0)


def test_a_record_of_the_earlier_noise_scheme_is_refused_naming_the_field():
    cfg = {"type": "noisy", "flip_prob": 0.1, "seed": 5, "base": {"type": "rules", "seed": 2}}
    ident = grader_identity(cfg)
    assert ident["noise"] == NOISE_SCHEME == "per_call"
    earlier = {k: v for k, v in ident.items() if k != "noise"}  # a record made before the nonce
    with pytest.raises(ValueError) as info:
        check_identity({"grader": earlier}, {"grader": ident}, what="calibration record", holder="record")
    assert str(info.value).startswith("calibration record mismatch in grader.noise: record has no grader.noise "
                                      "(written before that field existed), this run has 'per_call';")
    assert str(info.value).endswith("- recalibrate for this run")
    check_identity({"grader": dict(ident)}, {"grader": ident}, what="calibration record", holder="record")


def test_config_and_identity():
    cfg = {"type": "noisy", "flip_prob": 0.1, "seed": 5, "base": {"type": "rules", "seed": 2}}
    grader = build_grader(cfg)
    assert isinstance(grader, NoisyGrader) and grader.has_truth and not grader.deterministic
    ident = grader.identity
    assert ident == grader_identity(cfg)
    assert ident["name"] == "noisy+rubric+rules" and ident["flip_prob"] == 0.1 and ident["noise_seed"] == 5
    assert ident["noise"] == "per_call"
    assert grader_identity({**cfg, "flip_prob": 0.2}) != ident and grader_identity({**cfg, "seed": 6}) != ident


@pytest.mark.parametrize("cfg, needle", [
    ({"type": "noisy", "base": {"type": "rules"}}, "needs ['flip_prob']"),
    ({"type": "noisy", "flip_prob": 0.1}, "needs ['base']"),
    ({"type": "noisy", "flip_prob": 1.0, "base": {"type": "rules"}}, "flip_prob must be a number in [0, 1)"),
    ({"type": "noisy", "flip_prob": "0.1", "base": {"type": "rules"}}, "flip_prob must be a number"),
    ({"type": "noisy", "flip_prob": 0.1, "base": "rules"}, "base must be a grader config"),
    ({"type": "noisy", "flip_prob": 0.1, "base": {"type": "rules"}, "rate": 2}, "unknown keys for a noisy grader"),
])
def test_bad_configs(cfg, needle):
    for fn in (build_grader, grader_identity):
        with pytest.raises(ValueError) as info:
            fn(cfg)
        assert needle in str(info.value)


class _Judge:
    """A stochastic stand-in judge: verdict = seed parity."""

    identity = {"name": "stub", "model": "stub", "temperature": 1.0, "template_hash": "0"}

    async def ajudge(self, requests, seeds):
        return [Verdict("met" if s % 2 else "unmet", "judge") for s in seeds]

    async def aclose(self):
        return None


def test_no_truth_around_a_stochastic_judge():
    row = {"question": "Say hi.", "id": "j", "rubrics": [{"criterion": "greets", "points": 1}]}
    grader = NoisyGrader(RubricGrader(_Judge()), flip_prob=0.1)
    assert not grader.has_truth
    scores = DualScorer(grader).score([None], ["hi"], [row])
    assert scores.truth is None and all(r.truth is None for r in scores.point_results)


def test_base_results_without_verdicts_are_refused():
    class _NoVerdicts:
        identity = {"name": "function:x", "model": None, "temperature": None, "template_hash": "0"}

        async def agrade(self, items, *, scoring_index):
            return [GradeResult(0.5, (), scoring_index, 0) for _ in items]

        async def aclose(self):
            return None

    row = Rubric.from_row({"question": "q", "id": "n", "rubrics": [{"criterion": "c", "points": 1}]})
    with pytest.raises(GradingError, match="one verdict per criterion"):
        asyncio.run(NoisyGrader(_NoVerdicts(), flip_prob=0.1).agrade([GradingItem("r", row, nonce="0")],
                                                                      scoring_index=0))
