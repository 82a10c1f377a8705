"""OpenAIJudge against a real local OpenAI-compatible server (FastAPI + uvicorn) backed by the SmolLM2 judge."""

import asyncio
import json
import time

import pytest

from setgrpo_verl.grading import (
    DualScorer,
    GradingError,
    GradingItem,
    JudgeRequest,
    OpenAIJudge,
    Rubric,
    RubricGrader,
    rubric_score,
)

from .judge_server import JudgeServer

Q = "Name a primary colour."
R = "Red is a primary colour."


@pytest.fixture(scope="module")
def server(smollm2_judge):
    with JudgeServer(smollm2_judge) as srv:
        yield srv


def _judge(server, **kw):
    kw.setdefault("timeout", 120.0)  # generous: the SmolLM2 forward behind the server may run on a loaded CPU
    return OpenAIJudge(server.base_url, "smollm2-135m-judge", **kw)


def _run(coro_fn):
    """Run an async test body that gets a fresh judge-closing context."""
    return asyncio.run(coro_fn())


def test_happy_path_seeded_and_reproducible(server):
    crits = ["The response names a colour.", "The response is written in French.", "The response is polite."]
    reqs = [JudgeRequest(Q, R, c) for c in crits]

    async def body():
        judge = _judge(server, temperature=1.0)
        try:
            seeds = list(range(100, 100 + 3 * 8))
            many = [JudgeRequest(Q, R, crits[i % 3]) for i in range(24)]
            first = await judge.ajudge(many, seeds)
            again = await judge.ajudge(many, seeds)
            return first, again
        finally:
            await judge.aclose()

    first, again = _run(body)
    assert [v.outcome for v in first] == [v.outcome for v in again]  # the server honours the seed
    assert {v.outcome for v in first} <= {"met", "unmet"} and all(v.raw in ("yes", "no") for v in first)
    assert all(v.source == "judge" and v.p_yes is None for v in first)
    # the verdicts follow the judge's P(yes): seeds -> Bernoulli(p) exactly as the server computed it
    import numpy as np

    p = server.judge.p_yes(reqs)
    for i, v in enumerate(first):
        u = np.random.default_rng(100 + i).random()
        assert v.outcome == ("met" if u < p[i % 3] else "unmet")
    assert server.wait_idle()


def test_dual_scorer_over_http(server):
    rubric = Rubric.from_row({"question": Q, "id": "colour", "rubrics": [
        {"criterion": "The response names a colour.", "points": 3},
        {"criterion": "The response is written in French.", "points": 1},
        {"criterion": "The response insults the reader.", "points": -2}]})
    scorer = DualScorer(RubricGrader(_judge(server), seed=7))
    out = scorer.score([None, None], [R, "Bleu."], [rubric, rubric.to_row()])
    assert scorer.identity["name"] == "rubric+openai_chat" and len(scorer.identity["template_hash"]) == 16
    for res, s in zip(out.point_results + out.reference_results, list(out.point) + list(out.reference)):
        assert s == pytest.approx(rubric_score(rubric, res.verdicts))
    assert out.metrics()["grading/unparsed"] == 0


def test_slow_request_hits_timeout_and_nothing_hangs(server):
    async def body():
        judge = _judge(server, timeout=0.5, max_retries=1)
        t0 = time.perf_counter()
        try:
            with pytest.raises(GradingError, match="did not answer within timeout=0.5 s, in 2 attempts"):
                await judge.ajudge([JudgeRequest(Q, R, "[[slow]] criterion")], [1])
        finally:
            await judge.aclose()
        return time.perf_counter() - t0

    elapsed = _run(body)
    assert elapsed < 15  # two attempts of 0.5 s plus backoff: bounded, not the server's 30 s
    assert server.attempts["[[slow]] criterion"] == 2  # first try + 1 retry
    assert server.wait_idle()  # the server saw both connections closed by the client


def test_a_slow_judge_is_named_slow_with_its_timeout_not_unreachable(server):
    crit = "The response names a colour."
    server.judge.p_yes([JudgeRequest(Q, R, crit)])  # warm the server's P(yes) cache

    async def body():
        judge = _judge(server, timeout=0.5, max_retries=0)
        try:
            answered = await judge.ajudge([JudgeRequest(Q, R, crit)] * 3, [1, 2, 3])
            with pytest.raises(GradingError) as info:
                await judge.ajudge([JudgeRequest(Q, R, "[[slow]] too slow")], [4])
            return answered, str(info.value)
        finally:
            await judge.aclose()

    answered, message = _run(body)
    assert len(answered) == 3
    assert "did not answer within timeout=0.5 s, in 1 attempts" in message
    assert "answered 3 requests before" in message and "slow or overloaded rather than unreachable" in message
    assert "reward.reward_kwargs.grader.timeout" in message and "--judge-max-concurrency" in message
    assert "cannot be reached" not in message and "model name" not in message
    assert server.wait_idle()


