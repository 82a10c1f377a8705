"""``python -m setgrpo_verl ...``: the same command line as ``setgrpo-verl`` (see :mod:`setgrpo_verl.runner.cli`)."""

import sys

from .runner.cli import main

sys.exit(main())
