"""The ``transformers`` rollout for verl 0.9.1 on CPU: a token-in/token-out server that batches requests.

verl's agent loop sends one ``generate`` request per response to a rollout *replica*; on GPUs that is a vLLM or
SGLang server. :class:`TransformersRolloutServer` is a Ray actor holding a Hugging Face causal LM: requests that
arrive within :data:`BATCH_WAIT_S` of each other (and share sampling parameters) are left-padded into one batch and
decoded by one ``model.generate`` call, each distinct prompt prefilled once however many responses it asks for (in
float32; see :meth:`TransformersRolloutServer._shared_prompt_cache`). Every request samples from its own random
stream, keyed by the server's seed, the weight version, its prompt and its sample index (:func:`request_seed`), so
the tokens of a request do not depend on the batch it decodes in, and no two requests of a run share draws.
:class:`TransformersReplica` launches one server per replica (``actor_rollout_ref.rollout.name=transformers``),
and :class:`TransformersRolloutAdapter` lives in verl's hybrid actor worker and writes the actor's full weights into a
buffer it shares with the server (:mod:`~setgrpo_verl.verl_cpu.weight_buffer`) on verl's weight-sync path (every
step), so the rollout always samples from the current policy.

The model runs in verl's ``rollout.dtype`` (bf16 in the GPU recipes and on CPUs with bf16 units, see
:func:`setgrpo_verl.runner.launch.cpu_overrides`). Log-probabilities, when verl asks for them
(``rollout.calculate_log_probs``), are those of the sampled tokens under ``softmax(logits / temperature)`` of the
unprocessed logits, taken in float32: the quantity verl's actor computes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import ray
import torch

from verl.utils.torch_dtypes import PrecisionType
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from setgrpo_verl.verl_cpu.streams import occurrence_indices, request_seed, sampling_processors, token_log_probs

from .kv_cache import preallocate
from .weight_buffer import Layout, WeightBuffer

logger = logging.getLogger(__name__)

#: ``actor_rollout_ref.rollout.name`` of this rollout.
ROLLOUT_NAME = "transformers"

#: Seconds without a new request after which a server decodes the requests it holds (or sooner, when a batch is
#: full).
BATCH_WAIT_S = 0.2


def server_name(replica_rank: int) -> str:
    """Ray actor name of the rollout server of replica ``replica_rank``."""
    return f"setgrpo_transformers_rollout_{replica_rank}"


@dataclass
class _Request:
    prompt_ids: list[int]
    seed: int
    future: asyncio.Future


def _sampling_key(params: dict[str, Any], default_max_tokens: int) -> tuple:
    """(temperature, top_p, top_k, max_new_tokens, logprobs) of a verl sampling-parameter dict.

    Raises:
        ValueError: a sampling setting this rollout does not implement (repetition penalty other than 1) or a
            negative temperature.
    """
    repetition_penalty = float(params.get("repetition_penalty", 1.0) or 1.0)
    if repetition_penalty != 1.0:
        raise ValueError(f"the transformers rollout does not implement repetition_penalty={repetition_penalty}")
    temperature = float(params.get("temperature", 1.0) or 0.0)
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: a sampling temperature is >= 0 (0 decodes greedily)")
    top_p = float(params.get("top_p", 1.0) or 1.0)
    top_k = int(params.get("top_k", -1) or -1)
    max_tokens = int(params.get("max_tokens") or params.get("max_new_tokens") or default_max_tokens)
    return temperature, top_p, top_k, max_tokens, bool(params.get("logprobs"))


def replica_seed(base_seed: int, replica_rank: int) -> int:
    """The seed of one rollout replica's server, from which its requests' streams are keyed: distinct replicas of
    one run draw independent sampling streams (with one shared seed, the i-th request for a prompt on replica i and
    on replica j would sample the same noise, so two responses of a group served by different replicas could be
    identical), and runs with different base seeds differ too.

    Args:
        base_seed: the run's rollout seed (verl's ``actor_rollout_ref.rollout.seed``), an int >= 0.
        replica_rank: the replica's index, an int >= 0.

    Returns:
        An int in [0, 2**32).
    """
    return int(np.random.SeedSequence([int(base_seed), int(replica_rank)]).generate_state(1)[0])


def server_threads(num_cpus: int, ranks_per_node: int, ranks_per_replica: int) -> int:
    """Torch threads of one rollout server: the node's CPU cores shared among the replicas on the node.

    In verl's hybrid mode the actor workers wait while the rollout generates, so the servers may use every core.

    Args:
        num_cpus: CPU cores the node's processes may run on.
        ranks_per_node: the trainer's ranks on the node (``trainer.n_gpus_per_node``).
        ranks_per_replica: the ranks of one replica on the node (rollout TP x DP x PP, at most ``ranks_per_node``).

    Returns:
        An int >= 1.
    """
    replicas = max(1, int(ranks_per_node) // max(1, int(ranks_per_replica)))
    return max(1, int(num_cpus) // replicas)


def _object_store_bytes() -> int:
    """The size of Ray's object store in bytes (0 in a process without Ray)."""
    return int(ray.cluster_resources().get("object_store_memory", 0)) if ray.is_initialized() else 0


