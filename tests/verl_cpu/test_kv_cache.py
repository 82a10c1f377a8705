"""The preallocated key-value cache layer: every step returns what ``DynamicLayer``'s concatenation returns, written
in place into one buffer; a step past the buffer, or a cache reordered by another method, concatenates."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from setgrpo_verl.verl_cpu.kv_cache import PreallocatedLayer, preallocate


def _steps(seed: int = 0, batch: int = 3, heads: int = 2, dim: int = 4, lengths=(5, 1, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, n, dim, generator=g), torch.randn(batch, heads, n, dim, generator=g))
            for n in lengths]


def _reference(steps):
    layer = DynamicLayer()
    return [tuple(t.clone() for t in layer.update(k, v)) for k, v in steps]


def test_each_step_returns_the_concatenated_keys_and_values_from_one_buffer():
    steps = _steps()
    expected = _reference(steps)
    layer = PreallocatedLayer(*steps[0], capacity=9)
    assert torch.equal(layer.keys, expected[0][0]) and layer.get_seq_length() == 5
    for (k, v), (ref_k, ref_v) in zip(steps[1:], expected[1:]):
        keys, values = layer.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert keys.data_ptr() == layer._key_buffer.data_ptr()  # a view of the buffer, not a fresh copy
    assert layer.get_seq_length() == 9


def test_a_step_past_the_buffer_concatenates():
    steps = _steps()
    expected = _reference(steps)
    layer = PreallocatedLayer(*steps[0], capacity=6)
    layer.update(*steps[1])
    keys, values = layer.update(*steps[2])  # position 7 of a 6-position buffer
    assert torch.equal(keys, expected[2][0]) and torch.equal(values, expected[2][1])
    keys, _ = layer.update(*steps[3])
    assert torch.equal(keys, expected[3][0])


def test_a_cache_reordered_by_another_method_concatenates():
    steps = _steps()
    layer = PreallocatedLayer(*steps[0], capacity=9)
    order = torch.tensor([2, 0, 1])
    layer.batch_select_indices(order)
    reference = DynamicLayer()
    reference.update(steps[0][0][order], steps[0][1][order])
    keys, _ = layer.update(*steps[1])
    assert torch.equal(keys, reference.update(*steps[1])[0])


def test_preallocate_converts_every_plain_layer_and_refuses_other_layers():
    steps = _steps()
    cache = DynamicCache()
    for i in range(3):
        cache.update(*steps[0], layer_idx=i)
    cache = preallocate(cache, capacity=8)
    assert [type(layer) for layer in cache.layers] == [PreallocatedLayer] * 3
    assert cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="capacity 4"):
        PreallocatedLayer(*steps[0], capacity=4)
    cache.layers[1] = PreallocatedLayer(*steps[0], capacity=8)
    with pytest.raises(ValueError, match="layer 0 of the cache is a PreallocatedLayer, not a plain DynamicLayer"):
        preallocate(cache, capacity=8)
