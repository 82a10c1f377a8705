"""The judge is probed before Ray on the Hydra path too: main_ppo's callback sends an HTTP judge one tiny rubric and
refuses, naming the model, the URL and the HTTP status or connection error, before any worker starts; the command
line's first stage, started right after its own probe, skips it; the key is never written."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from setgrpo_verl.integration import run_check
from setgrpo_verl.integration.judge_access import (JUDGE_KEY_ENV, SKIP_PROBE_ENV, describe_judge, judge_probe_line,
                                                   probe_judge, remote_judge)

from ..stub_judge import StubJudge
from .test_pre_ray_checks import CAL_ONLY, _compose

SECRET = "sk-do-not-print-0123456789"


def _free_port() -> int:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openai(url: str, **extra) -> dict:
    return {"type": "openai", "base_url": url, "model": "judge-m", "max_retries": 0, "timeout": 5.0, **extra}


def _callback(grader: dict, monkeypatch) -> None:
    """The Hydra callback on a config with this grader (the config check itself is the composed test's)."""
    cfg = OmegaConf.create({"reward": {"reward_manager": {"name": "setgrpo_dual"}, "reward_kwargs": {"grader": grader}}})
    monkeypatch.setattr(run_check, "check_run_config", lambda config: None)
    run_check.SetGRPOConfigCheck().on_job_start(cfg)


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.setenv(JUDGE_KEY_ENV, SECRET)
    monkeypatch.delenv(SKIP_PROBE_ENV, raising=False)
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", "")  # pass_judge_key sets it; restored after the test


def test_the_callback_refuses_an_unreachable_judge_naming_model_url_and_the_fix(environment, monkeypatch, capsys):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(SystemExit) as info:
        _callback(_openai(url), monkeypatch)
    message = str(info.value)
    assert message.startswith("setgrpo_verl judge error: the judge failed a probe request before Ray started: "
                              f"judge 'judge-m' at {url} could not be reached (no HTTP status)")
    assert "APIConnectionError" in message
    assert "reward.reward_kwargs.grader.base_url" in message and f"{SKIP_PROBE_ENV}=1" in message
    assert SECRET not in message + "".join(capsys.readouterr())


@pytest.mark.parametrize("status", [401, 404, 503])
def test_the_callback_refuses_a_judge_that_answers_an_error_naming_its_status(environment, monkeypatch, capsys, status):
    with StubJudge() as judge:
        with pytest.raises(SystemExit) as info:
            _callback(_openai(judge.url(f"status-{status}")), monkeypatch)
    message = str(info.value)
    assert f"judge 'judge-m' at {judge.url(f'status-{status}')}" in message and f"HTTP {status}" in message
    assert f"stub refusal {status}" in message  # the server's own words
    assert len(judge.requests) == 1  # max_retries=0: one request, 4xx and 5xx alike
    assert judge.requests[0]["authorization"] == f"Bearer {SECRET}"  # the key went to the judge, and nowhere else
    assert SECRET not in message + "".join(capsys.readouterr())


def test_a_judge_that_answers_passes_and_the_line_says_it_was_probed(environment, monkeypatch, capsys):
    with StubJudge() as judge:
        _callback(_openai(judge.url()), monkeypatch)
    out = capsys.readouterr().out
    assert f"[setgrpo-verl] judge probe: judge 'judge-m' at {judge.url()} answered a probe request" in out
    assert len(judge.requests) == 1 and judge.requests[0]["body"]["model"] == "judge-m"
    assert SECRET not in out


def test_the_probe_is_skipped_when_asked_and_the_line_says_so(environment, monkeypatch, capsys):
    monkeypatch.setenv(SKIP_PROBE_ENV, "1")
    url = f"http://127.0.0.1:{_free_port()}/v1"  # would fail a probe
    _callback(_openai(url), monkeypatch)
    assert (f"[setgrpo-verl] judge probe: skipped ({SKIP_PROBE_ENV}=1): judge 'judge-m' at {url} was not probed"
            in capsys.readouterr().out)


def test_only_graders_that_call_an_http_judge_are_probed(monkeypatch):
    with StubJudge() as judge:
        noisy = {"type": "noisy", "flip_prob": 0.1, "seed": 0, "base": _openai(judge.url())}
        assert remote_judge(noisy)["base_url"] == judge.url() and probe_judge(noisy)  # the judge under the noise
        assert len(judge.requests) == 1
    for grader in ({"type": "rules"}, {"type": "local_hf"}, {"type": "function", "path": "f.py"},
                   {"type": "noisy", "flip_prob": 0.1, "base": {"type": "rules"}}):
        assert remote_judge(grader) is None and not probe_judge(grader)
        assert judge_probe_line(grader, {}).startswith("judge probe: none (")
    assert describe_judge({"type": "rules"}) == "the 'rules' grader"


def test_the_callback_probes_after_the_composed_config_passes_its_check(environment, capsys):
    """A calibration-only run composed as main_ppo composes it, with an HTTP judge that refuses every request: the
    check before Ray passes, then the probe stops the run before Ray."""
    with StubJudge() as judge:
        url = judge.url("status-401")
        cfg = _compose(CAL_ONLY, f"+reward.reward_kwargs.grader={{type:openai,base_url:'{url}',model:judge-m,"
                                 "max_retries:0}")
        with pytest.raises(SystemExit, match=r"judge 'judge-m' at .* answered HTTP 401"):
            run_check.SetGRPOConfigCheck().on_job_start(cfg)
    assert len(judge.requests) == 1
    assert SECRET not in OmegaConf.to_yaml(cfg) + "".join(capsys.readouterr())


def test_the_command_line_skips_the_probe_only_in_the_stage_it_starts_after_its_own(monkeypatch, tmp_path):
    from setgrpo_verl.runner import run as run_module
    from setgrpo_verl.runner import stages

    seen = []
    monkeypatch.setattr(stages, "run_stage", lambda run_dir, stage, cmd, env, **kw: seen.append((stage, dict(env))))
    monkeypatch.delenv(SKIP_PROBE_ENV, raising=False)
    commands = [("calibrate_train", ["main_ppo"]), ("grpo", ["main_ppo"])]
    for judge, first in (("openai", "1"), ("local", None)):
        seen.clear()
        run_module.run_stages(SimpleNamespace(run_dir=tmp_path, judge=judge, verbose=False), commands, None)
        assert [env.get(SKIP_PROBE_ENV) for _, env in seen] == [first, None]
