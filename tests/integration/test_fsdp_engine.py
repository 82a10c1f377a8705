"""The worker's sketch pass under FSDP1 (verl's default) and FSDP2 on two gloo CPU ranks equals the single-process
pass, and FSDP1 units are resharded during the activation-only backward (docs/sketch.md#memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sketch._tiny import run_two_gloo_ranks

WORKER = Path(__file__).with_name("fsdp_engine_worker.py")


@pytest.mark.slow
def test_fsdp1_and_fsdp2_two_gloo_ranks_match_one_process_and_fsdp1_reshards(tmp_path):
    results, proc = run_two_gloo_ranks(WORKER, tmp_path)
    for res in results:
        assert "traceback" not in res, res["traceback"]
        for key, err in res["errors"].items():  # both strategies, padded and packed, sketches and log-probs
            assert err <= 1e-4, (res["rank"], key, err)
        assert res["fsdp/grad_none"] and res["fsdp2/grad_none"]
        seen = res["unsharded_at_embedding"]
        units = seen["fsdp_units"]  # 3 decoder layers + the root
        # the activation-only backward alone leaves every unit unsharded until the end of the backward ...
        assert seen["fsdp-without-reshard"] == [units, units]
        # ... with the sketch's hooks only the root and the first layer are still unsharded at the embedding; FSDP2
        # needs no hook for that (it reshards from the gradient of each unit's inputs)
        assert seen["fsdp"] == [2, 2] and seen["fsdp2"] == [2, 2]
        assert seen["fsdp/after"] == seen["fsdp-without-reshard/after"] == seen["fsdp2/after"] == 0
        assert res["ok"]
    assert proc.returncode == 0, proc.stderr[-5000:]
