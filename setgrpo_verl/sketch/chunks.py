"""The sketch's arithmetic on model-dtype tensors: its precision and its row chunks (docs/sketch.md#precision,
docs/sketch.md#memory).

On CUDA a projection runs in the precision of the layer it sketches: in bfloat16 (float16) when the layer's own
product ran in it, with the float32 accumulation of the matrix product (the result is rounded to that dtype once), and
in float32 otherwise; off CUDA (the CPU) always in float32 (:data:`REDUCED_DEVICES`). Each response's sum over its tokens is float32. Tensors that must be copied first (a gather of rows, a cast)
are copied a few rows at a time, so no copy of a whole [tokens, width] tensor (logits: [tokens, V]) is ever made. All
products run with autocast off, so the chosen dtype holds inside the engine's autocast region.
"""

from __future__ import annotations

import torch

#: Working-set bound of one chunk when rows of a model-dtype tensor are gathered or cast before a projection: no copy of
#: a whole [tokens, width] tensor (logits: [tokens, V]) is ever made.
CHUNK_BYTES = 1 << 26

#: Dtypes in which a layer's projections run as the layer itself ran; any other layer dtype projects in float32.
REDUCED = (torch.bfloat16, torch.float16)
#: Devices on which they do. On the CPU the projections stay float32: oneDNN's AMX bfloat16 matrix product stops the
#: process with SIGFPE (in its blocking heuristic) on some of the sketch's backward products (torch 2.13, the tiny
#: Llama of tests/verl_cpu/test_validate_main_ppo.py), and a CPU run is not where their speed matters.
REDUCED_DEVICES = ("cuda",)


def chunk_rows(width: int, itemsize: int = 4) -> int:
    """Rows of a [n, width] tensor of ``itemsize``-byte entries that fit in :data:`CHUNK_BYTES` (at least 1)."""
    return max(1, CHUNK_BYTES // (itemsize * max(1, width)))


def compute_dtype(layer_dtype: torch.dtype, device_type: str, *, override: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a layer's projections on ``device_type`` (``"cuda"``, ``"cpu"``, ...): ``override`` when given (a
    reference precision), else the layer's own dtype when it is bfloat16 or float16 on a device of
    :data:`REDUCED_DEVICES`, else float32 (float32 and float64 layers, and every layer off CUDA)."""
    if override is not None:
        return override
    return layer_dtype if layer_dtype in REDUCED and device_type in REDUCED_DEVICES else torch.float32


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with autocast off, so the sketch's float32 arithmetic stays float32 inside the engine's bf16 autocast
    (the hooks run within the forward's and backward's autocast region)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return a @ b


def project(x: torch.Tensor, weight_t: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x[rows] @ weight_t`` ([n, width] x [width, r] -> [n, r]) in ``weight_t``'s dtype, autocast off.

    ``x`` of another dtype is cast, and gathered rows are copied, chunk by chunk (:data:`CHUNK_BYTES`); otherwise one
    product. In bfloat16 / float16 the product accumulates in float32 inside the matrix multiply on CUDA and on the
    CPU and its result is rounded to that dtype (docs/sketch.md#precision)."""
    dtype = weight_t.dtype
    if rows is None and x.dtype == dtype:
        return matmul_f32(x, weight_t)
    n = x.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, weight_t.shape[1], dtype=dtype, device=x.device)
    step = chunk_rows(x.shape[1], dtype.itemsize)
    for start in range(0, n, step):
        part = x[start : start + step] if rows is None else x[rows[start : start + step]]
        out[start : start + step] = matmul_f32(part.to(dtype), weight_t)
    return out
