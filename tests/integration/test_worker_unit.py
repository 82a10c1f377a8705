"""The worker's sketch path without Ray: verl's micro-batching, order restoration, and the engine's own model inputs,
outputs and autocast (``FSDPEngineWithLMHead``, verl 0.9.1)."""

from __future__ import annotations

import hashlib
import inspect

import pytest
import torch

from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from setgrpo_verl.integration import worker
from setgrpo_verl.integration.worker import sketch_and_log_probs, sketch_batch
from setgrpo_verl.sketch import SketchConfig, compute_sketches
from tests.sketch._tiny import tiny_llama, tiny_qwen3, tiny_qwen35_text, with_per_sequence_delta_rule

from ._engine import BareEngine, cpu_platform, nested_batch, padded_layout, verl_log_probs
from .test_ray_cpu import SKETCH, _batch, _tiny_model


@pytest.fixture(autouse=True)
def _verl_on_the_cpu():
    with cpu_platform():
        yield


def _ragged(vocab: int, b: int = 5, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(b)]
    responses = [torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(b)]
    masks = [torch.ones_like(r) for r in responses]
    masks[0][1] = 0  # a response token outside the loss
    return nested_batch(prompts, responses, masks)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def test_sketch_batch_matches_whole_batch_hook_and_bf16_autocast_keeps_the_geometry():
    model = _tiny_model()
    data = _batch()
    ids, am, rm = padded_layout(data)
    exact = compute_sketches(model, ids, am, rm, SKETCH).sketches
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=20, use_remove_padding=True)
    torch.testing.assert_close(sketch_batch(BareEngine(model), data, SKETCH, loss_agg_mode="token-mean"), exact,
                               rtol=1e-4, atol=1e-5)
    bf16 = sketch_batch(BareEngine(model, autocast_dtype=torch.bfloat16), data, SKETCH, loss_agg_mode="token-mean")
    assert bf16.dtype == torch.float32
    gram, gram_bf16 = exact @ exact.T, bf16 @ bf16.T
    assert float((gram - gram_bf16).abs().max() / gram.abs().max()) < 0.03  # far below the sketch's own error


def _families():
    return {"llama_tied": tiny_llama(tie=True, dtype=torch.float32), "qwen3": tiny_qwen3(dtype=torch.float32),
            "qwen35_hybrid": tiny_qwen35_text()}


