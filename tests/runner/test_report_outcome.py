"""``setgrpo-verl report --outcome`` on the committed comparison runs (docs/outcome.md#through-verl-the-runs): the
command alone, with no script outside the repository, re-analyses the run folders to the committed analysis."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from setgrpo_verl.runner import cli

COMMITTED = Path(__file__).resolve().parents[2] / "validation" / "outcome_verl" / "flip0.06"


def test_report_outcome_re_analyses_the_committed_run_folders(tmp_path, capsys):
    runs = tmp_path / "flip0.06"
    for run in sorted(COMMITTED.glob("*_s[0-9]")):
        shutil.copytree(run, runs / run.name)
    assert len(list(runs.iterdir())) == 6  # two seeds of three arms

    assert cli.main(["report", "--outcome", str(runs)]) == 0
    assert (runs / "outcome.txt").read_text() == (COMMITTED / "outcome.txt").read_text()
    fresh, committed = (json.loads((d / "outcome.json").read_text()) for d in (runs, COMMITTED))
    assert fresh.keys() == committed.keys() and fresh["steps"] == committed["steps"] == 100
    assert (runs / "outcome.png").stat().st_size > 10_000
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == \
        (COMMITTED / "outcome.txt").read_text().rstrip().splitlines()[-1]
