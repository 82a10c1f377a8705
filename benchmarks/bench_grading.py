"""Benchmark: dual scoring with the embedded SmolLM2-135M local judge (prints times, no assertions).

Target: 64 responses x ~4 judged criteria, scored twice, well under a minute on 2 idle CPU cores.
Two layouts of the 64 IFBench responses (IFBench sample outputs shipped in setgrpo_verl/data, cut to --response-tokens tokens):
* ``grouped``: 8 prompts x 8 responses (the training layout, rollout.n = 8: the question prefix is shared);
* ``distinct``: 64 different prompts (worst case for prefix sharing).
Each IFBench rubric has 3 judged quality criteria (+1 judged NLTK-type instruction for some) plus rule criteria.

    python benchmarks/bench_grading.py [--response-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from setgrpo_verl.grading import (DualScorer, GradingItem, JudgeRequest, LocalHFJudge, Rubric, RubricGrader,
                                      load_ifbench_rubrics)
    from setgrpo_verl.grading.convert import ifbench_data_file

    t0 = time.perf_counter()
    judge = LocalHFJudge(temperature=1.0, batch_size=args.batch_size)
    print(f"judge load: {time.perf_counter() - t0:.1f} s  (threads={torch.get_num_threads()})", flush=True)
    tok = judge.tokenizer
    text = ifbench_data_file("IFBench_sample_output.jsonl").read_text(encoding="utf-8")
    samples = {r["prompt"]: r["response"] for r in map(json.loads, text.splitlines())}
    rows = [Rubric.from_row(r) for r in load_ifbench_rubrics()]

    def cut(s: str, start: int = 0) -> str:
        ids = tok.encode(s, add_special_tokens=False)
        return tok.decode(ids[start : start + args.response_tokens])

    layouts = {
        "grouped": [GradingItem(cut(samples[r.question], 16 * k), r) for r in rows[:8] for k in range(8)],
        "distinct": [GradingItem(cut(samples[r.question]), r) for r in rows[8:72]],
    }
    # reference throughput of a plain forward in the same conditions (the machine may be shared)
    ids = torch.randint(100, 40000, (16, 128))
    with torch.inference_mode():
        judge.model.model(ids[:2, :16])
        t0 = time.perf_counter()
        judge.model.model(ids)
    plain_tps = ids.numel() / (time.perf_counter() - t0)
    print(f"plain forward 16x128 tokens: {plain_tps:.0f} tokens/s")
    for name, items in layouts.items():
        judged = sum(1 for it in items for c in it.rubric.criteria if c.rule is None)
        segs = [judge._segments(JudgeRequest(it.question, it.response, c.criterion))
                for it in items for c in it.rubric.criteria if c.rule is None]
        n_tokens = sum(len(tok.encode(t, add_special_tokens=False)) for t in
                       list({a for a, _, _ in segs}) + [b for _, b in {(a, b) for a, b, _ in segs}] + [c for *_, c in segs])
        judge._cache.clear()
        scorer = DualScorer(RubricGrader(judge, seed=0))
        t0 = time.perf_counter()
        out = asyncio.run(scorer.ascore(items))
        dt = time.perf_counter() - t0
        m = out.metrics()
        print(
            f"{name:9s}: {len(items)} responses, {judged} judged criteria ({judged / len(items):.2f}/response), "
            f"{n_tokens} tokens through the model; scored twice in {dt:.1f} s = {dt * plain_tps / n_tokens:.2f} x "
            f"the plain-forward time of those tokens; |r - r'| mean {m['grading/abs_diff_mean']:.3f}, "
            f"judged disagreement {m['grading/judged_disagreement_rate']:.2f}",
            flush=True,
        )

if __name__ == "__main__":
    main()
