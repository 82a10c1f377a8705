"""The CPU backend's verl overrides at the path the README and docs/verl_integration.md name.

The launcher itself is :mod:`setgrpo_verl.runner.launch`.
"""

from .runner.launch import cpu_overrides

__all__ = ["cpu_overrides"]
