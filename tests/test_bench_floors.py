"""benchmarks/floors.py: the multiply-add and byte counts behind bench_step_floor.py and bench_sketch_pass.py, on a
tiny config counted by hand and on SmolLM2-135M against the table in docs/sketch.md#speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from setgrpo_verl.sketch import SketchConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "floors.py"


def _floors():
    spec = importlib.util.spec_from_file_location("floors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["floors"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


#: head dim 4, key-value width 4; per layer q 64 + k 32 + v 32 + o 64 + gate 96 + up 96 + down 96 = 480
TINY = SimpleNamespace(hidden_size=8, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1,
                       num_hidden_layers=3, vocab_size=20)
SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          num_hidden_layers=30, vocab_size=49152)


def test_per_token_counts_of_a_tiny_decoder():
    f = _floors()
    assert f.linear_macs(TINY) == 3 * 480
    assert f.head_macs(TINY) == 160
    assert f.attention_macs(TINY, 5) == 3 * 2 * 8 * 5
    assert f.causal_attention_macs(TINY, 3) == 3 * 2 * 8 * (1 + 2 + 3)
    assert f.kv_bytes_per_token(TINY, 4) == 3 * 2 * 4 * 4


def test_decode_step_generate_forward_and_update_of_a_tiny_decoder():
    f = _floors()
    step = f.decode_step(TINY, batch=2, context=5, weight_bytes=1000, element_bytes=4)
    assert (step.macs, step.bytes) == (2 * (1440 + 160 + 3 * 2 * 8 * 6), 1000 + 2 * 6 * 96)
    # one prompt of 3 tokens prefilled once (head on its last position), then 1 step of its 2 responses
    gen = f.generate(TINY, groups=1, k=2, prompt=3, response=2, weight_bytes=1000, element_bytes=4)
    assert gen.macs == (3 * 1440 + 288 + 160) + 2 * (1440 + 160 + 3 * 2 * 8 * 4)
    assert gen.bytes == (1000 + 3 * 96) + (1000 + 2 * 4 * 96)
    assert f.forward(TINY, rows=2, prompt=3, response=2) == 2 * (5 * 1440 + 3 * 2 * 8 * 15 + 2 * 160)
    assert f.forward(TINY, rows=1, prompt=3, response=2, head_rows="all") == 5 * 1440 + 720 + 5 * 160
    upd = f.update(TINY, rows=2, prompt=3, response=2, params=100, compute_bytes=2)
    assert (upd.macs, upd.bytes) == (3 * 16480, 2 * 100 * 2 + 100 * 4 + 7 * 100 * 4)


def test_sketch_pass_floor_of_smollm2_is_the_documented_one():
    s = _floors().sketch_pass(SMOLLM2, SketchConfig(), prompt=96, response=24, rows=16)
    assert s["F"] / 1e6 == pytest.approx(136.6, abs=0.05)
    assert s["B"] / 1e6 == pytest.approx(116.0, abs=0.05)
    assert s["S"] / 1e6 == pytest.approx(32.3, abs=0.05)
    assert s["floor"] == pytest.approx(2.09, abs=0.005)


def test_floor_is_the_larger_of_compute_and_memory_time():
    f = _floors()
    work = f.Work(macs=100.0, bytes=50.0) + f.Work(macs=0.0, bytes=50.0)
    assert f.floor_seconds(work, macs_per_s=10.0, bytes_per_s=100.0) == (10.0, 10.0, 1.0)
    assert f.floor_seconds(work.scaled(2), macs_per_s=1000.0, bytes_per_s=10.0) == (20.0, 0.2, 20.0)
    with pytest.raises(ValueError, match="rates must be positive"):
        f.floor_seconds(work, macs_per_s=0.0, bytes_per_s=1.0)