# ------------------------------------------------------------------ a judge with a concurrency limit (HTTP 429)
def test_a_judge_that_allows_fewer_requests_in_flight_is_met_by_sending_fewer(server):
    crits = [f"The response names colour number {i}." for i in range(6)]
    server.judge.p_yes([JudgeRequest(Q, R, c) for c in crits])  # warm the server's P(yes) cache
    requests = [JudgeRequest(Q, R, crits[i % 6]) for i in range(48)]
    seeds = list(range(48))

    async def verdicts(base_url):
        judge = OpenAIJudge(base_url, "smollm2-135m-judge", timeout=120.0, max_retries=1, max_concurrency=16)
        try:
            return [v.outcome for v in await judge.ajudge(requests, seeds)]
        finally:
            await judge.aclose()

    unlimited = asyncio.run(verdicts(server.base_url))
    server.refused = server.peak = 0
    limited = asyncio.run(verdicts(server.base_url.replace("/v1", "/limit-3/v1")))
    assert server.refused > 0  # the judge did refuse the surplus: 16 in flight against its 3
    assert limited == unlimited  # every request answered, with the verdicts of an unlimited judge
    assert server.wait_idle()


def test_persistent_429_fails_after_rate_limit_wait_naming_max_concurrency(server):
    async def body():
        judge = OpenAIJudge(server.base_url.replace("/v1", "/limit-0/v1"), "smollm2-135m-judge", timeout=120.0,
                            max_retries=0, max_concurrency=8, rate_limit_wait=2.0)
        try:
            await judge.ajudge([JudgeRequest(Q, R, f"c{i}") for i in range(8)], list(range(8)))
        finally:
            await judge.aclose()

    server.refused = 0
    with pytest.raises(GradingError) as info:
        _run(body)
    message = str(info.value)
    assert "kept refusing requests with HTTP 429" in message and "Too many concurrent requests" in message
    assert "from max_concurrency=8 to 1" in message  # lowered all the way before giving up
    assert "reward.reward_kwargs.grader.max_concurrency, CLI --judge-max-concurrency" in message
    assert "rate_limit_wait=2 s" in message and "model name" not in message
    assert server.refused > 8  # requests were sent again after their first refusal
    assert server.wait_idle()


@pytest.mark.parametrize("code", [429, 500])
def test_injected_errors_are_retried(server, code):
    crit = f"[[{code}x2]] The response names a colour."
    server.judge.p_yes([JudgeRequest(Q, R, crit)])  # warm the server's P(yes) cache: attempts are then instant

    async def body():
        judge = _judge(server, max_retries=3)
        try:
            return await judge.ajudge([JudgeRequest(Q, R, crit)], [5])
        finally:
            await judge.aclose()

    (verdict,) = _run(body)
    assert verdict.outcome in ("met", "unmet")
    assert server.attempts[crit] == 3  # two injected failures, then the answer


def test_errors_beyond_retries_raise(server):
    crit = "[[500x9]] The response names a colour."

    async def body():
        judge = _judge(server, max_retries=1)
        try:
            await judge.ajudge([JudgeRequest(Q, R, crit)], [5])
        finally:
            await judge.aclose()

    with pytest.raises(GradingError, match="InternalServerError"):
        _run(body)
    assert server.attempts[crit] == 2