@pytest.fixture
def verl_qwen35_patch(monkeypatch):
    """verl's monkey patch of the Qwen3.5 decoder layer and Gated DeltaNet (what ``apply_monkey_patch`` installs for
    Qwen3.5), undone after the test: the layers take ``cu_seqlens`` and run each packed sequence on its own."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from verl.models.transformers.qwen3_5 import qwen3_5_decoder_layer_forward, qwen3_5_gated_delta_net_forward

    monkeypatch.setattr(m.Qwen3_5DecoderLayer, "forward", qwen3_5_decoder_layer_forward)
    monkeypatch.setattr(m.Qwen3_5GatedDeltaNet, "forward", qwen3_5_gated_delta_net_forward)


@pytest.mark.parametrize("family", ["llama_tied", "qwen3", "qwen35_hybrid"])
def test_packed_equals_padded_through_the_engine_for_every_family(family, verl_qwen35_patch):
    model = _families()[family]
    if family == "qwen35_hybrid":  # the torch delta rule ignores cu_seqlens: run it per sequence, as verl's split does
        model = with_per_sequence_delta_rule(model)
    # Qwen3_5ForConditionalGeneration's verl forward takes cu_seqlens (so verl passes them); the text-only class used
    # here receives them through its **kwargs, which is what the engine does for the VL class
    engine = BareEngine(model, pass_packed_cu_seqlens=family == "qwen35_hybrid" or None)
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=5)
    out = {}
    for packed in (False, True):
        data = _ragged(model.config.vocab_size)
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_remove_padding=packed,
                             temperature=0.7)
        out[packed] = sketch_and_log_probs(engine, data, cfg, loss_agg_mode="token-mean")[:2]
    assert _rel(out[True][0], out[False][0]) <= 1e-4, family
    lp_packed, lp_padded = (torch.cat(out[k][1].unbind()) for k in (True, False))
    assert float(((lp_packed - lp_padded).abs() / lp_padded.abs()).max()) <= 1e-4, family
    # and both equal one sequence at a time (no packing, no padding)
    data = _ragged(model.config.vocab_size)
    rows = zip(data["prompts"].unbind(), data["responses"].unbind(), data["response_mask"].unbind())
    for i, (p, r, m) in enumerate(rows):
        ids = torch.cat([p, r])[None]
        ref = compute_sketches(model, ids, torch.ones_like(ids), m[None], cfg, temperature=0.7).sketches
        assert _rel(out[True][0][i : i + 1], ref) <= 1e-4, (family, i)


def test_packed_hybrid_without_cu_seqlens_is_refused(verl_qwen35_patch):
    model = tiny_qwen35_text()
    data = _ragged(model.config.vocab_size)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_remove_padding=True,
                         temperature=1.0)
    with pytest.raises(NotImplementedError, match="use_remove_padding=False"):
        sketch_batch(BareEngine(model), data, SketchConfig(), loss_agg_mode="token-mean")
    # with cu_seqlens, transformers' torch delta rule (no flash-linear-attention) would still ignore them: refused
    with pytest.raises(NotImplementedError, match="flash-linear-attention"):
        sketch_batch(BareEngine(model, pass_packed_cu_seqlens=True), data, SketchConfig(), loss_agg_mode="token-mean")
    ids, am, rm = padded_layout(data)
    with pytest.raises(ValueError, match="linear-attention"):
        compute_sketches(model, ids, am, rm, use_remove_padding=True)


@pytest.mark.parametrize("autocast", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_old_log_probs_are_verls_own_at_temperature_0_7(autocast, packed):
    """The fused pass's old_log_probs are bit-equal to verl's compute_log_prob (forward_step, no grad) on the same
    micro-batch, in verl's dtype: the first PPO ratio exp(log_prob - old_log_prob) is exactly 1."""
    model = tiny_qwen3(dtype=torch.float32)
    engine = BareEngine(model, autocast_dtype=autocast)
    data = _ragged(model.config.vocab_size)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_remove_padding=packed,
                         temperature=0.7)
    _, fused, _ = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    expected = verl_log_probs(engine, data)
    for a, b in zip(fused.unbind(), expected.unbind(), strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    # and they are the temperature-scaled log-probs of the responses (independent forward, float32 reference)
    if autocast == torch.float32:
        for i, (p, r) in enumerate(zip(data["prompts"].unbind(), data["responses"].unbind())):
            with torch.no_grad():
                logits = model(input_ids=torch.cat([p, r])[None]).logits[0, p.numel() - 1 : -1] / 0.7
            ref = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).squeeze(-1)
            torch.testing.assert_close(fused.unbind()[i], ref, rtol=1e-4, atol=1e-5)


def test_the_engine_path_builds_the_projections_once_per_call(monkeypatch):
    entered = []
    original = worker.GradientSketcher.__enter__

    def counting(self):
        entered.append(self)
        return original(self)

    monkeypatch.setattr(worker.GradientSketcher, "__enter__", counting)
    data = _batch()
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, use_remove_padding=True)
    sketch_batch(BareEngine(_tiny_model()), data, SKETCH, loss_agg_mode="token-mean")
    assert len(entered) == 1  # 4 micro-batches, one sketcher (projections on the device once)


