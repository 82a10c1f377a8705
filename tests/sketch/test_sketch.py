"""Per-response gradient sketches (docs/algorithm.md#5-sketches) on a tiny random Llama: exactness, unbiasedness,
layout invariance, hygiene (no .grad, hooks removed) and error messages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from setgrpo_verl.sketch import GradientSketcher, SketchConfig, compute_sketches
from tests.sketch._tiny import cosine, exact_gradients, tiny_llama, verl_batch

IDENTITY_CASES = [
    # (model kwargs, config kwargs, loss_agg_mode)
    (dict(), dict(), "token-mean"),
    (dict(bias=True), dict(include_norms=True), "seq-mean-token-mean"),
    (dict(tie=True), dict(include_embeddings=True, include_norms=True), "seq-mean-token-sum"),
    (dict(), dict(include_embeddings=True), "token-sum"),
]


@pytest.mark.parametrize("model_kw,cfg_kw,mode", IDENTITY_CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_identity_sketch_is_exact_per_response_gradient(model_kw, cfg_kw, mode, packed):
    model = tiny_llama(**model_kw)
    ids, am, rm = verl_batch()
    out = compute_sketches(
        model, ids, am, rm, SketchConfig(identity=True, **cfg_kw), loss_agg_mode=mode, use_remove_padding=packed
    )
    exact = exact_gradients(model, ids, am, rm, out.block_names, seq_mean_token_mean=mode == "seq-mean-token-mean")
    assert out.sketches.dtype == torch.float32 and out.sketches.shape == exact.shape
    scale = exact.abs().max()
    assert scale > 0
    torch.testing.assert_close(out.sketches.double(), exact, rtol=0, atol=1e-5 * scale.item())
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    expected_blocks = n_linear
    if cfg_kw.get("include_norms"):
        expected_blocks += sum("Norm" in type(m).__name__ for m in model.modules())
    if cfg_kw.get("include_embeddings") and not model_kw.get("tie"):
        expected_blocks += 1  # untied embedding has its own block; tied shares the LM head's
    assert len(out.block_names) == expected_blocks
    assert all(p.grad is None for p in model.parameters())


def test_log_probs_match_plain_forward():
    model = tiny_llama()
    ids, am, rm = verl_batch()
    pos = torch.clip(am.cumsum(-1) - 1, min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, -rm.shape[1] - 1 : -1] / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, -rm.shape[1] :, None]).squeeze(-1)
    ref = torch.where(am[:, -rm.shape[1] :].bool(), ref, 0.0)
    for packed in (False, True):
        out = compute_sketches(model, ids, am, rm, temperature=0.7, use_remove_padding=packed)
        assert out.log_probs.dtype == torch.float32
        torch.testing.assert_close(out.log_probs.double(), ref.detach(), rtol=0, atol=1e-5)


def test_sketch_gram_is_unbiased():
    """Mean over seeds of S S^T converges to the exact Gram G G^T (z-scores within Monte-Carlo error)."""
    model = tiny_llama(hidden=16, layers=1, vocab=48)
    ids, am, rm = verl_batch(bsz=3, vocab=48)
    cfg = dict(rank_out=2, rank_in=3, copies=2, head_rank_out=2, head_rank_in=2, head_copies=3)
    names = compute_sketches(model, ids, am, rm, SketchConfig(**cfg)).block_names
    exact = exact_gradients(model, ids, am, rm, names)
    gram = exact @ exact.T
    norms = gram.diagonal().sqrt()
    samples = []
    for seed in range(200):
        s = compute_sketches(model, ids, am, rm, SketchConfig(seed=seed, **cfg)).sketches.double()
        samples.append(s @ s.T)
    samples = torch.stack(samples)
    mean, se = samples.mean(0), samples.std(0) / samples.shape[0] ** 0.5
    z = (mean - gram) / se
    assert z.abs().max() < 4.5, f"sketch Gram biased: z-scores {z}"
    # convergence: the seed average is far closer to the exact Gram than a single sketch is
    single = ((samples - gram) / (norms[:, None] * norms[None, :])).abs().amax((1, 2)).mean()
    averaged = ((mean - gram) / (norms[:, None] * norms[None, :])).abs().max()
    assert averaged < 0.25 * single, (averaged, single)
    assert averaged < 0.05


def test_cosine_error_shrinks_with_sketch_size():
    model = tiny_llama(hidden=64, layers=2, vocab=128)
    ids, am, rm = verl_batch(vocab=128)
    names = compute_sketches(model, ids, am, rm, SketchConfig(identity=True)).block_names
    exact = exact_gradients(model, ids, am, rm, names)
    cos_exact = cosine(exact @ exact.T)
    errors = {}
    for rank in (1, 4, 16):  # Kronecker ranks and copies grow together: 1 -> 64 -> 1024 floats per block
        errs = []
        for seed in range(6):
            cfg = SketchConfig(rank_out=rank // 2 or 1, rank_in=rank // 2 or 1, copies=rank, head_copies=rank, seed=seed)
            s = compute_sketches(model, ids, am, rm, cfg).sketches
            s = s.double()
            errs.append((cosine(s @ s.T) - cos_exact).abs().max().item())
        errors[rank] = sum(errs) / len(errs)
    assert errors[16] < errors[4] < errors[1], errors
    assert errors[16] < 0.5 * errors[1], errors


def test_padded_packed_and_micro_batch_sizes_agree():
    model = tiny_llama().float()
    ids, am, rm = verl_batch(bsz=4)
    cfg = SketchConfig(rank_out=2, rank_in=3, copies=4, include_norms=True, include_embeddings=True)
    ref = compute_sketches(model, ids, am, rm, cfg, micro_batch_size=4)
    for packed in (False, True):
        for mbs in (1, 3, 4):
            out = compute_sketches(model, ids, am, rm, cfg, micro_batch_size=mbs, use_remove_padding=packed)
            scale = ref.sketches.abs().max().item()
            torch.testing.assert_close(out.sketches, ref.sketches, rtol=0, atol=2e-5 * scale)
            torch.testing.assert_close(out.log_probs, ref.log_probs, rtol=0, atol=2e-5)


def test_projections_reproducible_seeded_and_small():
    model = tiny_llama()
    ids, am, rm = verl_batch()
    a = compute_sketches(model, ids, am, rm, SketchConfig(seed=3)).sketches
    b = compute_sketches(tiny_llama(), ids, am, rm, SketchConfig(seed=3)).sketches
    c = compute_sketches(model, ids, am, rm, SketchConfig(seed=4)).sketches
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    cfg = SketchConfig(rank_out=3, rank_in=5, copies=2, head_rank_out=2, head_rank_in=4, head_copies=6)
    with GradientSketcher(model, cfg) as sk:
        head = next(blk for blk in sk.blocks if blk.name == "lm_head")
        assert head.is_head and head.p_out.shape == (12, model.config.vocab_size)
        assert head.p_in.shape == (24, model.config.hidden_size)
        body = next(blk for blk in sk.blocks if blk.name.endswith("layers.0.mlp.down_proj"))
        assert body.p_out.shape == (6, model.config.hidden_size)
        assert body.p_in.shape == (10, model.config.intermediate_size)
        assert sk.dim == 30 * (len(sk.blocks) - 1) + 48


def test_default_size_is_documented_and_bounded():
    cfg = SketchConfig()
    assert (cfg.rank_out, cfg.rank_in, cfg.copies) == (1, 2, 64)
    assert (cfg.head_rank_out, cfg.head_rank_in, cfg.head_copies) == (1, 8, 256)
    assert not cfg.include_embeddings and not cfg.include_norms and not cfg.identity
    # SmolLM2-135M: 30 layers x 7 Linear + LM head
    assert 30 * 7 * 128 + 2048 == 28_928 < 50_000


def test_non_reentrant_checkpointing_and_frozen_parameters():
    model = tiny_llama().float()
    ids, am, rm = verl_batch()
    ref = compute_sketches(model, ids, am, rm).sketches
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF only checkpoints in training mode; dropout is 0 in LlamaConfig
    ckpt = compute_sketches(model, ids, am, rm).sketches
    torch.testing.assert_close(ckpt, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    model.gradient_checkpointing_disable()
    model.eval()
    # A frozen layer is not trained, so it is not sketched; the other blocks' slices are unchanged.
    same = SketchConfig(head_rank_out=1, head_rank_in=2, head_copies=64)  # every block 128 floats
    full = compute_sketches(model, ids, am, rm, same)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    part = compute_sketches(model, ids, am, rm, same)
    assert part.block_names == [n for n in full.block_names if not n.startswith("model.layers.0.")]
    cols = torch.cat([torch.arange(o, o + s) for o, s in _block_slices(full, part.block_names)])
    torch.testing.assert_close(part.sketches, full.sketches[:, cols], rtol=0, atol=0)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable nn.Linear"):
        compute_sketches(model, ids, am, rm)


def _block_slices(out, names):
    """(offset, size) of the named blocks in ``out``'s rows when all its blocks have the same size."""
    size = out.sketches.shape[1] // len(out.block_names)
    return [(out.block_names.index(n) * size, size) for n in names]