def test_unparsed_verdict_stops_grading_by_default_and_is_excluded_when_allowed(server):
    server.judge.p_yes([JudgeRequest(Q, R, "[[garbage-once]] The response is short.")])  # warm the cache
    rubric = Rubric.from_row({"question": Q, "id": "u", "rubrics": [
        {"criterion": "[[garbage]] The response names a colour.", "points": 2},
        {"criterion": "[[garbage-once]] The response is short.", "points": 1}]})

    async def body(**grader):
        judge = _judge(server, parse_retries=1)
        try:
            return await DualScorer(RubricGrader(judge, seed=3, **grader)).ascore([GradingItem(R, rubric)])
        finally:
            await judge.aclose()

    # default: one unparsed criterion of two stops grading, quoting the judge's reply
    with pytest.raises(GradingError, match="max_unparsed_ratio=0") as info:
        asyncio.run(body())
    assert "'Well, it depends on how you look at it.'" in str(info.value) and "row 'u'" in str(info.value)
    # allowed (1 of 2 <= 0.5): the unparsed criterion counts neither as met nor as unmet
    out = asyncio.run(body(max_unparsed_ratio=0.5))
    for res in (out.point_results[0], out.reference_results[0]):
        garbage, once = res.verdicts
        assert garbage.outcome == "unparsed" and garbage.raw.startswith("Well")
        assert once.outcome in ("met", "unmet")  # re-asked once, then parsed
        assert res.score == (1.0 if once.outcome == "met" else 0.0)
    metrics = out.metrics()
    assert metrics["grading/unparsed"] == 2 and metrics["grading/unparsed_rate"] == pytest.approx(0.5)
    assert metrics["grading/judged"] == 4
    assert server.attempts["[[garbage]] The response names a colour."] == 2 * 2 * 2  # 2 runs x 2 scorings x 2 asks
    # just under half allowed: 1 of 2 unparsed is above it
    with pytest.raises(GradingError, match="max_unparsed_ratio=0.49"):
        asyncio.run(body(max_unparsed_ratio=0.49))


def test_failure_cancels_siblings_and_leaves_nothing_in_flight(server):
    async def body():
        judge = _judge(server, max_retries=0, timeout=20.0)
        requests = [JudgeRequest(Q, R, f"[[slow]] sibling {i}") for i in range(4)]
        requests.append(JudgeRequest(Q, R, "[[500x99]] fails fast"))
        try:
            with pytest.raises(GradingError):
                await judge.ajudge(requests, list(range(5)))
        finally:
            await judge.aclose()
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    t0 = time.perf_counter()
    leftover = _run(body)
    assert leftover == []
    assert time.perf_counter() - t0 < 10  # did not wait for the slow siblings
    assert server.wait_idle(timeout=5)  # every slow request was disconnected, none left running on the server


# ------------------------------------------------------------------ HTTP 200 bodies that are not a chat completion
def _judge_one(server, crit, *, base_url=None, seed=5, **kw):
    async def body():
        judge = OpenAIJudge(base_url or server.base_url, "smollm2-135m-judge", **{"timeout": 120.0, **kw})
        try:
            return (await judge.ajudge([JudgeRequest(Q, R, crit)], [seed]))[0]
        finally:
            await judge.aclose()

    return _run(body)


def _expected_outcome(server, crit, seed):
    """The verdict the server's seeded draw gives for this criterion (what any well-behaved route returns)."""
    import numpy as np

    p = float(server.judge.p_yes([JudgeRequest(Q, R, crit)])[0])
    return "met" if np.random.default_rng(seed).random() < p else "unmet"


@pytest.mark.parametrize("kind", ["html", "empty", "error-payload"])
def test_non_completion_200_is_retried_like_5xx_then_judged(server, kind):
    crit = f"[[{kind}x2]] The response names a colour."
    verdict = _judge_one(server, crit, max_retries=3)
    assert server.attempts[crit] == 3  # two bad bodies, then the answer
    assert verdict.outcome == _expected_outcome(server, crit, 5) and verdict.raw in ("yes", "no")


@pytest.mark.parametrize("kind,body_start", [("html", "<html>"), ("empty", ""), ("error-payload", '{"error"')])
def test_non_completion_200_beyond_retries_names_url_status_and_body(server, kind, body_start):
    crit = f"[[{kind}x99]] The response names a colour."
    with pytest.raises(GradingError) as info:
        _judge_one(server, crit, max_retries=1)
    msg = str(info.value)
    assert server.attempts[crit] == 2  # first try + 1 retry, never read as an answer
    assert f"{server.base_url}/chat/completions" in msg and "HTTP 200" in msg
    assert f"starts {body_start!r}" in msg or (body_start and body_start in msg)
    if kind == "error-payload":
        assert "injected overload" in msg  # the server's own message is kept


