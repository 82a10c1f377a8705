"""What verl's TaskRunner and workers need from the driver's environment on a cluster
(docs/verl_integration.md#loggers-on-a-cluster): wandb's key, and run folders every node can write.

verl 0.9.1 calls ``wandb.init`` in its TaskRunner, a Ray actor that does not inherit the driver's shell: on a cluster
started with ``ray start`` (or on several nodes) neither ``WANDB_API_KEY`` nor ``~/.netrc`` of the driver reaches it,
and the run would fail after the models and vLLM are up. :func:`check_run_env` refuses before Ray a wandb logger
with no key where ``main_ppo`` starts; :func:`pass_run_env` hands the key (from the environment or from
``wandb login``'s ``~/.netrc``) and the other ``WANDB_*`` settings to every Ray worker through the job's runtime
environment (:func:`~.judge_access.forward_to_ray`), never through the command line or the config.

On several nodes verl's TaskRunner (the file and tensorboard loggers, the SetGRPO record and state) and its workers
(checkpoints) write into the run's folders from whichever node they run on: :func:`check_run_env` refuses folders on
a node-local file system with ``trainer.nnodes > 1``, unless ``SETGRPO_SHARED_FS=1`` says they are shared.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from .dotted import config_value
from .judge_access import forward_to_ray

__all__ = ["SHARED_FS_ENV", "WANDB_KEY_ENV", "check_run_env", "local_file_system", "pass_run_env", "wandb_key"]

WANDB_KEY_ENV = "WANDB_API_KEY"
#: wandb's host in ``~/.netrc`` (``wandb login`` writes it there).
_WANDB_HOST = "api.wandb.ai"
#: Set to 1 where ``main_ppo`` starts when the run's folders are on a file system every node shares that
#: :func:`local_file_system` takes for a local one.
SHARED_FS_ENV = "SETGRPO_SHARED_FS"
#: File systems that live on one machine.
_LOCAL_TYPES = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs", "devtmpfs"}


def _wandb_asked(config: Any) -> bool:
    loggers = config_value(config, "trainer.logger", [])
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    return "wandb" in [str(x) for x in loggers]


def wandb_key(environ: Mapping[str, str], home: Optional[str] = None) -> Optional[str]:
    """The wandb key where ``main_ppo`` starts: ``WANDB_API_KEY``, else the password of ``api.wandb.ai`` in
    ``~/.netrc`` (``home``: the home directory, default ``$HOME``); None when neither holds one."""
    if environ.get(WANDB_KEY_ENV):
        return environ[WANDB_KEY_ENV]
    path = Path(home or environ.get("HOME") or os.path.expanduser("~")) / ".netrc"
    try:
        entry = netrc.netrc(str(path)).authenticators(_WANDB_HOST)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry and entry[2] else None


def local_file_system(path: str, mounts: Optional[str] = None) -> Optional[str]:
    """The type of the node-local file system that holds ``path`` (``"xfs"``), or None when it is another (NFS,
    Lustre, ...), from ``/proc/mounts`` (or its text ``mounts``): the longest mount point above the path."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    target, best, kind = os.path.abspath(path), "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, parts[2]
    return kind if kind in _LOCAL_TYPES else None


def _run_folders(config: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """The folders the TaskRunner and the workers write, by the setting that names them."""
    env = config_value(config, "ray_kwargs.ray_init.runtime_env.env_vars", {}) or {}
    folders = {"trainer.default_local_dir": config_value(config, "trainer.default_local_dir")}
    for name in ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR"):
        value = env.get(name) if hasattr(env, "get") else None
        value = value or environ.get(name)
        if value:
            folders[name] = str(Path(value).parent) if name == "VERL_FILE_LOGGER_PATH" else value
    return {k: str(v) for k, v in folders.items() if v}


def check_run_env(config: Any, environ: Optional[Mapping[str, str]] = None, mounts: Optional[str] = None) -> None:
    """Refuse, before Ray, what the TaskRunner could not do on a cluster (module docstring).

    Args:
        config: the composed verl config (``trainer.logger``, ``trainer.nnodes``, the run's folders).
        environ: where ``main_ppo`` starts (``os.environ``).
        mounts: the text of ``/proc/mounts`` (read when None).

    Raises:
        ValueError: ``trainer.logger`` names wandb, ``WANDB_MODE`` is not offline or disabled, and there is no wandb
            key (``WANDB_API_KEY`` or ``~/.netrc``); with ``trainer.nnodes > 1``, a run folder on a node-local file
            system (naming the setting, the path, the file system and the fixes).
    """
    environ = os.environ if environ is None else environ
    mode = str(environ.get("WANDB_MODE", "")).lower()
    if _wandb_asked(config) and mode not in ("offline", "disabled", "dryrun") and not wandb_key(environ):
        raise ValueError(
            "trainer.logger names wandb, but there is no wandb key where main_ppo starts (WANDB_API_KEY, or "
            "`wandb login`'s ~/.netrc): verl's TaskRunner would fail at wandb.init after the models and vLLM are up; "
            "export WANDB_API_KEY (it reaches every Ray worker through the job's runtime environment), set "
            "WANDB_MODE=offline, or drop wandb from trainer.logger")
    nnodes = int(config_value(config, "trainer.nnodes", 1) or 1)
    if nnodes <= 1 or str(environ.get(SHARED_FS_ENV, "")).strip() == "1":
        return
    for key, folder in _run_folders(config, environ).items():
        kind = local_file_system(folder, mounts)
        if kind:
            raise ValueError(
                f"{key}: {folder} is on a node-local file system ({kind}), but trainer.nnodes={nnodes}: verl's "
                "TaskRunner and workers write the run's metrics, record and checkpoints there from other nodes too; "
                f"put the run's folders (RUN_ROOT in the recipes) on a file system every node mounts (NFS, Lustre, "
                f"...), or set {SHARED_FS_ENV}=1 where main_ppo starts if it is one")


def pass_run_env(config: Any, environ: Optional[dict] = None) -> list[str]:
    """With a wandb logger, give every Ray worker the wandb key (from ``~/.netrc`` into ``WANDB_API_KEY`` when only
    there) and every ``WANDB_*`` setting of the driver's environment, through the job's runtime environment
    (:func:`~.judge_access.forward_to_ray`). Returns the names forwarded (none without wandb)."""
    environ = os.environ if environ is None else environ
    if not _wandb_asked(config):
        return []
    key = wandb_key(environ)
    if key and not environ.get(WANDB_KEY_ENV):
        environ[WANDB_KEY_ENV] = key
    names = sorted(n for n in environ if n.startswith("WANDB_") and environ[n])
    if names:
        forward_to_ray(names, environ)
    return names
