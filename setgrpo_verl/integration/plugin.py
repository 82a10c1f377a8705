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

In the driver of ``python -m verl.trainer.main_ppo`` the plugin also makes ``algorithm.adv_estimator=setgrpo`` on
verl's default ``ppo_trainer`` config run SetGRPO's config, ``setgrpo_trainer`` (:func:`redirect_invocation`).
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
#: The config that ``main_ppo`` on verl's default config runs when it is asked for the setgrpo estimator.
SETGRPO_CONFIG = "setgrpo_trainer"
#: verl 0.9.1's ``main_ppo`` default: ``@hydra.main(config_path="config", config_name="ppo_trainer")``.
STOCK_CONFIG = "ppo_trainer"
#: The one line logged when ``main_ppo`` on verl's default config runs SetGRPO's config instead.
REDIRECT_MESSAGE = (
    "setgrpo_verl: algorithm.adv_estimator=setgrpo on verl's default ppo_trainer config runs SetGRPO's config, "
    "exactly as `--config-name setgrpo_trainer` (verl's ppo_trainer plus algorithm.setgrpo)"
)
_CONFIG_NAME_FLAGS = ("--config-name", "-cn")
_CONFIG_PATH_FLAGS = ("--config-path", "-cp")


def _main_ppo_arguments(orig_argv: list[str]) -> list[str] | None:
    """The command-line arguments after ``verl.trainer.main_ppo`` when this process runs it, else None."""
    for i, arg in enumerate(orig_argv):
        if arg == "-m" and i + 1 < len(orig_argv):
            return orig_argv[i + 2:] if orig_argv[i + 1] == "verl.trainer.main_ppo" else None
        if arg.endswith(os.path.join("verl", "trainer", "main_ppo.py")):
            return orig_argv[i + 1:]
    return None


def _flag(arguments: list[str], i: int, flags: tuple[str, ...]) -> tuple[str | None, int]:
    """``(value, tokens)`` when ``arguments[i]`` is one of ``flags`` (``--flag value`` or ``--flag=value``)."""
    flag, eq, value = arguments[i].partition("=")
    if flag not in flags:
        return None, 0
    if eq:
        return value, 1
    return (arguments[i + 1], 2) if i + 1 < len(arguments) else ("", 1)


def stock_config_requests_setgrpo(arguments: list[str]) -> bool:
    """True when ``main_ppo`` arguments select the ``setgrpo`` estimator on verl's default ``ppo_trainer`` config.

    Any other ``--config-name`` (``setgrpo_trainer`` or a user's own config) and any ``--config-path`` (the user's
    own config directory) is left to Hydra and the config's own checks.
    """
    config_name = STOCK_CONFIG
    estimator = None
    i = 0
    while i < len(arguments):
        name, used = _flag(arguments, i, _CONFIG_NAME_FLAGS)
        if used:
            config_name, i = name, i + used
            continue
        if _flag(arguments, i, _CONFIG_PATH_FLAGS)[1]:
            return False
        flag, eq, value = arguments[i].partition("=")
        if flag.lstrip("+") == "algorithm.adv_estimator" and eq:
            estimator = value.strip("'\"")
        i += 1
    return estimator == "setgrpo" and config_name.removesuffix(".yaml") == STOCK_CONFIG


def setgrpo_arguments(arguments: list[str]) -> list[str]:
    """``arguments`` with the config name set to :data:`SETGRPO_CONFIG` (any ``--config-name ppo_trainer`` replaced);
    the overrides stay as given, so ``algorithm.setgrpo.*`` keys need no ``+``."""
    kept = []
    i = 0
    while i < len(arguments):
        used = _flag(arguments, i, _CONFIG_NAME_FLAGS)[1]
        if not used:
            kept.append(arguments[i])
        i += used or 1
    return [f"--config-name={SETGRPO_CONFIG}", *kept]


def redirect_invocation(orig_argv: list[str] | None = None, argv: list[str] | None = None) -> bool:
    """Make ``python -m verl.trainer.main_ppo algorithm.adv_estimator=setgrpo ...`` on verl's default config run
    :data:`SETGRPO_CONFIG`, logging :data:`REDIRECT_MESSAGE` once (stderr).

    verl's ``main_ppo`` is ``@hydra.main(config_name="ppo_trainer")``, and Hydra lets ``--config-name`` on the command
    line choose another config; Hydra reads ``sys.argv`` when ``main()`` is called, after ``import verl`` has loaded
    this plugin. So the driver's ``argv`` (``sys.argv``, edited in place) gets ``--config-name=setgrpo_trainer`` in
    front of the user's overrides, and the run is the one ``--config-name setgrpo_trainer`` composes. Other
    processes (Ray workers, other programs), other estimators and a user's own ``--config-name`` or
    ``--config-path`` are left alone.

    Args:
        orig_argv: the process's command line (default ``sys.orig_argv``), to recognise ``main_ppo``.
        argv: the list Hydra parses (default ``sys.argv``), edited in place.

    Returns:
        True when the arguments were redirected.
    """
    arguments = _main_ppo_arguments(list(sys.orig_argv if orig_argv is None else orig_argv))
    if arguments is None or not stock_config_requests_setgrpo(arguments):
        return False
    argv = sys.argv if argv is None else argv
    argv[1:] = setgrpo_arguments(argv[1:])
    print(REDIRECT_MESSAGE, file=sys.stderr, flush=True)
    return True


# ---------------------------------------------------------------------------------------------- on import
redirect_invocation()

_verl = sys.modules.get("verl")
if _verl is not None and getattr(_verl, "__version__", VERL_VERSION) != VERL_VERSION:
    logger.warning(
        "setgrpo_verl is built against verl %s but verl %s is installed: install verl[verl-core]==%s",
        VERL_VERSION, _verl.__version__, VERL_VERSION,
    )

install()