def test_error_payload_on_some_requests_does_not_change_the_score(server):
    """An overloaded server that answers some requests with an error payload: the scores are those of a server that
    answered every request, because those requests are retried instead of counted as unparsed answers."""
    from setgrpo_verl.grading import verdict_seed

    rubric = Rubric.from_row({"question": Q, "id": "ovl", "rubrics": [
        {"criterion": "[[error-payloadx1]] The response names a colour.", "points": 2},
        {"criterion": "The response is written in French.", "points": 1},
        {"criterion": "[[error-payloadx1]] The response insults the reader.", "points": -1}]})
    out = DualScorer(RubricGrader(_judge(server, max_retries=2, parse_retries=0), seed=3)).score([None], [R], [rubric])
    for i, (res, score) in enumerate(zip(out.point_results + out.reference_results, [out.point[0], out.reference[0]])):
        expected = [_expected_outcome(server, c.criterion, verdict_seed(3, i, Q, R, j, c.criterion, "0"))
                    for j, c in enumerate(rubric.criteria)]
        assert [v.outcome for v in res.verdicts] == expected
        assert score == pytest.approx(rubric_score(rubric, [e == "met" for e in expected]))
    assert out.metrics()["grading/unparsed"] == 0


# ------------------------------------------------------------------ reasoning ("thinking") judges
@pytest.mark.parametrize("parser", ["on", "off"])
def test_thinking_judge_cut_off_by_token_budget_is_a_clear_error(server, parser):
    crit = f"The response names a colour. (thinking, parser {parser}, cut off)"
    with pytest.raises(GradingError) as info:
        _judge_one(server, crit, base_url=_flavour_url(server, parser), max_tokens=4, parse_retries=2)
    msg = str(info.value)
    assert server.attempts[crit] == 3  # re-asked up to parse_retries; every attempt cut: the budget is named
    assert "finish_reason='length'" in msg and "max_tokens=4" in msg and "enable_thinking" in msg
    assert "in all 3 attempts" in msg
    assert "Okay, let me" in msg  # the start of what the judge said
    assert server.requests[-1]["max_tokens"] == 4 and "chat_template_kwargs" not in server.requests[-1]


@pytest.mark.parametrize("parser", ["on", "off"])
def test_thinking_judge_with_enough_budget_gives_the_verdict_after_its_reasoning(server, parser):
    crit = f"The response names a colour. (thinking, parser {parser}, budget)"
    verdict = _judge_one(server, crit, base_url=_flavour_url(server, parser), max_tokens=256, seed=11)
    assert verdict.outcome == _expected_outcome(server, crit, 11)
    if parser == "off":  # the reply text holds the reasoning block; with the parser on it is split off by the server
        assert verdict.raw.startswith("<think>") and "</think>" in verdict.raw
    else:  # what the judge said as its answer, nothing of ours added
        assert verdict.raw.strip() in ("yes", "no")
    assert server.attempts[crit] == 1 and server.requests[-1]["max_tokens"] == 256


@pytest.mark.parametrize("parser", ["on", "off"])
def test_thinking_switched_off_by_chat_template_kwargs(server, parser):
    crit = f"The response names a colour. (thinking, parser {parser}, switched off)"
    verdict = _judge_one(server, crit, base_url=_flavour_url(server, parser), max_tokens=4, seed=12,
                         chat_template_kwargs={"enable_thinking": False})
    assert server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert verdict.outcome == _expected_outcome(server, crit, 12) and verdict.raw.strip() in ("yes", "no")


def test_unparsed_answers_are_quoted_in_errors(server):
    crit = "[[garbage]] The response is polite."
    rubric = Rubric.from_row({"question": Q, "id": "g", "rubrics": [{"criterion": crit, "points": 1}]})
    with pytest.raises(GradingError) as info:
        DualScorer(RubricGrader(_judge(server, parse_retries=0), seed=1)).score([None], [R], [rubric])
    assert "Well, it depends" in str(info.value)


