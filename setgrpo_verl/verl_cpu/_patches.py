"""The two places where verl 0.9.1 has no public extension point for a CPU backend, patched in one module.

1. ``verl.utils.distributed.initialize_global_process_group_ray`` builds the backend string
   ``"cpu:gloo,{device}:{backend}"``, which names the ``cpu`` device twice when the device is the CPU; the
   wrapper passes ``"cpu:gloo"`` instead.
2. ``verl.workers.rollout.base.get_rollout_class`` reads the private dict ``_ROLLOUT_REGISTRY``; the transformers
   rollout's adapter is added to it by its fully qualified name (imported only when a worker builds it).

Both are checked against the verl version they were written for and fail loudly if verl changed.
"""

from __future__ import annotations

import functools
import sys

#: The verl release whose internals these patches match.
PATCHED_VERL_VERSION = "0.9.1"


def _check_verl_version() -> None:
    import verl

    if verl.__version__ != PATCHED_VERL_VERSION:
        raise RuntimeError(
            f"setgrpo_verl.verl_cpu patches verl {PATCHED_VERL_VERSION} internals but verl {verl.__version__} is "
            f"installed: install verl[verl-core]=={PATCHED_VERL_VERSION} for CPU runs"
        )


def _cpu_backend(backend: str | None) -> str:
    """``"cpu:gloo,cpu:gloo"``-style strings (one entry per device) reduced to one entry per device."""
    if not backend:
        return "cpu:gloo"
    entries: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        entries.setdefault(device, name)
    return ",".join(f"{d}:{b}" if b else d for d, b in entries.items())


def patch_process_group() -> None:
    """Make verl's Ray process-group initialisation use one gloo backend on the CPU (idempotent).

    Modules that imported the function by name before this ran get the wrapper too.

    Raises:
        RuntimeError: verl is not the patched version, or the function no longer has the expected signature.
    """
    _check_verl_version()
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_setgrpo_cpu", False):
        return
    code = getattr(original, "__code__", None)
    if code is None or code.co_varnames[:2] != ("timeout_second", "backend"):
        raise RuntimeError(
            "verl.utils.distributed.initialize_global_process_group_ray changed its signature; "
            "setgrpo_verl.verl_cpu cannot fix its CPU backend string"
        )

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=_cpu_backend(backend))

    initialize_global_process_group_ray._setgrpo_cpu = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "initialize_global_process_group_ray", None) is original:
            module.initialize_global_process_group_ray = initialize_global_process_group_ray


def register_rollout_class(name: str, qualified_name: str) -> None:
    """Add ``(name, "async") -> qualified_name`` to verl's rollout-class table (idempotent).

    Raises:
        RuntimeError: verl is not the patched version or the table is gone.
    """
    _check_verl_version()
    from verl.workers.rollout import base

    table = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not isinstance(table, dict):
        raise RuntimeError(
            "verl.workers.rollout.base._ROLLOUT_REGISTRY is gone; setgrpo_verl.verl_cpu cannot register its rollout"
        )
    table[(name, "async")] = qualified_name