class TransformersRolloutServer:
    """Ray actor: batched token-in/token-out generation with a Hugging Face causal LM on CPU.

    Args:
        model_path: local Hugging Face model directory (the actor's ``model.path``).
        response_length: default number of new tokens (``rollout.response_length``).
        max_batch_size: most requests decoded together (``rollout.max_num_seqs``).
        seed: the server's seed (:func:`replica_seed`), from which every request's random stream is keyed.
        trust_remote_code: passed to ``from_pretrained``.
        dtype: the model's dtype (verl's ``rollout.dtype``), ``torch.bfloat16`` or ``torch.float32``.
        num_threads: torch intra-op threads of the server (Ray starts actors with one); ``None`` keeps the
            process's setting.
        attn_implementation: the model's attention (``transformers``' ``attn_implementation``). ``sdpa``, PyTorch's
            fused attention kernel, samples the same distribution as ``eager`` and decodes a little faster on CPU
            (0.92 of ``eager``'s time on one quickstart calibration batch on an idle 2-core machine, 0.67 with
            the cores shared; ``benchmarks/bench_rollout_attention.py`` prints the ratio).
    """

    def __init__(self, model_path: str, response_length: int, max_batch_size: int, seed: int = 0,
                 trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                 num_threads: Optional[int] = None, attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads is not None:
            torch.set_num_threads(max(1, int(num_threads)))
        self.seed = int(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
        self.model.eval()
        self.response_length = int(response_length)
        self.max_batch_size = max(1, int(max_batch_size))
        eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.version = 0
        # requests per prompt under the current weight version: the sample index of the next one
        self._served: dict[tuple[int, ...], int] = {}
        self._served_version = 0
        self._share_prompts = dtype == torch.float32 and self._has_plain_cache()
        self._preallocate = True  # the shared prompts' cache written in place (off: concatenated, for comparisons)
        self._pending: dict[tuple, list[_Request]] = {}
        self._drainer: Optional[asyncio.Task] = None
        self._weights: Optional[WeightBuffer] = None  # the shared weight buffer, mapped at the first sync
        # one thread: generation and weight loading never overlap, and the event loop stays free to queue requests
        self._executor = ThreadPoolExecutor(max_workers=1)

    async def generate(self, request_id=None, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       **kwargs) -> TokenOutput:
        """One response to ``prompt_ids`` (verl's ``TokenOutput``: token ids, optional log-probs, weight version),
        sampled from the stream of ``sampling_params["seed"]`` when the caller sets one (vLLM's per-request seed),
        else of :func:`request_seed` with this prompt's next sample index under the current weight version.

        Raises:
            ValueError: multimodal input or an unsupported sampling setting.
        """
        if image_data is not None or video_data is not None:
            raise ValueError("the transformers rollout serves text-only models")
        key = _sampling_key(dict(sampling_params or {}), self.response_length)
        seed = (sampling_params or {}).get("seed")
        seed = self._next_seed(list(prompt_ids)) if seed is None else int(seed)
        future = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append(_Request(list(prompt_ids), seed, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    def _next_seed(self, prompt_ids: list[int]) -> int:
        if self._served_version != self.version:
            self._served, self._served_version = {}, self.version
        index = self._served.get(tuple(prompt_ids), 0)
        self._served[tuple(prompt_ids)] = index + 1
        return request_seed(self.seed, self.version, prompt_ids, index)

    def _num_pending(self) -> int:
        return sum(len(queue) for queue in self._pending.values())

    async def _await_quiet(self) -> None:
        # verl's agent loop submits a step's requests one by one over tens of milliseconds: keep collecting until
        # no request arrived for BATCH_WAIT_S (or a batch is full), so one step's responses decode as one batch
        # instead of a few small ones that each pay the full decoding time
        seen = -1
        while (pending := self._num_pending()) != seen and pending < self.max_batch_size:
            seen = pending
            await asyncio.sleep(BATCH_WAIT_S)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await self._await_quiet()
            key = next(iter(self._pending))
            queue = self._pending[key]
            batch, self._pending[key] = queue[: self.max_batch_size], queue[self.max_batch_size:]
            if not self._pending[key]:
                del self._pending[key]
            try:
                outputs = await loop.run_in_executor(
                    self._executor, self._generate_batch, [r.prompt_ids for r in batch], key, [r.seed for r in batch]
                )
            except Exception as exc:  # every waiting request sees the failure
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, out in zip(batch, outputs):
                if not r.future.done():
                    r.future.set_result(out)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], key: tuple,
                        seeds: Optional[list[int]] = None) -> list[TokenOutput]:
        """Decode one batch: B prompts, one sampling key (:func:`_sampling_key`) and B request seeds (by default each
        prompt's :func:`occurrence_indices` in this batch under the current weight version)."""
        temperature, top_p, top_k, max_tokens, want_logprobs = key
        if seeds is None:
            seeds = [request_seed(self.seed, self.version, p, i) for p, i in zip(prompts, occurrence_indices(prompts))]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_tokens, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
            return_dict_in_generate=True, output_logits=want_logprobs,
        )
        # greedy decoding of the processed scores: with sampling, the processors leave only each row's sampled token
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if temperature > 0:
            kwargs["logits_processor"] = sampling_processors(temperature, top_p, top_k, seeds)
        shared = self._shared_prompt_cache(prompts, input_ids, attention_mask, max_tokens)
        if shared is not None:
            kwargs["past_key_values"] = shared
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        new_tokens = out.sequences[:, width:]
        if want_logprobs:
            token_logprobs = token_log_probs(out.logits, new_tokens, temperature)
        results = []
        for i in range(len(prompts)):
            tokens = new_tokens[i].tolist()
            length = len(tokens)
            for t, tok in enumerate(tokens):  # keep the first end-of-sequence token, drop the padding after it
                if tok in self.eos_ids:
                    length = t + 1
                    break
            results.append(TokenOutput(
                token_ids=tokens[:length],
                log_probs=token_logprobs[i, :length].tolist() if want_logprobs else None,
                stop_reason="completed",
                extra_fields={"global_steps": self.version},
            ))
        return results

    def _shared_prompt_cache(self, prompts: list[list[int]], input_ids: torch.Tensor,
                             attention_mask: torch.Tensor, new_tokens: int) -> Optional[Any]:
        """The KV cache of every prompt but its last token, computed once per distinct prompt and repeated for each
        request that sends it (the K responses of a group), or ``None`` when no prompt repeats or the model's cache
        is not a plain attention cache, or the model is not in float32.

        ``generate`` then runs only the last prompt token and the new tokens, so a group's prompt is prefilled once
        instead of K times. The cached keys and values are those ``generate`` would compute itself (same left padding,
        same position ids), so in float32 every request samples the same tokens as with ``generate``'s own prefill.
        In bfloat16 the differently shaped prefill rounds differently (rollout log-probs moved by up to 0.17 nats and
        sampled tokens changed on the embedded model), so a bfloat16 server keeps ``generate``'s own prefill. The
        cache is preallocated for the last prompt token and ``new_tokens`` more
        (:class:`setgrpo_verl.verl_cpu.kv_cache.PreallocatedLayer`), so decoding writes each step in place instead of
        copying the cache.

        Args:
            prompts: the batch's prompt token ids, B lists.
            input_ids: [B, W] int64, the left-padded prompts.
            attention_mask: [B, W] int64, 1 on prompt tokens.
            new_tokens: the most tokens ``generate`` will add.

        Returns:
            A ``transformers`` ``DynamicCache`` of batch size B and length W - 1, or ``None``.
        """
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if not self._share_prompts or len(distinct) == len(prompts) or input_ids.shape[1] < 2:
            return None
        first = torch.tensor([owner.index(u) for u in range(len(distinct))], dtype=torch.long)
        ids, mask = input_ids[first, :-1], attention_mask[first, :-1]
        # the position ids generate derives from a left-padded attention mask
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values
        cache.reorder_cache(torch.tensor(owner, dtype=torch.long))
        if self._preallocate:
            cache = preallocate(cache, input_ids.shape[1] + new_tokens)
        return cache

    @torch.no_grad()
    def _has_plain_cache(self) -> bool:
        """Whether the model's KV cache is a plain attention cache (every layer a full ``DynamicLayer``), whose rows
        can be repeated; hybrid linear-attention and sliding-window caches are not."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = self.model(input_ids=torch.tensor([[self.pad_id]]), use_cache=True).past_key_values
        return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)

    async def load_weights(self, path: str, layout: Layout, global_steps: Optional[int] = None) -> int:
        """Copy the actor's full weights (parameter names as in the Hugging Face model) from the shared buffer at
        ``path`` (:mod:`~setgrpo_verl.verl_cpu.weight_buffer`; mapped at the first call and kept) into the model's
        parameters; returns the count.

        Raises:
            RuntimeError: a parameter of the model is missing from the buffer (other than a tied LM head) or a
                name is unknown: the actor and the rollout would disagree about the policy.
            ValueError: the file at ``path`` is not ``layout``'s size.
            FileNotFoundError: no file at ``path`` on this host: the server runs on another host than the actor
                worker (the CPU backend runs on one host, ``trainer.nnodes=1``) or restarted after the first sync.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._load_buffer, path, layout, global_steps)

    def _load_buffer(self, path: str, layout: Layout, global_steps: Optional[int]) -> int:
        if self._weights is None or self._weights.path != Path(path) or self._weights.layout != layout:
            if not Path(path).exists():
                raise FileNotFoundError(f"the transformers rollout server finds no weight buffer at {path}: either it "
                                        "runs on another host than the actor worker (run the CPU backend on one "
                                        "host, trainer.nnodes=1) or it was restarted after the first weight sync "
                                        "(restart the run, --resume continues it)")
            self._weights = WeightBuffer.open(path, layout)
        return self._load(self._weights.views, global_steps)

    def _load(self, state_dict: dict[str, torch.Tensor], global_steps: Optional[int]) -> int:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if isinstance(getattr(self.model, "_tied_weights_keys", None), dict):
            tied = set(self.model._tied_weights_keys)
        missing = [m for m in missing if m not in tied]
        if missing or unexpected:
            raise RuntimeError(
                f"transformers rollout weight sync: {len(missing)} model parameters missing (e.g. {missing[:3]}) and "
                f"{len(unexpected)} unknown names (e.g. {unexpected[:3]}) in the actor's weights"
            )
        if global_steps is not None:
            self.version = int(global_steps)
        return len(state_dict)

    # control-plane calls verl's replica makes; the model stays resident on the CPU, so there is nothing to do
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return None

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


