"""``python -m setgrpo_verl ...``: the same command line as ``setgrpo-verl`` (see :mod:`setgrpo_verl.cli`)."""

import sys

from .cli import main

sys.exit(main())
