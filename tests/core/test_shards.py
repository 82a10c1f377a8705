"""Calibration shards: what a shard file holds is what is read back, a changed or torn file is refused naming the
file and the field, and the record of a shard set depends on the set only (merged parts, one run: byte for byte)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.record import package_versions, prompt_fingerprint
from setgrpo_verl.core.shards import (
    CalibrationShard,
    in_part,
    load_shards,
    parse_part,
    read_shard,
    record_from_shards,
    shard_identity,
    shard_name,
    shard_start_source,
    shard_versions,
    TornShardError,
    write_calibration,
    write_shard,
)
from setgrpo_verl.runner.merge import merge_calibration
from setgrpo_verl.rundir import LaunchError

from .synthetic import make_groups

K, BATCH, BATCHES = 4, 20, 5
RUN = {"loss_agg_mode": "token-mean", "sketch": {"rank_out": 1}, "grader": {"name": "judge"},
       "policy": {"model": "m", "temperature": 1.0}}
PROMPTS = [prompt_fingerprint(f"q{i}", f"question {i}", ["rubric"]) for i in range(BATCH * BATCHES - 7)]


def _settings(**changes):
    values = {"alpha": 0.2, "beta": 0.4, "delta": 0.2, "tau_grid": (0.0, 0.3, 0.6), "rho": 0.1,
              "on_infeasible": "reject_all", **changes}
    return CalibrationSettings(**values)


def _identity(**changes):
    return shard_identity(k=K, settings=_settings(**changes), split_seed=0, run=RUN, prompts=PROMPTS,
                          batch_size=BATCH)


def _shards(identity=None, *, drop_last_group=True):
    """Shards of the calibration prompts (the last batch smaller; its last prompt's group incomplete)."""
    point, reference, gram = (x.numpy() for x in make_groups(len(PROMPTS), K, seed=3))
    out = []
    for b in range(BATCHES):
        lo, hi = b * BATCH, min((b + 1) * BATCH, len(PROMPTS))
        keep = np.arange(hi - lo)
        if drop_last_group and b == BATCHES - 1:
            keep = keep[:-1]
        out.append(CalibrationShard(index=b, prompts=tuple(PROMPTS[lo:hi]), point=point[lo:hi][keep],
                                    reference=reference[lo:hi][keep], gram=gram[lo:hi][keep], truth=None,
                                    prompt_index=keep, identity=identity or _identity(),
                                    dropped={"incomplete": int(len(keep) < hi - lo), "no_response": 0, "grading_failed": 0},
                                    created_at=f"2026-01-01T00:00:0{b}+00:00"))
    return out


def _write(directory, shards):
    return [write_shard(directory, s) for s in shards]


def test_a_shard_reads_back_as_written(tmp_path):
    shard = _shards()[4]
    path = write_shard(tmp_path, shard)
    assert path.name == shard_name(4) and not list(tmp_path.glob(".*.tmp"))
    back = read_shard(path)
    for name in ("point", "reference", "gram", "prompt_index"):
        np.testing.assert_array_equal(getattr(back, name), getattr(shard, name))
    assert back.prompts == shard.prompts and back.identity == shard.identity and back.dropped == shard.dropped


def test_truth_verdicts_read_back_and_shards_without_them_still_load(tmp_path):
    """The noise-free verdicts [G, K, J] (int8, -1 past a rubric's criteria) and the criteria points [G, J] read
    back as written; a shard without them (written before shards stored them) reads with both None."""
    import dataclasses

    shard = _shards()[4]
    g = shard.point.shape[0]
    rng = np.random.default_rng(0)
    verdicts = rng.integers(0, 2, size=(g, K, 3)).astype(np.int8)
    points = np.tile([2.0, -1.0, 0.0], (g, 1))
    verdicts[:, :, 2] = -1  # every rubric has 2 criteria here; the third is padding
    back = read_shard(write_shard(tmp_path, dataclasses.replace(shard, truth_verdicts=verdicts,
                                                                criterion_points=points)))
    assert back.truth_verdicts.dtype == np.int8 and back.criterion_points.dtype == np.float64
    np.testing.assert_array_equal(back.truth_verdicts, verdicts)
    np.testing.assert_array_equal(back.criterion_points, points)
    old = read_shard(write_shard(tmp_path / "old", shard))
    assert old.truth_verdicts is None and old.criterion_points is None
    with pytest.raises(ValueError, match=r"field truth_verdicts has shape \(12, 4, 3\), expected \(12, 4, 2\)"):
        read_shard(write_shard(tmp_path / "bad", dataclasses.replace(shard, truth_verdicts=verdicts,
                                                                     criterion_points=points[:, :2])))
    with pytest.raises(ValueError, match="field criterion_points is missing while truth_verdicts is there"):
        read_shard(write_shard(tmp_path / "half", dataclasses.replace(shard, truth_verdicts=verdicts)))
    with pytest.raises(ValueError, match="field truth_verdicts holds values other than"):
        read_shard(write_shard(tmp_path / "two", dataclasses.replace(shard, truth_verdicts=verdicts + 1,
                                                                     criterion_points=points)))


def test_changed_content_is_refused_naming_the_file_and_field(tmp_path):
    path = write_shard(tmp_path, _shards()[0])
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    data["point"] = data["point"] + 1e-9
    np.savez(path, **data)
    with pytest.raises(ValueError, match=rf"{path.name}: field point does not match"):
        read_shard(path)
    meta = json.loads(str(data["meta"]))
    meta["index"] = 1
    data["meta"] = np.array(json.dumps(meta, sort_keys=True))
    np.savez(path, **data)
    with pytest.raises(ValueError, match=rf"{path.name}: field content_sha256") as caught:
        read_shard(path)
    assert not isinstance(caught.value, TornShardError)  # refused, never set aside and calibrated again
    with pytest.raises(ValueError, match="field content_sha256"):
        load_shards(tmp_path, torn="skip")


def test_a_torn_shard_is_never_read_as_data(tmp_path):
    paths = _write(tmp_path, _shards()[:2])
    size = paths[1].stat().st_size
    with open(paths[1], "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(TornShardError, match=paths[1].name):
        read_shard(paths[1])
    shards, torn = load_shards(tmp_path, torn="skip")
    assert sorted(shards) == [0] and torn == [paths[1]]
    with pytest.raises(TornShardError):
        load_shards(tmp_path)


def _fail_reads(monkeypatch, err: int) -> None:
    """Every read of a member of a zip (an .npz) fails with the file system's error ``err``, as on a flaky disk."""
    import zipfile

    def fail(self, *args):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(zipfile.ZipExtFile, "read", fail)


def test_a_file_system_error_is_not_a_torn_shard_and_names_the_file(tmp_path, monkeypatch):
    import builtins
    import errno

    paths = _write(tmp_path, _shards()[:2])
    _fail_reads(monkeypatch, errno.EIO)  # fails mid-read, after the zip's directory was read
    with pytest.raises(OSError, match=rf"calibration shard {paths[0]} could not be read \(Input/output error\): the "
                                      "file system failed") as caught:
        read_shard(paths[0])
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, TornShardError)
    with pytest.raises(OSError, match=paths[0].name):
        load_shards(tmp_path, torn="skip")  # never skipped (and calibrated again) as torn
    with pytest.raises(LaunchError, match=rf"{paths[0].name} could not be read \(Input/output error\)"):
        merge_calibration([tmp_path], tmp_path / "out")
    monkeypatch.undo()
    real_open = builtins.open

    def stale(file, *args, **kwargs):  # a network file system's stale handle at open
        if str(file) == str(paths[1]):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", stale)
    with pytest.raises(OSError, match=rf"{paths[1].name} could not be read \(Stale file handle\)") as caught:
        load_shards(tmp_path, torn="skip")
    assert caught.value.errno == errno.ESTALE
    monkeypatch.undo()
    assert [read_shard(p).index for p in paths] == [0, 1]  # both whole once the storage answers


def test_another_runs_shard_is_refused_naming_file_and_field(tmp_path):
    _write(tmp_path, _shards())
    with pytest.raises(ValueError, match=r"batch_000000.npz mismatch in settings.alpha: shard has 0.2, this run has "
                                         r"0.3"):
        load_shards(tmp_path, _identity(alpha=0.3))
    other = shard_identity(k=K, settings=_settings(), split_seed=0, run={**RUN, "grader": {"name": "other"}},
                           prompts=PROMPTS, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"mismatch in grader.name: shard has 'judge', this run has 'other'"):
        load_shards(tmp_path, other)


def test_parts_are_disjoint_and_complete():
    assert parse_part("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="0 <= I < N"):
            parse_part(bad)
    owners = [[i for i in range(3) if in_part(b, i, 3)] for b in range(10)]
    assert all(len(o) == 1 for o in owners)


def test_merged_parts_give_the_record_of_one_run_byte_for_byte(tmp_path):
    shards = _shards()
    one, part0, part1 = tmp_path / "one" / "shards", tmp_path / "p0" / "shards", tmp_path / "p1" / "shards"
    _write(one, shards)
    _write(part0, [s for s in shards if in_part(s.index, 0, 2)])
    _write(part1, [s for s in shards if in_part(s.index, 1, 2)])
    # one run: the shard set read back from its directory, as the trainer builds its record
    read, _ = load_shards(one, _identity())
    record, paired = record_from_shards([(one / shard_name(b), s) for b, s in read.items()])
    write_calibration(record, paired, tmp_path / "one" / "record.json")
    merged = merge_calibration([tmp_path / "p1", part0], tmp_path / "merged")
    assert (tmp_path / "merged" / "record.json").read_bytes() == (tmp_path / "one" / "record.json").read_bytes()
    # ... which is calibrate() on every complete group in batch order
    direct = calibrate(*(torch.from_numpy(np.concatenate([getattr(s, n) for s in shards]))
                         for n in ("point", "reference", "gram")),
                       _settings(), split_seed=0, created_at=shards[-1].created_at,
                       metadata={**RUN, "calibration_prompts": PROMPTS})
    assert merged.to_dict() == direct.to_dict()
    saved = np.load(tmp_path / "merged" / "paired_scores.npz")
    assert saved["point"].shape == (len(PROMPTS) - 1, K) and int(saved["dropped_incomplete"]) == 1
    assert len(merged.calibration_prompts) == len(PROMPTS)


def test_merge_refuses_missing_overlapping_and_foreign_parts(tmp_path):
    shards = _shards()
    _write(tmp_path / "p0", [s for s in shards if in_part(s.index, 0, 2)])
    _write(tmp_path / "p1", [s for s in shards if in_part(s.index, 1, 2)])
    with pytest.raises(LaunchError, match=r"missing: 2 of 5 batches have no shard, the first batch 1"):
        merge_calibration([tmp_path / "p0"], tmp_path / "out")
    shutil.copytree(tmp_path / "p1", tmp_path / "again")
    with pytest.raises(LaunchError, match=r"overlap: .*p1/batch_000001.npz and .*again/batch_000001.npz"):
        merge_calibration([tmp_path / "p0", tmp_path / "p1", tmp_path / "again"], tmp_path / "out")
    _write(tmp_path / "levels", [s for s in _shards(_identity(beta=0.5)) if in_part(s.index, 1, 2)])
    with pytest.raises(LaunchError, match=r"batch_000001.npz mismatch in settings.beta: shard has 0.5, this run has "
                                          r"0.4"):
        merge_calibration([tmp_path / "p0", tmp_path / "levels"], tmp_path / "out")
    _write(tmp_path / "only1", [shards[1]])
    _write(tmp_path / "shifted", [CalibrationShard(**{**shards[1].__dict__, "index": 3})])  # batch 1 again, as 3
    with pytest.raises(LaunchError, match=r"overlap: prompt 'q20' is in .*only1/batch_000001.npz and in "):
        merge_calibration([tmp_path / "p0", tmp_path / "only1", tmp_path / "shifted"], tmp_path / "out")
    assert not (tmp_path / "out").exists()



def test_merge_names_a_pilot_as_the_source_of_tau_start_and_refuses_one_that_does_not_give_it(tmp_path):
    from setgrpo_verl.core.record import content_sha256

    other = [prompt_fingerprint(f"pilot{i}", f"pilot question {i}", []) for i in range(200)]
    pilot = calibrate(*make_groups(200, K, seed=9), CalibrationSettings(
        alpha=0.2, beta=0.4, delta=0.2, tau_grid=(0.0, 0.3, 0.6), on_infeasible="reject_all"),
        metadata={"calibration_prompts": other})
    assert pilot.tau_sel is not None
    pilot.to_json(tmp_path / "pilot.json")
    fixed = _identity(srgo_procedure="fixed_sequence", tau_start=pilot.tau_sel)
    _write(tmp_path / "run", _shards(fixed))
    record = merge_calibration([tmp_path / "run"], tmp_path / "out", pilot=tmp_path / "pilot.json")
    assert record.tau_start_source == {"kind": "pilot", "record_sha256": content_sha256(pilot)}
    start = next(t for t in (0.0, 0.3, 0.6) if t != pilot.tau_sel)
    _write(tmp_path / "elsewhere", _shards(_identity(srgo_procedure="fixed_sequence", tau_start=start)))
    with pytest.raises(LaunchError, match=rf"starts the fixed sequence at tau={pilot.tau_sel}"):
        merge_calibration([tmp_path / "elsewhere"], tmp_path / "out2", pilot=tmp_path / "pilot.json")
    shared = calibrate(*make_groups(200, K, seed=9), CalibrationSettings(
        alpha=0.2, beta=0.4, delta=0.2, tau_grid=(0.0, 0.3, 0.6), on_infeasible="reject_all"),
        metadata={"calibration_prompts": PROMPTS[:3] + other[3:]})
    shared.to_json(tmp_path / "shared.json")
    with pytest.raises(LaunchError, match="3 calibration prompt.* were also the pilot's"):
        merge_calibration([tmp_path / "run"], tmp_path / "out3", pilot=tmp_path / "shared.json")


def test_merge_never_overwrites_a_calibrations_paired_scores(tmp_path):
    _write(tmp_path / "run", _shards())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "paired_scores.npz").write_bytes(b"kept")
    with pytest.raises(LaunchError, match=r"out/paired_scores.npz exists \(without record.json: a calibration or "
                                          r"merge that stopped before its record; delete it .*never overwrites"):
        merge_calibration([tmp_path / "run"], tmp_path / "out")
    assert (tmp_path / "out" / "paired_scores.npz").read_bytes() == b"kept"
    assert not (tmp_path / "out" / "record.json").exists()


def test_merge_out_is_a_directory_argument(tmp_path, capsys):
    from setgrpo_verl.runner import cli

    _write(tmp_path / "run", _shards())
    (tmp_path / "afile").write_text("x")
    assert cli.main(["merge-calibration", str(tmp_path / "run"), "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {tmp_path / 'afile'} is an existing file, not a directory")
    assert "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "x"
    assert cli.main(["merge-calibration", str(tmp_path / "run"), "--out", str(tmp_path / "o" / "record.json")]) == 2
    assert f"names a file, but --out is the directory the merge writes record.json and paired_scores.npz into: give " \
           f"--out {tmp_path / 'o'}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(LaunchError, match=r"afile/sub: the directory cannot be created \(Not a directory"):
        merge_calibration([tmp_path / "run"], tmp_path / "afile" / "sub")


def test_a_merge_writes_under_its_out_directorys_lock(tmp_path):
    from setgrpo_verl.runner.runlock import run_dir_lock

    _write(tmp_path / "run", _shards())
    with run_dir_lock(tmp_path / "out", ["setgrpo-verl", "merge-calibration", "other"]):
        with pytest.raises(LaunchError, match=r"out is in use by another command \(pid .*merge-calibration other"):
            merge_calibration([tmp_path / "run"], tmp_path / "out")
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["LOCK"]
    merge_calibration([tmp_path / "run"], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["LOCK", "paired_scores.npz", "record.json"]


def test_a_merge_into_a_runs_calibration_takes_the_run_directorys_lock(tmp_path):
    """calibrate and train lock <run-dir>/LOCK; a merge into <run-dir>/calibration takes that lock too, so a
    calibrate --overwrite of the run cannot delete calibration/ under it."""
    from setgrpo_verl.runner.runlock import run_dir_lock

    _write(tmp_path / "part", _shards())
    with run_dir_lock(tmp_path / "run", ["setgrpo-verl", "calibrate", "--overwrite"]):
        with pytest.raises(LaunchError, match=r"run is in use by another command \(pid .*calibrate --overwrite"):
            merge_calibration([tmp_path / "part"], tmp_path / "run" / "calibration")
    merge_calibration([tmp_path / "part"], tmp_path / "run" / "calibration")
    assert sorted(p.name for p in (tmp_path / "run" / "calibration").iterdir()) == ["paired_scores.npz", "record.json"]


def test_a_merged_record_names_the_versions_that_calibrated_not_the_merging_machines(tmp_path):
    calibrating = {"setgrpo-verl": "0.1.0", "torch": "2.11.0", "scipy": "1.14.1", "verl": "0.9.1"}
    newer = {**calibrating, "torch": "2.13.0"}  # the newest shard's versions are the record's
    shards = [CalibrationShard(**{**s.__dict__, "package_versions": newer if s.index == BATCHES - 1 else calibrating})
              for s in _shards()]
    _write(tmp_path / "run", shards)
    assert read_shard(tmp_path / "run" / shard_name(0)).package_versions == calibrating
    record = merge_calibration([tmp_path / "run"], tmp_path / "out")
    assert record.package_versions == newer != package_versions()
    assert CalibrationRecord.from_json(tmp_path / "out" / "record.json").package_versions == newer
    # shards that record no versions (written before shards did) leave the installed ones
    _write(tmp_path / "old", _shards())
    assert merge_calibration([tmp_path / "old"], tmp_path / "out_old").package_versions == package_versions()
    # a part calibrated with another major.minor of verl is refused, naming both files and versions
    other = [CalibrationShard(**{**s.__dict__, "package_versions": {**calibrating, "verl": "0.8.2"}})
             if s.index == 1 else s for s in shards]
    _write(tmp_path / "mixed", other)
    with pytest.raises(LaunchError, match=r"different software: .*batch_000001.npz was written with verl 0.8.2, "
                                          r".*batch_000004.npz with verl 0.9.1"):
        merge_calibration([tmp_path / "mixed"], tmp_path / "out_mixed")


def test_parts_started_from_a_pilot_keep_it_as_the_source_when_merged_without_pilot(tmp_path):
    fixed = _identity(srgo_procedure="fixed_sequence", tau_start=0.3)
    source = {"kind": "pilot", "record_sha256": "ab" * 32}
    shards = [CalibrationShard(**{**s.__dict__, "tau_start_source": source}) for s in _shards(fixed)]
    _write(tmp_path / "p0", [s for s in shards if in_part(s.index, 0, 2)])
    _write(tmp_path / "p1", [s for s in shards if in_part(s.index, 1, 2)])
    assert read_shard(tmp_path / "p0" / shard_name(0)).tau_start_source == source
    assert merge_calibration([tmp_path / "p0", tmp_path / "p1"], tmp_path / "out").tau_start_source == source
    # a part started by the user has no recorded source: the start stays the user's
    _write(tmp_path / "user", _shards(fixed))
    assert merge_calibration([tmp_path / "user"], tmp_path / "out_user").tau_start_source == {"kind": "user"}
    # parts that name different pilots are refused, naming a file of each
    other = [CalibrationShard(**{**s.__dict__, "tau_start_source": {**source, "record_sha256": "cd" * 32}})
             for s in shards if in_part(s.index, 1, 2)]
    _write(tmp_path / "other", other)
    with pytest.raises(LaunchError, match=r"different tau_start sources: .*p0/batch_000000.npz names .*ab.*, "
                                          r".*other/batch_000001.npz names .*cd"):
        merge_calibration([tmp_path / "p0", tmp_path / "other"], tmp_path / "out_other")


def test_a_pilot_may_stand_for_the_users_start_but_a_mix_of_starts_is_refused():
    user, pilot = {"kind": "user"}, {"kind": "pilot", "record_sha256": "ab" * 32}
    shards = [CalibrationShard(**{**s.__dict__, "tau_start_source": pilot if s.index == 3 else user})
              for s in _shards(_identity(srgo_procedure="fixed_sequence", tau_start=0.3))]
    sources = [(f"p/{shard_name(s.index)}", s) for s in shards]
    assert shard_start_source(sources, pilot) == pilot  # merge --pilot: the pilot the user's parts started from
    with pytest.raises(ValueError, match=r"different tau_start sources: p/batch_000000.npz names .*user.*, "
                                         r"p/batch_000003.npz names .*pilot"):
        shard_start_source(sources, None)
    with pytest.raises(ValueError, match=r"p/batch_000003.npz names the tau_start source .*abab.*, this calibration "
                                         r".*cdcd"):
        shard_start_source(sources, {**pilot, "record_sha256": "cd" * 32})


def test_shard_versions_are_checked_against_a_resuming_run():
    written = {"setgrpo-verl": "0.1.0", "verl": "0.9.1", "torch": "2.11.0"}
    shards = [CalibrationShard(**{**s.__dict__, "package_versions": written}) for s in _shards()]
    sources = [(f"p/{shard_name(s.index)}", s) for s in shards]
    assert list(shard_versions(sources)) == ["setgrpo-verl", "torch", "verl"]  # sorted: the record's bytes
    assert shard_versions(sources, running={**written, "torch": "2.13.0"})["torch"] == "2.13.0"
    with pytest.raises(ValueError, match=r"p/batch_000000.npz was written with setgrpo-verl 0.1.0, this run with "
                                         r"setgrpo-verl 0.2.0; .*install setgrpo-verl 0.1.0 to continue"):
        shard_versions(sources, running={**written, "setgrpo-verl": "0.2.0"})
