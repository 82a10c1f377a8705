"""``setgrpo-verl compare`` end to end on the smoke profile: two arms, one seed, two steps, a small held-out set."""

import json

import pytest

from setgrpo_verl.runner import cli

# compare starts verl runs (a Ray instance each): one at a time with the other runs of its chain (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]


def test_compare_runs_two_arms_and_reads_their_held_out_truth_reward(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["compare", "--run-dir", str(run), "--profile", "smoke", "--flip-prob", "0.05", "--arms", "grpo",
            "setgrpo_reliability", "--seeds", "0", "--steps", "2", "--val-every", "1", "--heldout-prompts", "6"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("outcome: setgrpo_reliability ") and out[-1].endswith("(held-out truth reward gain, "
                                                                                       "1 seed, 2 steps)")
    result = json.loads((run / "outcome" / "outcome.json").read_text())
    assert [r["arm"] for r in result["arms"]] == ["setgrpo_reliability", "grpo"]
    for r in result["arms"]:
        assert 0.0 <= r["start"] <= 1.0 and 0.0 <= r["end"] <= 1.0 and r["calls_per_step"] > 0
    assert not (run / "compare" / "grpo_s0" / "checkpoints").exists()
    # a second call keeps both finished runs and analyses them again
    assert cli.main([*argv, "--resume"]) == 0
    assert "is complete, kept" in capsys.readouterr().out
