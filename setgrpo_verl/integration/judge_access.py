"""How verl's reward workers reach an HTTP judge: its URL on a multi-node run, and its key
(docs/verl_integration.md#the-judge-on-a-cluster).

verl 0.9.1 places reward workers on every node, so a judge URL on the loopback interface (``localhost``,
``127.0.0.0/8``, ``::1``, ``0.0.0.0``) reaches the judge from one node only: :func:`loopback_judge_error` refuses it
before Ray when ``trainer.nnodes > 1``.

:func:`probe_judge` sends an HTTP judge one tiny rubric before Ray starts (the Hydra callback, and the command line
before it writes anything), so that a wrong URL, model or key fails in seconds rather than after a full rollout;
``SETGRPO_SKIP_JUDGE_PROBE=1`` (:data:`SKIP_PROBE_ENV`) leaves it out where the judge was just probed.

The workers of a Ray cluster do not inherit the shell of the driver, so ``OPENAI_API_KEY`` set there does not reach
them. :func:`pass_judge_key` adds it to the job's Ray runtime environment through Ray's runtime-env hook
(``RAY_RUNTIME_ENV_HOOK``, which ``ray.init`` calls on the job's runtime environment), after verl printed its
``ray.init`` arguments: the key is never in the command line, verl's printed config, a log or the record. Other
variables the workers need from the driver (wandb's key, the policy files' fingerprints) travel the same way
(:func:`forward_to_ray`).
"""

from __future__ import annotations

import importlib
import ipaddress
import os
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

__all__ = ["JUDGE_KEY_ENV", "SKIP_PROBE_ENV", "check_judge_access", "describe_judge", "forward_to_ray",
           "is_loopback_host", "judge_probe_line", "loopback_judge_error", "pass_judge_key", "probe_judge",
           "remote_judge", "runtime_env_with_judge_key", "skip_probe"]

#: The environment variable the HTTP judge reads its key from (``setgrpo_verl.grading.http_judge``).
JUDGE_KEY_ENV = "OPENAI_API_KEY"
#: Set to 1 where ``main_ppo`` starts to leave out the Hydra callback's judge probe (the command line sets it for the
#: stage it starts right after its own probe).
SKIP_PROBE_ENV = "SETGRPO_SKIP_JUDGE_PROBE"
#: Ray's environment variable naming a ``module.function`` that ``ray.init`` calls on the job's runtime environment.
RAY_HOOK_ENV = "RAY_RUNTIME_ENV_HOOK"
#: Where :func:`pass_judge_key` keeps a hook that was set before it, which its own hook calls first.
PREVIOUS_HOOK_ENV = "SETGRPO_PREVIOUS_RAY_RUNTIME_ENV_HOOK"
#: The names (comma-separated) of the variables the hook copies from the driver's environment into the job's.
FORWARD_ENV = "SETGRPO_RAY_FORWARD"
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
    forward_to_ray([JUDGE_KEY_ENV], environ)
    return True


def forward_to_ray(names: list[str], environ: Optional[dict] = None) -> None:
    """Arrange for the next ``ray.init`` of this process to give every Ray worker the variables ``names`` from the
    driver's environment (as they are when ``ray.init`` runs), through Ray's runtime-env hook; a hook set before is
    kept and called first, and a variable the runtime environment sets already keeps its value.

    Args:
        names: environment variable names.
        environ: the environment to change (``os.environ``).
    """
    environ = os.environ if environ is None else environ
    listed = [n for n in (environ.get(FORWARD_ENV) or "").split(",") if n]
    environ[FORWARD_ENV] = ",".join(dict.fromkeys([*listed, *names]))
    current = environ.get(RAY_HOOK_ENV)
    if current and current != _HOOK:
        environ[PREVIOUS_HOOK_ENV] = current
    environ[RAY_HOOK_ENV] = _HOOK


