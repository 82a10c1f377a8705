"""LocalHFJudge on the embedded SmolLM2-135M-Instruct: exact batched P(yes), real grader randomness, seeding."""

import asyncio

import numpy as np
import pytest
import torch

from setgrpo_verl.grading import DualScorer, GradingItem, JudgeRequest, Rubric, RubricGrader, load_ifbench_rubrics


def _plain_p_yes(judge, request, temperature):
    """Reference: one unbatched, uncached forward over the concatenated prompt segments."""
    ids = sum((judge.tokenizer.encode(s, add_special_tokens=False) for s in judge._segments(request)), [])
    with torch.no_grad():
        logits = judge.model(torch.tensor([ids])).logits[0, -1].double() / temperature
    margin = torch.logsumexp(logits[judge._yes_ids], -1) - torch.logsumexp(logits[judge._no_ids], -1)
    return float(torch.sigmoid(margin))


def test_batched_prefix_cached_p_yes_matches_plain_forward(smollm2_judge):
    reqs = [
        JudgeRequest("What is 2+2?", "4", "The answer is correct."),
        JudgeRequest("What is 2+2?", "4", "The response is rude and long-winded."),
        JudgeRequest("What is 2+2?", "It is five, obviously.", "The answer is correct."),
        JudgeRequest("Write a haiku about rain in the city at night.", "Rain on the asphalt\nneon drowns in puddles\n"
                     "the last bus is late", "The response is a haiku."),
        JudgeRequest("What is 2+2?", "4", "The answer is correct."),  # duplicate
    ]
    p = smollm2_judge.p_yes(reqs)
    assert p.dtype == np.float64 and p.shape == (5,)
    assert p[0] == p[4]
    for i in (1, 2, 3):  # shared question / shared response / distinct question, different lengths
        assert p[i] == pytest.approx(_plain_p_yes(smollm2_judge, reqs[i], 1.0), abs=2e-5)
    # the temperature divides the logits before the yes/no log-sum-exps
    old = smollm2_judge.temperature
    try:
        smollm2_judge.temperature = 2.0
        p2 = 1 / (1 + np.exp(-np.array(smollm2_judge._margins(reqs[:1]))))
    finally:
        smollm2_judge.temperature = old
    assert p2[0] == pytest.approx(_plain_p_yes(smollm2_judge, reqs[0], 2.0), abs=2e-5)


def _ifbench_items(ifbench_samples, n=6):
    items = []
    for row in load_ifbench_rubrics(limit=n):
        rubric = Rubric.from_row(row)
        items.append(GradingItem(ifbench_samples[rubric.question][:400], rubric))
    return items


def test_two_scorings_differ_and_each_is_reproducible(smollm2_judge, ifbench_samples):
    items = _ifbench_items(ifbench_samples)
    scores = asyncio.run(DualScorer(RubricGrader(smollm2_judge, seed=0)).ascore(items))
    judged = [(a, b) for pa, pb in zip(scores.point_results, scores.reference_results)
              for a, b in zip(pa.verdicts, pb.verdicts) if a.source == "judge"]
    assert len(judged) >= 18
    assert all(0.0 < a.p_yes < 1.0 and a.p_yes == b.p_yes for a, b in judged)  # same judge, same protocol
    assert any(a.outcome != b.outcome for a, b in judged)  # ... but independent draws: real grader randomness
    assert scores.metrics()["grading/judged_disagreement_rate"] > 0
    rule = [(a, b) for pa, pb in zip(scores.point_results, scores.reference_results)
            for a, b in zip(pa.verdicts, pb.verdicts) if a.source == "rule"]
    assert rule and all(a == b for a, b in rule)  # code-checked criteria do not vary
    # scoring i is reproducible from its seed: fresh grader, reversed batch order, one scoring at a time
    for idx, expected in ((0, scores.point_results), (1, scores.reference_results)):
        again = asyncio.run(RubricGrader(smollm2_judge, seed=0).agrade(items[::-1], scoring_index=idx))[::-1]
        assert [r.verdicts for r in again] == [r.verdicts for r in expected]
        assert [r.score for r in again] == [r.score for r in expected]
    other = asyncio.run(RubricGrader(smollm2_judge, seed=1).agrade(items, scoring_index=0))
    assert [r.verdicts for r in other] != [r.verdicts for r in scores.point_results]


