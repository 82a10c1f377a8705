"""Sketches under FSDP2 (verl's apply_fsdp2) on two gloo CPU ranks equal a single-process run
(docs/sketch.md#mechanics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sketch._tiny import run_two_gloo_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_match_single_process(tmp_path):
    results, proc = run_two_gloo_ranks(WORKER, tmp_path)
    for res in results:
        assert "traceback" not in res, res["traceback"]
        assert res["num_dtensor_params"] > 0  # the model really was sharded
        assert res["grad_none_after_sketch"]
        for key, err in res["errors"].items():
            assert err < 1e-4, (res["rank"], key, err)
        assert res["dp_grad_rel_err"] < 1e-4
        assert res["ok"]
    assert proc.returncode == 0, proc.stderr[-5000:]
