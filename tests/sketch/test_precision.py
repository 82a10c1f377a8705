"""The sketch's arithmetic on the device: projections in the layer's precision, one product for the layers that share
an input (docs/sketch.md#precision)."""

from __future__ import annotations

import pytest
import torch

from setgrpo_verl.sketch import GradientSketcher, SketchConfig, compute_sketches
from tests.sketch._tiny import cosine, tiny_qwen3, verl_batch

CFG = SketchConfig(rank_out=1, rank_in=2, copies=8, head_rank_in=4, head_copies=16, seed=5)


def _stacks(copies: dict) -> list[int]:
    """How many projections each device copy stacks, sorted."""
    return sorted(len(key[0]) for key in copies)


def _unshared(model):
    """Give k_proj, v_proj and up_proj a copy of their input, so no two layers share an input tensor."""
    for layer in model.model.layers:
        for module in (layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
            module.register_forward_pre_hook(lambda m, args: (args[0].clone(),))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("packed", [False, True])
def test_layers_sharing_an_input_are_projected_with_one_product(dtype, tol, packed, monkeypatch):
    """q/k/v and gate/up are projected with one product of their stacked input projections; the sketches are those of
    one product per layer to float tolerance."""
    from setgrpo_verl.sketch import projections

    ids, am, rm = verl_batch()
    model = tiny_qwen3(dtype=dtype, layers=2)
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})
    stacked = compute_sketches(model, ids, am, rm, CFG, use_remove_padding=packed)
    # per layer: q/k/v stacked (3), gate/up stacked (2), o_proj and down_proj alone; the head and the P_out alone
    assert _stacks(projections._DEVICE_COPIES).count(3) == 2 and _stacks(projections._DEVICE_COPIES).count(2) == 2

    unshared = tiny_qwen3(dtype=dtype, layers=2)
    _unshared(unshared)
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})
    single = compute_sketches(unshared, ids, am, rm, CFG, use_remove_padding=packed)
    assert set(_stacks(projections._DEVICE_COPIES)) == {1}
    scale = single.sketches.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(stacked.sketches, single.sketches, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(stacked.log_probs, single.log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("model_dtype, expected", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                   (torch.float64, torch.float32)])
def test_projections_run_in_the_layers_precision(model_dtype, expected, monkeypatch):
    """On the CPU every layer is projected in float32 (oneDNN's AMX bfloat16 product can stop the process there);
    ``projection_dtype`` sets the reference precision."""
    from setgrpo_verl.sketch import projections

    ids, am, rm = verl_batch()
    model = tiny_qwen3(dtype=model_dtype)
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})
    out = compute_sketches(model, ids, am, rm, CFG)
    assert {key[2] for key in projections._DEVICE_COPIES} == {expected}
    assert out.sketches.dtype == torch.float32
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})
    compute_sketches(model, ids, am, rm, CFG, projection_dtype=torch.float64)
    assert {key[2] for key in projections._DEVICE_COPIES} == {torch.float64}


@pytest.mark.parametrize("model_dtype, expected", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_on_a_reduced_precision_device_the_hooks_project_in_the_layers_precision(model_dtype, expected, monkeypatch):
    """What CUDA runs, with the CPU counted as such a device: the hooks pass each tensor's device to the rule."""
    from setgrpo_verl.sketch import chunks, projections

    ids, am, rm = verl_batch()
    model = tiny_qwen3(dtype=model_dtype)
    monkeypatch.setattr(chunks, "REDUCED_DEVICES", ("cpu",))
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})
    compute_sketches(model, ids, am, rm, CFG)
    assert {key[2] for key in projections._DEVICE_COPIES} == {expected}


def test_bfloat16_projections_agree_with_float32_ones():
    """On a bfloat16 model the sketch's cosines with bfloat16 projections are those with float32 projections to
    well inside the sketch's own error (docs/sketch.md#precision)."""
    ids, am, rm = verl_batch(bsz=4, t_prompt=8, t_resp=8)
    model = tiny_qwen3(dtype=torch.bfloat16, hidden=64)
    low = compute_sketches(model, ids, am, rm, SketchConfig(), projection_dtype=torch.bfloat16).sketches.double()
    ref = compute_sketches(model, ids, am, rm, SketchConfig(), projection_dtype=torch.float32).sketches.double()
    assert (low - ref).norm() / ref.norm() < 1e-2
    assert (cosine(low @ low.T) - cosine(ref @ ref.T)).abs().max() < 2e-3


@pytest.mark.parametrize("layer, device, override, expected", [
    (torch.bfloat16, "cuda", None, torch.bfloat16), (torch.float16, "cuda", None, torch.float16),
    (torch.float32, "cuda", None, torch.float32), (torch.float64, "cuda", None, torch.float32),
    (torch.bfloat16, "cpu", None, torch.float32), (torch.bfloat16, "cpu", torch.bfloat16, torch.bfloat16)])
def test_the_projection_dtype_follows_the_layer_on_cuda_and_is_float32_on_the_cpu(layer, device, override, expected):
    from setgrpo_verl.sketch.chunks import compute_dtype

    assert compute_dtype(layer, device, override=override) == expected


def test_a_bfloat16_product_accumulates_in_float32_on_the_cpu():
    """torch's bfloat16 matrix product on the CPU sums in float32 and rounds once: 4,096 ones sum to 4,096 (a
    bfloat16 running sum stops at 256)."""
    from setgrpo_verl.sketch.chunks import project

    ones = torch.ones(2, 4096, dtype=torch.bfloat16)
    y = project(ones, ones[:1].T)
    assert y.dtype == torch.bfloat16 and y.tolist() == [[4096.0], [4096.0]]


def test_projection_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match="projection_dtype"):
        GradientSketcher(tiny_qwen3(), projection_dtype=torch.int64)