def test_thinking_knobs_enter_the_judge_identity():
    from setgrpo_verl.grading import build_grader, grader_identity

    base = {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"}
    plain = grader_identity(base)
    off = grader_identity(base | {"chat_template_kwargs": {"enable_thinking": False}})
    budget = grader_identity(base | {"max_tokens": 2048})
    assert len({plain["template_hash"], off["template_hash"], budget["template_hash"]}) == 3
    built = build_grader(base | {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2048})
    assert (built.judge.chat_template_kwargs, built.judge.max_tokens) == ({"enable_thinking": False}, 2048)
    assert built.identity == grader_identity(base | {"chat_template_kwargs": {"enable_thinking": False},
                                                     "max_tokens": 2048})
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        build_grader(base | {"chat_template_kwargs": "enable_thinking=false"})


def _flavour_url(server, parser):
    return server.base_url.replace("/v1", f"/reasoning-parser-{parser}/v1")


def test_cli_probe_of_a_thinking_judge_names_the_token_budget(server, capsys, tmp_path):
    """`calibrate --judge openai` against a thinking judge whose replies are cut off: one error line (exit 2) that
    names the budget and both knobs, before the policy loads; with the flags the grader sends them."""
    from setgrpo_verl.runner import cli, launch
    from setgrpo_verl.runner.run import grader_config

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"Name the number {i}.", "id": f"d{i}", "rubrics": [
        {"criterion": "Names the number.", "points": 1}]}) + "\n" for i in range(40)))
    argv = ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--data", str(data),
            "--judge", "openai", "--judge-base-url", _flavour_url(server, "on"), "--judge-model", "qwen3-like"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "max_tokens=16" in err[-1] and "--judge-max-tokens" in err[-1]
    assert "--judge-chat-template-kwargs" in err[-1] and "cannot be reached" not in err[-1]
    assert not (tmp_path / "run").exists()
    args = cli.build_parser().parse_args(argv + ["--judge-max-tokens", "512", "--judge-chat-template-kwargs",
                                                 '{"enable_thinking": false}'])
    grader = grader_config(args, seed=0)
    assert (grader["max_tokens"], grader["chat_template_kwargs"]) == (512, {"enable_thinking": False})
    launch.probe_judge(grader)  # the probe now gets a verdict
    assert server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv + ["--judge-chat-template-kwargs", "enable_thinking=false"])


def test_request_longer_than_the_judge_context_names_row_and_response_and_is_not_retried(server):
    long = "word " * 1500
    judge = OpenAIJudge(server.base_url.replace("/v1", "/ctx-3000/v1"), "smollm2-135m-judge", timeout=120.0,
                        max_retries=2)
    rubric = Rubric.from_row({"id": "long-1", "question": Q, "rubrics": [
        {"criterion": "The response is an essay about colours.", "points": 1}]})
    before = len(server.requests)
    with pytest.raises(GradingError) as info:
        DualScorer(RubricGrader(judge)).score([Q, Q], [R, long], [rubric, rubric])
    message = str(info.value)
    assert "row 'long-1', response 'word word" in message
    assert "as longer than its context (HTTP 400, not retried: This model's maximum context length is 750" in message
    assert "max_response_tokens" in message and "retries" not in message
    sent_long = [b for b in server.requests[before:] if "word word" in b["messages"][-1]["content"]]
    assert 1 <= len(sent_long) <= 2  # one request per scoring at most
    assert len({json.dumps(b, sort_keys=True) for b in sent_long}) == len(sent_long)  # none repeated


def test_max_response_tokens_cuts_responses_to_fit_the_judge_context(server):
    long = "word " * 1500
    judge = OpenAIJudge(server.base_url.replace("/v1", "/ctx-3000/v1"), "smollm2-135m-judge", timeout=120.0,
                        max_response_tokens=1000)
    rubric = Rubric.from_row({"id": "long-1", "question": Q, "rubrics": [
        {"criterion": "The response is an essay about colours.", "points": 1}]})
    before = len(server.requests)
    out = DualScorer(RubricGrader(judge)).score([Q], [long], [rubric])
    assert out.point[0] in (0.0, 1.0)
    sent = server.requests[before:][0]["messages"][-1]["content"]
    assert ("word " * 200).strip() in sent and "word " * 201 not in sent  # 1,000 UTF-8 bytes = 200 words
    assert judge.identity["template_hash"] != OpenAIJudge("http://x/v1", "smollm2-135m-judge").identity["template_hash"]


def test_other_client_errors_are_not_retried(server):
    judge = OpenAIJudge(server.base_url.replace("/v1", "/no-such-route/v1"), "smollm2-135m-judge", max_retries=3)

    async def body():
        try:
            await judge.ajudge([JudgeRequest(Q, R, "The response names a colour.")], [5])
        finally:
            await judge.aclose()

    before = len(server.requests)
    with pytest.raises(GradingError, match="answered HTTP 404, a refusal that repeating the request cannot change "
                                           r"\(not retried\): no route no-such-route"):
        _run(body)
    assert len(server.requests) - before == 1
