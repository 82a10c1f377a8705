"""Multiply-add and byte counts of the phases of a CPU step on a Llama-style decoder, and their floors.

Pure arithmetic, no timing: the benchmarks multiply these counts by a host's measured rates
(``benchmarks/bench_step_floor.py``, ``benchmarks/bench_sketch_pass.py``; docs/benchmarks.md#step-floor). ``config`` is
any object with a Hugging Face Llama config's ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``num_hidden_layers`` and ``vocab_size``. Counts are multiply-adds (one per weight per
token for a linear layer); the LM head is tied to the embedding (SmolLM2), so the weights hold its matrix once.
"""

from __future__ import annotations

from dataclasses import dataclass


def linear_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
    d, mlp = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    return [(d, d), (kv, d), (kv, d), (d, d), (mlp, d), (mlp, d), (d, mlp)]


def linear_macs(config) -> int:
    """Multiply-adds of every decoder layer's linear layers for one token (the LM head excluded)."""
    return config.num_hidden_layers * sum(o * i for o, i in linear_shapes(config))


def head_macs(config) -> int:
    """Multiply-adds of the LM head for one position (``hidden x vocabulary``)."""
    return config.hidden_size * config.vocab_size


def attention_macs(config, context: float) -> float:
    """Multiply-adds of attention for one query token over ``context`` keys, summed over the layers: ``Q K^T`` and
    ``A V``, each ``hidden x context`` (grouped key-value heads share keys, not products)."""
    return config.num_hidden_layers * 2 * config.hidden_size * context


def kv_bytes_per_token(config, element_bytes: int) -> int:
    """Bytes of the key-value cache of one token over all layers."""
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return config.num_hidden_layers * 2 * kv * element_bytes


def causal_attention_macs(config, tokens: int) -> float:
    """Attention multiply-adds of a causal pass over ``tokens`` positions (position t sees t + 1 keys)."""
    return attention_macs(config, tokens * (tokens + 1) / 2)


@dataclass(frozen=True)
class Work:
    """What a phase must do at least: ``macs`` multiply-adds and ``bytes`` moved through memory (reads + writes)."""

    macs: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.macs + other.macs, self.bytes + other.bytes)

    def scaled(self, factor: float) -> "Work":
        return Work(self.macs * factor, self.bytes * factor)


def decode_step(config, batch: int, context: int, weight_bytes: int, element_bytes: int) -> Work:
    """One decoding step of ``batch`` sequences that each attend to ``context`` cached tokens: every row's linear
    layers, head and attention; the weights read once and every row's key-value cache read once.

    Args:
        weight_bytes: bytes of the model's weights in the rollout dtype (read once per step).
        element_bytes: bytes per element of the rollout dtype (the key-value cache's).
    """
    macs = batch * (linear_macs(config) + head_macs(config) + attention_macs(config, context + 1))
    moved = weight_bytes + batch * (context + 1) * kv_bytes_per_token(config, element_bytes)
    return Work(macs, moved)


def prefill(config, groups: int, prompt: int, weight_bytes: int, element_bytes: int) -> Work:
    """Each of the ``groups`` distinct prompts (``prompt`` tokens) prefilled once, the head on its last position
    only (the first new token of all its responses comes from those logits); its key-value cache written once."""
    return Work(groups * (prompt * linear_macs(config) + causal_attention_macs(config, prompt) + head_macs(config)),
                weight_bytes + groups * prompt * kv_bytes_per_token(config, element_bytes))


def decode_steps(config, batch: int, prompt: int, response: int, weight_bytes: int, element_bytes: int) -> Work:
    """The ``response - 1`` decoding steps of ``batch`` sequences after the prefill (:func:`decode_step` each, the
    context growing from ``prompt``)."""
    steps = [decode_step(config, batch, prompt + t, weight_bytes, element_bytes) for t in range(response - 1)]
    return sum(steps, Work(0.0, 0.0))


