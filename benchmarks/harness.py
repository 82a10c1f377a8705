"""Run-and-measure scaffolding shared by the benchmarks: timing (median or best of repeats, passes alternated in
one process so load from other processes hits them alike), peak memory (the process's peak resident set, reset
before a pass; CUDA's peak allocation), and one pass per fresh subprocess whose last stdout line is a JSON dict."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable


def device_sync(device) -> Callable[[], None]:
    """A function that waits for the device's queued work (CUDA), a no-op on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def times(fn: Callable[[], object], repeats: int, *, sync: Callable[[], None] = lambda: None,
          warmup: bool = True) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (after one untimed warm-up call unless ``warmup`` is false)."""
    if warmup:
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def median_seconds(fn: Callable[[], object], repeats: int, **kwargs) -> float:
    """Median seconds of :func:`times`."""
    return statistics.median(times(fn, repeats, **kwargs))


def min_seconds(fn: Callable[[], object], repeats: int, **kwargs) -> float:
    """Best (smallest) seconds of :func:`times` without a warm-up call (the first call's one-off costs count once)."""
    return min(times(fn, repeats, warmup=False, **kwargs))


def alternated(passes: dict[str, Callable[[], object]], repeats: int, *,
               sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each pass over ``repeats`` rounds, the passes alternating within a round (one warm-up round)."""
    for fn in passes.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, fn in passes.items():
            out[name].extend(times(fn, 1, sync=sync, warmup=False))
    return out


def rss_gb() -> float:
    """The process's current resident set (GB)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gb() -> float:
    """The process's peak resident set since start or the last :func:`reset_peak_rss` (``VmHWM``, GB)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak_rss() -> None:
    """Reset the peak resident set to the current one (Linux ``/proc/self/clear_refs`` value 5), so a measured peak
    is that of the pass, not of what ran before it."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def run_child(script: str, argv: list[str]) -> dict:
    """Run ``python script *argv`` in a fresh process and return the JSON dict on its last stdout line; exits with
    the child's stderr when it fails."""
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{os.path.basename(script)} {' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rollout_batch(groups: int, k: int, prompt: int, response: int, dtype: str):
    """The embedded policy's CPU rollout server (``dtype`` ``"fp32"`` or ``"bf16"``, ``groups * k`` requests a batch)
    and what the rollout benchmarks decode: ``groups`` random prompts of ``prompt`` tokens, each sent ``k`` times, and
    the sampling key (temperature 1, top_p 1, no top_k, ``response`` new tokens, log-probs)."""
    import torch

    from setgrpo_verl.models import embedded_model_dir
    from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer

    server = TransformersRolloutServer(str(embedded_model_dir()), response_length=response,
                                       max_batch_size=groups * k, seed=0,
                                       dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                                       num_threads=torch.get_num_threads())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, server.tokenizer.vocab_size, (prompt,), generator=gen).tolist()
               for _ in range(groups)]
    return server, [p for p in prompts for _ in range(k)], (1.0, 1.0, -1, response, True)
