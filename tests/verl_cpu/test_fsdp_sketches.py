"""Sketches on FSDP shards inside the live loop: a CPU ``main_ppo`` calibration with 2 FSDP2 actor ranks on gloo gives,
row by row in batch order, the sketches a single process computes for the same sequences, and by default exactly
``SketchConfig()``'s size.

A test-only module loaded by verl in every process (``VERL_USE_EXTERNAL_MODULES``) saves each sketched batch as the
trainer received it (sequences and sketches, in batch order); the reference is :func:`setgrpo_verl.sketch.
compute_sketches` on the initial weights (calibration never updates them).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from setgrpo_verl.sketch import SketchConfig, compute_sketches

from .conftest import tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]

_DUMP = '''
import os

from setgrpo_verl.integration import plugin


def patch():
    import torch
    import transfer_queue as tq

    from setgrpo_verl.integration import trainer

    original = trainer.SetGRPOTrainer._compute_sketches

    def dumped(self, batch, fused=False):
        original(self, batch, fused)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["prompts", "responses", "response_mask", trainer.SKETCH_KEY])
        rows = {k: list(data[k].unbind()) if data[k].is_nested else list(data[k]) for k in data.keys()}
        out = os.environ["SKETCH_DUMP"]
        torch.save({k: [t.clone() for t in v] for k, v in rows.items()}, os.path.join(out, f"{len(os.listdir(out))}.pt"))

    trainer.SetGRPOTrainer._compute_sketches = dumped


plugin.install((plugin.Registration("setgrpo_verl.integration.trainer", "sketch_dump:patch", "the sketch dump"),))
'''


def test_two_fsdp_ranks_give_the_single_process_sketches(tiny_model, reward_file, tmp_path):
    (tmp_path / "sketch_dump.py").write_text(_DUMP)
    dump = tmp_path / "dump"
    dump.mkdir()
    env = {"VERL_USE_EXTERNAL_MODULES": "sketch_dump", "PYTHONPATH": str(tmp_path), "SKETCH_DUMP": str(dump)}
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "setgrpo_verl", "calibrate", "--run-dir", str(tmp_path / "run"), "--model",
         str(tiny_model), "--judge", "function", "--reward-function", str(reward_file), "--actor-ranks", "2",
         "--rollout-n", "2", "--groups-per-step", "2", "--calib-groups", "4", "--calib-batch-size", "4",
         "--max-prompt-length", "128", "--max-response-length", "6", "--alpha", "0.5", "--beta", "0.9",
         "--delta", "0.3", "--tau-grid", "0.0", "--on-infeasible", "reject_all",
         "--precision", "fp32"],  # compared with a float32 single-process reference to 1e-5
        capture_output=True, text=True, env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0, tail(proc)
    (batch,) = [torch.load(p) for p in sorted(dump.iterdir())]
    sketches = torch.stack(batch["setgrpo_sketch"]).double()
    assert sketches.shape[0] == 8
    # the 2 ranks serve from 2 rollout replicas: their sampling streams are independent, so the tiny random model's
    # near-uniform samples of 6 tokens are all distinct (a shared stream gave each sequence twice)
    responses = {tuple(r.tolist()) for r in batch["responses"]}
    assert len(responses) == 8, batch["responses"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32, attn_implementation="eager")
    config = SketchConfig()
    for i, (prompt, response, mask) in enumerate(zip(batch["prompts"], batch["responses"], batch["response_mask"])):
        ids = torch.cat([prompt, response]).unsqueeze(0)
        attention = torch.ones_like(ids)
        ref = compute_sketches(model, ids, attention, mask.unsqueeze(0).long(), config, loss_agg_mode="token-mean",
                               temperature=1.0).sketches[0].double()
        assert ref.shape == sketches[i].shape  # SketchConfig()'s size, computed by the workers
        rel = float((sketches[i] - ref).norm() / ref.norm())
        assert rel <= 1e-5, (i, rel)
