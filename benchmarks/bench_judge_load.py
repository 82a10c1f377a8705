"""Benchmark: the reward phase against a judge server under load (prints figures, no assertions).

A local OpenAI-compatible stub (``judge_stub.py``, loopback) answers after ``--latency`` seconds, serves at most
``--limit`` requests at once (the surplus gets HTTP 429), and answers a share of requests with HTTP 503, slowly, or
cut by the token budget. The real grading path of the ``setgrpo_dual`` reward manager (``DualScorer`` over a
``RubricGrader`` with the ``openai`` judge, one ``ascore`` per response as ``run_single`` calls it) scores
``--prompts`` x ``--k`` responses against ``--criteria`` judged criteria, ``--scorings`` times each, split over N
reward workers, each its own process with its own event loop and in-flight limit, as verl's reward workers are.

For each N it prints the requests in flight at the stub over time, the throughput against the stub's limit
(``limit / latency`` requests per second), the reward phase's wall time against its floor (requests / limit x
latency), and the 429s, 503s, re-asks and failed responses and groups.

    python benchmarks/bench_judge_load.py [--workers 1 4 16] [--latency 0.02] [--limit 8] [--criteria 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from judge_stub import JudgeStub  # noqa: E402


def _rubric(criteria: int) -> dict:
    return {"id": "load", "question": "Name a primary colour and say why.",
            "rubrics": [{"criterion": f"The response meets requirement {j}.", "points": 1} for j in range(criteria)]}


def _worker(url: str, rows: list[tuple[int, int]], args, ready, start, out) -> None:
    """One reward worker: score its responses, one ``ascore`` per response, concurrently; put its figures on
    ``out``."""
    import openai  # noqa: F401  (imported before the clock starts, as in a warm reward worker)

    from setgrpo_verl.grading import DualScorer, GradingError, GradingItem, OpenAIJudge, Rubric, RubricGrader

    rubric = Rubric.from_row(_rubric(args.criteria))
    judge = OpenAIJudge(url, "stub", max_concurrency=args.max_concurrency, timeout=args.timeout, max_retries=4,
                        parse_retries=2, max_tokens=16)
    scorer = DualScorer(RubricGrader(judge, seed=0), scoring_indices=(0, 1)[:args.scorings])

    async def one(prompt: int, sample: int):
        item = GradingItem(response=f"Red, prompt {prompt}, sample {sample}.", rubric=rubric,
                           nonce=f"1/{prompt}/{sample}")
        try:
            scores = await scorer.ascore([item])
        except GradingError as exc:
            return prompt, None, str(exc)
        return prompt, int(scores.metrics(prefix="")["reasks"]), ""

    async def run():
        try:
            return await asyncio.gather(*(one(p, s) for p, s in rows))
        finally:
            await scorer.aclose()

    asyncio.run(scorer.ascore([GradingItem(response="warm-up", rubric=rubric, nonce="0/0/0")]))  # lazy imports
    ready.release()
    start.wait()
    t0 = time.perf_counter()
    results = asyncio.run(run())
    out.put((time.perf_counter() - t0, results))


def _series(samples: list[tuple[float, int]], width: float) -> str:
    """Requests in flight per ``width`` seconds: mean (max)."""
    if not samples:
        return "-"
    out, t, bucket = [], width, []
    for when, n in samples:
        if when > t and bucket:
            out.append(f"{sum(bucket) / len(bucket):.0f}({max(bucket)})")
            bucket, t = [], t + width * (1 + int((when - t) // width))
        bucket.append(n)
    if bucket:
        out.append(f"{sum(bucket) / len(bucket):.0f}({max(bucket)})")
    return " ".join(out)


def run_setting(stub: JudgeStub, workers: int, args) -> dict:
    rows = [(p, s) for p in range(args.prompts) for s in range(args.k)]
    ctx = mp.get_context("fork")
    ready, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(stub.base_url, rows[w::workers], args, ready, start, out))
             for w in range(workers)]
    for p in procs:
        p.start()
    for _ in procs:  # every worker imported and sent one request before the clock starts
        ready.acquire()
    time.sleep(1.0)
    stub.reset()
    t0 = time.perf_counter()
    start.set()
    parts = [out.get() for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    samples = [(t, n) for t, n in stub.samples]
    results = [r for _, res in parts for r in res]
    failed = [r for r in results if r[1] is None]
    requests = len(rows) * args.criteria * args.scorings
    floor = requests / args.limit * args.latency
    in_window = [n for t, n in samples if t <= wall]
    return {"workers": workers, "requests": requests, "wall": wall, "floor": floor,
            "throughput": stub.answered / wall, "ceiling": args.limit / args.latency, "answered": stub.answered,
            "refused": stub.refused, "errors": stub.errors, "slow": stub.slow, "cut": stub.cut, "peak": stub.peak,
            "mean_in_flight": sum(in_window) / max(1, len(in_window)),
            "reasks": sum(r[1] for r in results if r[1] is not None), "failed_responses": len(failed),
            "failed_groups": len({r[0] for r in failed}), "first_error": failed[0][2][:300] if failed else "",
            "series": _series(samples, max(0.5, round(wall / 12, 1)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--criteria", type=int, default=10)
    ap.add_argument("--scorings", type=int, default=2, choices=(1, 2))
    ap.add_argument("--latency", type=float, default=0.02, help="seconds per answered request")
    ap.add_argument("--limit", type=int, default=8, help="requests in flight the stub serves; more get HTTP 429")
    ap.add_argument("--error-rate", type=float, default=0.002, help="share of requests answered HTTP 503")
    ap.add_argument("--slow-rate", type=float, default=0.002, help="share of requests 20x slower")
    ap.add_argument("--cut-rate", type=float, default=0.01, help="share of replies cut before the verdict")
    ap.add_argument("--max-concurrency", type=int, default=32, help="the openai grader's per-worker requests in flight")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu} ({os.cpu_count()} cores); stub: latency {args.latency * 1e3:g} ms, limit {args.limit} in "
          f"flight, 503 {args.error_rate:.1%}, slow {args.slow_rate:.1%} (x20), cut {args.cut_rate:.1%}; "
          f"{args.prompts} x K={args.k} responses, {args.criteria} criteria, {args.scorings} scorings, "
          f"max_concurrency {args.max_concurrency} per worker", flush=True)
    rows = []
    with JudgeStub(latency=args.latency, limit=args.limit, error_rate=args.error_rate, slow_rate=args.slow_rate,
                   cut_rate=args.cut_rate) as stub:
        for n in args.workers:
            r = run_setting(stub, n, args)
            rows.append(r)
            print(f"\nworkers={n}: in flight at the stub, mean(max) per {max(0.5, round(r['wall'] / 12, 1))} s: "
                  f"{r['series']}", flush=True)
            if r["first_error"]:
                print(f"  first failure: {r['first_error']}")
    print("\n| reward workers | requests | wall s | floor s | wall / floor | answered/s (ceiling) | mean / peak in "
          "flight | 429s | 503s | slow | cut | re-asks | failed responses (groups) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workers']} | {r['requests']} | {r['wall']:.1f} | {r['floor']:.1f} | {r['wall'] / r['floor']:.2f} "
              f"| {r['throughput']:.0f} ({r['ceiling']:.0f}) | {r['mean_in_flight']:.1f} / {r['peak']} | "
              f"{r['refused']} | {r['errors']} | {r['slow']} | {r['cut']} | {r['reasks']} | "
              f"{r['failed_responses']} ({r['failed_groups']}) |")


if __name__ == "__main__":
    main()
