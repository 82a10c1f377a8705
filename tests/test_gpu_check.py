"""benchmarks/gpu_check.sh, the sketch's prepared GPU check, in its tiny CPU mode: it runs with torch and transformers
only (verl, Ray, vLLM and flash-attn cannot be imported), from the repository root with PYTHONPATH=., and prints every
figure docs/benchmarks.md#gpu-check names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Imports the check must not need: each is made to fail in the child.
_BLOCKED = ("verl", "ray", "vllm", "flash_attn")
_RUN = ("import runpy, sys\n"
        f"for name in {_BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import fails\n"
        "sys.argv = ['benchmarks/gpu_check.py', '--tiny', '--device', 'cpu', '--reps', '1']\n"
        "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')\n")


def test_the_gpu_check_runs_on_torch_and_transformers_alone_and_prints_its_figures():
    env = {**os.environ, "PYTHONPATH": ".", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for shape in ("tiny-a", "tiny-b"):
        for what in ("fwd+bwd", "fwd+lp", "sketch"):
            assert re.search(rf"\[{shape}\] .* {re.escape(what)} +\d+\.\d+ s  peak", out), (shape, what, out)
        assert re.search(rf"\[{shape}\] sketch / fwd\+bwd = \d", out)
        assert re.search(rf"\[{shape}\] sketch / fwd\+lp  = \d", out)
    cosine = float(re.search(r"max \|cosine difference\| ([0-9.e+-]+)", out).group(1))
    assert 0 < cosine < 1e-2  # bfloat16 projections are not float32 ones, and agree with them
    assert "logits_to_keep against the full logits: bit-equal" in out
    assert "modules loaded from verl, ray, vllm, flash_attn: none" in out


def test_the_wrapper_runs_the_check_from_the_repository_root_without_installing_anything():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert 'cd "$(dirname "$0")/.."' in script and "PYTHONPATH=" in script and "timeout 300" in script
    assert "pip install" not in script and "pip3" not in script


def test_the_wrapper_needs_only_python3_and_stops_at_once_without_a_gpu(tmp_path):
    """Where there is only `python3` (no `python`) and torch sees no GPU, the full-size check stops in seconds naming
    why, instead of building the 4B model on the CPU until `timeout 300`."""
    import shutil
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    for tool in ("bash", "timeout", "dirname", "env"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([str(bin_dir / "bash"), "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU that torch can use: torch.cuda.is_available() is False" in proc.stderr
    assert "CUDA_VISIBLE_DEVICES=''" in proc.stderr and "--tiny runs the same code on the CPU" in proc.stderr
    assert "model built" not in proc.stdout and time.monotonic() - start < 60