def test_concurrent_callers_share_batches(smollm2_judge, monkeypatch):
    reqs = [JudgeRequest("Name a fruit.", f"{fruit}.", "The response names a fruit.")
            for fruit in ("Apple", "Banana", "Cherry", "A car")]
    expected = smollm2_judge.p_yes(reqs)
    calls = []
    original = smollm2_judge.p_yes

    def counting(batch):
        calls.append(len(batch))
        return original(batch)

    monkeypatch.setattr(smollm2_judge, "p_yes", counting)

    async def body():
        return await asyncio.gather(*(smollm2_judge.ap_yes([r]) for r in reqs))

    got = asyncio.run(body())
    assert calls == [4]  # four concurrent callers, one batched forward
    np.testing.assert_array_equal(np.concatenate(got), expected)


def test_temperature_zero_is_deterministic(smollm2_judge, ifbench_samples):
    items = _ifbench_items(ifbench_samples, n=3)
    old = smollm2_judge.temperature
    try:
        smollm2_judge.temperature = 0.0
        out = asyncio.run(DualScorer(RubricGrader(smollm2_judge, seed=0)).ascore(items))
    finally:
        smollm2_judge.temperature = old
    np.testing.assert_array_equal(out.point, out.reference)
    assert all(v.p_yes in (0.0, 1.0) for r in out.point_results for v in r.verdicts if v.source == "judge")


def test_a_cut_response_ends_on_a_whole_character_within_the_token_limit(smollm2_judge):
    """The judge cuts a response to max_response_tokens: with a byte-level tokenizer a token limit can fall inside a
    multi-byte character, and the cut must still be a prefix of the response (no U+FFFD) that re-encodes to at most
    the limit."""
    tok = smollm2_judge.tokenizer
    texts = ["这是一个关于机器学习的回答，包含很多中文字符。" * 3, "Great answer 🎉🎉 with emoji 👍🏽 and flags 🇫🇷🇯🇵 done",
             "Résumé: naïve café — ünïcödé ✓ 日本語テキスト"]
    split = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for limit in range(1, len(ids)):
            split += "\ufffd" in tok.decode(ids[:limit])
            cut = smollm2_judge._truncate(text, limit)
            assert text.startswith(cut) and "\ufffd" not in cut, (text, limit, cut)
            assert len(tok.encode(cut, add_special_tokens=False)) <= limit, (text, limit)
            assert limit - len(tok.encode(cut, add_special_tokens=False)) <= 3, (text, limit)  # no more than a char
        assert smollm2_judge._truncate(text, len(ids)) == text
    assert split > 20  # the limits above do fall inside characters


def test_a_tokenizer_that_normalises_when_it_decodes_still_gets_a_cut_of_the_limit(smollm2_judge):
    """A tokenizer may decode to another normal form than the text it encoded (an NFC normaliser): the cut is then
    no exact prefix of the text, and must still be about ``limit`` tokens long, not empty."""
    import types
    import unicodedata

    tok = smollm2_judge.tokenizer
    nfc = types.SimpleNamespace(encode=tok.encode, decode=lambda ids: unicodedata.normalize("NFC", tok.decode(ids)))
    text = unicodedata.normalize("NFD", "Café résumé naïve. ") * 60
    judge = types.SimpleNamespace(tokenizer=nfc)
    cut = type(smollm2_judge)._truncate(judge, text, 100)
    ids = tok.encode(text, add_special_tokens=False)
    assert not text.startswith(cut) and "\ufffd" not in cut
    assert any(cut == nfc.decode(ids[:n]) for n in range(97, 101))  # the text's first ~100 tokens
