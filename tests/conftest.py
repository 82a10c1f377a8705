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


def pytest_collection_modifyitems(config, items):
    """xdist groups for pyproject's ``--dist loadgroup``: every test that holds ``serial_main_ppo`` runs on one worker,
    one module after the other, so the other worker runs the rest of the suite instead of waiting for the lock; every
    other module's tests stay together on one worker, so a module's fixtures are built once. The verl runs' group is
    collected first, so that it starts at once: it is the suite's longest chain."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = "main_ppo" if "serial_main_ppo" in item.fixturenames else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group").args[0] != "main_ppo")


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
