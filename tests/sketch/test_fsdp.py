"""Sketches under FSDP2 (verl's apply_fsdp2) on two gloo CPU ranks equal a single-process run
(docs/sketch.md#mechanics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_match_single_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    results = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        results.append(json.loads(path.read_text()))
    for res in results:
        assert "traceback" not in res, res["traceback"]
        assert res["num_dtensor_params"] > 0  # the model really was sharded
        assert res["grad_none_after_sketch"]
        for key, err in res["errors"].items():
            assert err < 1e-4, (res["rank"], key, err)
        assert res["dp_grad_rel_err"] < 1e-4
        assert res["ok"]
    assert proc.returncode == 0, proc.stderr[-5000:]
