"""The local judge: a Hugging Face causal LM scoring yes / no from its next-token distribution.

:class:`LocalHFJudge` (default: the embedded SmolLM2-135M-Instruct) is for machines without a server. One forward pass
gives the next-token distribution after the assistant header; ``P(yes) = sigmoid(LSE(l_yes / T) - LSE(l_no / T))``
over the single-token spellings of yes / no, and the verdict is drawn from Bernoulli(P(yes)) with a uniform from the
request's seed (``T = 0``: argmax). Requests are batched (also across concurrent callers, e.g. verl's per-sample
reward coroutines), the shared prefix (system + question + response) is run once per distinct response and its KV
cache reused for every criterion, and P(yes) is cached by content so the second scoring of a response costs no
forward pass (the sampling, not the network, is what differs between scorings -- exactly as for a sampled server
judge). It reads no reply text, so it never gives an unparsed verdict.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import os
import threading
from typing import Sequence

import numpy as np
import torch

from .protocol import CRITERION_SPLIT, RESPONSE_SPLIT, JudgeRequest, judge_messages, template_hash
from .types import GradingError, Verdict

__all__ = ["LocalHFJudge"]

_YES = ("yes", "Yes", "YES", " yes", " Yes", " YES")
_NO = ("no", "No", "NO", " no", " No", " NO")


class LocalHFJudge:
    """Judge backed by a local Hugging Face causal LM; verdicts sampled from its yes/no next-token probabilities.

    Args:
        model_path: local HF model directory, or ``None`` for the embedded SmolLM2-135M-Instruct
            (:func:`setgrpo_verl.models.load_causal_lm`).
        temperature: ``T`` in ``P(yes) = sigmoid(LSE(l_yes/T) - LSE(l_no/T))``; ``0`` = deterministic argmax.
        batch_size: distinct questions / responses per forward pass; criteria run in batches of
            ``4 * batch_size`` against the cached prefix.
        max_question_tokens / max_response_tokens: the question and the response are cut to this many tokens
            (head kept) before rendering -- part of the protocol, so they enter ``template_hash``.
        dtype: model dtype (float32 default).
        cache_size: number of P(yes) values kept (content-keyed LRU).
        max_wait_s: how long the async batcher waits to collect requests from concurrent callers.

    Shapes: the prompt is cut into three token segments, (system + question) ``[Bq, Lq]``, response ``[Br, Lr]`` and
    criterion ``[Bc, Lc]`` (each right-padded); each level runs once per distinct prefix against the KV cache of its
    parent rows (padding holes masked, positions continuing from the real length); only the last real position of
    the criterion segment goes through the LM head.
    """

    name = "local_hf"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        temperature: float = 1.0,
        batch_size: int = 16,
        max_question_tokens: int = 256,
        max_response_tokens: int = 384,
        dtype: torch.dtype = torch.float32,
        cache_size: int = 65536,
        max_wait_s: float = 0.02,
    ):
        from ..models import EMBEDDED_MODEL_NAME, load_causal_lm

        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if batch_size < 1 or max_question_tokens < 1 or max_response_tokens < 1:
            raise ValueError("batch_size, max_question_tokens and max_response_tokens must be >= 1")
        self.model_path = model_path
        self.model_name = EMBEDDED_MODEL_NAME if model_path is None else os.path.abspath(str(model_path))
        self.temperature = float(temperature)
        self.batch_size = int(batch_size)
        self.max_question_tokens = int(max_question_tokens)
        self.max_response_tokens = int(max_response_tokens)
        self.model, self.tokenizer = load_causal_lm(model_path, dtype=dtype)
        self._yes_ids = self._single_token_ids(_YES)
        self._no_ids = self._single_token_ids(_NO)
        if not self._yes_ids or not self._no_ids:
            raise ValueError(f"{self.model_name}: no single-token spelling of yes/no in its vocabulary")
        self._cache: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._cache_size = int(cache_size)
        self._lock = threading.Lock()  # one forward at a time (the model is shared; torch uses all cores anyway)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="setgrpo-judge")
        self._max_wait_s = float(max_wait_s)
        # id(loop) -> (loop, pending [(requests, future)], [drainer task]): one batcher per event loop
        self._batchers: dict[int, tuple[asyncio.AbstractEventLoop, list, list]] = {}

    def _single_token_ids(self, words) -> list[int]:
        ids = set()
        for w in words:
            toks = self.tokenizer.encode(w, add_special_tokens=False)
            if len(toks) == 1:
                ids.add(toks[0])
        return sorted(ids)

    @property
    def identity(self) -> dict:
        """``{name, model, temperature, template_hash}`` (docs/algorithm.md#7-record)."""
        return self.identity_for(model_path=self.model_path, temperature=self.temperature,
                                 max_question_tokens=self.max_question_tokens,
                                 max_response_tokens=self.max_response_tokens)

    @classmethod
    def identity_for(cls, *, model_path: str | None, temperature: float, max_question_tokens: int,
                     max_response_tokens: int, **_) -> dict:
        """The identity a judge with these settings reports (the model is not loaded)."""
        from ..models import EMBEDDED_MODEL_NAME

        return {
            "name": cls.name,
            "model": EMBEDDED_MODEL_NAME if model_path is None else os.path.abspath(str(model_path)),
            "temperature": float(temperature),
            "template_hash": template_hash(max_question_tokens=int(max_question_tokens),
                                           max_response_tokens=int(max_response_tokens)),
        }

    # ---------------------------------------------------------------- probabilities
    @staticmethod
    def _key(r: JudgeRequest) -> str:
        return hashlib.sha256(json.dumps([r.question, r.response, r.criterion]).encode()).hexdigest()

    def _truncate(self, text: str, limit: int) -> str:
        """``text`` cut to its first ``limit`` tokens, ending on a whole character (unchanged if shorter).

        A byte-level tokenizer can split a character between two tokens: decoding the first half ends in U+FFFD, and
        the cut then re-encodes to more tokens than ``limit``. The cut moves back, token by token, to the longest one
        that ends in no U+FFFD the text does not have there and re-encodes to at most ``limit`` tokens (the
        comparison is not on exact prefixes, since a tokenizer may normalise text or spacing when it decodes); if
        none does, the plain cut of ``limit`` tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        for n in range(limit, 0, -1):
            cut = self.tokenizer.decode(ids[:n])
            split = cut.endswith("\ufffd") and not text[:len(cut)].endswith("\ufffd")
            if not split and len(self.tokenizer.encode(cut, add_special_tokens=False)) <= limit:
                return cut
        return self.tokenizer.decode(ids[:limit])

    def _segments(self, r: JudgeRequest) -> tuple[str, str, str]:
        """The chat-templated judge prompt cut into (system + question, response, criterion + generation header):
        the first segment is shared by all responses to a question, the first two by all criteria of a response."""
        sent_r, sent_c = "\u241fSETGRPO_RESPONSE\u241f", "\u241fSETGRPO_CRITERION\u241f"
        req = JudgeRequest(self._truncate(r.question, self.max_question_tokens), sent_r, sent_c)
        text = self.tokenizer.apply_chat_template(judge_messages(req), tokenize=False, add_generation_prompt=True)
        cut_r = text.rfind(RESPONSE_SPLIT + sent_r)
        cut_c = text.rfind(CRITERION_SPLIT + sent_c)
        if cut_r < 0 or cut_c < cut_r:  # pragma: no cover - a chat template that rewrites the user message
            raise GradingError(f"{self.model_name}: the chat template altered the judge prompt; cannot split it")
        response = self._truncate(r.response, self.max_response_tokens)
        return (
            text[:cut_r],
            text[cut_r:cut_c].replace(sent_r, response),
            text[cut_c:].replace(sent_c, r.criterion),
        )

    def p_yes(self, requests: Sequence[JudgeRequest]) -> np.ndarray:
        """P(yes) at the judge temperature for each request (float64 ``[len(requests)]``), batched and cached.

        ``T = 0`` returns 1.0 / 0.0 / 0.5 (argmax; ties 0.5)."""
        keys = [self._key(r) for r in requests]
        with self._lock:
            todo: dict[str, JudgeRequest] = {}
            for k, r in zip(keys, requests):
                if k not in self._cache and k not in todo:
                    todo[k] = r
            if todo:
                margins = self._margins(list(todo.values()))
                for k, m in zip(todo, margins):
                    self._cache[k] = float(m)
            out = np.empty(len(keys), dtype=np.float64)
            for i, k in enumerate(keys):
                self._cache.move_to_end(k)
                out[i] = self._cache[k]
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        # cached values are the log-odds margins at the judge temperature (T = 0: at T = 1, thresholded)
        if self.temperature == 0:
            return np.where(out > 0, 1.0, np.where(out < 0, 0.0, 0.5))
        return 1.0 / (1.0 + np.exp(-out))

    def _extend(self, parent, rows: list[int], segments: list[list[int]]):
        """Run token ``segments`` (right-padded ``[n, L]``) after the cached rows ``rows`` of ``parent``.

        ``parent`` is ``None`` or ``(layers, mask [Bp, Lp], lengths [Bp])``; padding holes stay masked and positions
        continue from each parent's real length. Returns ``((layers, mask, lengths), last_hidden [n, L, H], seg_len)``.
        """
        from transformers import DynamicCache

        n, width = len(segments), max(len(t) for t in segments)
        ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        seg_mask = torch.zeros((n, width), dtype=torch.long)
        seg_len = torch.tensor([len(t) for t in segments])
        for i, toks in enumerate(segments):
            ids[i, : len(toks)] = torch.tensor(toks)
            seg_mask[i, : len(toks)] = 1
        if parent is None:
            cache, mask, base = None, seg_mask, torch.zeros(n, dtype=torch.long)
        else:
            layers, parent_mask, parent_len = parent
            idx = torch.tensor(rows)
            cache = DynamicCache(ddp_cache_data=[(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers])
            mask = torch.cat([parent_mask.index_select(0, idx), seg_mask], dim=1)
            base = parent_len.index_select(0, idx)
        out = self.model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=base.unsqueeze(1) + torch.arange(width).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return (layers, mask, base + seg_len), out.last_hidden_state, seg_len

    @torch.inference_mode()
    def _margins(self, requests: list[JudgeRequest]) -> list[float]:
        """``LSE(l_yes / T) - LSE(l_no / T)`` per request (log-odds of yes at the judge temperature; T = 0 uses 1).

        Three-level prefix sharing: (system + question) once per distinct question, the response once per distinct
        (question, response), then every criterion against that cache; only the last position hits the LM head."""
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        tree: dict[str, dict[str, list[tuple[int, str]]]] = {}
        for i, r in enumerate(requests):
            a, b, c = self._segments(r)
            tree.setdefault(a, {}).setdefault(b, []).append((i, c))
        temp = self.temperature if self.temperature > 0 else 1.0
        yes, no = torch.tensor(self._yes_ids), torch.tensor(self._no_ids)
        out = [0.0] * len(requests)
        bs = self.batch_size
        questions = sorted(tree, key=len)
        for qa in range(0, len(questions), bs):
            q_chunk = questions[qa : qa + bs]
            q_state, _, _ = self._extend(None, [], [encode(q) for q in q_chunk])
            responses = [(row, b) for row, q in enumerate(q_chunk) for b in sorted(tree[q], key=len)]
            for rb in range(0, len(responses), bs):
                r_chunk = responses[rb : rb + bs]
                r_state, _, _ = self._extend(q_state, [row for row, _ in r_chunk], [encode(b) for _, b in r_chunk])
                leaves = [(row, i, c) for row, (qrow, b) in enumerate(r_chunk) for i, c in tree[q_chunk[qrow]][b]]
                for lc in range(0, len(leaves), 4 * bs):
                    l_chunk = leaves[lc : lc + 4 * bs]
                    _, hidden, seg_len = self._extend(r_state, [row for row, _, _ in l_chunk], [encode(c) for _, _, c in l_chunk])
                    last = hidden[torch.arange(len(l_chunk)), seg_len - 1]
                    logits = self.model.lm_head(last).float() / temp
                    margin = torch.logsumexp(logits[:, yes], -1) - torch.logsumexp(logits[:, no], -1)
                    for k, (_, i, _) in enumerate(l_chunk):
                        out[i] = float(margin[k])
        return out

    # ---------------------------------------------------------------- async interface
    async def _drain(self, pending: list) -> None:
        loop = asyncio.get_running_loop()
        while pending:
            await asyncio.sleep(self._max_wait_s)
            batch = pending[:]
            del pending[:]
            flat = [r for reqs, _ in batch for r in reqs]
            try:
                probs = await loop.run_in_executor(self._executor, self.p_yes, flat)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            offset = 0
            for reqs, fut in batch:
                if not fut.done():
                    fut.set_result(probs[offset : offset + len(reqs)])
                offset += len(reqs)

    async def ap_yes(self, requests: Sequence[JudgeRequest]) -> np.ndarray:
        """Async :meth:`p_yes`: requests from concurrent callers on one event loop are merged into shared batches
        (collected for ``max_wait_s``, or while the previous batch runs)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        state = self._batchers.get(id(loop))
        if state is None or state[0] is not loop:
            state = (loop, [], [None])
            self._batchers[id(loop)] = state
        _, pending, drainer = state
        pending.append((list(requests), fut))
        if drainer[0] is None or drainer[0].done():
            drainer[0] = loop.create_task(self._drain(pending))
        return await fut

    async def ajudge(self, requests: Sequence[JudgeRequest], seeds: Sequence[int]) -> list[Verdict]:
        """Verdicts drawn from Bernoulli(P(yes)) with ``numpy.random.default_rng(seed).random()`` per request."""
        if len(requests) != len(seeds):
            raise ValueError(f"{len(requests)} requests but {len(seeds)} seeds")
        if not requests:
            return []
        probs = await self.ap_yes(requests)
        verdicts = []
        for p, seed in zip(probs, seeds):
            u = np.random.default_rng(int(seed)).random()
            verdicts.append(Verdict("met" if u < p else "unmet", "judge", p_yes=float(p)))
        return verdicts

    async def aclose(self) -> None:
        """Forget this event loop's batcher (the model stays loaded)."""
        self._batchers.pop(id(asyncio.get_running_loop()), None)
