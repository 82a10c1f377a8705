"""Calibration shards (docs/record.md#calibration-shards): one file per calibration batch, written as soon as the
batch is scored and sketched.

A calibration then survives a stop (a resumed run calibrates only the batches without a shard), can be spread over
several jobs (each calibrates a deterministic part of the batches, :func:`in_part`) and the record is built from
the complete shard set sorted by batch (:func:`record_from_shards`), the same record byte for byte however that
set was reached. Every shard carries the run's identity (:func:`shard_identity`: policy, grader, sketch, K, levels
and settings, the calibration prompt set) and a content hash; the identity is compared with
:func:`~setgrpo_verl.core.check_identity`, the check a record gets against a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..atomic import atomic_file
from .calibration import calibrate
from .identity import check_identity
from .record import CalibrationRecord, differing_versions, pilot_start
from .settings import CalibrationSettings

__all__ = ["DROP_REASONS", "SHARD_DIR", "CalibrationShard", "TornShardError", "in_part", "load_shards", "parse_part",
           "pilot_source", "prompts_sha256", "read_shard", "record_from_shards", "shard_identity", "shard_name",
           "write_calibration", "write_shard"]

#: The directory of a calibration's shards, next to its record.
SHARD_DIR = "shards"
_SCHEMA = 1
_FLOATS = ("point", "reference", "gram", "truth")
_DTYPES = {"prompt_index": np.int64, "truth_verdicts": np.int8}
_FIX = ("these shards were calibrated for another run: delete them (or the whole calibration directory) to "
        "calibrate again, or run with the shard's settings")


class TornShardError(ValueError):
    """A shard file that cannot be read whole (a write cut off mid-file, a partial copy): never read as data."""


#: Why a calibration group is left out (``CalibrationShard.dropped``, ``dropped_<reason>`` in ``paired_scores.npz``):
#: fewer than K responses, none, or a response whose grading failed (docs/verl_integration.md#partial-groups).
DROP_REASONS = ("incomplete", "no_response", "grading_failed")


@dataclass(frozen=True)
class CalibrationShard:
    """The calibration data of one batch.

    ``index``: the batch's position among the calibration batches (0-based); ``prompts``: one
    :func:`~setgrpo_verl.core.record.prompt_fingerprint` per prompt of the batch, in rollout order; float64 ``point [G, K]``,
    ``reference [G, K]``, ``gram [G, K, K]`` and ``truth [G, K]`` (None when the grader has none) of the G complete
    groups, sorted by ``prompt_index`` (int64 [G], each group's position in ``prompts``); ``dropped``: groups left
    out for holding fewer than K responses (``incomplete``), none (``no_response``) or a response whose grading
    failed (``grading_failed``; 0 in shards written before it was counted); ``verdicts``: the judge's
    ``(unparsed, judged)`` verdict counts or None; ``identity``: :func:`shard_identity`; ``created_at``: ISO 8601;
    ``package_versions``: :func:`~setgrpo_verl.core.record.package_versions` of the process that rolled the batch out and
    sketched it; ``tau_start_source``: where the fixed sequence's ``tau_start`` came from
    (:func:`pilot_source`; empty: set by the user). Both are empty in shards written before shards recorded them.
    ``truth_verdicts`` int8 ``[G, K, J]`` (1 met, 0 unmet, -1 no verdict, or past the J_g criteria of group g's
    rubric) and ``criterion_points`` float64 ``[G, J]`` (0 past a rubric's criteria): the noise-free verdicts of
    every response when the grader knows them (docs/validation.md#noisy-grader), so that the batch can be scored
    again offline at another noise level (its Gram matrices do not depend on the grader); both None otherwise and
    in shards written before shards stored them.
    """

    index: int
    prompts: tuple
    point: np.ndarray
    reference: np.ndarray
    gram: np.ndarray
    truth: np.ndarray | None
    prompt_index: np.ndarray
    identity: dict
    dropped: dict = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    verdicts: tuple | None = None
    created_at: str = ""
    package_versions: dict = field(default_factory=dict)
    tau_start_source: dict = field(default_factory=dict)
    truth_verdicts: np.ndarray | None = None
    criterion_points: np.ndarray | None = None


def _canonical(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, floats as floats): what a shard's identity reads as."""
    return json.loads(json.dumps(value, sort_keys=True))


def prompts_sha256(prompts: Iterable[dict]) -> str:
    """SHA-256 of an ordered list of prompt fingerprints (canonical JSON): which calibration prompt set, in which
    order."""
    return hashlib.sha256(json.dumps(list(prompts), sort_keys=True).encode()).hexdigest()


def shard_identity(*, k: int, settings: CalibrationSettings, split_seed: int, run: dict, prompts: Sequence[dict],
                   batch_size: int) -> dict[str, Any]:
    """The identity every shard of one calibration carries (docs/record.md#calibration-shards).

    Args:
        k: responses per group (``rollout.n``).
        settings: the calibration's settings, stored as :meth:`~setgrpo_verl.core.CalibrationSettings.to_dict`.
        split_seed: the coverage/risk split's seed.
        run: the run identity: ``loss_agg_mode``, ``sketch``, ``grader``, ``policy`` and ``training``.
        prompts: every calibration prompt's fingerprint, in rollout order (all parts together).
        batch_size: prompts per calibration batch (a shard holds one batch).

    Returns:
        A JSON-ready dict: ``K``, ``settings``, ``split_seed``, the run identity's keys and ``prompts``
        (``count``, ``batch_size``, ``sha256`` of the ordered fingerprints).

    Raises:
        TypeError: ``settings`` is not a :class:`~setgrpo_verl.core.CalibrationSettings`.
        ValueError: ``batch_size < 1``.
    """
    if not isinstance(settings, CalibrationSettings):
        raise TypeError(f"settings must be a CalibrationSettings, got {type(settings).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    return _canonical({"K": int(k), "settings": settings.to_dict(), "split_seed": int(split_seed), **run,
                       "prompts": {"count": len(prompts), "batch_size": int(batch_size),
                                   "sha256": prompts_sha256(prompts)}})


def parse_part(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``: the I-th of N parts (0 <= I < N) of a calibration's batches.

    Raises:
        ValueError: not two integers ``I/N`` with 0 <= I < N.
    """
    head, sep, tail = str(text).partition("/")
    try:
        index, parts = int(head), int(tail)
    except ValueError:
        index, parts = -1, 0
    if not sep or not 0 <= index < parts:
        raise ValueError(f"shard {text!r}: give I/N with 0 <= I < N (the I-th of N parts, counted from 0)")
    return index, parts


def in_part(batch: int, index: int, parts: int) -> bool:
    """Whether calibration batch ``batch`` belongs to part ``index`` of ``parts``: every ``parts``-th batch from
    ``index`` on (batch mod parts == index), so that the parts are disjoint, together complete, and alike in size."""
    return batch % parts == index


def shard_name(index: int) -> str:
    """The file name of batch ``index``'s shard."""
    return f"batch_{index:06d}.npz"


def _array_sha256(array: np.ndarray) -> str:
    h = hashlib.sha256(f"{array.dtype.str}{list(array.shape)}".encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def write_shard(directory: str | os.PathLike, shard: CalibrationShard) -> Path:
    """Write ``shard`` into ``directory`` as :func:`shard_name`, whole or not at all
    (:func:`setgrpo_verl.atomic.atomic_file`), and return its path.

    The file is a compressed ``.npz`` of the arrays (float64; ``prompt_index`` int64, ``truth_verdicts`` int8),
    a ``meta`` JSON string
    (batch, prompts, identity, dropped counts, verdict counts, created_at, package versions, tau_start source and
    each array's SHA-256) and ``content_sha256``, the SHA-256 of ``meta``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"point": shard.point, "reference": shard.reference, "gram": shard.gram,
              "prompt_index": np.asarray(shard.prompt_index, dtype=np.int64)}
    for name in ("truth", "truth_verdicts", "criterion_points"):
        if getattr(shard, name) is not None:
            arrays[name] = getattr(shard, name)
    arrays = {k: np.asarray(v, dtype=_DTYPES.get(k, np.float64)) for k, v in arrays.items()}
    meta = json.dumps({"schema": _SCHEMA, "index": int(shard.index), "prompts": list(shard.prompts),
                       "identity": shard.identity, "dropped": {k: int(v) for k, v in shard.dropped.items()},
                       "verdicts": None if shard.verdicts is None else [float(v) for v in shard.verdicts],
                       "created_at": shard.created_at, "package_versions": dict(shard.package_versions),
                       "tau_start_source": dict(shard.tau_start_source),
                       "arrays": {k: _array_sha256(v) for k, v in arrays.items()}}, sort_keys=True)
    path = directory / shard_name(shard.index)
    with atomic_file(path) as fh:
        np.savez_compressed(fh, meta=np.array(meta),
                            content_sha256=np.array(hashlib.sha256(meta.encode()).hexdigest()), **arrays)
    return path


def _torn(path: Path, exc: BaseException) -> TornShardError:
    return TornShardError(f"calibration shard {path} cannot be read whole ({type(exc).__name__}: {exc}): a write "
                          "that was cut off or a partial copy; its batch is calibrated again")


def read_shard(path: str | os.PathLike) -> CalibrationShard:
    """Read and check one shard file (:func:`write_shard`).

    Raises:
        TornShardError: the file's bytes cannot be decoded (cut off mid-write, a partial copy, not an ``.npz``).
        OSError: the file system failed the read (an error with an ``errno``: ``EIO``, ``ESTALE`` on network
            storage, ``EACCES``, ``ENOENT``, ...), the file named; the shard may be whole, so it is never taken for
            a torn one.
        ValueError: naming the file and the field: a content hash that does not match (``content_sha256``: the
            metadata was edited; an array's name: that array was changed), a missing or unexpected field, or
            shapes that do not fit together.
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {name: z[name] for name in z.files}
    except OSError as exc:
        if exc.errno is None:  # a decoder's error about the bytes, not the file system's
            raise _torn(path, exc) from None
        raise OSError(exc.errno, f"calibration shard {path} could not be read ({exc.strerror}): the file system "
                      "failed, the file may be whole and is kept as it is; check the storage, then run the command "
                      "again") from exc
    except (zipfile.BadZipFile, EOFError, ValueError, KeyError, zipfile.LargeZipFile, zlib.error) as exc:
        raise _torn(path, exc) from None
    for name in ("meta", "content_sha256"):
        if name not in data:
            raise ValueError(f"calibration shard {path}: field {name} is missing: not a shard this package wrote")
    meta_text = str(data.pop("meta"))
    if hashlib.sha256(meta_text.encode()).hexdigest() != str(data.pop("content_sha256")):
        raise ValueError(f"calibration shard {path}: field content_sha256 does not match its metadata: the file was "
                         "edited after it was written; delete it to calibrate its batch again")
    meta = json.loads(meta_text)
    hashes = meta.get("arrays", {})
    for name in sorted(set(hashes) | set(data)):
        if name not in data or name not in hashes or _array_sha256(data[name]) != hashes[name]:
            raise ValueError(f"calibration shard {path}: field {name} does not match the content hash it was written "
                             "with: the file was changed after it was written; delete it to calibrate its batch again")
    if meta.get("schema") != _SCHEMA:
        raise ValueError(f"calibration shard {path}: field schema is {meta.get('schema')!r}, this package reads "
                         f"{_SCHEMA}")
    identity = dict(meta["identity"])
    try:  # as this version writes them: settings written before a field existed read with its default
        identity["settings"] = _canonical(CalibrationSettings.from_dict(identity.get("settings")).to_dict())
    except ValueError as exc:
        raise ValueError(f"calibration shard {path}: field identity.settings: {exc}") from None
    shard = CalibrationShard(index=int(meta["index"]), prompts=tuple(meta["prompts"]), point=data["point"],
                             reference=data["reference"], gram=data["gram"], truth=data.get("truth"),
                             prompt_index=data["prompt_index"], identity=identity,
                             dropped={**dict.fromkeys(DROP_REASONS, 0), **meta["dropped"]},
                             verdicts=None if meta["verdicts"] is None else tuple(meta["verdicts"]),
                             created_at=meta["created_at"], package_versions=meta.get("package_versions", {}),
                             tau_start_source=meta.get("tau_start_source", {}),
                             truth_verdicts=data.get("truth_verdicts"), criterion_points=data.get("criterion_points"))
    g, k = shard.point.shape if shard.point.ndim == 2 else (-1, -1)
    shapes = {"point": (g, k), "reference": (g, k), "gram": (g, k, k), "prompt_index": (g,)}
    if shard.truth is not None:
        shapes["truth"] = (g, k)
    if (shard.truth_verdicts is None) != (shard.criterion_points is None):
        missing, there = (("criterion_points", "truth_verdicts") if shard.criterion_points is None
                          else ("truth_verdicts", "criterion_points"))
        raise ValueError(f"calibration shard {path}: field {missing} is missing while {there} is there: a shard "
                         "stores both or neither")
    if shard.truth_verdicts is not None:
        j = shard.criterion_points.shape[-1] if shard.criterion_points.ndim == 2 else -1
        shapes.update(truth_verdicts=(g, k, j), criterion_points=(g, j))
        if not np.isin(shard.truth_verdicts, (-1, 0, 1)).all():
            raise ValueError(f"calibration shard {path}: field truth_verdicts holds values other than 1 (met), 0 "
                             "(unmet) and -1 (no verdict)")
    for name, shape in shapes.items():
        if getattr(shard, name).shape != shape or k != shard.identity.get("K"):
            raise ValueError(f"calibration shard {path}: field {name} has shape {getattr(shard, name).shape}, "
                             f"expected {shape} for K={shard.identity.get('K')}")
    if path.name != shard_name(shard.index):
        raise ValueError(f"calibration shard {path}: field index is {shard.index}, but the file is named for "
                         f"another batch ({shard_name(shard.index)} expected)")
    return shard


def load_shards(directory: str | os.PathLike, identity: dict | None = None, *,
                torn: str = "refuse") -> tuple[dict[int, CalibrationShard], list[Path]]:
    """The shards of ``directory`` by batch index, each read (:func:`read_shard`) and, given ``identity``, checked
    against it; temporary files of unfinished writes are ignored.

    Args:
        directory: a shard directory (absent: no shards).
        identity: :func:`shard_identity` of the run, or None to check nothing against it.
        torn: ``"refuse"`` raises on a torn file; ``"skip"`` leaves it out (its path is returned), so that its
            batch is calibrated again.

    Returns:
        ``({batch index: shard}, [torn files left out])``.

    Raises:
        TornShardError: a torn file with ``torn="refuse"``.
        OSError: a file the file system failed to read (never skipped as torn; see :func:`read_shard`).
        ValueError: a shard that does not read (see :func:`read_shard`) or whose identity differs from ``identity``
            (naming the file and the first differing field).
    """
    directory = Path(directory)
    shards, skipped = {}, []
    for path in sorted(directory.glob("batch_*.npz")) if directory.is_dir() else []:
        try:
            shard = read_shard(path)
        except TornShardError:
            if torn != "skip":
                raise
            skipped.append(path)
            continue
        if identity is not None:
            check_identity(shard.identity, _canonical(identity), what=f"calibration shard {path}", holder="shard",
                           fix=_FIX)
        shards[shard.index] = shard
    return shards, skipped


def _check_set(sources: Sequence[tuple[Path, CalibrationShard]]) -> dict:
    """The common identity of a shard set that is complete and without overlap (see :func:`record_from_shards`)."""
    if not sources:
        raise ValueError("no calibration shards to build a record from")
    first_path, first = sources[0]
    identity = first.identity
    owner: dict[int, Path] = {}
    prompt_owner: dict[str, tuple[Path, str]] = {}
    for path, shard in sources:
        check_identity(shard.identity, identity, what=f"calibration shard {path}", holder="shard",
                       fix=f"every shard must come from one calibration: {first_path} has this run's value")
        if shard.index in owner:
            raise ValueError(f"calibration shards overlap: {owner[shard.index]} and {path} both hold batch "
                             f"{shard.index}; give each batch once (each part of a sharded calibration once)")
        owner[shard.index] = path
        for p in shard.prompts:
            key = json.dumps(p, sort_keys=True)
            if key in prompt_owner:
                raise ValueError(f"calibration shards overlap: prompt {p.get('id')!r} is in {prompt_owner[key][0]} "
                                 f"and in {path}; a prompt's group may enter the calibration once")
            prompt_owner[key] = (path, p.get("id"))
    count, size = identity["prompts"]["count"], identity["prompts"]["batch_size"]
    missing = sorted(set(range(math.ceil(count / size))) - set(owner))
    if missing:
        raise ValueError(f"calibration shards missing: {len(missing)} of {math.ceil(count / size)} batches have no "
                         f"shard, the first batch {missing[0]} ({shard_name(missing[0])}); calibrate the missing "
                         "part(s) (--resume, or the --shard job that holds them) before building the record")
    prompts = [p for _, s in sorted(sources, key=lambda x: x[1].index) for p in s.prompts]
    if prompts_sha256(prompts) != identity["prompts"]["sha256"] or len(prompts) != count:
        raise ValueError("calibration shards hold other prompts than the calibration prompt set their identity names "
                         "(field prompts.sha256): shards of another data split; calibrate them again")
    return identity


def record_from_shards(sources: Sequence[tuple[str | os.PathLike, CalibrationShard]], *,
                       tau_start_source: dict | None = None) -> tuple[CalibrationRecord, dict[str, np.ndarray]]:
    """The record and paired scores of a complete shard set (docs/record.md#calibration-shards).

    The shards are taken in batch order, so the record depends on the set only: the same, byte for byte, whether
    it was written in one run, resumed, or merged from several jobs; its ``created_at`` is the newest shard's, and
    so are its ``package_versions`` (the versions that calibrated, not those of the machine that merges; the
    installed ones only when no shard records them).

    Args:
        sources: ``(path, shard)`` pairs (the paths name the files in messages).
        tau_start_source: where a fixed sequence's ``tau_start`` came from (``calibrate``'s argument, e.g. from
            :func:`pilot_source`); None: the source the shards recorded, or the user when they recorded none.

    Returns:
        ``(record, paired)``: ``paired`` holds float64 ``point``, ``reference``, ``gram`` (and ``truth``) of every
        complete group in batch order, ``dropped_incomplete``, ``dropped_no_response`` and
        ``dropped_grading_failed`` (int64 scalars), and
        ``unparsed_verdicts`` / ``judged_verdicts`` when the judge counted them.

    Raises:
        ValueError: no shards; shards of different calibrations (naming the file and the first differing field of
            the identity: policy, grader, sketch, K, levels, settings, prompt set); two shards of one batch or one
            prompt in two shards; a batch without a shard; truth in some shards only; shards written by another
            major.minor version of setgrpo-verl or verl than the newest shard (both files and versions named);
            shards that record different ``tau_start`` sources, or one other than ``tau_start_source``; anything
            ``calibrate`` refuses.
    """
    sources = [(Path(p), s) for p, s in sources]
    identity = _check_set(sources)
    ordered = [s for _, s in sorted(sources, key=lambda x: x[1].index)]
    truths = [s.truth is not None for s in ordered]
    if any(truths) and not all(truths):
        raise ValueError(f"the truth score came with {sum(truths)} of {len(truths)} calibration shards; the grader "
                         "gives it for every response or for none")
    k = identity["K"]
    paired = {name: np.concatenate([getattr(s, name) for s in ordered]) for name in ("point", "reference", "gram")}
    if all(truths):
        paired["truth"] = np.concatenate([s.truth for s in ordered])
    for reason in DROP_REASONS:
        paired[f"dropped_{reason}"] = np.int64(sum(int(s.dropped.get(reason, 0)) for s in ordered))
    verdicts = [s.verdicts for s in ordered if s.verdicts is not None]
    if verdicts:
        paired["unparsed_verdicts"], paired["judged_verdicts"] = (np.float64(sum(v)) for v in zip(*verdicts))
    settings = CalibrationSettings.from_dict(identity["settings"])
    # shards written before schema 6 of the record have no training identity (named when checked against a run)
    run = {key: identity.get(key, {}) for key in ("loss_agg_mode", "sketch", "grader", "policy", "training")}
    versions = shard_versions(sources)
    tau_start_source = shard_start_source(sources, tau_start_source)
    record = calibrate(
        torch.from_numpy(paired["point"]).reshape(-1, k), torch.from_numpy(paired["reference"]).reshape(-1, k),
        torch.from_numpy(paired["gram"]).reshape(-1, k, k), settings, split_seed=identity["split_seed"],
        metadata={**run, "calibration_prompts": [p for s in ordered for p in s.prompts]},
        tau_start_source=tau_start_source, created_at=max(s.created_at for s in ordered),
    )
    if versions:
        record = dataclasses.replace(record, package_versions=versions)
    return record, paired


def shard_versions(sources: Sequence[tuple[str | os.PathLike, CalibrationShard]], *,
                   running: dict | None = None) -> dict:
    """The package versions a shard set was calibrated with: the newest recording shard's (sorted by name; {} when
    no shard records them).

    Args:
        sources: ``(path, shard)`` pairs (the paths name the files in messages).
        running: the versions of a run about to add shards to the set (a resumed calibration): every shard is
            checked against them, and they are returned.

    Raises:
        ValueError: two shards, or a shard and ``running``, with another major.minor of setgrpo-verl or verl
            (both files, or the file and the running versions, named).
    """
    recorded = sorted((s.created_at, s.index, str(p), s.package_versions) for p, s in sources if s.package_versions)
    if not recorded and not running:
        return {}
    newest_path, versions = ("this run", running) if running else recorded[-1][2:]
    for _, _, path, theirs in recorded:
        for name in differing_versions(theirs, versions):
            raise ValueError(f"calibration shards of different software: {path} was written with {name} "
                             f"{theirs[name]}, {newest_path} with {name} {versions[name]}; calibrate every batch "
                             f"with one version (install {name} {theirs[name]} to continue, or the other "
                             "version's part again)")
    return dict(sorted(versions.items()))


def shard_start_source(sources: Sequence[tuple[str | os.PathLike, CalibrationShard]], given: dict | None) -> dict | None:
    """Where the fixed sequence's ``tau_start`` of a shard set came from (docs/record.md#calibration-shards).

    Args:
        sources: ``(path, shard)`` pairs.
        given: a pilot's source checked by the caller (:func:`pilot_source`), or None.

    Returns:
        ``given`` when given (it may stand for shards that record the user's start, never for another pilot);
        else the one source the shards record, or None when none records one (shards written before shards
        recorded it; ``calibrate`` then names the user).

    Raises:
        ValueError: shards that name different sources (a pilot and the user, or two pilots), or a pilot other
            than ``given``; a file of each is named.
    """
    recorded: dict[str, Any] = {}  # each source -> the first file that names it
    for path, shard in sorted(sources, key=lambda x: x[1].index):
        if shard.tau_start_source:
            recorded.setdefault(json.dumps(shard.tau_start_source, sort_keys=True), path)
    if given is not None:
        mine = json.dumps(_canonical(given), sort_keys=True)
        recorded = {k: p for k, p in recorded.items() if k != mine and json.loads(k).get("kind") != "user"}
        if recorded:
            other, path = next(iter(recorded.items()))
            raise ValueError(f"calibration shard {path} names the tau_start source {other}, this calibration "
                             f"{mine}; every part of one calibration starts its fixed sequence from the same pilot")
        return _canonical(given)
    if len(recorded) > 1:
        (one, first), (other, second) = list(recorded.items())[:2]
        raise ValueError(f"calibration shards with different tau_start sources: {first} names {one}, {second} names "
                         f"{other}; every part of one calibration starts its fixed sequence from the same pilot")
    return json.loads(next(iter(recorded))) if recorded else None


def write_calibration(record: CalibrationRecord, paired: dict[str, np.ndarray], record_path: str | os.PathLike) -> None:
    """Write ``paired_scores.npz`` (:func:`record_from_shards`'s paired scores and dropped-group counts) next to
    ``record_path``, then the record, each whole or not at all (:func:`setgrpo_verl.atomic.atomic_file`): a record
    next to its paired scores means the calibration finished."""
    folder = Path(record_path).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_file(folder / "paired_scores.npz") as fh:
        np.savez(fh, **{name: paired[name] for name in _FLOATS + tuple(f"dropped_{r}" for r in DROP_REASONS)
                        if name in paired})
    record.to_json(record_path)


def pilot_source(pilot: CalibrationRecord, settings: CalibrationSettings, prompts: Sequence[dict], *,
                 name: str = "the pilot") -> dict:
    """The ``tau_start_source`` of a fixed sequence whose ``tau_start`` came from ``pilot`` (docs/algorithm.md#4-srgo).

    Args:
        pilot: the pilot record, calibrated on other prompts.
        settings: this calibration's settings.
        prompts: this calibration's prompt fingerprints (checked disjoint from the pilot's).
        name: the pilot in messages (its path).

    Returns:
        ``{"kind": "pilot", "record_sha256": <the pilot's content hash>}``.

    Raises:
        ValueError: the settings are not a fixed sequence from the pilot's ``tau_sel``, or anything
            :func:`~setgrpo_verl.core.record.pilot_start` refuses (a reject-all pilot, a start off the grid, shared
            prompts).
    """
    tau_start, source = pilot_start(pilot, settings.tau_grid, calibration_prompts=prompts)
    if settings.srgo_procedure != "fixed_sequence" or settings.tau_start != tau_start:
        raise ValueError(f"{name} starts the fixed sequence at tau={tau_start}, but this calibration has "
                         f"srgo_procedure={settings.srgo_procedure}, tau_start={settings.tau_start}: calibrate "
                         f"with srgo_procedure=fixed_sequence and tau_start={tau_start}")
    return source
