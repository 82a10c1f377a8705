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
