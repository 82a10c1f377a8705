"""Prompt identity of verl RL rows: which prompt a row is, for the record and the calibration/training overlap check.

A leaf module (no verl import). A row's identity is ``(id, question, rubric)``: from the rubric that our converters
put in ``reward_model.ground_truth`` (a RubricHub row as JSON, docs/verl_integration.md), else from
``extra_info.id`` and the last user turn of the prompt. The positional ``extra_info.index`` is never an id (it
restarts at 0 in every split). :func:`setgrpo_verl.core.record.prompt_fingerprint` turns an identity into the record's
entry (docs/record.md#fields).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["calibration_fingerprints", "check_calibration_disjoint", "check_start_pilot", "prompt_fingerprints",
           "prompt_identity", "read_prompt_identities", "read_prompt_rubrics"]


def _as_mapping(value: Any) -> Mapping | None:
    if isinstance(value, Mapping):
        return value
    if isinstance(value, (str, bytes)):
        text = value.strip()
        if text[:1] in ("{", b"{"):
            try:
                value = json.loads(text)
            except ValueError:
                return None
            return value if isinstance(value, Mapping) else None
    return None


def _last_user_turn(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    try:
        turns = list(prompt)
    except TypeError:
        return None
    for turn in reversed(turns):
        if isinstance(turn, Mapping) and turn.get("role") == "user":
            return str(turn.get("content"))
    return None


def prompt_identity(reward_model: Any, extra_info: Any, prompt: Any) -> tuple[str | None, str | None, Any]:
    """``(id, question, rubric)`` of one verl RL row (its ``reward_model``, ``extra_info`` and ``prompt`` columns).

    ``id``: ``extra_info.id``, else the rubric row's ``id``, else None. ``question``: the rubric row's
    ``question``, else the last user turn of ``prompt``. ``rubric``: the rubric row's ``rubrics`` list, else the
    raw ground truth.
    """
    reward_model = reward_model if isinstance(reward_model, Mapping) else {}
    extra_info = extra_info if isinstance(extra_info, Mapping) else {}
    truth = reward_model.get("ground_truth")
    row = _as_mapping(truth)
    rubric_row = row is not None and "rubrics" in row
    prompt_id = extra_info.get("id")
    if prompt_id is None and rubric_row:
        prompt_id = row.get("id")
    question = row.get("question") if rubric_row else None
    if question is None:
        question = _last_user_turn(prompt)
    rubric = row.get("rubrics") if rubric_row else truth
    if hasattr(rubric, "tolist"):  # parquet lists arrive as numpy arrays
        rubric = rubric.tolist()
    return (None if prompt_id is None else str(prompt_id)), question, rubric


def read_prompt_identities(files: str | os.PathLike | Sequence[str | os.PathLike], *,
                           prompt_key: str = "prompt") -> Iterable[tuple[str | None, str | None]]:
    """``(id, question)`` of every row of verl RL parquet file(s) (missing files are skipped: verl reports them).

    Raises:
        ValueError: a file that is not readable parquet (the message names it).
    """
    for prompt_id, question, _ in _read_identities(files, prompt_key):
        yield prompt_id, question


def read_prompt_rubrics(files: str | os.PathLike | Sequence[str | os.PathLike], *,
                        prompt_key: str = "prompt") -> Iterable[tuple[str | None, str | None, Any]]:
    """:func:`prompt_identity` ``(id, question, rubric)`` of every row of verl RL parquet file(s) (missing files are
    skipped), for reading a calibration's rubrics back (docs/record.md#the-judges-regime).

    Raises:
        ValueError: a file that is not readable parquet (the message names it).
    """
    return _read_identities(files, prompt_key)


def prompt_fingerprints(rows: Iterable[Mapping[str, Any]], *, prompt_key: str = "prompt") -> list[dict[str, str]]:
    """The record's :func:`setgrpo_verl.core.record.prompt_fingerprint` of each verl RL row (a mapping with
    ``reward_model``, ``extra_info`` and ``prompt_key``), as the calibration computes them (docs/record.md#fields)."""
    from setgrpo_verl.core.record import prompt_fingerprint

    return [prompt_fingerprint(*prompt_identity(r.get("reward_model"), r.get("extra_info"), r.get(prompt_key)))
            for r in rows]


def calibration_fingerprints(files: str | os.PathLike | Sequence[str | os.PathLike], *,
                             prompt_key: str = "prompt") -> list[dict[str, str]]:
    """:func:`prompt_fingerprints` of every row of verl RL parquet file(s) (missing files are skipped).

    Raises:
        ValueError: a file that is not readable parquet (the message names it).
    """
    from setgrpo_verl.core.record import prompt_fingerprint

    return [prompt_fingerprint(*identity) for identity in _read_identities(files, prompt_key)]


def _read_identities(files: Any, prompt_key: str) -> Iterable[tuple[str | None, str | None, Any]]:
    """:func:`prompt_identity` of every row of the readable files (arguments: :func:`read_prompt_identities`)."""
    import pyarrow.parquet as pq

    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    for path in paths:
        path = os.path.expanduser(os.fspath(path))
        if not os.path.isfile(path):
            continue
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError types
            raise ValueError(f"{path}: not a readable parquet file of verl RL rows ({exc})") from None
        columns = set(table.column_names)
        n = table.num_rows
        rm = table.column("reward_model").to_pylist() if "reward_model" in columns else [None] * n
        ei = table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * n
        pr = table.column(prompt_key).to_pylist() if prompt_key in columns else [None] * n
        for reward_model, extra_info, prompt in zip(rm, ei, pr):
            yield prompt_identity(reward_model, extra_info, prompt)


def _files(value: Any) -> list[str]:
    return [os.fspath(value)] if isinstance(value, (str, os.PathLike)) else [os.fspath(v) for v in value]


def check_calibration_disjoint(config: Any) -> None:
    """Refuse a run that calibrates and then trains on prompts it calibrated on (docs/record.md#compatibility-with-a-run).

    Only a run that calibrates and trains in one ``main_ppo`` (``algorithm.setgrpo.record_path`` null,
    ``calibration.only`` false) is checked here; a run with a record is checked against the record's prompts.
    ``calibration.files=null`` takes the calibration prompts from ``data.train_files``, which training then uses
    too; otherwise no row of ``calibration.files`` may share an id or a question text
    (:func:`setgrpo_verl.core.record.question_key`) with a row of ``data.train_files``: the calibration groups certify
    the guarantees for fresh prompts only.

    Args:
        config: the composed ``main_ppo`` config.

    Raises:
        ValueError: ``calibration.files=null``, or the first shared prompt and how many there are, with the fix.
    """
    from setgrpo_verl.core.record import question_key

    setgrpo = config.algorithm.setgrpo
    cal = setgrpo.calibration
    if setgrpo.get("record_path") or cal.get("only"):
        return
    fix = ("give algorithm.setgrpo.calibration.files prompts disjoint from data.train_files (`setgrpo-verl "
           "calibrate` splits one --data file in two), or calibrate alone (calibration.only=true) and train with "
           "algorithm.setgrpo.record_path")
    if cal.get("files") is None:
        raise ValueError(
            "algorithm.setgrpo.calibration.files=null calibrates on the first calibration.num_prompts prompts of "
            "data.train_files, and this run then trains on the same file: calibration prompts must stay out of "
            f"training (their groups certify the guarantees for fresh prompts); {fix}")
    prompt_key = str(config.data.get("prompt_key", "prompt"))
    ids, questions = set(), set()
    for prompt_id, question in read_prompt_identities(_files(cal.files), prompt_key=prompt_key):
        if prompt_id is not None:
            ids.add(prompt_id)
        if question is not None:
            questions.add(question_key(question))
    shared = [(prompt_id, question) for prompt_id, question in
              read_prompt_identities(_files(config.data.train_files), prompt_key=prompt_key)
              if (prompt_id is not None and prompt_id in ids)
              or (question is not None and question_key(question) in questions)]
    if shared:
        prompt_id, question = shared[0]
        raise ValueError(
            f"data.train_files shares {len(shared)} prompt(s) with algorithm.setgrpo.calibration.files, the first "
            f"{prompt_id!r} ({' '.join(str(question).split())[:80]!r}); calibration prompts must stay out of "
            f"training (their groups certify the guarantees for fresh prompts): {fix}")


def check_start_pilot(config: Any, setgrpo: Any, calibration_prompts: Sequence[dict] | None = None) -> dict | None:
    """The ``tau_start_source`` of the run's pilot record (``algorithm.setgrpo.tau_start_pilot``), checked before
    Ray as the calibration checks it again before its first rollout (docs/algorithm.md#43-where-the-start-comes-from).

    Args:
        config: the composed verl config of a run that calibrates.
        setgrpo: its validated ``algorithm.setgrpo`` block (:class:`~.config.SetGRPOConfig`).
        calibration_prompts: the fingerprints of the prompts it calibrates on; None = every row of the files the
            calibration samples (``calibration.files``, else ``data.train_files``), so that a pilot sharing a
            prompt with those files is refused even where the calibration draws only some of their rows.

    Returns:
        None without a pilot, else ``{"kind": "pilot", "record_sha256": ...}``.

    Raises:
        ValueError: a missing or invalid pilot file, or what :func:`setgrpo_verl.core.shards.pilot_source` refuses (a
            reject-all pilot, one that lists no calibration prompts, shared prompts, another start), each
            prefixed with the key and the file.
    """
    if not setgrpo.tau_start_pilot:
        return None
    name = f"algorithm.setgrpo.tau_start_pilot={setgrpo.tau_start_pilot}"
    path = os.path.expanduser(setgrpo.tau_start_pilot)
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no such file; pass a record calibrated on other prompts, or give tau_start alone")
    if calibration_prompts is None:
        cal = setgrpo.calibration
        files = cal.files if cal.files is not None else config.data.train_files
        calibration_prompts = calibration_fingerprints(files, prompt_key=str(config.data.get("prompt_key", "prompt")))
    from setgrpo_verl.core import CalibrationRecord
    from setgrpo_verl.core.shards import pilot_source

    settings = setgrpo.calibration_settings(norm_by_std=bool(config.algorithm.get("norm_adv_by_std_in_grpo", True)))
    try:
        return pilot_source(CalibrationRecord.from_json(path), settings, calibration_prompts)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
