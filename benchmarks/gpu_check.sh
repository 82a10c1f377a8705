#!/usr/bin/env bash
# The sketch's GPU check (docs/benchmarks.md#gpu-check): time, peak memory and precision in bfloat16 on a
# Qwen3-4B-shaped model with random weights; torch and transformers only, nothing installed, at most 5 minutes on one
# H100 or H200. Run from anywhere: bash benchmarks/gpu_check.sh [--tiny] [--reps 3] [--shapes 12k,41k]
# (python3 by default, PYTHON=... for another interpreter); without a GPU torch can use it stops at once, naming why,
# except with --tiny, which runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