class TransformersReplica(RolloutReplica):
    """verl rollout replica backed by one :class:`TransformersRolloutServer` (hybrid mode: the actor pushes weights)."""

    #: The Ray actor class of the server.
    server_cls = TransformersRolloutServer

    async def launch_servers(self):
        name = server_name(self.replica_rank)
        model_path = getattr(self.model_config, "local_path", None) or self.model_config.path
        server = ray.remote(self.server_cls).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency
        ).remote(
            model_path,
            self.config.response_length,
            self.config.max_num_seqs,
            replica_seed(int(self.config.seed), self.replica_rank),
            bool(getattr(self.model_config, "trust_remote_code", False)),
            PrecisionType.to_dtype(self.config.dtype),
            server_threads(len(os.sched_getaffinity(0)), self.gpus_per_node, self.gpus_per_replica_node),
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"ray://{name}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


class TransformersRolloutAdapter(BaseRollout):
    """verl's rollout object inside the hybrid actor worker: gathers the actor's weights and writes them into the
    replica server's shared weight buffer on every weight sync (``BaseRollout.update_weights``), then has the server
    load them."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = int(os.environ.get("RANK", 0))
        self.replica_rank = rank // world
        self.is_leader = rank % world == 0
        self._server = None
        self.dtype = PrecisionType.to_dtype(self.config.dtype)  # the server model's dtype: weights travel in it
        self._buffer: Optional[WeightBuffer] = None  # the shared weight buffer, made at the first sync

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        """Gather every (possibly sharded) tensor on all ranks; the replica's leader writes them into the shared
        weight buffer (:mod:`~setgrpo_verl.verl_cpu.weight_buffer`, made at the first sync) and waits for the
        server to load them, so the next rollout samples from these weights.

        Raises:
            ValueError: ``wire_format`` other than ``named_tensors`` (set ``rollout.checkpoint_engine.backend=naive``),
                or a weight of another shape than at the first sync.
            KeyError: a weight the first sync did not have; RuntimeError: one it had is missing.
            OSError: no room for the buffer (its size and directory named).
        """
        if wire_format != "named_tensors":
            raise ValueError(
                f"the transformers rollout receives full named tensors, not {wire_format!r}: "
                "set actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        if not self.is_leader:
            for _, tensor in weights:  # the gathers of sharded weights are collective: every rank takes part
                if hasattr(tensor, "full_tensor"):
                    tensor.full_tensor()
            return None
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        first = self._buffer is None
        if first:  # the layout comes from the first sync's weights (a DTensor shard's shape is the whole weight's);
            # Ray's object store keeps its room in /dev/shm
            weights = list(weights)
            self._buffer = WeightBuffer.create(Layout.of([(n, tuple(t.shape)) for n, t in weights], self.dtype),
                                               keep_free=_object_store_bytes())
        try:
            self._buffer.write_all(weights)
            await self._server.load_weights.remote(str(self._buffer.path), self._buffer.layout,
                                                   global_steps=kwargs.get("global_steps"))
        except BaseException:
            if first:  # the server never mapped it: the next sync makes a new one
                self._buffer.unlink()
                self._buffer = None
            raise
        if first:  # both processes hold the mapping: the file's name is no longer needed
            self._buffer.unlink()
        return None
