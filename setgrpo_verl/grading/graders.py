"""Graders: one small interface turning (prompt, response, rubric) items into a score + per-criterion verdicts.

Interface (duck-typed)::

    grader.identity -> {"name", "model", "temperature", "template_hash"}      # for the calibration record
    await grader.agrade(items: Sequence[GradingItem], *, scoring_index: int) -> list[GradeResult]
    await grader.aclose()

* :class:`RubricGrader` -- rule criteria checked by code (:mod:`.rules`), the others by a judge
  (:class:`~.judges.OpenAIJudge` or :class:`~.judges.LocalHFJudge`); score = :func:`~.rubric.rubric_score`.
* :class:`FunctionGrader` -- a user Python function, verl style (``path`` + ``name``), called once per item and
  scoring with ``scoring_index`` and ``seed``.

Seeding: the verdict seed of criterion j of a response in scoring i is
``sha256(grader seed, i, question, response, j, criterion, nonce)`` (31 bits; ``nonce`` names the rollout sample,
as for the noisy grader's flips, and is left out of the hash when an item has none), so scoring i of a sample is
reproducible regardless of batch composition or order, a repeated response gets fresh verdicts at every step, and
scorings 0 and 1 are independent draws.
:func:`build_grader` builds a grader from a plain config mapping (what the verl reward manager reads).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
from typing import Any, Mapping, Sequence

from .answers import split_response_part, with_response_part
from .http_judge import OpenAIJudge
from .local_judge import LocalHFJudge
from .protocol import JudgeRequest, gather_or_cancel, strip_reasoning, template_hash
from .rubric import GradeResult, GradingError, GradingItem, Rubric, Verdict, rubric_score
from .rules import check_rule

__all__ = ["FunctionGrader", "RubricGrader", "as_rubric", "build_grader", "check_unparsed", "describe_item",
           "grader_identity", "verdict_seed"]

#: How many unparsed judge replies an unparsed-verdict error quotes.
QUOTED_REPLIES = 3


def verdict_seed(seed: int, scoring_index: int, question: str, response: str, j: int, criterion: str,
                 nonce: str | None = None) -> int:
    """The 31-bit seed of one verdict (criterion ``j``) in scoring ``scoring_index`` (see module docstring); with the
    item's ``nonce`` (its rollout sample, :attr:`~.rubric.GradingItem.nonce`) the seed is fresh per grading call,
    so a judge at temperature above 0 draws a repeated response's verdicts anew at every step, and the same again
    in a rerun (docs/grading.md#judge-protocol). Without a nonce it is the seed of the scheme before nonces."""
    fields = [int(seed), int(scoring_index), question, response, int(j), criterion]
    payload = json.dumps(fields if nonce is None else ["judge-verdict", *fields, str(nonce)])
    return int.from_bytes(hashlib.sha256(payload.encode()).digest()[:8], "big") % 2**31


class RubricGrader:
    """Rubric grading: rule criteria by code, the rest by ``judge``; the score mixes both
    (docs/algorithm.md#0-notation).

    Args:
        judge: an :class:`OpenAIJudge` / :class:`LocalHFJudge` (anything with ``identity`` and ``ajudge``), or
            ``None`` when every criterion carries a rule (a judged criterion then raises :class:`GradingError`).
        seed: grader seed (enters every verdict seed).
        max_unparsed_ratio: the largest fraction of a response's judged criteria that may stay unparsed
            (docs/grading.md#unparsed-verdicts); above it grading stops with :class:`GradingError` quoting the
            judge's first replies. Default 0: any unparsed verdict stops. A value in (0, 1) scores a response
            over its parsed criteria (the unparsed ones count neither as met nor as unmet) and enters the identity.

    Raises:
        ValueError: ``max_unparsed_ratio`` outside [0, 1).
    """

    def __init__(self, judge=None, *, seed: int = 0, max_unparsed_ratio: float = 0.0):
        self.judge = judge
        self.seed = int(seed)
        self.max_unparsed_ratio = check_unparsed_ratio(max_unparsed_ratio)

    @property
    def deterministic(self) -> bool:
        """True without a judge: every criterion is a rule checked by code, so every scoring gives the same score."""
        return self.judge is None

    @property
    def identity(self) -> dict:
        """``{name, model, temperature, template_hash}``: the judge's identity, name prefixed with ``rubric+``
        (a non-zero ``max_unparsed_ratio`` enters ``template_hash``)."""
        if self.judge is None:
            return {"name": "rubric+rules", "model": None, "temperature": 0.0, "template_hash": template_hash(rules_only=True)}
        ident = dict(self.judge.identity)
        ident["name"] = f"rubric+{ident['name']}"
        return with_unparsed_policy(ident, self.max_unparsed_ratio)

    async def agrade(self, items: Sequence[GradingItem], *, scoring_index: int) -> list[GradeResult]:
        """Grade every item once (scoring ``scoring_index``).

        Returns:
            One :class:`GradeResult` per item (score float, verdicts in criterion order).

        Raises:
            GradingError: a judged criterion without a judge, a rule that cannot run, a judge failure, a response
                whose unparsed judged verdicts exceed ``max_unparsed_ratio`` (:func:`check_unparsed`), or one whose
                every criterion is unparsed.
        """
        verdicts: list[list[Verdict | None]] = []
        requests: list[JudgeRequest] = []
        seeds: list[int] = []
        slots: list[tuple[int, int]] = []
        for n, item in enumerate(items):
            if item.rubric is None:
                raise GradingError(f"item {n} has no rubric: a RubricGrader needs one per response")
            question = item.question
            row: list[Verdict | None] = []
            for j, crit in enumerate(item.rubric.criteria):
                if crit.rule is not None:
                    met = check_rule(crit.rule, question, item.response)
                    row.append(Verdict("met" if met else "unmet", "rule"))
                    continue
                if self.judge is None:
                    raise GradingError(
                        f"rubric {item.rubric.id!r} criterion {j} ({crit.criterion!r}) has no rule and this grader "
                        "has no judge: configure a judge (local_hf or openai)"
                    )
                row.append(None)
                requests.append(JudgeRequest(question, item.response, crit.criterion))
                seeds.append(verdict_seed(self.seed, scoring_index, question, item.response, j, crit.criterion,
                                          item.nonce))
                slots.append((n, j))
            verdicts.append(row)
        if requests:
            try:
                judged = await self.judge.ajudge(requests, seeds)
            except GradingError as exc:
                refused = getattr(exc, "request", None)
                if refused is None or refused not in requests:
                    raise
                n = slots[requests.index(refused)][0]
                raise GradingError(f"scoring {scoring_index}, {describe_item(items[n])}: {exc}") from exc
            for (n, j), v in zip(slots, judged):
                verdicts[n][j] = v
        check_unparsed(items, verdicts, self.max_unparsed_ratio, scoring_index=scoring_index)
        results = []
        for item, row in zip(items, verdicts):
            results.append(
                GradeResult(
                    score=rubric_score(item.rubric, row),
                    verdicts=tuple(row),
                    scoring_index=int(scoring_index),
                    seed=self.seed,
                )
            )
        return results

    async def aclose(self) -> None:
        if self.judge is not None:
            await self.judge.aclose()


def check_unparsed_ratio(value) -> float:
    """``max_unparsed_ratio`` as a float after checking it is a number in [0, 1).

    Raises:
        ValueError: a bool, a non-number, NaN or a value outside [0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"max_unparsed_ratio must be a number in [0, 1) (0: any unparsed verdict stops grading), "
                         f"got {value!r}")
    return float(value)


def with_unparsed_policy(identity: dict, max_unparsed_ratio: float) -> dict:
    """``identity`` with a non-zero ``max_unparsed_ratio`` folded into its ``template_hash`` (scores over the parsed
    criteria only are another protocol); unchanged for 0."""
    if not max_unparsed_ratio:
        return identity
    out = dict(identity)
    out["template_hash"] = template_hash(judge=identity.get("template_hash"), max_unparsed_ratio=max_unparsed_ratio)
    return out


def check_unparsed(items: Sequence[GradingItem], verdicts: Sequence[Sequence[Verdict | None]],
                   max_unparsed_ratio: float, *, scoring_index: int) -> None:
    """Stop when a response has more unparsed judged verdicts than ``max_unparsed_ratio`` allows
    (docs/grading.md#unparsed-verdicts).

    Args:
        items: the graded items (for row ids and responses in the message).
        verdicts: per item, its verdicts in criterion order.
        max_unparsed_ratio: the allowed fraction of a response's judged verdicts that are unparsed (0: none).
        scoring_index: the scoring, for the message.

    Raises:
        GradingError: some response exceeds the ratio; names how many responses, the first one, and quotes the
            first :data:`QUOTED_REPLIES` unparsed replies of the batch.
    """
    over, quoted = [], []
    for item, row in zip(items, verdicts):
        judged = [v for v in row if v is not None and v.source == "judge"]
        unparsed = [v for v in judged if v.outcome == "unparsed"]
        quoted.extend(v.raw for v in unparsed[: max(0, QUOTED_REPLIES - len(quoted))])
        if unparsed and len(unparsed) > max_unparsed_ratio * len(judged):
            failed = [f"criterion {j}{_criterion_text(item, j)}: {v.failure or 'unparsed'} after {v.reasks} re-ask(s)"
                      for j, v in enumerate(row) if v is not None and v.outcome == "unparsed"]
            over.append((item, len(unparsed), len(judged), failed))
    if not over:
        return
    item, n_unparsed, n_judged, failed = over[0]
    replies = ", ".join("nothing" if r in (None, "") else repr(r[:80]) for r in quoted)
    if any(r and strip_reasoning(r) is None for r in quoted):
        replies += (" (a reasoning block that never closes: raise the grader's max_tokens, or serve the judge with "
                    "its reasoning parser, e.g. vLLM's --reasoning-parser, so the reasoning leaves content)")
    raise GradingError(
        f"{len(over)} of {len(items)} responses in scoring {scoring_index} have unparsed judge verdicts above "
        f"max_unparsed_ratio={max_unparsed_ratio:g} (first: {describe_item(item)}, {n_unparsed} of {n_judged} judged "
        f"criteria unparsed: {'; '.join(failed[:QUOTED_REPLIES])}). The judge's first unparsed replies: {replies}. An unparsed verdict is neither met nor "
        "unmet, so leaving it out would change the score without a word: use a judge that answers with one verdict "
        "word (docs/grading.md#reading-a-verdict says how a verdict is read, in English, Chinese and the common "
        "European languages), raise parse_retries, or set the grader's max_unparsed_ratio to score such responses over their "
        "parsed criteria"
    )


def _criterion_text(item: GradingItem, j: int) -> str:
    """`` ('<start of criterion j>')`` of the item's rubric, or nothing without one."""
    criteria = item.rubric.criteria if item.rubric is not None else ()
    return f" ({criteria[j].criterion[:60]!r})" if j < len(criteria) else ""


class FunctionGrader:
    """A user scoring function, verl style: ``fn(data_source, solution_str, ground_truth, extra_info, *,
    scoring_index, seed, **kwargs)`` (sync or async), called once per item and scoring.

    It returns a finite float score, or a dict with a finite ``"score"`` and optionally ``"verdicts"`` (a list of
    ``True`` / ``False`` / ``None`` or of ``"met"``/``"unmet"``/``"unparsed"`` strings). NaN, +-inf, a bool or a
    non-number raise :class:`GradingError` naming the row and the response (verl's group normalisation would turn
    one such score into NaN advantages for the whole group); so does an exception the function raises (chained). ``ground_truth`` is the item's
    ``ground_truth`` if set, else its rubric as a RubricHub dict. The seed passed is
    ``verdict_seed(seed, scoring_index, question, response, -1, "")`` (question = the item's prompt, else its
    rubric's question, else ``""``).

    Args:
        path: Python file defining the function (loaded with verl's ``load_extern_object``), or ``None`` with
            ``fn`` given directly.
        name: function name in that file.
        fn: the callable itself (instead of path/name).
        seed: grader seed.
        kwargs: extra keyword arguments passed on every call.
    """

    def __init__(self, path: str | None = None, name: str = "compute_score", *, fn=None, seed: int = 0,
                 kwargs: Mapping[str, Any] | None = None):
        if fn is None:
            if not path:
                raise ValueError("FunctionGrader needs path (+ name) of a Python file, or fn")
            from verl.utils.import_utils import load_extern_object

            fn = load_extern_object(module_path=path, object_name=name)
        if not callable(fn):
            raise TypeError(f"{path}:{name} is not callable")
        self.fn = fn
        # a function object is named by its module and qualified name, as a file is by its path and object name
        self.path = path if path else getattr(fn, "__module__", None) or "<unknown module>"
        self.fn_name = name if path else getattr(fn, "__qualname__", repr(fn))
        self.seed = int(seed)
        self.kwargs = dict(kwargs or {})
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = repr(fn)
        self._source_hash = hashlib.sha256(source.encode()).hexdigest()[:16]

    @property
    def deterministic(self) -> bool:
        """False: nothing is known about the function's randomness."""
        return False

    @property
    def identity(self) -> dict:
        """``{name: "function:<path>:<name>", model: None, temperature: None, template_hash: sha of the source}``."""
        return {"name": f"function:{self.path}:{self.fn_name}", "model": None, "temperature": None,
                "template_hash": self._source_hash}

    async def _one(self, item: GradingItem, scoring_index: int) -> GradeResult:
        question = item.prompt if item.prompt is not None else (item.rubric.question if item.rubric else "")
        seed = verdict_seed(self.seed, scoring_index, question, item.response, -1, "")
        ground_truth = item.ground_truth if item.ground_truth is not None else (
            item.rubric.to_row() if item.rubric is not None else None)
        kwargs = dict(data_source=item.data_source, solution_str=item.response, ground_truth=ground_truth,
                      extra_info=dict(item.extra_info or {}), scoring_index=int(scoring_index), seed=seed, **self.kwargs)
        try:
            if inspect.iscoroutinefunction(self.fn):
                out = await self.fn(**kwargs)
            else:
                out = await asyncio.get_running_loop().run_in_executor(None, lambda: self.fn(**kwargs))
        except Exception as exc:
            # a bare KeyError('criteria') from the user's code would name neither the function nor the input
            raise GradingError(
                f"{self.identity['name']} raised {type(exc).__name__}: {exc} in scoring {scoring_index} for "
                f"{describe_item(item)}; fix the function for this input"
            ) from exc
        verdicts: tuple[Verdict, ...] = ()
        if isinstance(out, Mapping):
            if "score" not in out:
                raise GradingError(f"{self.identity['name']} returned a dict without 'score': {sorted(out)}")
            raw = out.get("verdicts") or ()
            verdicts = tuple(_as_verdict(v) for v in raw)
            out = out["score"]
        if isinstance(out, bool):
            raise GradingError(f"{self.identity['name']} returned {out!r} for {describe_item(item)}, expected a number "
                               "or {'score': ...}")
        try:
            score = float(out)
        except (TypeError, ValueError) as exc:
            raise GradingError(f"{self.identity['name']} returned {out!r} for {describe_item(item)}, expected a number "
                               "or {'score': ...}") from exc
        if not math.isfinite(score):
            # NaN or +-inf would reach verl's group normalisation and turn the whole group's advantages into NaN
            raise GradingError(
                f"{self.identity['name']} returned the non-finite score {score!r} in scoring {scoring_index} for "
                f"{describe_item(item)}; a reward must be a finite number: make the function return one (e.g. a floor "
                "such as 0.0 or -1.0 for an empty answer)"
            )
        return GradeResult(score=score, verdicts=verdicts, scoring_index=int(scoring_index), seed=self.seed)

    async def agrade(self, items: Sequence[GradingItem], *, scoring_index: int) -> list[GradeResult]:
        """Call the function once per item (concurrently); see the class docstring."""
        return list(await gather_or_cancel([self._one(item, scoring_index) for item in items]))

    async def aclose(self) -> None:
        return None


def describe_item(item: GradingItem) -> str:
    """A short name of a grading item for error messages: its row id (if known) and the start of its response."""
    extra = dict(item.extra_info or {})
    row = extra.get("id", extra.get("index"))
    if row is None and item.rubric is not None:
        row = item.rubric.id
    text = item.response if len(item.response) <= 80 else item.response[:80] + "..."
    return (f"row {row!r}, " if row is not None else "") + f"response {text!r}"


def _as_verdict(v) -> Verdict:
    if isinstance(v, Verdict):
        return v
    if isinstance(v, Mapping):
        return Verdict(str(v["outcome"]), str(v.get("source", "function")), v.get("p_yes"), v.get("raw"))
    if v is None or v == "unparsed":
        return Verdict("unparsed", "function")
    if isinstance(v, str):
        if v not in ("met", "unmet"):
            raise GradingError(f"unknown verdict {v!r}: use met / unmet / unparsed or True / False / None")
        return Verdict(v, "function")
    return Verdict("met" if bool(v) else "unmet", "function")


_JUDGE_KEYS = {
    "local_hf": {"model_path", "temperature", "batch_size", "max_question_tokens", "max_response_tokens"},
    "openai": {"base_url", "model", "api_key", "temperature", "max_tokens", "chat_template_kwargs", "max_concurrency",
               "timeout", "max_retries", "parse_retries", "max_unparsed_ratio", "max_response_tokens",
               "rate_limit_wait"},
}


def check_stochastic_judge(kind: str, temperature: Any) -> None:
    """Refuse a judge temperature at or below 0 for a ``local_hf`` / ``openai`` grader.

    SetGRPO calibrates a stochastic grader: the reference score r' is a second, independent scoring
    (docs/algorithm.md#2-jrsc). A judge at temperature 0 scores each response the same twice, so the conformal
    set is a point and SetGRPO silently becomes GRPO.

    Raises:
        ValueError: ``temperature`` <= 0, naming the key (``reward.reward_kwargs.grader.temperature``, the command
            line's ``--judge-temperature``) and the fix.
    """
    if kind in _JUDGE_KEYS and temperature is not None and float(temperature) <= 0:
        raise ValueError(
            f"grader temperature {temperature} (reward.reward_kwargs.grader.temperature, --judge-temperature): "
            "SetGRPO calibrates a stochastic grader, and a judge at temperature <= 0 scores every response the same "
            "twice, so the conformal set is a point and SetGRPO becomes GRPO; use a temperature > 0 (default 1.0)")


def check_stochastic_grader(config: Mapping[str, Any]) -> None:
    """Refuse a grader config that scores every response the same way each time, for a run that reads a second
    scoring (SetGRPO's calibration, its online monitor, the reliability variant).

    The reference score r' must be an independent second scoring (docs/algorithm.md#2-jrsc). A ``rules`` grader
    alone, a ``noisy`` grader with ``flip_prob`` 0 over such a grader, or a judge at temperature <= 0
    (:func:`check_stochastic_judge`) gives r' = r: the conformal set is a point, the monitor sees no reversal and
    reliability weights are all 1, so SetGRPO silently becomes GRPO. A ``function`` grader is the user's to make
    random (it receives the scoring's seed), so it is not refused here.

    Args:
        config: a grader mapping as :func:`build_grader` takes it (``reward.reward_kwargs.grader``).

    Raises:
        ValueError: naming the grader, the key (``reward.reward_kwargs.grader``; the command line's ``--judge rules``
            without ``--flip-prob``) and the fix.
    """
    base, wrapped = config, False
    while isinstance(base, Mapping) and base.get("type") == "noisy":  # flips at a positive rate make it random
        if float(base.get("flip_prob") or 0.0) > 0:
            return
        base, wrapped = base.get("base"), True
    if not isinstance(base, Mapping):
        return  # a malformed config is build_grader's to refuse, naming what is wrong
    check_stochastic_judge(str(base.get("type")), base.get("temperature"))
    if base.get("type") == "rules":
        what = "a noisy grader with flip_prob 0 over a rules grader" if wrapped else "a rules grader"
        raise ValueError(
            f"reward.reward_kwargs.grader is {what}, which scores every response the same way twice: SetGRPO reads "
            "a second, independent scoring (the reference r'), so its conformal set would be a point, its monitor "
            "would see no reversal and SetGRPO would become GRPO; give the flips a rate, {type: noisy, flip_prob: "
            "0.06, base: {type: rules}} (the command line's --flip-prob > 0), use a judge at temperature > 0, train "
            "with algorithm.adv_estimator=grpo, or, training with a record, set algorithm.setgrpo.monitor.enable=false "
            "so that nothing reads a second scoring")


def build_grader(config: Mapping[str, Any] | None):
    """Build a grader from a plain mapping (e.g. verl's ``reward.reward_kwargs.grader``).

    Keys: ``type`` (``local_hf`` | ``openai`` | ``function`` | ``rules`` | ``noisy``) and ``seed`` (default 0), plus
      * ``local_hf``: ``model_path`` (null = embedded SmolLM2-135M-Instruct), ``temperature`` (1.0),
        ``batch_size``, ``max_question_tokens``, ``max_response_tokens`` (see :class:`LocalHFJudge`);
      * ``openai``: ``base_url``, ``model`` (required), ``api_key``, ``temperature``, ``max_tokens`` (token budget
        per verdict; raise it for a reasoning judge), ``chat_template_kwargs`` (e.g. ``{enable_thinking: false}``),
        ``max_concurrency``, ``timeout``, ``max_retries``, ``parse_retries``, ``rate_limit_wait``,
        ``max_response_tokens`` (responses cut to fit the judge's context; see :class:`OpenAIJudge`) and
        ``max_unparsed_ratio`` (default 0: any unparsed verdict stops; see :class:`RubricGrader`);
      * ``function``: ``path``, ``name`` (default ``compute_score``), ``kwargs``;
      * ``rules``: no judge (every criterion must carry a rule);
      * ``noisy``: ``flip_prob`` (required, in [0, 1)) and ``base`` (required: the config of the grader whose
        verdicts are flipped, e.g. ``{type: rules}``); ``seed`` seeds the flips (:class:`~.noisy.NoisyGrader`,
        docs/validation.md#noisy-grader).

    Raises:
        ValueError: missing ``type``, unknown type or unknown / missing key (named); a judge temperature <= 0
            (:func:`check_stochastic_judge`).
    """
    if not config or "type" not in config:
        raise ValueError(
            "grader config needs a 'type': local_hf (embedded SmolLM2 judge), openai (OpenAI-compatible server), "
            "function (path + name), rules (rule criteria only) or noisy (flip_prob + base)"
        )
    cfg = {k: v for k, v in dict(config).items()}
    if "response" in cfg:
        raise ValueError("the grader key 'response' (what of a response is graded) is applied by DualScorer, which "
                         "reads it from the grader mapping: pass the mapping to DualScorer (or grade the chosen text "
                         "yourself with setgrpo_verl.grading.answers.graded_text)")
    kind = cfg.pop("type")
    seed = int(cfg.pop("seed", 0))
    if kind == "noisy":
        from .noisy import NoisyGrader

        base, flip_prob = _noisy_parts(cfg)
        return NoisyGrader(build_grader(base), flip_prob=flip_prob, seed=seed)
    if kind == "function":
        unknown = set(cfg) - {"path", "name", "kwargs"}
        if unknown:
            raise ValueError(f"unknown keys for a function grader: {sorted(unknown)} (allowed: path, name, kwargs)")
        return FunctionGrader(cfg.get("path"), cfg.get("name") or "compute_score", seed=seed,
                              kwargs=dict(cfg.get("kwargs") or {}))
    if kind == "rules":
        if cfg:
            raise ValueError(f"a rules grader takes only 'seed', got {sorted(cfg)}")
        return RubricGrader(None, seed=seed)
    if kind not in _JUDGE_KEYS:
        raise ValueError(f"unknown grader type {kind!r}: use local_hf, openai, function, rules or noisy")
    if kind == "openai" and "on_unparsed" in cfg:
        raise ValueError("the openai grader's on_unparsed was replaced by max_unparsed_ratio (default 0: any unparsed "
                         "verdict stops grading, docs/grading.md#unparsed-verdicts); remove on_unparsed")
    unknown = set(cfg) - _JUDGE_KEYS[kind]
    if unknown:
        raise ValueError(f"unknown keys for a {kind} grader: {sorted(unknown)} (allowed: {sorted(_JUDGE_KEYS[kind])})")
    check_stochastic_judge(kind, cfg.get("temperature"))
    if kind == "openai":
        missing = [k for k in ("base_url", "model") if not cfg.get(k)]
        if missing:
            raise ValueError(f"an openai grader needs {missing} (e.g. base_url=http://127.0.0.1:8000/v1)")
        ratio = cfg.pop("max_unparsed_ratio", 0.0)
        return RubricGrader(OpenAIJudge(**cfg), seed=seed, max_unparsed_ratio=ratio)
    return RubricGrader(LocalHFJudge(**cfg), seed=seed)


def grader_identity(config: Mapping[str, Any] | None) -> dict:
    """The identity ``{name, model, temperature, template_hash}`` that :func:`build_grader` ``(config)`` would
    report, computed WITHOUT building it (no model load, no connection): for the trainer's calibration record.

    The ``response`` key (:mod:`.answers`) is read here, as :class:`~.dual.DualScorer` reads it: a non-default part
    enters ``template_hash``, so the identity equals ``DualScorer(config).identity``.

    Raises:
        ValueError: as :func:`build_grader` for a bad config; a ``response`` other than answer / full.
    """
    if not config or "type" not in config:
        build_grader(config)  # raises the explanatory error
    cfg, part = split_response_part(config)
    return with_response_part(_identity(cfg), part)


def _identity(config: Mapping[str, Any]) -> dict:
    """:func:`grader_identity` of a grader mapping without the ``response`` key."""
    if "type" not in config or "response" in config:
        build_grader(config)  # raises the explanatory error
    cfg = dict(config)
    kind = cfg.pop("type")
    seed = int(cfg.pop("seed", 0))
    if kind == "noisy":
        from .noisy import noisy_identity

        base, flip_prob = _noisy_parts(cfg)
        return noisy_identity(_identity(base), flip_prob, seed)
    if kind in ("function", "rules"):
        return build_grader(config).identity
    if kind not in _JUDGE_KEYS or set(cfg) - _JUDGE_KEYS[kind]:
        build_grader(config)  # raises the explanatory error
    check_stochastic_judge(kind, cfg.get("temperature"))
    judge_cls = OpenAIJudge if kind == "openai" else LocalHFJudge
    defaults = {k: p.default for k, p in inspect.signature(judge_cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    ratio = check_unparsed_ratio(cfg.pop("max_unparsed_ratio", 0.0))
    ident = judge_cls.identity_for(**{**defaults, **cfg})
    ident["name"] = f"rubric+{ident['name']}"
    return with_unparsed_policy(ident, ratio)


def _noisy_parts(cfg: Mapping[str, Any]) -> tuple[dict, float]:
    """``(base config, flip_prob)`` of a noisy grader's keys (without ``type`` and ``seed``).

    Raises:
        ValueError: unknown keys, a missing ``flip_prob`` or ``base``, or a ``base`` that is not a grader mapping.
    """
    unknown = set(cfg) - {"flip_prob", "base"}
    if unknown:
        raise ValueError(f"unknown keys for a noisy grader: {sorted(unknown)} (allowed: flip_prob, base, seed)")
    missing = [k for k in ("flip_prob", "base") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"a noisy grader needs {missing}, e.g. {{type: noisy, flip_prob: 0.1, seed: 0, "
                         "base: {type: rules}}")
    base = cfg["base"]
    if not isinstance(base, Mapping) or "type" not in base:
        raise ValueError(f"a noisy grader's base must be a grader config with a 'type', got {base!r}")
    from .noisy import check_flip_prob

    return dict(base), check_flip_prob(cfg["flip_prob"])


def as_rubric(rubric: Rubric | Mapping | str) -> Rubric:
    """A :class:`Rubric` from a Rubric, a RubricHub dict or its JSON string."""
    return rubric if isinstance(rubric, Rubric) else Rubric.from_row(rubric)