def generate(config, groups: int, k: int, prompt: int, response: int, weight_bytes: int, element_bytes: int) -> Work:
    """One rollout batch: :func:`prefill` of the ``groups`` prompts, then :func:`decode_steps` of all ``groups * k``
    sequences for ``response`` new tokens."""
    return (prefill(config, groups, prompt, weight_bytes, element_bytes)
            + decode_steps(config, groups * k, prompt, response, weight_bytes, element_bytes))


def forward(config, rows: int, prompt: int, response: int, *, head_rows: str = "response") -> float:
    """Multiply-adds of one forward over ``rows`` sequences of ``prompt + response`` tokens; the head on the
    response positions only (``head_rows="response"``, all a log-prob needs) or on every position (``"all"``)."""
    tokens = prompt + response
    head_positions = response if head_rows == "response" else tokens
    return rows * (tokens * linear_macs(config) + causal_attention_macs(config, tokens)
                   + head_positions * head_macs(config))


def update(config, rows: int, prompt: int, response: int, params: int, compute_bytes: int) -> Work:
    """One actor update (forward, backward with input and weight gradients, AdamW) over ``rows`` sequences.

    The backward costs two forwards (input and weight gradients; attention's two products each twice). Memory: the
    compute-dtype weights read in the forward and the backward, float32 gradients written once, and AdamW reading
    parameter, gradient and both moments and writing parameter and moments (7 float32 passes over ``params``).
    """
    macs = 3 * forward(config, rows, prompt, response)
    moved = 2 * params * compute_bytes + params * 4 + 7 * params * 4
    return Work(macs, moved)


def sketch_pass(config, sketch, prompt: int, response: int, rows: int) -> dict[str, float]:
    """Multiply-adds per token of a Llama-style decoder for sequences of ``prompt + response`` tokens in
    micro-batches of ``rows``: the forward F (every position's logits), the activation-only backward B (input
    gradients of every linear layer, twice the attention products, the head's on the scoring rows only), the sketch's
    projections S (``k (r_out out + r_in in)`` per block and token, the head on the scoring rows, the per-response
    sums) and ``(F + B + S) / F``, the least fused / plain that an exact pass can reach when verl's log-softmax is free
    (docs/sketch.md#speed). ``sketch`` is a :class:`setgrpo_verl.sketch.SketchConfig`."""
    tokens = prompt + response
    scoring = response / tokens
    attention = attention_macs(config, (tokens + 1) / 2) / config.num_hidden_layers  # per layer, average context
    linear = linear_macs(config)
    head = head_macs(config)
    r_out, r_in, k = sketch.shape_for(False)
    h_out, h_in, h_k = sketch.shape_for(True)
    per_block = r_out * r_in * k * (1 + rows)  # the outer product and the one-hot sum over the micro-batch's rows
    body = config.num_hidden_layers * sum(k * (r_out * o + r_in * i) + per_block for o, i in linear_shapes(config))
    head_sketch = scoring * (h_k * (h_out * config.vocab_size + h_in * config.hidden_size)
                             + h_out * h_in * h_k * (1 + rows))
    layers = config.num_hidden_layers
    f = linear + layers * attention + head
    b = linear + 2 * layers * attention + scoring * head
    s = body + head_sketch
    return {"F": f, "B": b, "S": s, "floor": (f + b + s) / f}


def floor_seconds(work: Work, macs_per_s: float, bytes_per_s: float) -> tuple[float, float, float]:
    """(floor, compute, memory) seconds of ``work``: compute at ``macs_per_s`` multiply-adds per second, memory at
    ``bytes_per_s`` bytes moved (read + written) per second, the floor the larger of the two.

    Raises:
        ValueError: a rate that is not positive.
    """
    if macs_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(f"rates must be positive, got {macs_per_s} multiply-adds/s and {bytes_per_s} bytes/s")
    compute, memory = work.macs / macs_per_s, work.bytes / bytes_per_s
    return max(compute, memory), compute, memory