def test_fused_kernels_and_dense_batches_are_refused():
    data = _batch()
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=8, use_fused_kernels=True)
    with pytest.raises(NotImplementedError, match="use_fused_kernels=False"):
        sketch_batch(BareEngine(_tiny_model()), data, SKETCH, loss_agg_mode="token-mean")
    data = _batch()
    data["input_ids"] = data["input_ids"].to_padded_tensor(0)
    with pytest.raises(ValueError, match="left_right_2_no_padding"):
        sketch_batch(BareEngine(_tiny_model()), data, SKETCH, loss_agg_mode="token-mean")


#: sha256 of verl 0.9.1's ``FSDPEngineWithLMHead.forward_step`` source: worker._forward_autocast copies its autocast.
FORWARD_STEP_SHA256 = "ec2681395b00c6549e17003cc3eb93703a537ab6689c69195e7ce983fedc60b7"


def test_the_copied_autocast_of_verls_forward_step_is_unchanged():
    source = inspect.getsource(FSDPEngineWithLMHead.forward_step)
    assert "autocast_dtype = getattr(self, \"_autocast_dtype\", torch.bfloat16)" in source
    assert hashlib.sha256(source.encode()).hexdigest() == FORWARD_STEP_SHA256, (
        "verl's FSDPEngineWithLMHead.forward_step changed: re-check setgrpo_verl.integration.worker._forward_autocast"
    )


#: sha256 of verl 0.9.1's ``FSDPEngineWithLMHead.prepare_model_outputs`` and ``_scale_logits_by_temperature`` sources:
#: worker._response_log_probs copies their temperature scaling and their label and temperature fields.
PREPARE_MODEL_OUTPUTS_SHA256 = "5239f536e8f617e3538cc0aa2c4aaf7d4d27e59877abb40abe635e6a2d46c7ce"
SCALE_LOGITS_SHA256 = "c5128d4596dc71ada3160cd9bcefc3aced525cb67f79cd074205301a3069db67"


def test_the_copied_log_prob_rule_of_verls_prepare_model_outputs_is_unchanged():
    from verl.workers.engine.fsdp import transformer_impl

    outputs = inspect.getsource(FSDPEngineWithLMHead.prepare_model_outputs)
    scale = inspect.getsource(transformer_impl._scale_logits_by_temperature)
    assert "logits / temperature.clamp(min=1e-8).to(logits.dtype)" in scale
    assert hashlib.sha256(outputs.encode()).hexdigest() == PREPARE_MODEL_OUTPUTS_SHA256, (
        "verl's FSDPEngineWithLMHead.prepare_model_outputs changed: re-check setgrpo_verl.integration.worker."
        "_response_log_probs"
    )
    assert hashlib.sha256(scale.encode()).hexdigest() == SCALE_LOGITS_SHA256, (
        "verl's _scale_logits_by_temperature changed: re-check setgrpo_verl.integration.worker._response_log_probs"
    )


class _LogSumExpRows(torch.overrides.TorchFunctionMode):
    """Counts the rows that ``torch.logsumexp`` reduces (verl's float32 log-probs run it once per scored row)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.logsumexp:
            self.rows += args[0].numel() // args[0].shape[-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packed", [False, True])
def test_the_fused_pass_takes_the_log_softmax_of_the_response_rows_only(packed):
    """verl's own pass takes the log-softmax of every position and keeps the response tokens'; the fused pass takes it
    on the positions that score a response token only (fewer rows, forward and backward), in the packed layout the head
    builds those rows only (``logits_to_keep``), and its old log-probs are still verl's, bit for bit (on the CPU)."""
    model = tiny_qwen3(dtype=torch.float32)
    engine = BareEngine(model)
    data = _ragged(model.config.vocab_size)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_remove_padding=packed,
                         temperature=0.7)
    head_rows = []  # the rows of every LM-head forward
    model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].numel() // args[0].shape[-1]))
    with _LogSumExpRows() as verl_rows:
        expected = verl_log_probs(engine, data)
    tokens, responses = int(data["input_ids"].offsets()[-1]), int(data["responses"].offsets()[-1])
    assert verl_rows.rows == tokens and sum(head_rows) >= tokens  # every position
    head_rows.clear()
    with _LogSumExpRows() as fused_rows:
        _, fused, _ = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    assert fused_rows.rows == responses  # the response tokens only
    # packed: the forward is given logits_to_keep, so the head builds the response rows only
    assert sum(head_rows) == responses if packed else sum(head_rows) >= tokens
    for a, b in zip(fused.unbind(), expected.unbind(), strict=True):
        assert torch.equal(a, b)


