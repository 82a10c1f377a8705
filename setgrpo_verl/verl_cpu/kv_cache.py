"""A key-value cache layer that writes each decoding step into a buffer allocated once, for the CPU rollout.

``transformers``' ``DynamicLayer`` concatenates every step's keys and values onto the whole cache, which copies
the cache once per token and layer (a fresh allocation each time). :class:`PreallocatedLayer` holds the cache in a
buffer sized for the prompt and every new token and hands attention the filled part, a view with the same
shape and values as the concatenated tensor, so the model computes the same numbers (the rollout samples the same
tokens; docs/verl_integration.md#cpu-backend).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["PreallocatedLayer", "preallocate"]


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the first ``length`` positions of a buffer of ``capacity``.

    Args:
        keys: [B, H_kv, L, D] the cached keys so far (copied into the buffer).
        values: [B, H_kv, L, D_v] the cached values so far.
        capacity: positions the buffer holds, >= L.

    A step that would overflow the buffer, or a cache that was reordered or cut by another ``DynamicLayer``
    method (its keys no longer the buffer's front), concatenates as ``DynamicLayer`` does.

    Raises:
        ValueError: ``capacity`` below the cached length.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        length = keys.shape[-2]
        if capacity < length:
            raise ValueError(f"a cache of {length} positions does not fit a buffer of capacity {capacity}")
        self._key_buffer = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        self._value_buffer = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        self._key_buffer[..., :length, :] = keys
        self._value_buffer[..., :length, :] = values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = self._key_buffer[..., :length, :], self._value_buffer[..., :length, :]

    def _in_buffer(self) -> bool:
        """Whether the keys are still the buffer's first positions (no other method replaced them)."""
        return (self.keys.data_ptr() == self._key_buffer.data_ptr() and self.keys.stride() == self._key_buffer.stride()
                and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.values.stride() == self._value_buffer.stride()
                and self.keys.shape[:-2] == self._key_buffer.shape[:-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states`` / ``value_states`` ([B, H_kv, T, D]) after the cached positions; returns the keys
        and values of every position so far (views into the buffer)."""
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if length + new > self._key_buffer.shape[-2] or not self._in_buffer():
            return super().update(key_states, value_states, *args, **kwargs)
        self._key_buffer[..., length:length + new, :] = key_states
        self._value_buffer[..., length:length + new, :] = value_states
        self.keys = self._key_buffer[..., :length + new, :]
        self.values = self._value_buffer[..., :length + new, :]
        return self.keys, self.values


def preallocate(cache: DynamicCache, capacity: int) -> DynamicCache:
    """``cache`` with every layer a :class:`PreallocatedLayer` of ``capacity`` positions holding its contents.

    Args:
        cache: a ``DynamicCache`` whose layers are all plain ``DynamicLayer`` s with a cached prefix.
        capacity: positions per layer: the cached length plus every token still to be written.

    Raises:
        ValueError: a layer that is not a plain ``DynamicLayer`` (sliding-window or linear-attention layers keep
            their own update rule), or ``capacity`` below the cached length.
    """
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"layer {i} of the cache is a {type(layer).__name__}, not a plain DynamicLayer")
    cache.layers = [PreallocatedLayer(layer.keys, layer.values, capacity) for layer in cache.layers]
    return cache
