"""The CPU backend's engine (setgrpo_verl.verl_cpu.engine): verl's padded log-probs, entropies and their gradients,
computed in chunks, against verl 0.9.1's own ``prepare_model_outputs`` on the same model and batch."""

from __future__ import annotations

import hashlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import entropy_from_logits
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from setgrpo_verl.verl_cpu.engine import CPUEngineWithLMHead, padded_log_probs, takes_chunked_outputs
from tests.integration._engine import BareEngine, cpu_platform, nested_batch
from tests.sketch._tiny import tiny_llama

VOCAB = 300


class _Verl(BareEngine):
    def __init__(self, module, dtype):
        super().__init__(module, autocast_dtype=dtype)
        self.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)


class _Chunked(CPUEngineWithLMHead, _Verl):
    pass


def _batch(temperature):
    g = torch.Generator().manual_seed(3)
    lengths = [(7, 5), (3, 9), (11, 2), (4, 4), (9, 8)]  # ragged: every row but one padded
    prompts = [torch.randint(1, VOCAB, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(1, VOCAB, (r,), generator=g) for _, r in lengths]
    data = nested_batch(prompts, responses, [torch.ones_like(r) for r in responses])
    data["loss_mask"] = data["response_mask"]
    tu.assign_non_tensor(data, use_remove_padding=False, use_fused_kernels=False, temperature=temperature,
                         pad_token_id=0)
    return data


def _loss(model_output, data, dp_group=None):
    """A response-weighted sum of the log-probs (every valid position's gradient differs)."""
    values = model_output["log_probs"].values().float()
    weights = torch.linspace(-1.0, 2.0, values.numel())
    return (weights * values).sum(), {}


def _run(engine_cls, dtype, temperature, *, grad):
    with cpu_platform():
        return _forward(engine_cls, dtype, temperature, grad=grad)


def _forward(engine_cls, dtype, temperature, *, grad):
    model = tiny_llama(vocab=VOCAB, hidden=32, dtype=torch.float32)
    engine = engine_cls(model, dtype)
    data = _batch(temperature)
    tu.assign_non_tensor(data, calculate_entropy=not grad)
    if not grad:
        with torch.no_grad():
            _, out = engine.forward_step(data, loss_function=None, forward_only=True)
        return out["model_output"], None
    model.train()
    loss, out = engine.forward_step(data, loss_function=_loss, forward_only=False)
    loss.backward()
    return out["model_output"], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_log_probs_entropies_and_gradients_are_verls(dtype, temperature):
    exact = dtype == torch.bfloat16  # fp32: verl reduces one row at a time, which rounds differently on threads
    check = (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)) if exact else (
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
    verl_out, _ = _run(_Verl, dtype, temperature, grad=False)
    ours, _ = _run(_Chunked, dtype, temperature, grad=False)
    for key in ("log_probs", "entropy"):
        assert ours[key].dtype == verl_out[key].dtype
        check(ours[key].values(), verl_out[key].values())
        assert torch.equal(ours[key].offsets(), verl_out[key].offsets())
    verl_out, verl_grads = _run(_Verl, dtype, temperature, grad=True)
    ours, grads = _run(_Chunked, dtype, temperature, grad=True)
    check(ours["log_probs"].values(), verl_out["log_probs"].values())
    assert "entropy" not in ours
    for name, g in verl_grads.items():
        assert g.abs().max() > 0, name
        check(grads[name], g)


class _ChunkedFloatEntropy(_Chunked):
    def __init__(self, module, dtype):
        super().__init__(module, dtype)
        self.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=True,
                                             entropy_from_logits_chunk_size=3)