class _WithCuSeqlens(torch.nn.Module):
    """A causal LM whose forward takes ``cu_seqlens`` (as verl's Qwen3.5 forward does) and hands them to its layers."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, input_ids=None, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        extra = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return self.lm(input_ids=input_ids, **extra, **kwargs)


def test_compute_sketches_passes_cu_seqlens_to_a_forward_that_takes_them(verl_qwen35_patch):
    model = _WithCuSeqlens(with_per_sequence_delta_rule(tiny_qwen35_text()))
    ids, am, rm = padded_layout(_ragged(model.config.vocab_size))
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=5)
    padded = compute_sketches(model, ids, am, rm, cfg, temperature=0.7)
    packed = compute_sketches(model, ids, am, rm, cfg, temperature=0.7, use_remove_padding=True)
    assert _rel(packed.sketches, padded.sketches) <= 1e-4
    torch.testing.assert_close(packed.log_probs, padded.log_probs, rtol=1e-4, atol=1e-5)


#: torch calls that make the host wait for the device (a read of device values) when their tensor is on a GPU.
_SYNCS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "any", "all"}


class _DeviceTraffic(torch.overrides.TorchFunctionMode):
    """Counts, per calling function of setgrpo_verl, the torch calls that would wait for the device, and the copy
    requests (``Tensor.to``) of the sketch's projection matrices."""

    def __init__(self, projections: set):
        super().__init__()
        self.projections, self.syncs, self.copies = projections, {}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "to" and args and id(args[0]) in self.projections:
            self.copies += 1
        syncs = name in _SYNCS and not (name in ("any", "all") and len(args) > 1)  # reductions alone do not sync
        syncs |= name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                               for a in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if syncs and name not in ("any", "all"):
            frame = inspect.currentframe().f_back
            while frame is not None and "setgrpo_verl" not in frame.f_code.co_filename:
                if "/torch/" not in frame.f_code.co_filename:
                    frame = None  # called from verl or the test, not from the sketch pass
                    break
                frame = frame.f_back
            if frame is not None:
                self.syncs[frame.f_code.co_name] = self.syncs.get(frame.f_code.co_name, 0) + 1
        return func(*args, **(kwargs or {}))


#: the functions that read the host micro-batch (offsets, lengths, segment ids) before it moves to the device
_HOST_LAYOUT = {"_host_layout", "_response_lengths", "_token_segments", "begin"}


def test_projections_stay_on_the_device_and_micro_batches_do_not_wait_for_it(monkeypatch):
    """The projections are copied to the device once per process, not per call or micro-batch; the sketch pass reads
    device values only once per call (the non-finite check and the results), whatever the number of micro-batches."""
    from setgrpo_verl.sketch import projections

    made = set()
    original = projections.projection

    def recording(*args):
        out = original(*args)
        made.add(id(out))
        return out

    monkeypatch.setattr(projections, "projection", recording)
    monkeypatch.setattr(projections, "_DEVICE_COPIES", {})  # as in a fresh worker process
    model = _tiny_model()
    runs = []
    for micro in (4, 2, 2):  # 2, 4 and 4 micro-batches of the 8 rows
        data = _batch()
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro, use_remove_padding=True)
        with _DeviceTraffic(made) as traffic:
            sketch_batch(BareEngine(model), data, SKETCH, loss_agg_mode="token-mean")
        runs.append(traffic)
    first, second, third = runs
    assert 0 < first.copies <= len(made)  # each projection requested once on its device ...
    assert second.copies == third.copies == 0  # ... and never again
    device_side = {k: v for k, v in second.syncs.items() if k not in _HOST_LAYOUT}
    assert device_side == {k: v for k, v in first.syncs.items() if k not in _HOST_LAYOUT}, (first.syncs, second.syncs)
    # once per call: the non-finite rows (nonzero, tolist) and the results to the host (sketches, log-probs)
    assert device_side == {"sketch_and_log_probs": 4}, device_side


