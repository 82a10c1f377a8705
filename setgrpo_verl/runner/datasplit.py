"""The data split of a run directory (docs/cli.md#run-directory): rubric rows -> disjoint calibration and training
prompts as verl RL rows, written once as ``data/{calibration,train}.parquet`` with their settings and prompt ids in
``data/split.json``, and the checks that a later command uses that same split.

Nothing here runs verl.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

from .lifecycle import dir_state
from ..atomic import write_atomic
from ..rundir import LaunchError, mark_complete

__all__ = ["DEFAULT_DATA", "SPLIT_FILE", "check_split_flags", "existing_split", "split_drop_line", "split_data",
           "split_matches", "write_data"]

#: The embedded default data of :func:`split_data` without ``data``: ``ifbench`` (the IFBench prompts) or
#: ``validation`` (under ``rules_only``: the composite validation rubrics, docs/validation.md#validation-rubrics).
DEFAULT_DATA = ("ifbench", "validation")


def _rubric_rows(data: str | os.PathLike | None, rules_only: bool = False,
                 default_data: str = "ifbench", duplicate_criteria: str = "error") -> tuple[list[dict], str]:
    from ..grading import load_ifbench_rubrics, load_validation_rubrics, read_rubric_rows

    if default_data not in DEFAULT_DATA:
        raise LaunchError(f"default data {default_data!r}: use one of {', '.join(DEFAULT_DATA)}")
    if data is None:
        if rules_only and default_data == "validation":
            return load_validation_rubrics(), "the embedded composite validation rubrics (rule criteria only)"
        if rules_only:
            return load_ifbench_rubrics(rules_only=True), "the embedded IFBench rubric conversion (rule criteria only)"
        return load_ifbench_rubrics(), "the embedded IFBench rubric conversion"
    path = Path(data).expanduser()
    if not path.is_file():
        raise LaunchError(f"--data {data}: no such file; pass a RubricHub-format .jsonl/.json/.parquet file (rows "
                          "with id, question, rubrics) or omit --data for the embedded IFBench prompts")
    try:
        return read_rubric_rows(path, duplicate_criteria=duplicate_criteria), str(path)
    except (ValueError, OSError) as exc:  # the message names the file, line, row, criterion and field
        raise LaunchError(f"--data: {exc}") from None


def split_data(
    *,
    data: str | os.PathLike | None,
    model_path: str | os.PathLike,
    max_prompt_length: int,
    calibration_prompts: int,
    seed: int,
    rules_only: bool = False,
    default_data: str = "ifbench",
    duplicate_criteria: str = "error",
) -> dict[str, Any]:
    """Validate the rubric rows, drop overlong prompts, shuffle and split them into verl RL rows (nothing written).

    With ``rules_only`` (the ``rules`` grader) the embedded default is the IFBench rows with their rule criteria only,
    or with ``default_data="validation"`` (every command with ``--judge rules``) the composite validation rubrics
    (:func:`setgrpo_verl.grading.load_validation_rubrics`, docs/validation.md#validation-rubrics), and every
    criterion of a ``data`` file must carry a rule. Without ``rules_only`` the default is the IFBench rows with
    their judged criteria whatever ``default_data`` says.

    The first ``calibration_prompts`` rows of the ``seed``-shuffled file go to ``data/calibration.parquet``, the rest
    to ``data/train.parquet`` (disjoint, so calibration groups stay exchangeable with fresh ones and training never
    reuses them). Prompts whose chat-formatted length exceeds ``max_prompt_length`` tokens are dropped, as verl's
    ``data.filter_overlong_prompts`` would, but before the split so that the counts are exact.

    A prompt that appears more than once (the same id, or the same question text up to whitespace and case,
    :func:`setgrpo_verl.core.record.question_key`) is kept once, at its first row, so the two parts stay disjoint. A
    criterion listed twice in a ``data`` row stops the split, or with ``duplicate_criteria="keep_one"`` keeps its
    first copy (:func:`setgrpo_verl.grading.read_rubric_rows`).

    Returns:
        ``{"calibration": [rows], "train": [rows], "source": str, "duplicates": int (rows removed), "too_long":
        int (prompts dropped for exceeding ``max_prompt_length``), "settings": dict (the arguments)}`` for
        :func:`write_data`.

    Raises:
        LaunchError: unreadable file, an invalid row (the message names the row, criterion and field), a criterion
            without a rule under ``rules_only``, fewer usable prompts than ``calibration_prompts`` + 1, or
            ``default_data`` not in :data:`DEFAULT_DATA`.
    """
    rows, source = _rubric_rows(data, rules_only, default_data, duplicate_criteria)
    rubrics, duplicates = _checked_rubrics(rows, source, rules_only)
    kept = _fitting_rows(rubrics, model_path, max_prompt_length)
    if len(kept) <= calibration_prompts:
        bundled = data is None and rules_only and default_data == "validation"
        raise LaunchError(_too_few_prompts(source, len(kept), len(rubrics), max_prompt_length, calibration_prompts,
                                           bundled_validation=bundled))
    random.Random(seed).shuffle(kept)
    calibration, train = kept[:calibration_prompts], kept[calibration_prompts:]
    for split, part in (("calibration", calibration), ("train", train)):
        for i, row in enumerate(part):
            row["extra_info"] = {**row["extra_info"], "index": i, "split": split}
    settings = {"data": None if data is None else str(Path(data).expanduser().resolve()),
                "calibration_prompts": int(calibration_prompts), "seed": int(seed),
                "max_prompt_length": int(max_prompt_length), "rules_only": bool(rules_only),
                "default_data": None if data is not None else default_data}
    return {"calibration": calibration, "train": train, "source": source, "duplicates": duplicates,
            "too_long": len(rubrics) - len(kept), "settings": settings}


def _checked_rubrics(rows: Sequence[Mapping[str, Any]], source: str, rules_only: bool) -> tuple[list, int]:
    """The rows as rubrics, each prompt once (with how many duplicates were removed), after refusing a row without
    positive points or, under ``rules_only``, with a criterion that has no rule."""
    from ..grading import as_rubric, drop_duplicate_rows

    try:
        rubrics = [as_rubric(row) for row in rows]
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"{source}: {exc}; fix or remove that row") from None
    # a prompt that appears twice (same id, or same question text) would land in both parts of the split
    rubrics, duplicates = drop_duplicate_rows(rubrics)
    for rubric in rubrics:
        if not any(c.points > 0 for c in rubric.criteria):
            raise LaunchError(f"{source}: rubric row {rubric.id!r} has no criterion with positive points, so its score "
                              "(sum of met points / sum of positive points) is undefined; add one or remove the row")
        judged = [j for j, c in enumerate(rubric.criteria) if c.rule is None]
        if rules_only and judged:
            raise LaunchError(f"{source}: rubric row {rubric.id!r}, criterion {judged[0]} has no rule, but --judge rules "
                              "checks rule criteria only; give every criterion a rule or choose a judge")
    return rubrics, duplicates


def _fitting_rows(rubrics: Sequence[Any], model_path: str | os.PathLike, max_prompt_length: int) -> list[dict]:
    """The verl RL rows of ``rubrics`` whose chat-formatted prompt fits in ``max_prompt_length`` tokens of the
    model's tokenizer (verl's ``data.filter_overlong_prompts``, applied before the split)."""
    from transformers import AutoTokenizer

    from ..grading import rubrics_to_verl_rows

    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    kept = []
    for row in rubrics_to_verl_rows(rubrics):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= max_prompt_length:
            kept.append(row)
    return kept


def _too_few_prompts(source: str, kept: int, usable: int, max_prompt_length: int, calibration_prompts: int, *,
                     bundled_validation: bool) -> str:
    """The message for ``kept`` fitting prompts (of ``usable``) when calibration needs ``calibration_prompts`` and
    training one more, with the fixes that apply (``bundled_validation``: the embedded validation rubrics)."""
    more = "pass more prompts with --data"
    if bundled_validation:
        more += (f" (more validation rubrics, the embedded ones first: from the repository root, python "
                 f"scripts/make_validation_rubrics.py "
                 f"compose --rows {calibration_prompts + 500} --out rubrics.jsonl, then --data rubrics.jsonl)")
    # raising the prompt length helps only when prompts were dropped as too long and the file holds enough
    longer = "raise --max-prompt-length, " if kept < usable and usable > calibration_prompts else ""
    return (f"{source}: {kept} of {usable} prompts fit in {max_prompt_length} prompt tokens, "
            f"but calibration needs {calibration_prompts} and training at least one more; {longer}"
            f"lower --calib-groups or {more}")


#: The data split's settings file (what :func:`split_data` was called with), next to the parquet files.
SPLIT_FILE = "split.json"


def _split_ids(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(row["extra_info"]["id"]) for row in rows]


#: The parts of a data split: ``heldout`` (validation prompts disjoint from both others) only where a command
#: adds it (``setgrpo-verl compare``).
_PARTS = ("calibration", "train", "heldout")


def _parts(split: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(name for name in _PARTS if name in split)


def write_data(run_dir: str | os.PathLike, split: Mapping[str, Any]) -> dict[str, Path]:
    """Write :func:`split_data`'s rows as ``<run_dir>/data/{calibration,train}.parquet`` (and ``heldout.parquet``
    where the split has held-out prompts), its settings and prompt ids as ``data/split.json`` and then
    ``data/COMPLETE``; returns the parquet paths by part."""
    from ..grading import write_verl_parquet

    out = Path(run_dir) / "data"
    paths = {name: write_verl_parquet(split[name], out / f"{name}.parquet") for name in _parts(split)}
    meta = {**split.get("settings", {}), "source": split["source"], "duplicates_removed": split.get("duplicates", 0),
            "too_long_removed": split.get("too_long", 0),
            "ids": {name: _split_ids(split[name]) for name in _parts(split)}}
    write_atomic(out / SPLIT_FILE, json.dumps(meta, indent=1) + "\n")
    mark_complete(out)
    return paths


def split_drop_line(split: Mapping[str, Any]) -> str | None:
    """The console line that counts the prompts :func:`split_data` dropped for exceeding ``max_prompt_length``
    (also in ``split.json`` as ``too_long_removed``), with the flag that keeps them; None when none was dropped."""
    dropped = int(split.get("too_long", 0))
    if not dropped:
        return None
    total = dropped + sum(len(split[name]) for name in _parts(split))
    limit = split.get("settings", {}).get("max_prompt_length")
    return (f"[setgrpo-verl] data: dropped {dropped} of {total} prompts ({100 * dropped / total:.0f} %) whose chat-"
            f"formatted prompt exceeds --max-prompt-length {limit} tokens (data.max_prompt_length); raise "
            "--max-prompt-length to keep them")


def existing_split(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``data/split.json`` of a run directory whose ``data/`` is complete, or None when it has no finished data
    split (:func:`setgrpo_verl.runner.lifecycle.dir_state`).

    Raises:
        LaunchError: a complete ``data/`` without a readable ``split.json``.
    """
    data = Path(run_dir) / "data"
    if dir_state(data) != "complete":
        return None
    try:
        return json.loads((data / SPLIT_FILE).read_text())
    except (OSError, ValueError):
        raise LaunchError(f"{data} holds a data split without a readable {SPLIT_FILE}: pass --overwrite to split the "
                          "data again, or choose another --run-dir") from None


