"""Every reward worker reaches the judge: a loopback judge URL is refused on several nodes, and the judge's key goes
to the Ray workers through the job's runtime environment, never through the config or the command line."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from setgrpo_verl.integration import judge_access
from setgrpo_verl.integration.judge_access import (JUDGE_KEY_ENV, PREVIOUS_HOOK_ENV, RAY_HOOK_ENV, is_loopback_host,
                                                   loopback_judge_error, pass_judge_key, runtime_env_with_judge_key)

OPENAI = {"type": "openai", "base_url": "http://judge.internal:8000/v1", "model": "Qwen/Qwen3-8B"}


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "judge.localhost", "127.0.0.1", "127.8.9.10", "::1",
                                  "[::1]", "0.0.0.0", "::"])
def test_loopback_hosts(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["judge.internal", "10.0.0.5", "192.168.1.2", "fe80::1", "localhost-judge", "", None])
def test_reachable_hosts(host):
    assert not is_loopback_host(host)


def test_a_loopback_judge_is_refused_only_on_several_nodes():
    assert loopback_judge_error("http://127.0.0.1:8000/v1", 1) is None
    text = loopback_judge_error("http://127.0.0.1:8000/v1", 2)
    assert "trainer.nnodes=2" in text and "reward workers on every node" in text and "JUDGE_BASE_URL" in text
    assert loopback_judge_error("http://[::1]:8000/v1", 4) is not None
    assert loopback_judge_error("http://judge.internal:8000/v1", 4) is None


def test_the_key_is_added_to_the_runtime_env_by_ray_init(monkeypatch):
    """pass_judge_key sets Ray's runtime-env hook; ray.init (through the function it calls on the job's runtime env)
    then gives every worker the key; a key set in the runtime env already wins."""
    from ray._private import worker as ray_worker

    environ = {JUDGE_KEY_ENV: "sk-test"}
    assert pass_judge_key(OPENAI, environ) and environ[RAY_HOOK_ENV] == f"{judge_access.__name__}.runtime_env_with_judge_key"
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    verl_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "true"}, "working_dir": None}
    out = ray_worker._maybe_modify_runtime_env(verl_env, _skip_env_hook=False)
    assert out["env_vars"] == {"TOKENIZERS_PARALLELISM": "true", JUDGE_KEY_ENV: "sk-test"}
    assert verl_env["env_vars"] == {"TOKENIZERS_PARALLELISM": "true"}  # what verl printed is left as it was
    assert runtime_env_with_judge_key({"env_vars": {JUDGE_KEY_ENV: "sk-own"}})["env_vars"][JUDGE_KEY_ENV] == "sk-own"
    assert runtime_env_with_judge_key(None)["env_vars"] == {JUDGE_KEY_ENV: "sk-test"}


def _previous_hook(runtime_env):
    return {**(runtime_env or {}), "env_vars": {**(runtime_env or {}).get("env_vars", {}), "FROM_PREVIOUS": "1"}}


def test_a_hook_set_before_runs_first(monkeypatch):
    environ = {JUDGE_KEY_ENV: "sk-test", RAY_HOOK_ENV: f"{__name__}._previous_hook"}
    assert pass_judge_key(OPENAI, environ)
    assert environ[PREVIOUS_HOOK_ENV] == f"{__name__}._previous_hook"
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert runtime_env_with_judge_key({})["env_vars"] == {"FROM_PREVIOUS": "1", JUDGE_KEY_ENV: "sk-test"}


def test_nothing_to_pass_without_an_http_judge_or_a_key():
    assert not pass_judge_key(OPENAI, {}) and not pass_judge_key({"type": "local_hf"}, {JUDGE_KEY_ENV: "sk"})


def test_the_hydra_callback_passes_the_key_after_its_check(monkeypatch):
    from setgrpo_verl.integration import run_check

    cfg = OmegaConf.create({"reward": {"reward_manager": {"name": "setgrpo_dual"},
                                       "reward_kwargs": {"grader": dict(OPENAI)}}})
    monkeypatch.setattr(run_check, "check_run_config", lambda config: None)
    monkeypatch.setenv(RAY_HOOK_ENV, "")  # restored (unset) after the test
    monkeypatch.setenv(JUDGE_KEY_ENV, "sk-test")
    monkeypatch.setenv("SETGRPO_SKIP_JUDGE_PROBE", "1")  # the probe itself: test_judge_probe.py
    run_check.SetGRPOConfigCheck().on_job_start(cfg)
    assert os.environ[RAY_HOOK_ENV].endswith("runtime_env_with_judge_key")
    assert "sk-test" not in OmegaConf.to_yaml(cfg)