@pytest.mark.parametrize("packed", [False, True])
def test_rows_not_to_sketch_get_verls_log_probs_from_a_forward_without_backward(packed, monkeypatch):
    """Rows marked False in setgrpo_sketch_rows (groups that cannot update) get verl's old log-probs and a NaN sketch
    row, and no backward runs for them: each sketch backward sees only the sketched rows, and a micro-batch of
    skipped rows alone runs none. The sketched rows' sketches are those of the pass over every row."""
    model = tiny_qwen3(dtype=torch.float32)
    engine = BareEngine(model)
    data = _ragged(model.config.vocab_size, b=6)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=3, use_remove_padding=packed,
                         temperature=0.7)
    full, _, _ = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    backward_rows = []
    original = worker.GradientSketcher.backward

    def counting(self, objective):
        backward_rows.append(self._num_segments)
        return original(self, objective)

    monkeypatch.setattr(worker.GradientSketcher, "backward", counting)
    rows = torch.tensor([True, False, True, False, False, False])  # micro-batch 2 holds skipped rows only
    data[worker.SKETCH_ROWS_KEY] = rows
    sketches, log_probs, _ = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    assert backward_rows == [2]
    assert torch.isnan(sketches[~rows]).all() and torch.isfinite(sketches[rows]).all()
    torch.testing.assert_close(sketches[rows], full[rows], rtol=1e-5, atol=1e-6)
    expected = verl_log_probs(engine, data)
    for a, b in zip(log_probs.unbind(), expected.unbind(), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_fused_pass_reports_verls_own_entropy(packed, chunked):
    """With verl's calculate_entropy, the fused pass returns the response entropies verl's own old-log-prob pass
    (forward_step, no grad, the engine's chunking setting) computes, from the same temperature-scaled logits."""
    from types import SimpleNamespace

    from verl.utils import torch_functional as verl_F
    from verl.workers.utils.padding import response_from_nested

    model = tiny_qwen3(dtype=torch.float32)
    engine = BareEngine(model)
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=chunked,
                                           entropy_from_logits_chunk_size=3)
    engine.compute_entropy_from_logits = (verl_F.entropy_from_logits_with_chunking if chunked
                                          else verl_F.entropy_from_logits)
    data = _ragged(model.config.vocab_size)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_remove_padding=packed,
                         temperature=0.7)
    _, _, none = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    assert none is None  # not asked for: not computed
    tu.assign_non_tensor(data, calculate_entropy=True)
    _, log_probs, entropy = sketch_and_log_probs(engine, data, SKETCH, loss_agg_mode="token-mean")
    with torch.no_grad():
        _, out = engine.forward_step(data, loss_function=None, forward_only=True)
    expected = response_from_nested(out["model_output"]["entropy"], data["response_mask"])
    for a, b, lp in zip(entropy.unbind(), expected.unbind(), log_probs.unbind(), strict=True):
        assert a.shape == b.shape == lp.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert bool((a > 0).all())
    # and it is the entropy of the response tokens' distributions (independent float32 reference)
    for i, (p, r) in enumerate(zip(data["prompts"].unbind(), data["responses"].unbind())):
        with torch.no_grad():
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, p.numel() - 1 : -1] / 0.7
        probs = torch.softmax(logits.double(), -1)
        ref = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(entropy.unbind()[i].double(), ref, rtol=1e-4, atol=1e-5)
