"""RubricHub_v1 rows as released, mapped onto our rubric layout (docs/grading.md#rubric-rows).

The release (one parquet/JSONL file per domain) has no ``question`` and no ``id``. A row carries::

    {"data_source": "Instruction_Following",
     "prompt": [{"role": "system", ...}, {"role": "user", "content": "Describe a lighthouse in two paragraphs."}],
     "Rubrics": [{"criterion": "paragraphs:two", "points": 10,
                  "tags": {"verifier": "rule", "function": "ParagraphBasicChecker",
                           "parameters": {"num_paragraphs": 2, "keyword": null}}},
                 {"criterion": "The description mentions the lamp.", "points": 5, "tags": {"verifier": "llm"}}],
     "reward_model": {"style": "rubric", "ground_truth": "", "rubrics": [...same criteria...]},
     "extra_info": {...}}

:func:`release_row` turns such a row into ``{question, id, prompt, rubrics}``:

* the user turn of ``prompt`` becomes the question (what the judge reads); the whole ``prompt`` (with a system turn)
  is kept for the policy's chat;
* ``Rubrics`` or else ``reward_model.rubrics`` supply the criteria (when both are present they must agree);
* a missing id becomes ``rubrichub-<16 hex digits>``, the sha256 of the prompt messages and the criteria (null
  fields left out), so the same row gets the same id in every file, JSONL or parquet, and every run.

A criterion's ``tags`` select its verifier (:func:`rule_from_tags`): ``verifier: llm`` (or no ``verifier``) is judged;
``verifier: rule`` names a checker function, which runs as the equivalent if-verifiable checker
(:data:`SUPPORTED_FUNCTIONS`); a function without one is refused, naming it and listing the supported ones -- a rule
criterion never goes to the judge.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from typing import Any, Mapping

from .rules import registry

__all__ = ["EQUIVALENT_FUNCTIONS", "is_release_row", "release_row", "rule_from_tags", "supported_functions"]

#: RubricHub rule functions whose name is not an if-verifiable class name, with the equivalent if-verifiable check:
#: ``function -> (rule id, fixed kwargs)``. A parameter that the function fixes must, when the row gives it, equal
#: the fixed value. ``ParagraphBasicChecker`` (exactly 2 paragraphs separated by ``***``) is IFEval's
#: ``length_constraints:number_paragraphs`` with ``num_paragraphs=2`` (same split on ``***``, same empty-paragraph
#: rule).
EQUIVALENT_FUNCTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "ParagraphBasicChecker": ("ifeval:length_constraints:number_paragraphs", {"num_paragraphs": 2}),
}


@functools.lru_cache(maxsize=1)
def supported_functions() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every RubricHub rule function we run: ``function -> (rule id, fixed kwargs)``.

    An if-verifiable checker class name (IFBench and IFEval; the two share no class name) maps to its instruction
    id; :data:`EQUIVALENT_FUNCTIONS` adds the equivalents under other names."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for benchmark in ("ifbench", "ifeval"):
        for instruction, cls in registry(benchmark).items():
            out.setdefault(cls.__name__, (f"{benchmark}:{instruction}", {}))
    out.update(EQUIVALENT_FUNCTIONS)
    return out


def _plain_number(value: Any) -> Any:
    """A float that is an integer (parquet stores nullable integer columns as floats) as an int."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def rule_from_tags(tags: Any) -> tuple[str, dict[str, Any]] | None:
    """The rule ``(id, kwargs)`` a criterion's RubricHub ``tags`` select, or ``None`` for a judged criterion
    (docs/grading.md#rubric-rows).

    ``None``-valued parameters are dropped (the release stores the union of all functions' parameters, unused ones
    null); integral floats become ints.

    Raises:
        ValueError: ``tags`` is not a mapping, the verifier is neither ``rule`` nor ``llm``, a rule names no
            function or one without an equivalent check here (the message lists the supported functions), its
            parameters are not a mapping, or a parameter the equivalent check fixes has another value.
    """
    if tags is None:
        return None
    if not isinstance(tags, Mapping):
        raise ValueError(f"tags must be a mapping such as {{'verifier': 'llm'}}, got {tags!r}")
    verifier = tags.get("verifier")
    if verifier is None or verifier == "llm":
        return None
    if verifier != "rule":
        raise ValueError(f"tags.verifier is {verifier!r}; RubricHub criteria use 'rule' (checked by code) or 'llm' "
                         "(judged)")
    function = tags.get("function")
    supported = supported_functions()
    if function not in supported:
        raise ValueError(
            f"tags.function {function!r} has no equivalent rule checker here, so this rule criterion cannot be "
            "checked by code (it is never sent to the judge instead); supported functions: "
            f"{', '.join(sorted(supported))}. "
            "Drop the criterion, or rewrite it as a judged criterion (tags.verifier 'llm')"
        )
    params = tags.get("parameters") or {}
    if hasattr(params, "items") and not isinstance(params, Mapping):  # pragma: no cover - exotic mapping types
        params = dict(params.items())
    if not isinstance(params, Mapping):
        raise ValueError(f"tags.parameters of {function!r} must be a mapping, got {type(params).__name__}")
    rule_id, fixed = supported[function]
    kwargs = {str(k): _plain_number(v) for k, v in params.items() if v is not None}
    for key, value in fixed.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"tags.parameters.{key}={kwargs[key]!r}, but {function!r} checks {key}={value!r} "
                             f"(as {rule_id!r})")
        kwargs[key] = value
    return rule_id, kwargs


