"""Every row the dual-reward manager returns carries the same reward_extra_info keys, a calibration row whose grading
failed included: verl 0.9.1's colocated reward path (``RewardLoopManager.compute_rm_score``,
verl/experimental/reward_loop/reward_loop.py) builds the extra fields from the first row's keys."""

from __future__ import annotations

import numpy as np
import pytest

from setgrpo_verl.integration.reward_config import GRADING_ERROR_KEY

from .test_grading_failures import _failing_worker, _score


def _verl_extras(outputs: list[dict]) -> dict:
    """verl 0.9.1's assembly of the extra fields of a colocated reward batch (reward_loop.py, compute_rm_score)."""
    infos = [output.get("reward_extra_info", {}) for output in outputs]
    return {key: np.array([info[key] for info in infos]) for key in list(infos[0].keys())}


@pytest.mark.parametrize("texts", [["fine", "fail here"], ["fail here", "fine"]])
def test_a_failed_calibration_row_carries_the_keys_of_a_graded_one(tmp_path, texts):
    outputs = _score(_failing_worker(tmp_path), texts, calibration=True)
    graded, failed = sorted((o["reward_extra_info"] for o in outputs), key=lambda e: bool(e[GRADING_ERROR_KEY]))
    assert set(failed) == set(graded)
    extras = _verl_extras(outputs)  # raised KeyError when the failed row lacked the graded row's keys
    bad = texts.index("fail here")
    assert extras["reference_score"][bad] is None and extras["score"][bad] is None
    assert extras["reference_score"][1 - bad] == 0.5 and "judge down" in extras[GRADING_ERROR_KEY][bad]
