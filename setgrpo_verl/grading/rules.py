"""Deterministic rule checkers for rubric criteria, backed by the ``if-verifiable`` package (offline).

A rule id is ``"<benchmark>:<instruction id>"`` with benchmark ``ifbench`` or ``ifeval``, e.g.
``"ifbench:count:keywords_multiple"``; its kwargs are those of the instruction in the benchmark data. The check
is IFBench's *strict* check (``if_verifiable.common.evaluate_instructions``, ``strict_pass``); a response that is
empty after stripping ``<think>`` blocks fails every rule.

Four IFBench instruction types need NLTK data packages (``punkt_tab``, ``stopwords``,
``averaged_perceptron_tagger_eng``) that cannot be downloaded offline: :data:`NLTK_DATA_RULES`. Where that data is
missing, checking such a rule raises :class:`~setgrpo_verl.grading.rubric.GradingError` (never a silent verdict);
the IFBench converter turns these instructions into judged criteria instead.

if-verifiable's IFBench module calls ``nltk.download`` at import for every one of those data packages that is not
installed; offline each call prints refusal lines and returns False. That import runs with ``nltk.download``
replaced by a function that downloads nothing and records the request (:func:`missing_nltk_data`), so start-up
is quiet; installed NLTK data is found and used as before.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
from typing import Any, Iterator, Mapping

from .types import GradingError, Rule

__all__ = ["NLTK_DATA_RULES", "UnknownRuleError", "check_rule", "missing_nltk_data", "registry", "rule_description",
           "validate_rule"]

#: IFBench instruction ids whose if-verifiable checker needs NLTK data (measured: 25 of the 335 instruction checks
#: on IFBench's sample outputs (``setgrpo_verl/data``) raise LookupError offline; the other 310 run).
NLTK_DATA_RULES = frozenset({"ratio:stop_words", "words:start_verb", "format:title_case", "words:words_position"})

_BENCHMARKS = ("ifbench", "ifeval")


_NLTK_DOWNLOADS_REFUSED: set[str] = set()


def missing_nltk_data() -> frozenset[str]:
    """NLTK data packages that if-verifiable asked to download at import in this process (none were downloaded)."""
    return frozenset(_NLTK_DOWNLOADS_REFUSED)


@contextlib.contextmanager
def _no_nltk_downloads() -> Iterator[None]:
    """Within the block, ``nltk.download(name, ...)`` records ``name`` and returns False without any network access."""
    import nltk

    def refuse(info_or_id=None, *args: Any, **kwargs: Any) -> bool:
        _NLTK_DOWNLOADS_REFUSED.add(str(info_or_id))
        return False

    original = nltk.download
    nltk.download = refuse
    try:
        yield
    finally:
        nltk.download = original


@functools.lru_cache(maxsize=None)
def registry(benchmark: str) -> dict:
    """if-verifiable's instruction registry of ``benchmark`` (``ifbench`` or ``ifeval``): instruction id -> checker
    class (imported without NLTK downloads)."""
    with _no_nltk_downloads():
        if benchmark == "ifbench":
            from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
        else:
            from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    return INSTRUCTION_DICT


class UnknownRuleError(ValueError):
    """A rule id that names no if-verifiable instruction (the message lists the closest known ids)."""


def _split(rule_id: str) -> tuple[str, str]:
    benchmark, sep, instruction = rule_id.partition(":")
    if not sep or benchmark not in _BENCHMARKS or not instruction:
        raise UnknownRuleError(
            f"unknown rule id {rule_id!r}: rule ids are '<benchmark>:<instruction id>' with benchmark in "
            f"{_BENCHMARKS}, e.g. 'ifbench:count:keywords_multiple'"
        )
    return benchmark, instruction


def validate_rule(rule: Rule) -> None:
    """Check a rule against the if-verifiable registry without running it.

    Raises:
        UnknownRuleError: ``rule.id`` is not a known if-verifiable instruction (the message suggests close ids).
        ValueError: its kwargs are incomplete (if-verifiable would otherwise draw random values for the missing
            ones) or not accepted by the instruction.
    """
    try:
        key = json.dumps(dict(rule.kwargs), sort_keys=True)
    except (TypeError, ValueError):  # kwargs that are not JSON values: check without the cache
        _checker(rule, "")
        return
    _validate_cached(rule.id, key)


@functools.lru_cache(maxsize=4096)
def _validate_cached(rule_id: str, kwargs_json: str) -> None:
    # rubric rows repeat the same few rules; the registry lookup builds a checker object, so cache the outcome
    _checker(Rule(rule_id, json.loads(kwargs_json)), "")


def _checker(rule: Rule, prompt: str):
    benchmark, instruction = _split(rule.id)
    instructions = registry(benchmark)
    if instruction not in instructions:
        close = difflib.get_close_matches(instruction, list(instructions), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(f'{benchmark}:{c}') for c in close)}?" if close else (
            f"; the known ids are listed in if_verifiable.{benchmark}.instructions_registry.INSTRUCTION_DICT")
        raise UnknownRuleError(f"rule {rule.id!r}: {instruction!r} is not an if-verifiable {benchmark} instruction id"
                               f"{hint}")
    checker = instructions[instruction](instruction)
    given = {k: v for k, v in rule.kwargs.items() if v is not None}
    try:
        description = checker.build_description(**given)
    except TypeError as exc:
        raise ValueError(f"rule {rule.id!r}: bad kwargs {sorted(given)}: {exc}") from exc
    args = checker.get_instruction_args() or {}
    missing = sorted(k for k in args if k != "prompt" and k not in given)
    if missing:  # if-verifiable would silently draw random values for them
        raise ValueError(f"rule {rule.id!r} lacks kwargs {missing} (the checker would pick random values); give them")
    if "prompt" in args:
        description = checker.build_description(prompt=prompt)
    return checker, description


def rule_description(rule: Rule, prompt: str = "") -> str:
    """The instruction text the checker verifies (if-verifiable's ``build_description``), e.g. for criterion text."""
    return str(_checker(rule, prompt)[1])


def check_rule(rule: Rule, prompt: str, response: str) -> bool:
    """Check one rule criterion on a response (IFBench strict mode).

    Args:
        rule: the rule (id + kwargs).
        prompt: the prompt the response answers (some instructions, e.g. repeat-the-prompt, need it).
        response: the response text.

    Returns:
        ``True`` if the response follows the instruction.

    Raises:
        ValueError: unknown rule id or missing kwargs.
        GradingError: the checker needs NLTK data that is not installed (see :data:`NLTK_DATA_RULES`) or failed
            on this input; the message names the rule.
    """
    from if_verifiable.common import evaluate_instructions

    _checker(rule, prompt)  # validates id and kwargs
    benchmark, instruction = _split(rule.id)
    instructions = registry(benchmark)
    kwargs: Mapping[str, Any] = dict(rule.kwargs)
    try:
        results, _ = evaluate_instructions(response, [instruction], [kwargs], prompt, instructions)
    except LookupError as exc:
        raise GradingError(
            f"rule {rule.id!r} needs NLTK data that is not installed ({str(exc).strip().splitlines()[1:2]}); install "
            "it with nltk.download(...) or express this criterion as a judged criterion (drop its 'rule')"
        ) from exc
    except Exception as exc:  # a checker bug on this input: name it instead of guessing a verdict
        raise GradingError(f"rule {rule.id!r} with kwargs {dict(kwargs)} failed: {type(exc).__name__}: {exc}") from exc
    return bool(results and results[0].strict_pass)
