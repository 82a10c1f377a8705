"""float32 arithmetic of the sketch on model-dtype tensors, in row chunks (docs/sketch.md#memory).

Activations, output gradients and logits of the model dtype (bf16 under verl's autocast) are promoted to float32 a
few rows at a time, so no float32 copy of a whole [tokens, width] tensor (logits: [tokens, V]) is ever made.  All
products run with autocast off, so the sketch's float32 stays float32 inside the engine's bf16 autocast region.
"""

from __future__ import annotations

import torch

#: Float32 working-set bound of one chunk when activations, gradients or logits of the model dtype are promoted
#: to float32: no float32 copy of a whole [tokens, width] tensor (logits: [tokens, V]) is ever made.
CHUNK_BYTES = 1 << 26


def chunk_rows(width: int) -> int:
    """Rows of a [n, width] tensor whose float32 copy fits in :data:`CHUNK_BYTES` (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(1, width)))


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with autocast off, so the sketch's float32 arithmetic stays float32 inside the engine's bf16 autocast
    (the hooks run within the forward's and backward's autocast region)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return a @ b


def project_f32(x: torch.Tensor, weight_t: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x[rows] @ weight_t`` ([n, width] x [width, r] -> [n, r]), promoting x chunk by chunk."""
    n = x.shape[0] if rows is None else rows.numel()
    if rows is None and x.dtype == torch.float32:
        return matmul_f32(x, weight_t)
    out = torch.empty(n, weight_t.shape[1], dtype=torch.float32, device=x.device)
    step = chunk_rows(x.shape[1])
    for start in range(0, n, step):
        part = x[start : start + step] if rows is None else x[rows[start : start + step]]
        out[start : start + step] = matmul_f32(part.float(), weight_t)
    return out
