"""How verl's reward workers reach an HTTP judge: its URL on a multi-node run, and its key
(docs/verl_integration.md#the-judge-on-a-cluster).

verl 0.9.1 places reward workers on every node, so a judge URL on the loopback interface (``localhost``,
``127.0.0.0/8``, ``::1``, ``0.0.0.0``) reaches the judge from one node only: :func:`loopback_judge_error` refuses it
before Ray when ``trainer.nnodes > 1``.

The workers of a Ray cluster do not inherit the shell of the driver, so ``OPENAI_API_KEY`` set there does not reach
them. :func:`pass_judge_key` adds it to the job's Ray runtime environment through Ray's runtime-env hook
(``RAY_RUNTIME_ENV_HOOK``, which ``ray.init`` calls on the job's runtime environment), after verl printed its
``ray.init`` arguments: the key is never in the command line, verl's printed config, a log or the record.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

__all__ = ["JUDGE_KEY_ENV", "check_judge_access", "is_loopback_host", "loopback_judge_error", "pass_judge_key", "runtime_env_with_judge_key"]

#: The environment variable the HTTP judge reads its key from (``setgrpo_verl.grading.http_judge``).
JUDGE_KEY_ENV = "OPENAI_API_KEY"
#: Ray's environment variable naming a ``module.function`` that ``ray.init`` calls on the job's runtime environment.
RAY_HOOK_ENV = "RAY_RUNTIME_ENV_HOOK"
#: Where :func:`pass_judge_key` keeps a hook that was set before it, which its own hook calls first.
PREVIOUS_HOOK_ENV = "SETGRPO_PREVIOUS_RAY_RUNTIME_ENV_HOOK"
_HOOK = f"{__name__}.runtime_env_with_judge_key"


def is_loopback_host(host: Optional[str]) -> bool:
    """True for a host name or address that means "this machine": ``localhost`` (and ``*.localhost``), an address
    in ``127.0.0.0/8``, ``::1`` or the unspecified ``0.0.0.0`` / ``::``."""
    if not host:
        return False
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def loopback_judge_error(base_url: Optional[str], nnodes: int) -> Optional[str]:
    """Why a judge at ``base_url`` cannot serve a run on ``nnodes`` nodes, or None.

    Args:
        base_url: the HTTP judge's ``base_url`` (``reward.reward_kwargs.grader.base_url``).
        nnodes: ``trainer.nnodes``.

    Returns:
        For more than one node and a loopback host, the message naming the URL and the fix; else None.
    """
    if nnodes <= 1 or not base_url:
        return None
    host = urlsplit(str(base_url)).hostname
    if not is_loopback_host(host):
        return None
    return (f"reward.reward_kwargs.grader.base_url={base_url} is a loopback address, but trainer.nnodes={nnodes}: "
            "verl places reward workers on every node, and those off the judge's node cannot reach it there; "
            "serve the judge on an address every node reaches (e.g. http://<judge host>:8000/v1, JUDGE_BASE_URL in "
            "the recipes)")


def check_judge_access(grader: Mapping[str, Any], nnodes: int) -> None:
    """Refuse, before Ray, a judge some reward worker could not use: a grader ``api_key`` in the config (printed with
    verl's config and kept in the command line; the key reaches the workers through :func:`pass_judge_key`) and an
    HTTP judge on a loopback address with ``nnodes > 1`` (:func:`loopback_judge_error`).

    Args:
        grader: the grader config (``reward.reward_kwargs.grader``).
        nnodes: ``trainer.nnodes``.

    Raises:
        ValueError: naming the key or the URL and the fix.
    """
    if grader.get("api_key") is not None:
        raise ValueError(
            "reward.reward_kwargs.grader.api_key: a key in the config is printed with verl's config and kept in the "
            f"command line; remove it and export {JUDGE_KEY_ENV} where main_ppo starts (it reaches every reward "
            "worker through Ray's runtime environment, docs/verl_integration.md#the-judge-on-a-cluster)"
        )
    if str(grader.get("type", "")) == "openai":
        error = loopback_judge_error(grader.get("base_url"), nnodes)
        if error:
            raise ValueError(error)


def pass_judge_key(grader: Mapping[str, Any], environ: Optional[dict] = None) -> bool:
    """Arrange for the next ``ray.init`` of this process to give every Ray worker ``OPENAI_API_KEY`` (an HTTP
    judge's key from the driver's environment), through Ray's runtime-env hook; a hook set before is kept and
    called first.

    Args:
        grader: the grader config (``reward.reward_kwargs.grader``); only an ``openai`` grader uses a key.
        environ: the environment to change (``os.environ``).

    Returns:
        True when the hook was set (an ``openai`` grader and a key in the environment).
    """
    environ = os.environ if environ is None else environ
    if str(grader.get("type", "")) != "openai" or not environ.get(JUDGE_KEY_ENV):
        return False
    current = environ.get(RAY_HOOK_ENV)
    if current and current != _HOOK:
        environ[PREVIOUS_HOOK_ENV] = current
    environ[RAY_HOOK_ENV] = _HOOK
    return True


def runtime_env_with_judge_key(runtime_env: Optional[dict]) -> dict:
    """Ray's runtime-env hook: ``runtime_env`` (after a hook set before :func:`pass_judge_key`) with
    ``env_vars.OPENAI_API_KEY`` from this process's environment, unless the runtime environment sets it already."""
    previous = os.environ.get(PREVIOUS_HOOK_ENV)
    if previous:
        module, _, name = previous.rpartition(".")
        runtime_env = getattr(importlib.import_module(module), name)(runtime_env)
    runtime_env = dict(runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    if os.environ.get(JUDGE_KEY_ENV) and JUDGE_KEY_ENV not in env_vars:
        env_vars[JUDGE_KEY_ENV] = os.environ[JUDGE_KEY_ENV]
    runtime_env["env_vars"] = env_vars
    return runtime_env