def split_matches(run_dir: str | os.PathLike, split: Mapping[str, Any]) -> bool | None:
    """Whether the run directory's finished data split holds exactly the prompts of ``split`` (the same ids of each
    part in the same order, and no other part); None when it has no finished split, False when its ``split.json`` is
    unreadable."""
    try:
        old = existing_split(run_dir)
    except LaunchError:
        return False
    if old is None:
        return None
    return old.get("ids") == {name: _split_ids(split[name]) for name in _parts(split)}


def check_split_flags(run_dir: str | os.PathLike, *, data: str | os.PathLike | None, calib_groups: int | None) -> None:
    """``train`` uses the split that ``calibrate`` wrote: ``--data`` / ``--calib-groups`` must name that split.

    Raises:
        LaunchError: a flag that differs from the run directory's ``data/split.json`` (both values named).
    """
    if data is None and calib_groups is None:
        return
    try:
        old = existing_split(run_dir) or {}
    except LaunchError:
        old = {}
    if not old:
        raise LaunchError(f"train uses the data split in {Path(run_dir) / 'data'}, which records no settings (no "
                          f"{SPLIT_FILE}), so --data / --calib-groups cannot be checked against it: drop them, or rerun "
                          f"`setgrpo-verl calibrate --run-dir {run_dir} --overwrite` with them")
    given = {"--data": (None if data is None else str(Path(data).expanduser().resolve()), old.get("data")),
             "--calib-groups": (calib_groups, old.get("calibration_prompts"))}
    for flag, (value, recorded) in given.items():
        if value is not None and value != recorded:
            raise LaunchError(f"train {flag} {value}: the run directory's data split was made with {flag} "
                              f"{recorded} ({Path(run_dir) / 'data' / SPLIT_FILE}), and train uses that split; drop "
                              f"{flag}, or rerun `setgrpo-verl calibrate --run-dir {run_dir} {flag} {value} "
                              "--overwrite`")
