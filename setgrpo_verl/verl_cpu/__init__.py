"""A CPU backend for verl 0.9.1, so that ``python -m verl.trainer.main_ppo`` runs its whole loop without accelerators.

Active only in processes whose environment has ``VERL_PLATFORM=cpu`` (the launcher sets it together with
``trainer.device=cpu``; Ray hands the driver's environment to every worker), so GPU runs are untouched. Then the
``setgrpo`` verl plugin calls :func:`activate` before it registers anything else, which

* registers the verl platform ``cpu`` (:mod:`setgrpo_verl.verl_cpu.platform`: gloo collectives, a logical Ray
  ``GPU`` resource per actor rank) and gives each of verl's worker ranks its share of the node's cores as torch
  threads (Ray starts actors with one);
* registers verl's FSDP / FSDP2 language-model engine for the device ``cpu``, with the padded log-probs and
  entropies computed in row chunks (:mod:`setgrpo_verl.verl_cpu.engine`, the same values);
* registers the ``transformers`` rollout (:mod:`setgrpo_verl.verl_cpu.rollout`: batched Hugging Face generation in
  a Ray actor, the actor's weights written into a buffer it shares with the worker on the same host every step);
* fixes verl's process-group backend string for the CPU (:mod:`setgrpo_verl.verl_cpu._patches`, the one place
  where verl internals without a public hook are touched, checked against the verl version).

This module imports nothing from verl at import time and no Ray actor class at all: a process that imports the
rollout server first (Ray does, to rebuild the actor) imports verl through it, verl loads the plugin, and the plugin
finds this module complete and calls :func:`activate`; a process that imports verl first gets the same result. See ``docs/verl_integration.md#cpu-backend`` for the verl
settings a CPU run needs (the launcher, :mod:`setgrpo_verl.runner.launch`, applies them).
"""

from __future__ import annotations

import os

__all__ = ["CPU_PLATFORM", "ROLLOUT_NAME", "activate", "requested"]

#: Value of ``VERL_PLATFORM`` and ``trainer.device`` that selects this backend.
CPU_PLATFORM = "cpu"

#: ``actor_rollout_ref.rollout.name`` of the transformers rollout.
ROLLOUT_NAME = "transformers"


def requested() -> bool:
    """True when this process runs verl on the CPU (``VERL_PLATFORM=cpu`` in the environment)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM


def _load_replica():
    from .rollout import TransformersReplica

    return TransformersReplica


def activate() -> None:
    """Register the CPU platform, engine and rollout with verl and patch its process-group backend (idempotent).

    Raises:
        RuntimeError: the installed verl is not the version the patches were written for.
    """
    # the platform first: verl's engine modules ask for the platform while they are imported
    from . import platform  # importing it registers PlatformCPU

    platform.set_rank_threads()

    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from . import _patches
    from .engine import CPUEngineWithLMHead

    _patches.patch_process_group()
    _patches.register_rollout_class(ROLLOUT_NAME, "setgrpo_verl.verl_cpu.rollout.TransformersRolloutAdapter")
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    registered = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        if CPU_PLATFORM not in registered.get(backend, {}):
            EngineRegistry.register(model_type="language_model", backend=backend, device=CPU_PLATFORM)(
                CPUEngineWithLMHead
            )
