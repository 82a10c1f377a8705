"""Suite-wide test settings."""

import os

import torch

# CI runs `pytest -n 2` on 2 cores: one intra-op thread per worker avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
