"""verl plugin entry point (``[project.entry-points."verl.plugins"] setgrpo``).

verl 0.9.1 imports every ``verl.plugins`` entry point at ``import verl`` -- in the driver, its TaskRunner and
every Ray worker -- unless ``VERL_USE_EXTERNAL_PLUGINS=none``. Importing this module must therefore be cheap:
it imports nothing beyond the standard library. Each registration in :data:`REGISTRATIONS` runs when verl's
own registry module finishes importing (a post-import hook), so it is in place wherever verl looks it up and
its cost (the SetGRPO core, the trainer, the grading stack) is paid only by processes that use that registry:

* the advantage estimator ``setgrpo`` -- when ``verl.trainer.ppo.core_algos`` is imported
  (``ADV_ESTIMATOR_REGISTRY``, ``get_adv_estimator_fn``);
* the dual-reward manager ``setgrpo_dual`` -- when ``verl.experimental.reward_loop.reward_manager`` is imported
  (``REWARD_MANAGER``, ``get_reward_manager_cls``);
* the trainer mode ``setgrpo`` -- when ``verl.trainer.ppo.v1`` is imported (``TRAINER_REGISTRY``,
  ``get_trainer_cls``); its actor worker is :class:`setgrpo_verl.integration.worker.SetGRPOActorRolloutRefWorker`;
* in a CPU run (``VERL_PLATFORM=cpu``) the CPU backend of :mod:`setgrpo_verl.verl_cpu`, before anything else.

A registry module that is already imported when the plugin loads gets its registration at once. verl only
logs a failing plugin at DEBUG level, so every failure here is logged at ERROR level with its traceback; the
registry module itself still imports (verl stays usable for other estimators, managers and trainers).

In the driver of ``python -m verl.trainer.main_ppo`` the plugin also stops the one invocation that cannot
work -- ``algorithm.adv_estimator=setgrpo`` on verl's stock ``ppo_trainer`` config -- before Hydra and Ray
start, with one line naming the fix (:func:`check_invocation`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass

logger = logging.getLogger("setgrpo_verl.plugin")

#: The verl release this integration is built and tested against (the trainer mode overrides its v1 internals).
VERL_VERSION = "0.9.1"


@dataclass(frozen=True)
class Registration:
    """One thing the plugin registers in verl.

    Attributes:
        when: the verl module holding the registry; the registration runs right after it is imported.
        target: ``"module"`` whose import performs the registration, or ``"module:function"`` to import the
            module and call ``function()`` with no arguments.
        what: what gets registered, for error messages.
    """

    when: str
    target: str
    what: str


#: Everything the plugin registers. To add one, append a :class:`Registration`.
REGISTRATIONS: tuple[Registration, ...] = (
    Registration(
        when="verl.trainer.ppo.core_algos",
        target="setgrpo_verl.integration.estimator",
        what="the setgrpo advantage estimator",
    ),
    Registration(
        when="verl.experimental.reward_loop.reward_manager",
        target="setgrpo_verl.integration.reward_manager",
        what="the setgrpo_dual reward manager",
    ),
    Registration(
        when="verl.trainer.ppo.v1",
        target="setgrpo_verl.integration.trainer",
        what="the setgrpo trainer mode",
    ),
)


#: The CPU backend (:mod:`setgrpo_verl.verl_cpu`): registered first, and only in the processes of a CPU run
#: (``VERL_PLATFORM=cpu``), because verl resolves its platform once per process and GPU runs must stay untouched.
#: ``verl.plugin.platform`` is imported by ``import verl`` itself, so this runs when the plugin loads.
CPU_BACKEND = Registration(
    when="verl.plugin.platform",
    target="setgrpo_verl.verl_cpu:activate",
    what="the CPU backend for verl (platform, engine, transformers rollout)",
)


def registrations() -> tuple[Registration, ...]:
    """What this process registers: :data:`CPU_BACKEND` first in a CPU run, then :data:`REGISTRATIONS`."""
    cpu = os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"
    return ((CPU_BACKEND,) if cpu else ()) + REGISTRATIONS


def run_registration(registration: Registration) -> bool:
    """Perform one registration now; log a failure at ERROR level with its traceback instead of raising.

    Returns:
        True when the registration succeeded.
    """
    module, _, function = registration.target.partition(":")
    try:
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
        return True
    except Exception as exc:
        logger.error(
            "setgrpo_verl verl plugin FAILED to load %s: %s: %s. %s is unavailable in this process. "
            "(verl itself only logs plugin failures at DEBUG level.)\n%s",
            registration.target, type(exc).__name__, exc, registration.what[:1].upper() + registration.what[1:],
            traceback.format_exc(),
        )
        return False


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs registrations right after their verl registry module has been executed.

    It finds nothing itself: for a watched module name it asks the other finders for the real spec and wraps the
    loader's ``exec_module``; after the module body ran, the original loader is put back on the module and the
    registrations for that name run. Unwatched names cost one dict lookup.
    """

    def __init__(self) -> None:
        self.pending: dict[str, list[Registration]] = {}
        self._lock = threading.RLock()

    def watch(self, registration: Registration) -> None:
        with self._lock:
            self.pending.setdefault(registration.when, []).append(registration)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(loader, self)
        return spec

    def module_executed(self, name: str) -> None:
        with self._lock:
            registrations = self.pending.pop(name, [])
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        for registration in registrations:
            run_registration(registration)


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader and reports when the module body has finished executing."""

    def __init__(self, loader, finder: _PostImportFinder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder.module_executed(module.__name__)

    def __getattr__(self, name):
        return getattr(self._loader, name)


_finder = _PostImportFinder()


def install(wanted: tuple[Registration, ...] | None = None) -> None:
    """Register now what verl has already imported; hook the rest to the import of its registry module.

    Args:
        wanted: the registrations; None means :func:`registrations`.
    """
    for registration in registrations() if wanted is None else wanted:
        if registration.when in sys.modules:
            run_registration(registration)
        else:
            _finder.watch(registration)
    if _finder.pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


# ---------------------------------------------------------------------------------------------- stock invocation
#: The one line printed when ``main_ppo`` is asked for SetGRPO on verl's stock config.
STOCK_CONFIG_MESSAGE = (
    "error: algorithm.adv_estimator=setgrpo needs SetGRPO's Hydra config, which verl's default ppo_trainer lacks: "
    "add `--config-name setgrpo_trainer` to this python -m verl.trainer.main_ppo command"
)
_CONFIG_NAME_FLAGS = ("--config-name", "-cn")


def _main_ppo_arguments(orig_argv: list[str]) -> list[str] | None:
    """The command-line arguments after ``verl.trainer.main_ppo`` when this process runs it, else None."""
    for i, arg in enumerate(orig_argv):
        if arg == "-m" and i + 1 < len(orig_argv):
            return orig_argv[i + 2:] if orig_argv[i + 1] == "verl.trainer.main_ppo" else None
        if arg.endswith(os.path.join("verl", "trainer", "main_ppo.py")):
            return orig_argv[i + 1:]
    return None


def stock_config_requests_setgrpo(arguments: list[str]) -> bool:
    """True when ``main_ppo`` arguments select the ``setgrpo`` estimator on verl's default ``ppo_trainer`` config.

    Any other ``--config-name`` (``setgrpo_trainer`` or a user's own config) is left to Hydra and the config's
    own checks.
    """
    config_name = "ppo_trainer"
    estimator = None
    for i, arg in enumerate(arguments):
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_NAME_FLAGS:
            config_name = value if eq else (arguments[i + 1] if i + 1 < len(arguments) else "")
        elif flag.lstrip("+") == "algorithm.adv_estimator" and eq:
            estimator = value.strip("'\"")
    return estimator == "setgrpo" and config_name.removesuffix(".yaml") == "ppo_trainer"


def check_invocation(orig_argv: list[str] | None = None) -> None:
    """Exit with :data:`STOCK_CONFIG_MESSAGE` (status 2) when this process is ``main_ppo`` on the stock config
    with ``algorithm.adv_estimator=setgrpo``; such a run would otherwise start Ray and fail only at the first
    advantage computation."""
    arguments = _main_ppo_arguments(list(sys.orig_argv if orig_argv is None else orig_argv))
    if arguments is not None and stock_config_requests_setgrpo(arguments):
        print(STOCK_CONFIG_MESSAGE, file=sys.stderr, flush=True)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- on import
check_invocation()

_verl = sys.modules.get("verl")
if _verl is not None and getattr(_verl, "__version__", VERL_VERSION) != VERL_VERSION:
    logger.warning(
        "setgrpo_verl is built against verl %s but verl %s is installed: install verl[verl-core]==%s",
        VERL_VERSION, _verl.__version__, VERL_VERSION,
    )

install()