def test_entropy_with_chunking_is_verls_float32_entropy_in_the_padded_layout():
    """verl honours ``entropy_from_logits_with_chunking`` (float32 entropies) in the packed layout only; the CPU engine
    honours it padded too, and the log-probs stay verl's."""
    verl_out, _ = _run(_Verl, torch.bfloat16, 1.0, grad=False)
    ours, _ = _run(_ChunkedFloatEntropy, torch.bfloat16, 1.0, grad=False)
    assert ours["entropy"].dtype == torch.float32 and verl_out["entropy"].dtype == torch.bfloat16
    assert not torch.equal(ours["entropy"].values().bfloat16(), verl_out["entropy"].values())
    torch.testing.assert_close(ours["entropy"].values(), verl_out["entropy"].values().float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(ours["log_probs"].values(), verl_out["log_probs"].values())


def test_padded_log_probs_chunks_and_zero_padding_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = [6, 2, 4]
    labels = torch.randint(0, 11, (12,), generator=g)
    whole, entropy = padded_log_probs(logits, labels, lengths, entropy=entropy_from_logits, rows=100)
    chunked, _ = padded_log_probs(logits, labels, lengths, rows=1)
    expected = torch.cat([torch.log_softmax(logits[i, :n], -1) for i, n in enumerate(lengths)])
    expected = expected.gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(chunked, expected)
    p = torch.cat([torch.softmax(logits[i, :n], -1) for i, n in enumerate(lengths)])
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    assert not entropy.requires_grad
    (grad,) = torch.autograd.grad(chunked.sum(), logits)
    assert grad[1, 2:].abs().max() == 0 and grad[2, 4:].abs().max() == 0 and grad[1, :2].abs().max() > 0
    assert torch.autograd.gradcheck(lambda x: padded_log_probs(x, labels, lengths, rows=3)[0], (logits,))
    with pytest.raises(ValueError, match=r"labels must be \[12\]"):
        padded_log_probs(logits, labels[:-1], lengths)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 6\]"):
        padded_log_probs(logits, labels, [7, 1, 4])


def test_verls_own_code_keeps_packed_fused_and_entropy_with_gradient():
    data = _batch(1.0)
    tu.assign_non_tensor(data, calculate_entropy=True)
    with torch.no_grad():
        assert takes_chunked_outputs(data)
    assert not takes_chunked_outputs(data)  # entropy with a gradient (an entropy bonus)
    assert not takes_chunked_outputs(data, entropy_checkpointing=True)
    for key in ("use_remove_padding", "use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk"):
        other = _batch(1.0)
        tu.assign_non_tensor(other, **{key: True})
        assert not takes_chunked_outputs(other), key


def test_the_cpu_engine_is_registered_for_the_cpu():
    from verl.workers.engine.base import EngineRegistry

    import setgrpo_verl.verl_cpu as verl_cpu

    verl_cpu.activate()
    with cpu_platform():  # what a worker of a CPU run asks the registry for
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry.get_engine_cls("language_model", backend) is CPUEngineWithLMHead


#: sha256 of the verl 0.9.1 sources whose arithmetic setgrpo_verl.verl_cpu.engine copies.
VERL_SOURCES_SHA256 = {
    "prepare_model_outputs": "5239f536e8f617e3538cc0aa2c4aaf7d4d27e59877abb40abe635e6a2d46c7ce",
    "_scale_logits_by_temperature": "c5128d4596dc71ada3160cd9bcefc3aced525cb67f79cd074205301a3069db67",
    "logprobs_from_logits": "dffd21fe40eb806b45d740d0753a7f969889366c80e32e354988cc20f1e9d726",
    "logprobs_from_logits_v2": "1074be97faf338ae07d3c2351db0752714541a17e0616a785ee65b6fc14ea262",
    "entropy_from_logits": "f69d6578eeb3b2e4375c3db34ef2bf1638b050badc8084feac8f38d5971b7ece",
}


def test_the_copied_verl_arithmetic_is_unchanged():
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    functions = (FSDPEngineWithLMHead.prepare_model_outputs, transformer_impl._scale_logits_by_temperature,
                 verl_F.logprobs_from_logits, verl_F.logprobs_from_logits_v2, verl_F.entropy_from_logits)
    found = {f.__name__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest() for f in functions}
    assert found == VERL_SOURCES_SHA256, (
        "verl's padded log-prob code changed: re-check setgrpo_verl.verl_cpu.engine against it"
    )