def is_release_row(row: Mapping[str, Any]) -> bool:
    """True for a row in the RubricHub_v1 release layout: no ``rubrics`` but ``Rubrics`` or
    ``reward_model.rubrics``, or no ``question`` but a chat ``prompt``."""
    reward_model = row.get("reward_model")
    has_release_rubrics = "Rubrics" in row or (isinstance(reward_model, Mapping) and "rubrics" in reward_model)
    return ("rubrics" not in row and has_release_rubrics) or ("question" not in row and "prompt" in row)


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes, Mapping)) else value


def release_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A RubricHub_v1 release row as ``{question, id, prompt, rubrics, ...}`` (module docstring,
    docs/grading.md#rubric-rows); other fields are kept. A row already in our layout comes back unchanged (as a new
    dict).

    Raises:
        ValueError: ``prompt`` has no user turn or several (give a ``question`` then), or ``Rubrics`` and
            ``reward_model.rubrics`` disagree. The field names are in the message; :meth:`Rubric.from_row` adds
            the location.
    """
    out = dict(row)
    if not is_release_row(row):
        return out
    if "rubrics" not in out:
        top = _as_list(row.get("Rubrics"))
        reward_model = row.get("reward_model")
        nested = _as_list(reward_model.get("rubrics")) if isinstance(reward_model, Mapping) else None
        if top is not None and nested is not None and _canonical(top) != _canonical(nested):
            raise ValueError("Rubrics and reward_model.rubrics differ; keep one of them (or make them equal)")
        out["rubrics"] = top if top is not None else nested
        out.pop("Rubrics", None)
    if "question" not in out:
        prompt = _as_list(row.get("prompt"))
        if isinstance(prompt, list):
            users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
            if len(users) != 1:
                raise ValueError(f"prompt has {len(users)} user turns; the question the judge reads is the single user "
                                 "turn, so give the row a 'question' field")
            out["question"] = users[0].get("content")
    if out.get("id") is None:
        payload = _canonical([_as_list(out.get("prompt")) or out.get("question"), out.get("rubrics")])
        out["id"] = "rubrichub-" + hashlib.sha256(payload.encode()).hexdigest()[:16]
    return out


def _canonical(value: Any) -> str:
    """JSON text of a (possibly numpy-holding) value with sorted keys and without null mapping values, for comparing
    and hashing rows: a parquet file fills every struct field missing in a row with null, so the same row read from
    JSONL and from parquet compares and hashes alike."""
    def plain(v):
        v = _as_list(v)
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items() if x is not None}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v.item() if hasattr(v, "item") else v

    return json.dumps(plain(value), sort_keys=True, ensure_ascii=False, default=str)