def test_reentrant_checkpointing_is_rejected():
    model = tiny_llama().float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids, am, rm = verl_batch()
    with pytest.raises(RuntimeError, match="reentrant"):
        compute_sketches(model, ids, am, rm)
    assert all(p.grad is None for p in model.parameters())


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())


def test_no_grad_left_and_hooks_removed_even_on_error():
    model = tiny_llama().float()
    ids, am, rm = verl_batch()
    before = _hook_count(model)
    compute_sketches(model, ids, am, rm)
    assert _hook_count(model) == before
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(KeyError):
        with GradientSketcher(model) as sk:
            assert _hook_count(model) > before
            sk.begin(torch.zeros_like(ids))
            raise KeyError("boom")
    assert _hook_count(model) == before
    # an error raised from inside the sketch pass itself
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite log-probabilities"):
        compute_sketches(model, ids, am, rm)
    assert _hook_count(model) == before
    assert all(p.grad is None for p in model.parameters())


def test_error_no_linear_layer():
    class EmbOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def get_input_embeddings(self):
            return self.emb

    with pytest.raises(ValueError, match="no trainable nn.Linear"):
        with GradientSketcher(EmbOnly()):
            pass


def test_error_response_mask_mismatch():
    model = tiny_llama()
    ids, am, rm = verl_batch()
    bad = rm.clone()
    bad[3, -1] = 1  # row 3 has right padding there
    assert am[3, -1] == 0
    with pytest.raises(ValueError, match="response mask does not match"):
        compute_sketches(model, ids, am, bad)
    with pytest.raises(ValueError, match="response_mask must be"):
        compute_sketches(model, ids, am, rm[:2])
    with pytest.raises(ValueError, match="0/1"):
        compute_sketches(model, ids, am, rm * 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_sketches(model, ids, am, rm, loss_agg_mode="token_mean")
    with pytest.raises(ValueError, match="micro_batch_size"):
        compute_sketches(model, ids, am, rm, micro_batch_size=0)
    with pytest.raises(ValueError, match="ranks and copies must be >= 1"):
        SketchConfig(rank_out=0)


def test_segment_ids_must_match_token_rows():
    model = tiny_llama()
    ids, am, _ = verl_batch()
    with GradientSketcher(model) as sk:
        sk.begin(torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=torch.long))
        with pytest.raises(ValueError, match="token rows"):
            model(input_ids=ids, attention_mask=am)


