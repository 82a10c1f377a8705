"""Reading a dotted key of a verl config: one reader for the checks before Ray and on the workers.

A leaf module (no import of the package), so that the GPU check a worker runs before any model loads stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["config_value"]


def config_value(node: Any, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` (e.g. ``"actor_rollout_ref.actor.strategy"``) of a config: an OmegaConf node, a
    mapping or an object with attributes, or ``default`` where a part is missing or the value is None."""
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node
