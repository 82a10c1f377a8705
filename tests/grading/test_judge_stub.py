"""benchmarks/judge_stub.py (the load benchmark's judge server): verdicts by seed, HTTP 429 above its limit, cut
replies; the openai judge's in-flight limit comes down to the stub's limit and every verdict is read."""

import asyncio
import importlib.util
from pathlib import Path

from setgrpo_verl.grading import JudgeRequest, OpenAIJudge

_SPEC = importlib.util.spec_from_file_location(
    "judge_stub", Path(__file__).resolve().parents[2] / "benchmarks" / "judge_stub.py")
judge_stub = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(judge_stub)


def _judge_all(stub, n, **kw):
    async def body():
        judge = OpenAIJudge(stub.base_url, "stub", timeout=10.0, **kw)
        try:
            out = await judge.ajudge([JudgeRequest("q", f"r{i}", "c") for i in range(n)], list(range(n)))
            return out, judge._clients
        finally:
            await judge.aclose()

    return asyncio.run(body())


def test_the_stub_answers_by_seed_and_refuses_above_its_limit():
    with judge_stub.JudgeStub(latency=0.01, limit=4) as stub:
        verdicts, _ = _judge_all(stub, 40, max_concurrency=16)
        assert [v.outcome for v in verdicts] == ["met" if i % 2 else "unmet" for i in range(40)]
        assert stub.peak == 4 and stub.refused > 0 and stub.answered == 40


def test_cut_replies_are_reasked_and_read():
    with judge_stub.JudgeStub(latency=0.001, limit=64, cut_rate=0.2, seed=1) as stub:
        verdicts, _ = _judge_all(stub, 60, max_concurrency=1, parse_retries=4)  # one at a time: the draws in order
    assert stub.cut > 0 and sum(v.reasks for v in verdicts) == stub.cut  # each cut reply cost one re-ask
    for i, v in enumerate(verdicts):  # the re-ask's seed is the next one: its parity gives the verdict
        assert v.outcome == ("met" if (i + v.reasks) % 2 else "unmet")