def test_activation_checkpointing_acts_in_eval_mode_and_keeps_the_sketches():
    """The sketch pass runs in eval mode, where transformers does not checkpoint: ``activation_checkpointing`` turns
    it on for the checkpointed layers only; the hooks still fire once per forward call (the recomputation in the
    backward is not sketched twice) and the sketches are unchanged."""
    from setgrpo_verl.sketch import activation_checkpointing

    model = tiny_llama().float()
    ids, am, rm = verl_batch()
    ref = compute_sketches(model, ids, am, rm).sketches
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    calls = []
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # counts recomputations too
    compute_sketches(model, ids, am, rm)
    assert len(calls) == 1  # eval mode: transformers skips checkpointing
    calls.clear()
    with activation_checkpointing(model):
        assert model.model.layers[0].training and not model.model.layers[0].mlp.training
        ckpt = compute_sketches(model, ids, am, rm).sketches
    del mlp.forward
    assert len(calls) == 2  # forward + recomputation in the backward
    assert not any(m.training for m in model.modules())
    torch.testing.assert_close(ckpt, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


#: sha256 of torch 2.13's ``torch.distributed.fsdp._runtime_utils._post_backward_reshard_only_hook`` source, which
#: ``setgrpo_verl.sketch.fsdp1_reshard_in_backward`` calls.
RESHARD_ONLY_HOOK_SHA256 = "911e4e0bfaf5a0a91ee59ac91b1a670ea5bb9b9b641fadeca0e1917ef0d8805f"


def test_the_fsdp1_reshard_hook_the_sketch_calls_is_unchanged():
    import hashlib
    import inspect

    from torch.distributed.fsdp import _runtime_utils

    source = inspect.getsource(_runtime_utils._post_backward_reshard_only_hook)
    assert hashlib.sha256(source.encode()).hexdigest() == RESHARD_ONLY_HOOK_SHA256, (
        "torch's FSDP1 _post_backward_reshard_only_hook changed: re-check setgrpo_verl.sketch.fsdp1_reshard_in_backward"
    )


def test_float32_promotion_in_row_chunks_keeps_sketches_and_log_probs(monkeypatch):
    """Model-dtype activations, gradients and logits are promoted to float32 a few rows at a time (the log-softmax
    chunks recomputed in the backward): the same sketches and log-probs as in one piece, in bf16 too."""
    from setgrpo_verl.sketch import chunks

    ids, am, rm = verl_batch()
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama(dtype=dtype)
        whole = compute_sketches(model, ids, am, rm, temperature=0.7, use_remove_padding=True)
        monkeypatch.setattr(chunks, "CHUNK_BYTES", 4 * 96 * 3)  # 3 rows of the 96-token vocabulary per chunk
        assert chunks.chunk_rows(96) == 3
        chunked = compute_sketches(model, ids, am, rm, temperature=0.7, use_remove_padding=True)
        monkeypatch.undo()
        scale = whole.sketches.abs().max().item()
        torch.testing.assert_close(chunked.sketches, whole.sketches, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(chunked.log_probs, whole.log_probs, rtol=1e-6, atol=1e-6)


class _Ops(TorchDispatchMode):
    """The names of the aten ops that run inside the mode."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_chunked_log_softmax_backward_is_linear_in_the_rows(monkeypatch):
    """The log-softmax row chunks are split, not sliced: a slice's backward writes a zero-padded [n, V] gradient per
    chunk (quadratic in n), split's backward one concatenation; the gradient is the unchunked one."""
    from setgrpo_verl.sketch import chunks, layouts

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4 * 96 * 3)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(30, 96, generator=g, requires_grad=True)
    targets = torch.randint(0, 96, (30,), generator=g)
    weights = torch.randn(30, generator=g)
    with _Ops() as ops:
        (layouts._token_log_probs(logits, targets) * weights).sum().backward()
    assert not [n for n in ops.names if "slice_backward" in n]
    chunked, logits.grad = logits.grad, None
    (torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0] * weights).sum().backward()
    torch.testing.assert_close(chunked, logits.grad, rtol=1e-6, atol=1e-6)


