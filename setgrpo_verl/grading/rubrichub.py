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

verl's RL layout (what verl's preprocessing scripts and our own converters write) carries the rubric in
``reward_model.ground_truth`` instead::

    {"data_source": "rubrichub", "prompt": [{"role": "system", ...}, {"role": "user", ...}],
     "reward_model": {"style": "rubric", "ground_truth": "<a RubricHub row, or its criteria list, as JSON>"},
     "extra_info": {"index": 3, "id": "r-17", "split": "train"}}

:func:`verl_row` turns such a row into ``{question, id, prompt, rubrics}``: the question is the ground truth's own
``question``, else the last user turn of ``prompt`` (the whole ``prompt``, a system turn included, is kept for the
policy's chat); the id is the row's own (``extra_info.id``, the ground truth's ``id`` or the row's ``id``), else
``<data_source>:<split>:<extra_info.index>`` (the index restarts at 0 in every split, so it is qualified by both),
else none (:meth:`~.rubric.Rubric.from_row` then derives it from the question). A ground truth that is not a
rubric (a math answer, an empty string) is refused.

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

__all__ = ["EQUIVALENT_FUNCTIONS", "is_release_row", "is_verl_row", "release_row", "rule_from_tags",
           "supported_functions", "verl_row"]

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


def is_verl_row(row: Mapping[str, Any]) -> bool:
    """True for a row in verl's RL layout: ``reward_model.ground_truth`` present, and no criteria anywhere else
    (``rubrics``, ``Rubrics``, ``reward_model.rubrics``: those make it a row of ours or of the RubricHub release)."""
    reward_model = row.get("reward_model")
    return (isinstance(reward_model, Mapping) and "ground_truth" in reward_model and "rubrics" not in reward_model
            and "rubrics" not in row and "Rubrics" not in row)


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes, Mapping)) else value


def _ground_truth_rubric(truth: Any) -> dict[str, Any]:
    """A verl row's ``reward_model.ground_truth`` as a rubric row: a mapping with ``rubrics`` (or ``Rubrics``), or a
    bare list of criteria, either possibly as JSON text.

    Raises:
        ValueError: the ground truth is anything else (the message quotes its start).
    """
    value = _as_list(truth)
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    value = _as_list(value)
    if isinstance(value, Mapping) and ("rubrics" in value or "Rubrics" in value):
        out = dict(value)
        if "rubrics" not in out:
            out["rubrics"] = out.pop("Rubrics")
        return out
    if isinstance(value, list) and value:
        return {"rubrics": value}
    shown = repr(truth if not isinstance(truth, (str, bytes)) or len(truth) <= 80 else truth[:80] + "...")
    raise ValueError(
        f"reward_model.ground_truth is not a rubric ({type(truth).__name__} {shown}); SetGRPO grades every response "
        "against a rubric, so ground_truth holds a RubricHub row {question, id, rubrics} or its list of "
        "{criterion, points} criteria (as JSON text or as a struct); write rows with "
        "setgrpo_verl.grading.convert_rubric_file, or leave this row out")


def _last_user_turn(prompt: Any) -> str | None:
    """The content of the last user message of a chat ``prompt``, or None when it has none."""
    turns = _as_list(prompt)
    if not isinstance(turns, list):
        return None
    users = [m for m in turns if isinstance(m, Mapping) and m.get("role") == "user"]
    return users[-1].get("content") if users else None


def _verl_row_id(row: Mapping[str, Any], rubric: Mapping[str, Any]) -> Any:
    """A verl row's own id (``extra_info.id``, the rubric's ``id``, the row's ``id``), else its qualified
    ``extra_info.index``, else None (module docstring)."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
    for value in (extra.get("id"), rubric.get("id"), row.get("id")):
        if value is not None:
            return value
    index = _plain_number(extra.get("index"))
    if index is None:
        return None
    return f"{row.get('data_source') or 'verl'}:{extra.get('split') or 'data'}:{index}"


def verl_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A verl RL row (:func:`is_verl_row`) as ``{question, id, prompt, rubrics, ...}`` (module docstring,
    docs/grading.md#rubric-rows); the ground truth's other fields are kept.

    Raises:
        ValueError: the ground truth is not a rubric, or the row has neither a question in its ground truth nor a
            user turn in ``prompt``. :meth:`Rubric.from_row` adds the location.
    """
    out = _ground_truth_rubric(row["reward_model"]["ground_truth"])
    if out.get("question") is None:
        question = _last_user_turn(row.get("prompt"))
        if question is None:
            raise ValueError("prompt has no user turn and reward_model.ground_truth no question, so there is no "
                             "question for the judge to read; give the prompt a user turn")
        out["question"] = question
    if row.get("prompt") is not None:
        out["prompt"] = _as_list(row["prompt"])
    out["id"] = _verl_row_id(row, out)
    if out["id"] is None:
        out.pop("id")
    return out


def release_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A RubricHub_v1 release row, or a verl RL row (:func:`verl_row`), as ``{question, id, prompt, rubrics, ...}``
    (module docstring, docs/grading.md#rubric-rows); other fields are kept. A row already in our layout comes back
    unchanged (as a new dict).

    Raises:
        ValueError: ``prompt`` has no user turn or several (give a ``question`` then), ``Rubrics`` and
            ``reward_model.rubrics`` disagree, or a verl row's ground truth is not a rubric. The field names are in
            the message; :meth:`Rubric.from_row` adds the location.
    """
    if is_verl_row(row):
        return verl_row(row)
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
