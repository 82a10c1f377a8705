"""Suite-wide test settings."""

import fcntl
import os
import tempfile

import pytest
import torch

# CI runs `pytest -n 2` on 2 cores: one intra-op thread per worker avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# verl's file logger writes <project>/<experiment>.jsonl under the working directory when a run names no
# VERL_FILE_LOGGER_PATH (verl's defaults: verl_examples/gsm8k.jsonl): any such run of the suite, and the Ray workers
# it starts, writes into a temporary folder instead of the repository.
os.environ.setdefault("VERL_FILE_LOGGER_ROOT", tempfile.mkdtemp(prefix="setgrpo_verl_tests_file_logger_"))


#: The modules whose tests run verl's ``main_ppo`` or need a quiet machine (they hold ``serial_main_ppo``); collection
#: checks the list against the modules that hold the fixture.
MAIN_PPO_MODULES = frozenset({
    "tests/runner/test_compare_e2e.py",
    "tests/runner/test_smoke_e2e.py",
    "tests/verl_cpu/test_fsdp_sketches.py",
    "tests/verl_cpu/test_grpo_main_ppo.py",
    "tests/verl_cpu/test_rollout_batching.py",
    "tests/verl_cpu/test_setgrpo_main_ppo.py",
    "tests/verl_cpu/test_stop_and_resume.py",
    "tests/verl_cpu/test_validate_main_ppo.py",
})

#: The xdist work unit of ``MAIN_PPO_MODULES``.
MAIN_PPO_SCOPE = "main_ppo"


def pytest_collection_modifyitems(config, items):
    """A test that holds ``serial_main_ppo`` outside ``MAIN_PPO_MODULES``, or a listed module none of whose tests hold
    it, is a usage error: the schedule below would run it beside a verl run."""
    holders = {item.nodeid.split("::")[0] for item in items if "serial_main_ppo" in item.fixturenames}
    collected = {item.nodeid.split("::")[0] for item in items}
    wrong = sorted(holders - MAIN_PPO_MODULES) + sorted((MAIN_PPO_MODULES & collected) - holders)
    if wrong:
        raise pytest.UsageError(f"tests/conftest.py MAIN_PPO_MODULES disagrees with the modules that hold "
                                f"serial_main_ppo about {wrong}: list a module there exactly when its tests hold it")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # an xdist hook; tryfirst: before xdist's own scheduler choice
def pytest_xdist_make_scheduler(config, log):
    """pyproject's ``--dist loadfile`` with the modules of ``MAIN_PPO_MODULES`` as one work unit, handed out first:
    one worker runs the verl runs one after the other (the suite's longest chain) while the other runs the rest,
    instead of the two taking turns on the lock."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class VerlRunsOnOneWorker(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return MAIN_PPO_SCOPE if module in MAIN_PPO_MODULES else module

        def _assign_work_unit(self, node) -> None:
            if MAIN_PPO_SCOPE in self.workqueue:
                self.workqueue.move_to_end(MAIN_PPO_SCOPE, last=False)
            super()._assign_work_unit(node)

    return VerlRunsOnOneWorker(config, log)


@pytest.fixture(scope="module")
def serial_main_ppo():
    """Held by a test module for all its runs of verl's ``main_ppo``: each run starts a Ray instance of about a dozen
    processes (several GB), so the xdist workers take turns instead of running two at once on a 2-core machine."""
    with open(os.path.join(tempfile.gettempdir(), "setgrpo_verl_tests_main_ppo.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
