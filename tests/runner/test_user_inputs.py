"""Inputs users really have: a --data file saved with a UTF-8 byte-order mark (Windows editors, Excel) is read; prompts
dropped for exceeding --max-prompt-length are counted in data/split.json and on the console; a write that fails for
want of room or permission (a full disk, a read-only run directory) ends in one `error:` line naming the path and
what was being written, leaves no partial file, and a read-only run directory can still be reported (--out)."""

from __future__ import annotations

import errno
import json

import pytest

from setgrpo_verl.grading import read_rubric_rows
from setgrpo_verl.models import embedded_model_dir
from setgrpo_verl.runner import cli, runlock
from setgrpo_verl.runner.datasplit import split_data, write_data


def _rows(n: int, words: int = 4) -> list[dict]:
    return [{"question": f"Write one short sentence about the number {i}." + " and more" * words, "id": f"row-{i}",
             "rubrics": [{"criterion": "criterion", "points": 1.0}]} for i in range(n)]


def _read_only(monkeypatch, run):
    """Opening anything under ``run`` for writing fails as on a read-only mount (EROFS)."""
    real_open = runlock.os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(run)) and flags & (runlock.os.O_RDWR | runlock.os.O_WRONLY | runlock.os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(runlock.os, "open", read_only)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_data_file_with_a_byte_order_mark_is_read(tmp_path, suffix):
    rows = _rows(3)
    text = "".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows)
    path = tmp_path / f"rubrics{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # what Notepad and Excel write
    assert [r["id"] for r in read_rubric_rows(path)] == ["row-0", "row-1", "row-2"]


def test_prompts_dropped_as_too_long_are_counted(tmp_path):
    from setgrpo_verl.runner.datasplit import split_drop_line

    short, long = _rows(30, words=0), [{**r, "id": f"long-{i}"} for i, r in enumerate(_rows(15, words=60))]
    path = tmp_path / "rubrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in short + long))
    split = split_data(data=path, model_path=embedded_model_dir(), max_prompt_length=80, calibration_prompts=10,
                       seed=0)
    assert split["too_long"] == 15 and len(split["calibration"]) + len(split["train"]) == 30
    assert split_drop_line(split) == (
        "[setgrpo-verl] data: dropped 15 of 45 prompts (33 %) whose chat-formatted prompt exceeds --max-prompt-length "
        "80 tokens (data.max_prompt_length); raise --max-prompt-length to keep them")
    write_data(tmp_path / "run", split)
    assert json.loads((tmp_path / "run" / "data" / "split.json").read_text())["too_long_removed"] == 15
    split["too_long"] = 0
    assert split_drop_line(split) is None


def test_a_full_disk_during_the_data_split_names_the_path_and_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    """The parquet writer fails after the first file, as on a file system without room (pyarrow's OSError)."""
    from setgrpo_verl import grading

    real = grading.write_verl_parquet
    calls = []

    def full(rows, path):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(rows, path)

    monkeypatch.setattr(grading, "write_verl_parquet", full)
    run = tmp_path / "run"
    assert cli.main(["calibrate", "--profile", "smoke", "--run-dir", str(run), "--judge", "rules", "--flip-prob",
                     "0.06"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write the data split to {run / 'data'}: No space left on device (errno ENOSPC, " in err, err
    assert "MiB free there); free space" in err and "its partial files were removed" in err
    assert "Traceback" not in err and not (run / "data").exists()


def test_a_read_only_run_directory_is_named_and_report_writes_elsewhere(tmp_path, capsys, monkeypatch):
    """A run directory on a read-only mount (EROFS; root ignores file modes, so the mount is stood in for): the lock
    cannot be taken, which the error says with the fix; report --out writes elsewhere without the lock."""
    run = tmp_path / "ro"
    run.mkdir()
    _read_only(monkeypatch, run)
    assert cli.main(["report", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the run directory's lock (every command but a dry run takes it) to "
                          f"{run / 'LOCK'}: Read-only file system: the directory is not writable for this user"), err
    assert "report --out DIR" in err and "Traceback" not in err
    # with --out, a directory nobody here can write needs no lock: the report says what is missing, written elsewhere
    monkeypatch.setattr("setgrpo_verl.runner.writes.writable", lambda path: False)
    assert cli.main(["report", "--run-dir", str(run), "--out", str(tmp_path / "elsewhere")]) == 2
    err = capsys.readouterr().err
    assert "no finished calibration stage" in err and "LOCK" not in err, err


def _finished_comparison(run):
    from setgrpo_verl.rundir import COMPLETE

    from .test_compare import _metrics

    for arm, gain in (("grpo", 0.02), ("setgrpo_paper", 0.0)):
        _metrics(run / "compare" / f"{arm}_s0", [0.5, 0.5 + gain / 2, 0.5 + gain])
    assert (run / "compare" / "grpo_s0" / COMPLETE).is_file()
    return ["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "setgrpo_paper", "--seeds",
            "0", "--analysis-only"]


def test_a_full_disk_during_the_analysis_names_it_and_leaves_no_outcome(tmp_path, capsys, monkeypatch):
    from setgrpo_verl.report import outcome

    run = tmp_path / "run"
    argv = _finished_comparison(run)

    def full(curves, path):
        open(path, "wb").close()  # PIL created the file, then the disk was full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outcome, "plot_outcome", full)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the comparison's analysis to {run / 'outcome'}: No space left on "
                          "device (errno ENOSPC"), err
    assert not (run / "outcome").exists()


def test_the_analysis_of_a_read_only_run_directory_goes_to_out(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    argv = _finished_comparison(run)
    _read_only(monkeypatch, run)
    assert cli.main(argv) == 2
    assert "compare --analysis-only --out DIR" in capsys.readouterr().err
    monkeypatch.setattr("setgrpo_verl.runner.writes.writable", lambda path: False)
    assert cli.main([*argv, "--out", str(tmp_path / "analysis")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("outcome: grpo 0.020")
    assert (tmp_path / "analysis" / "outcome.json").is_file() and not (run / "outcome").exists()
