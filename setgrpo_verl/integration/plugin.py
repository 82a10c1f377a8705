"""verl plugin entry point (``[project.entry-points."verl.plugins"] setgrpo``).

verl 0.9.1 loads every ``verl.plugins`` entry point at ``import verl`` -- in the driver and in every Ray
worker -- unless ``VERL_USE_EXTERNAL_PLUGINS=none``. Importing this module registers:

* the advantage estimator ``setgrpo`` (``verl.trainer.ppo.core_algos`` registry),
* the dual-reward manager (``verl.experimental.reward_loop.reward_manager`` registry),
* the trainer mode ``setgrpo`` (``verl.trainer.ppo.v1.register_trainer``), whose actor worker is
  :class:`setgrpo_verl.integration.worker.SetGRPOActorRolloutRefWorker`.

verl only logs a failing plugin at DEBUG level, so every failure here is logged at ERROR level with its
traceback (stderr via verl's root logging config) before it is re-raised.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

logger = logging.getLogger("setgrpo_verl.plugin")

#: Modules whose import performs the registrations, in order.
PLUGIN_MODULES = (
    "setgrpo_verl.integration.estimator",
    # --- dual-reward manager: written by the grading issue (issue 5); registered on import. ---
    "setgrpo_verl.integration.reward_manager",
    "setgrpo_verl.integration.trainer",
)


def _load(module: str, call: str | None = None) -> Exception | None:
    try:
        loaded = importlib.import_module(module)
        if call is not None:
            getattr(loaded, call)()
        return None
    except Exception as exc:
        message = (
            f"setgrpo_verl verl plugin FAILED to load {module}: {type(exc).__name__}: {exc}. "
            "What it registers (the setgrpo estimator, the setgrpo_dual reward manager, the setgrpo trainer "
            "mode or the CPU backend) is unavailable in this process. "
            "(verl itself only logs plugin failures at DEBUG level.)"
        )
        logger.error(message + "\n" + traceback.format_exc())
        return exc


#: The verl release this integration is built and tested against (the trainer mode overrides its v1 internals).
VERL_VERSION = "0.9.1"

_verl = sys.modules.get("verl")
if _verl is not None and getattr(_verl, "__version__", VERL_VERSION) != VERL_VERSION:
    logger.warning(
        "setgrpo_verl is built against verl %s but verl %s is installed: install verl[verl-core]==%s",
        VERL_VERSION, _verl.__version__, VERL_VERSION,
    )

# A CPU run (VERL_PLATFORM=cpu) needs verl's CPU platform before any module asks verl for its platform.
# It is registered first, and a failure stops the plugin: every later verl call would pick the wrong device.
if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    _cpu_failure = _load("setgrpo_verl.verl_cpu", call="activate")
    if _cpu_failure is not None:
        raise ImportError("setgrpo_verl verl plugin failed to activate the CPU backend") from _cpu_failure

# Load every module even if one fails (a broken reward manager must not hide the estimator), then fail.
_failures = {m: e for m in PLUGIN_MODULES if (e := _load(m)) is not None}
if _failures:
    raise ImportError(f"setgrpo_verl verl plugin failed to load {sorted(_failures)}") from next(iter(_failures.values()))
