"""Speed of the SetGRPO core: ms per training step and per calibration.

Prints, in one run, the median milliseconds of ``setgrpo_coefficients`` (anchor + recovery +
status) for 64 groups x K=8 and 512 groups x K=16, and of ``calibrate`` on 10,000 groups x K=8,
plus the ratio to the source paper's 7 s per step of coefficient recovery and to our 10 ms target.

    python benchmarks/bench_core.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse

import torch
from harness import median_seconds

from setgrpo_verl.core import CalibrationSettings, calibrate, setgrpo_coefficients


def _groups(n: int, k: int, seed: int, dim: int = 6, noise: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    mu = torch.rand(n, k, generator=g, dtype=torch.float64)
    point = mu + noise * torch.randn(n, k, generator=g, dtype=torch.float64)
    reference = mu + noise * torch.randn(n, k, generator=g, dtype=torch.float64)
    grads = torch.randn(n, k, dim, generator=g, dtype=torch.float64) + 0.8 * torch.randn(n, 1, dim, generator=g,
                                                                                       dtype=torch.float64)
    return point, reference, grads @ grads.transpose(1, 2)


#: The paper's levels; a record that certifies no threshold is still timed.
PAPER = CalibrationSettings(alpha=0.05, beta=0.08, delta=0.05, on_infeasible="reject_all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} runs")
    for groups, k in ((64, 8), (512, 16)):
        p, r, m = _groups(10_000 if k == 8 else 4_000, k, seed=k)
        record = calibrate(p, r, m, PAPER)
        ms = 1e3 * median_seconds(lambda: setgrpo_coefficients(p[:groups], m[:groups], record), args.repeats)
        print(f"setgrpo_coefficients {groups:4d} groups x K={k:2d}: {ms:8.2f} ms/step  "
              f"(paper 7000 ms: {7000 / ms:7.0f}x faster; target 10 ms: {ms / 10:.2f}x of target)")
    p, r, m = _groups(10_000, 8, seed=1)
    ms = 1e3 * median_seconds(
        lambda: calibrate(p, r, m, PAPER),
        max(3, args.repeats // 5))
    print(f"calibrate 10,000 groups x K= 8: {ms:8.1f} ms")


if __name__ == "__main__":
    main()
