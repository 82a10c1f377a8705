"""Per-request random streams of the CPU rollout: the seed of each request and the logits processors that sample
each batch row from its own stream (docs/verl_integration.md, "Random streams").

A request's stream is keyed by the rollout server's seed, the weight version, the prompt and the response's index
among the requests for that prompt, so a request samples the same tokens whichever batch it decodes in, and no two
requests of a run, of two ``--shard`` parts or of a run and its resume share draws.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def request_seed(server_seed: int, version: int, prompt_ids: list[int], sample_index: int) -> int:
    """The seed of one request's random stream: the ``sample_index``-th response to ``prompt_ids`` under weight
    version ``version`` on a server seeded ``server_seed`` (:func:`replica_seed`). Distinct keys give independent
    streams, so responses of a group, groups of a batch, batches, ``--shard`` parts and resumed runs never share
    draws, and a request samples the same tokens whichever batch it decodes in (docs/verl_integration.md,
    "Random streams").

    Args:
        server_seed: an int >= 0.
        version: the weight version (verl's ``global_steps`` of the last weight sync), an int >= 0.
        prompt_ids: the prompt's token ids.
        sample_index: how many requests for this prompt and version came before this one, an int >= 0.

    Returns:
        An int in [0, 2**63), a valid ``torch.Generator`` and vLLM ``SamplingParams.seed``.
    """
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).digest()
    entropy = [int(server_seed), int(version), int.from_bytes(digest, "little"), int(sample_index)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


def occurrence_indices(prompts: list[list[int]]) -> list[int]:
    """For each prompt, how many equal prompts come before it in ``prompts`` (0 for a prompt's first request)."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for p in prompts:
        key = tuple(p)
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out


class RequestStreams(LogitsProcessor):
    """Samples each row of a batch from ``softmax(scores)`` with one uniform draw per step from that row's own
    ``torch.Generator`` (inverse-CDF sampling), and returns scores whose only finite entry is the sampled token, so
    ``generate``'s greedy step picks it. A row's draws depend only on its seed and step, not on the batch.

    Args:
        seeds: one seed per batch row (:func:`request_seed`).
    """

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores``: [B, V] float, the warped logits (-inf outside top-k / top-p); returns [B, V] float."""
        probs = torch.softmax(scores.double(), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])
        # the first token whose cumulative probability exceeds the draw: a token of positive probability
        chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=scores.shape[-1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, chosen, 0.0)


def token_log_probs(logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-probabilities of the chosen tokens under ``log_softmax(logits / temperature)`` (no division at
    temperature 0, greedy, nor at 1, where it changes nothing), one step at a time: bit for bit what one
    log-softmax over the stacked ``[B, T, V]`` logits gives, without allocating its copies.

    Args:
        logits: T float tensors [B, V], ``generate``'s raw logits of each step (``output_logits``).
        tokens: [B, T] int64, the tokens chosen at those steps.
        temperature: the sampling temperature, >= 0.

    Returns:
        [B, T] float log-probabilities.
    """
    return torch.stack([
        torch.log_softmax(step if temperature in (0.0, 1.0) else step / temperature, dim=-1)
        .gather(-1, tokens[:, t, None]).squeeze(-1)
        for t, step in enumerate(logits)
    ], dim=1)


def sampling_processors(temperature: float, top_p: float, top_k: int, seeds: list[int]) -> LogitsProcessorList:
    """The logits processors that sample with temperature, top-k and top-p (in ``generate``'s own order) from each
    request's random stream; ``temperature`` > 0 (at 1, which divides nothing, no temperature processor)."""
    processors: list[LogitsProcessor] = [] if temperature == 1.0 else [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(processors + [RequestStreams(seeds)])