def runtime_env_with_judge_key(runtime_env: Optional[dict]) -> dict:
    """Ray's runtime-env hook: ``runtime_env`` (after a hook set before :func:`forward_to_ray`) with ``env_vars`` of
    every variable :func:`forward_to_ray` named (``OPENAI_API_KEY`` by :func:`pass_judge_key`) that this process's
    environment sets, unless the runtime environment sets it already."""
    previous = os.environ.get(PREVIOUS_HOOK_ENV)
    if previous:
        module, _, name = previous.rpartition(".")
        runtime_env = getattr(importlib.import_module(module), name)(runtime_env)
    runtime_env = dict(runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    for name in [n for n in (os.environ.get(FORWARD_ENV) or "").split(",") if n]:
        if os.environ.get(name) and name not in env_vars:
            env_vars[name] = os.environ[name]
    runtime_env["env_vars"] = env_vars
    return runtime_env


def remote_judge(grader: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The config of the HTTP judge a grader calls (an ``openai`` grader, or one under ``noisy`` graders), or None
    for a grader that calls none (``rules``, ``function``, ``local_hf``, ``noisy`` over those)."""
    while str(grader.get("type", "")) == "noisy" and isinstance(grader.get("base"), Mapping):
        grader = grader["base"]
    return grader if str(grader.get("type", "")) == "openai" else None


def describe_judge(grader: Mapping[str, Any]) -> str:
    """A grader as error messages name it: ``judge '<model>' at <base_url>`` for an HTTP judge, else its type."""
    judge = remote_judge(grader)
    if judge is None:
        return f"the {grader.get('type')!r} grader"
    return f"judge {judge.get('model')!r} at {judge.get('base_url')}"


def skip_probe(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when :data:`SKIP_PROBE_ENV` is set to 1 (or true / yes) in ``environ`` (``os.environ``)."""
    value = (os.environ if environ is None else environ).get(SKIP_PROBE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


#: What a failed probe tells a Hydra user to change.
HYDRA_PROBE_FIX = ("fix reward.reward_kwargs.grader.base_url (the server's OpenAI-compatible /v1 endpoint, reachable "
                   "from every node) or .model (a name the server serves), export " + JUDGE_KEY_ENV + " where main_ppo "
                   "starts if the judge needs a key, or set " + SKIP_PROBE_ENV + "=1 to start without the probe")


def probe_judge(grader: Mapping[str, Any], *, fix: str = HYDRA_PROBE_FIX) -> bool:
    """Score one tiny rubric with the HTTP judge ``grader`` calls, before verl starts
    (docs/verl_integration.md#the-judge-on-a-cluster): a wrong URL, model name or key fails in seconds instead of
    after a full rollout. The key is read from ``OPENAI_API_KEY`` and never named.

    Args:
        grader: the grader config (``reward.reward_kwargs.grader``).
        fix: what the error tells the user to change (the Hydra keys; the command line names its flags).

    Returns:
        True when a judge was probed; False for a grader that calls none (:func:`remote_judge`).

    Raises:
        ValueError: the judge failed the probe, naming the model, the URL, the HTTP status or connection error, and
            the fixes.
    """
    from setgrpo_verl.grading import DualScorer, GradingError

    judge = remote_judge(grader)
    if judge is None:
        return False
    probe = {"question": "Say hello.", "id": "probe", "rubrics": [{"criterion": "The response greets.", "points": 1}]}
    try:
        DualScorer(dict(judge), scoring_indices=(0,)).score([None], ["Hello!"], [probe])
    except (GradingError, OSError, ValueError) as exc:
        named = describe_judge(grader)
        said = str(exc) if named in str(exc) else f"{named}: {exc}"  # the judge's errors name it already
        raise ValueError(f"the judge failed a probe request before Ray started: {said}. To start: {fix}") from None
    return True


def judge_probe_line(grader: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> str:
    """Probe the HTTP judge ``grader`` calls unless :data:`SKIP_PROBE_ENV` is set in ``environ`` (``os.environ``),
    and say what was done: probed, skipped, or no HTTP judge to probe.

    Raises:
        ValueError: the judge failed the probe (:func:`probe_judge`).
    """
    if remote_judge(grader) is None:
        return f"judge probe: none ({describe_judge(grader)} calls no HTTP judge)"
    if skip_probe(environ):
        return f"judge probe: skipped ({SKIP_PROBE_ENV}=1): {describe_judge(grader)} was not probed"
    probe_judge(grader)
    return f"judge probe: {describe_judge(grader)} answered a probe request"