class _VocabProducts(TorchDispatchMode):
    """The row counts of the matrix products whose left operand is vocabulary-wide (the LM head's output gradient)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            left = args[-2]
            if left.shape[-1] == self.vocab:
                self.rows.append(left.shape[0])
        return func(*args, **(kwargs or {}))


def _without_logits_to_keep(monkeypatch, layouts):
    """compute_sketches as for a forward that takes no ``logits_to_keep``."""
    takes = layouts.forward_takes
    monkeypatch.setattr(layouts, "forward_takes", lambda model, name: name != "logits_to_keep" and takes(model, name))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_to_keep_builds_the_scoring_rows_only_and_keeps_sketches_and_log_probs(packed, tie, monkeypatch):
    """With ``logits_to_keep`` the head's forward and backward run on the positions that score a response token
    (packed: the valid ones; padded: the same columns of every row), and the log-probs and sketches are those of the
    full logits to float tolerance."""
    from setgrpo_verl.sketch import layouts

    model = tiny_llama(dtype=torch.float32, tie=tie)
    ids, am, rm = verl_batch()
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=3)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.9])
    head_rows = []  # the rows of every LM-head forward
    model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].reshape(-1, 32).shape[0]))
    kept = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=packed, temperature=temperature)
    scoring = int(am[:, -rm.shape[1]:].sum())
    assert head_rows == [scoring if packed else rm.numel()] and rm.numel() < ids.numel()
    _without_logits_to_keep(monkeypatch, layouts)
    head_rows.clear()
    full = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=packed, temperature=temperature)
    assert head_rows == [int(am.sum()) if packed else ids.numel()]
    torch.testing.assert_close(kept.log_probs, full.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept.sketches, full.sketches, rtol=1e-5, atol=1e-6)
    assert kept.sketches.abs().max() > 0


def test_head_rows_only_checks_the_head_input():
    model = tiny_llama(dtype=torch.float32)
    ids = torch.randint(1, 96, (1, 6))
    with GradientSketcher(model, SketchConfig()) as sk:
        with pytest.raises(ValueError, match="needs head_rows"):
            sk.begin(torch.zeros(1, 6, dtype=torch.long), head_rows_only=True)
        sk.begin(torch.zeros(1, 6, dtype=torch.long), head_rows=torch.tensor([3, 4]), head_rows_only=True)
        with pytest.raises(ValueError, match="head_rows has 2 entries"):
            model(input_ids=ids, logits_to_keep=3)


@pytest.mark.parametrize("packed, tie, identity", [(False, False, False), (True, False, False), (False, True, True),
                                                    (True, True, True)])
def test_the_lm_head_backward_multiplies_the_rows_with_a_loss_term_only(packed, tie, identity, monkeypatch):
    """The logits gradient is zero at the positions that score no response token: the sketch backward multiplies the
    head's output gradient on the scoring rows only (the head's input gradient and its P_out projection), and the
    sketches are those of the backward over every row; with a tied head in identity mode both are the exact
    per-response gradients."""
    from setgrpo_verl.sketch import hooks, layouts

    model = tiny_llama(dtype=torch.float32, tie=tie)
    ids, am, rm = verl_batch()
    cfg = SketchConfig(identity=True) if identity else SketchConfig(rank_out=2, rank_in=2, copies=4, seed=3)
    _without_logits_to_keep(monkeypatch, layouts)  # the head builds every row's logits
    products = _VocabProducts(model.config.vocab_size)
    original = GradientSketcher.backward

    def recorded(self, objective):
        with products:
            return original(self, objective)

    monkeypatch.setattr(GradientSketcher, "backward", recorded)
    rows_only = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=packed).sketches
    scoring = int(am[:, -rm.shape[1]:].sum())  # positions that score a response token
    assert products.rows and max(products.rows) == scoring < ids.numel()
    monkeypatch.setattr(hooks, "_plain_linear", lambda module: False)  # the backward over every row
    products.rows.clear()
    every_row = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=packed).sketches
    assert max(products.rows) == (ids.numel() if not packed else int(am.sum()))
    torch.testing.assert_close(rows_only, every_row, rtol=1e-5, atol=1e-6)
    if identity:
        out = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=packed)
        exact = exact_gradients(model, ids, am, rm, out.block_names)
        assert exact.abs().max() > 0
        torch.testing.assert_close(rows_only.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


def test_head_rows_must_not_repeat():
    model = tiny_llama()
    with GradientSketcher(model, SketchConfig()) as sk:
        with pytest.raises(ValueError, match="must not repeat"):
            sk.begin(torch.zeros(1, 4, dtype=torch.long), head_rows=torch.tensor([1, 1]))
