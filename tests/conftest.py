"""Suite-wide test settings."""

import fcntl
import os
import tempfile
from pathlib import Path

import pytest
import torch

# CI runs `pytest -n 2` on 2 cores: one intra-op thread per worker avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# verl's file logger writes <project>/<experiment>.jsonl under the working directory when a run names no
# VERL_FILE_LOGGER_PATH (verl's defaults: verl_examples/gsm8k.jsonl): any such run of the suite, and the Ray workers
# it starts, writes into a temporary folder instead of the repository.
os.environ.setdefault("VERL_FILE_LOGGER_ROOT", tempfile.mkdtemp(prefix="setgrpo_verl_tests_file_logger_"))
# verl's default trainer.logger names wandb, which the check before Ray refuses without a key: the tests' compositions
# keep that default and log nowhere (tests/integration/test_run_env.py unsets it to test the refusal)
os.environ.setdefault("WANDB_MODE", "disabled")


#: The modules whose tests run verl's ``main_ppo`` (they hold ``serial_main_ppo``), in two chains of about equal
#: length (about 20 minutes each on a 2-core CPU). A chain's modules run one after the other; the two chains may run
#: beside each other. Both runs of the embedded 135M policy (several GB each) are in the first chain, so no two of
#: them overlap; the rest are tiny random models' runs. Collection checks the list against the fixture's holders.
MAIN_PPO_CHAINS = {
    "tests/runner/test_smoke_e2e.py": "verl_runs_1",
    "tests/runner/test_compare_e2e.py": "verl_runs_1",
    "tests/verl_cpu/test_validate_main_ppo.py": "verl_runs_1",
    "tests/verl_cpu/test_fsdp_sketches.py": "verl_runs_1",
    "tests/verl_cpu/test_stop_and_resume.py": "verl_runs_2",
    "tests/verl_cpu/test_setgrpo_main_ppo.py": "verl_runs_2",
    "tests/verl_cpu/test_grpo_main_ppo.py": "verl_runs_2",
}

#: The repository root: ``MAIN_PPO_CHAINS`` names modules relative to it, whatever rootdir pytest was given.
_REPO = Path(__file__).resolve().parents[1]


def _module(rootpath: Path, nodeid: str) -> str:
    """The module of a test node id (relative to pytest's ``rootpath``) as ``MAIN_PPO_CHAINS`` names it."""
    path = (Path(rootpath) / nodeid.split("::", 1)[0]).resolve()
    return path.relative_to(_REPO).as_posix() if path.is_relative_to(_REPO) else path.as_posix()


def pytest_collection_modifyitems(config, items):
    """A test that holds ``serial_main_ppo`` outside ``MAIN_PPO_CHAINS``, or a listed module none of whose tests hold
    it, is a usage error: the schedule below would run it beside a verl run of its own chain."""
    holders = {_module(config.rootpath, item.nodeid) for item in items if "serial_main_ppo" in item.fixturenames}
    collected = {_module(config.rootpath, item.nodeid) for item in items}
    wrong = sorted(holders - MAIN_PPO_CHAINS.keys()) + sorted((MAIN_PPO_CHAINS.keys() & collected) - holders)
    if wrong:
        raise pytest.UsageError(f"tests/conftest.py MAIN_PPO_CHAINS disagrees with the modules that hold "
                                f"serial_main_ppo about {wrong}: list a module there exactly when its tests hold it")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # an xdist hook; tryfirst: before xdist's own scheduler choice
def pytest_xdist_make_scheduler(config, log):
    """pyproject's ``--dist loadfile`` with each chain of ``MAIN_PPO_CHAINS`` as one work unit, the chains handed out
    first: the suite's two longest units start at once, one per worker, and the other modules fill in after them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    chains = sorted(set(MAIN_PPO_CHAINS.values()), reverse=True)

    class VerlRunChainsFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return MAIN_PPO_CHAINS.get(_module(config.rootpath, nodeid), nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            for chain in chains:
                if chain in self.workqueue:
                    self.workqueue.move_to_end(chain, last=False)
            super()._assign_work_unit(node)

    return VerlRunChainsFirst(config, log)


@pytest.fixture(scope="module")
def serial_main_ppo(request):
    """Held by a test module for all its runs of verl's ``main_ppo``: each run starts a Ray instance of about a dozen
    processes, so the modules of one chain of ``MAIN_PPO_CHAINS`` take turns under any schedule (at most one run of
    the embedded policy at a time, and at most two runs on a 2-core machine)."""
    chain = MAIN_PPO_CHAINS[_module(request.config.rootpath, request.node.nodeid)]
    with open(os.path.join(tempfile.gettempdir(), f"setgrpo_verl_tests_{chain}.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
