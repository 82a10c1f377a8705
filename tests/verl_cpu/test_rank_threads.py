"""verl's worker ranks on a CPU node share its cores as torch threads, instead of Ray's one thread per actor."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from setgrpo_verl.verl_cpu.platform import rank_threads, set_rank_threads

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cpus", "ranks", "threads"), [(2, 1, 2), (2, 2, 1), (16, 4, 4), (16, 3, 5), (3, 4, 1)])
def test_the_ranks_on_a_node_share_its_cores(cpus, ranks, threads):
    assert rank_threads(cpus, ranks) == threads


def test_only_a_worker_rank_changes_its_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert set_rank_threads({}) is None
        assert torch.get_num_threads() == 1
        assert set_rank_threads({"RAY_LOCAL_WORLD_SIZE": "1"}) == CORES
        assert torch.get_num_threads() == CORES
        with pytest.raises(ValueError, match="RAY_LOCAL_WORLD_SIZE='two'"):
            set_rank_threads({"RAY_LOCAL_WORLD_SIZE": "two"})
        with pytest.raises(ValueError, match="RAY_LOCAL_WORLD_SIZE='0'"):
            set_rank_threads({"RAY_LOCAL_WORLD_SIZE": "0"})
    finally:
        torch.set_num_threads(before)


def _threads_after_importing_verl(**env: str) -> int:
    """torch threads of a fresh process started as Ray starts an actor (OMP_NUM_THREADS=1) once verl has loaded
    its plugins (this package's CPU backend among them)."""
    environ = {k: v for k, v in os.environ.items() if k != "RAY_LOCAL_WORLD_SIZE"}
    environ.update(OMP_NUM_THREADS="1", VERL_PLATFORM="cpu", **env)
    code = "import verl.trainer.ppo.core_algos, torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(CORES < 2, reason="one core: a rank's share and Ray's single thread are the same")
def test_a_verl_worker_rank_computes_on_every_core_of_its_share():
    assert _threads_after_importing_verl() == 1
    assert _threads_after_importing_verl(RAY_LOCAL_WORLD_SIZE="1") == CORES
    assert _threads_after_importing_verl(RAY_LOCAL_WORLD_SIZE=str(CORES)) == 1
