"""The sketch's blocks and their random projections (docs/algorithm.md#5-sketches).

A block is one sketched parameter matrix (an ``nn.Linear`` weight with its bias column, the input embedding, or a
norm's 1-D parameters).  Its Kronecker projections P_out, P_in derive from (seed, block name) only, so they are
identical on every rank and across runs and are never checkpointed.  They are generated once per process on the CPU
and copied once to each device and dtype that uses them (:func:`on_device`, also the stacked input projections of
layers that share an input): later micro-batches and steps reuse the device copy, so a sketch pass makes no
host-to-device copy of them after the first (docs/sketch.md#memory).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from setgrpo_verl.sketch.config import SketchConfig


@dataclass
class Block:
    """One sketched parameter matrix and its slice [offset, offset + size) of a sketch row."""

    name: str
    kind: str  # "linear" | "embedding" | "norm"
    rows: int  # output rows of the parameter matrix (norm: 1)
    cols: int  # input columns (+1 for a trainable Linear bias; norm: total trainable 1-D parameter size)
    is_head: bool = False
    weight_cols: int = 0  # Linear: in_features when the weight is trainable, else 0
    bias: bool = False  # Linear: the bias is trainable (its column follows the weight's)
    offset: int = 0
    size: int = 0
    shape: tuple = (1, 1, 1)  # (r_out, r_in, k)
    p_out: torch.Tensor | None = None  # [k * r_out, rows] (linear/embedding) or [size, cols] (norm)
    p_in: torch.Tensor | None = None  # [k * r_in, cols]


@functools.lru_cache(maxsize=4096)
def projection(seed: int, key: str, rows: int, cols: int, variance: float) -> torch.Tensor:
    """i.i.d. N(0, variance) matrix [rows, cols] float32 from (seed, key); identical on every machine.

    Cached per process (read-only use), so repeated sketch passes do not regenerate them."""
    digest = hashlib.sha256(f"setgrpo-sketch/{seed}/{key}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * math.sqrt(variance)


#: (ids of the host projections, device, dtype) -> (the host projections, their device copy).  Holding the host
#: tensors keeps their ids from being reused while the entry lives.
_DEVICE_COPIES: dict[tuple, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}


def on_device(t: torch.Tensor | tuple[torch.Tensor, ...], device: torch.device | str,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The copy of the host projection ``t`` on ``device`` in ``dtype`` (a tuple of projections with the same columns:
    their rows stacked, in order), made on the first request in this process and reused afterwards (the projections
    are read-only).  Device memory: the projections of every sketched block stay resident, k (r_out out + r_in in)
    entries per block in each dtype used (docs/sketch.md#memory)."""
    parts = t if isinstance(t, tuple) else (t,)
    key = (tuple(id(p) for p in parts), str(torch.device(device)), dtype)
    entry = _DEVICE_COPIES.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], parts)):
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        entry = _DEVICE_COPIES[key] = (parts, stacked.to(device=device, dtype=dtype))
    return entry[1]


def layout_blocks(blocks: list[Block], cfg: SketchConfig) -> None:
    """Give every block its size, offset in a sketch row (blocks in order) and projections, in place.

    Linear / embedding blocks: P_out [k r_out, rows] of N(0, 1/(k r_out)), P_in [k r_in, cols] of N(0, 1/r_in);
    norm blocks: one dense P_out [r_out r_in k, cols] of N(0, 1/size); ``cfg.identity``: no projection, the block's
    sketch is its exact flattened gradient (size rows x cols)."""
    offset = 0
    for b in blocks:
        if cfg.identity:
            b.size = b.rows * b.cols
        elif b.kind == "norm":
            r_out, r_in, k = cfg.shape_for(False)
            b.size = r_out * r_in * k
            b.p_out = projection(cfg.seed, b.name + ":norm", b.size, b.cols, 1.0 / b.size)
        else:
            r_out, r_in, k = b.shape = cfg.shape_for(b.is_head)
            b.size = r_out * r_in * k
            b.p_out = projection(cfg.seed, b.name + ":out", k * r_out, b.rows, 1.0 / (k * r_out))
            b.p_in = projection(cfg.seed, b.name + ":in", k * r_in, b.cols, 1.0 / r_in)
        b.offset = offset
        offset += b.size
