"""Settings of the per-response gradient sketch and the token weights of its objective
(docs/algorithm.md#5-sketches, docs/algorithm.md#0-notation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: verl 0.9.1 ``core_algos.agg_loss`` modes and whether each response's tokens are weighted
#: 1/|o_i| (True) or 1 (False); the global constant of each mode does not change the geometry.
LOSS_AGG_MODES = {
    "token-mean": False,
    "token-sum": False,
    "seq-mean-token-sum": False,
    "seq-mean-token-sum-norm": False,
    "seq-mean-token-mean": True,
}


@dataclass(frozen=True)
class SketchConfig:
    """Settings of the per-response gradient sketch (docs/algorithm.md#5-sketches).

    Args:
        rank_out: r_out, rows of each copy's output projection P_out (int >= 1).
        rank_in: r_in, rows of each copy's input projection P_in (int >= 1).
        copies: k, independent Kronecker copies per block (int >= 1); a block contributes
            k * r_out * r_in floats and costs k * (r_out * out + r_in * in) flops per token.
        head_rank_out, head_rank_in, head_copies: the same three for the LM head
            (``model.get_output_embeddings()``), the block with the largest gradient share.
        seed: global seed; the projections of a block derive from (seed, block name) only, so they
            are identical on every rank and across runs and are never checkpointed.
        include_embeddings: also sketch the input-embedding weight's gradient (sum_t e_{id_t}
            g_t^T, rows of ``padding_idx`` excluded as torch does).  When the embedding is tied to
            the LM head (SmolLM2, Qwen3-4B, Llama-3.2-1B/3B) both uses share one block and one pair of
            projections, so the sketch estimates the gradient of the tied parameter itself; this holds with
            ``include_embeddings=False`` too, since the head's block is that parameter (sketching only its
            head use would leave part of a sketched parameter's gradient out).
        include_norms: also sketch the 1-D parameters (weight, bias) of normalisation modules
            (class name containing "Norm": LayerNorm, RMSNorm variants), whose outputs must depend
            elementwise on them.  They use one dense N(0, 1/r) projection of
            r = rank_out * rank_in rows per module.
        identity: debug option: every projection is the identity, so a block's sketch IS the exact
            flattened per-response gradient (Linear: [out, in (+1 bias column)] row-major; norms:
            concatenated 1-D parameters).  Only for small models.

    Defaults: body blocks (r_out, r_in, k) = (1, 2, 64), LM head (1, 8, 256): 128 floats per body
    block and 2,048 for the head, i.e. 210 * 128 + 2,048 = 28,928 floats for SmolLM2-135M.  Measured max
    absolute cosine error on SmolLM2-135M-Instruct (32 sampled responses to 8 prompts, 10 seeds): 0.052
    (mean) / 0.061 (worst seed) within a prompt's 4 responses, 0.067 / 0.079 over all 32 x 32 pairs
    (table and reasons: docs/sketch.md#measured-accuracy; tests/sketch/test_smollm2.py checks <= 0.05 on
    4 fixed responses through the real hooks).  Cost: k * (r_out * out + r_in * in)
    multiply-adds per token and block, ~25-50% of a forward.
    ``include_embeddings = include_norms = False``: nn.Linear blocks (LM head included) hold the
    dense-gradient parameters of a decoder-only LM; embedding gradients are sparse in the rows and
    norm weights are < 0.1% of the parameters.  Turn them on to sketch the full parameter gradient.

    Raises:
        ValueError: a rank below 1 or a non-integer rank/seed.
    """

    rank_out: int = 1
    rank_in: int = 2
    seed: int = 0
    include_embeddings: bool = False
    include_norms: bool = False
    identity: bool = False
    copies: int = 64
    head_rank_out: int = 1
    head_rank_in: int = 8
    head_copies: int = 256

    def __post_init__(self):
        for field in ("rank_out", "rank_in", "seed", "copies", "head_rank_out", "head_rank_in", "head_copies"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SketchConfig.{field} must be an int, got {value!r}")
        for field in ("rank_out", "rank_in", "copies", "head_rank_out", "head_rank_in", "head_copies"):
            if getattr(self, field) < 1:
                raise ValueError(f"SketchConfig ranks and copies must be >= 1, got {field}={getattr(self, field)}")

    def shape_for(self, is_head: bool) -> tuple[int, int, int]:
        """(r_out, r_in, k) of a block: the head triple for the LM head, the body triple otherwise."""
        if is_head:
            return self.head_rank_out, self.head_rank_in, self.head_copies
        return self.rank_out, self.rank_in, self.copies



def token_weights(response_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Token weights w of the response-level objective sum_t w_it log pi(o_it) (docs/algorithm.md#0-notation).

    Args:
        response_mask: 0/1 [B, T_resp] (any dtype), 1 = token in the loss.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.

    Returns:
        float32 [B, T_resp]: the mask, divided per row by its token count for ``seq-mean-token-mean``.

    Raises:
        ValueError: unknown ``loss_agg_mode``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; verl 0.9.1 modes: {sorted(LOSS_AGG_MODES)}")
    w = response_mask.float()
    if LOSS_AGG_MODES[loss_agg_mode]:
        w = w / w.sum(-1, keepdim=True).clamp(min=1.0)
    return w

