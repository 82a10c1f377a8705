"""On a cluster verl's TaskRunner does not inherit the driver's shell: a wandb logger without a key is refused before
Ray, a key (from the environment or `wandb login`'s ~/.netrc) reaches every Ray worker through the job's runtime
environment, and on several nodes run folders on a node-local file system are refused."""

from __future__ import annotations

import pytest

from setgrpo_verl.integration import run_env
from setgrpo_verl.integration.judge_access import runtime_env_with_judge_key
from setgrpo_verl.integration.run_check import check_run_config
from tests.integration.test_pre_ray_checks import LOCAL, _compose

GRPO = ("algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=graded_sync", "+reward.reward_kwargs.scorings=1")
WANDB = "trainer.logger=[console,wandb]"
MOUNTS = "/dev/sda1 / ext4 rw 0 0\nnfs:/export /shared nfs4 rw 0 0\n"


@pytest.fixture
def shell(monkeypatch, tmp_path):
    """A driver shell with no wandb key and no ~/.netrc (HOME is empty)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", run_env.SHARED_FS_ENV, "RAY_RUNTIME_ENV_HOOK", "SETGRPO_RAY_FORWARD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("VERL_PLATFORM", "cpu")  # no GPU checks here
    return tmp_path


def test_wandb_without_a_key_is_refused_before_ray(shell, monkeypatch):
    cfg = _compose(LOCAL, *GRPO, WANDB)
    with pytest.raises(ValueError, match=r"trainer.logger names wandb, but there is no wandb key where main_ppo "
                                         r"starts .*export WANDB_API_KEY"):
        check_run_config(cfg)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_run_config(cfg) is None
    assert check_run_config(_compose(LOCAL, *GRPO)) is None  # no wandb asked: nothing needed


@pytest.mark.parametrize("where", ["environment", "netrc"])
def test_the_wandb_key_reaches_every_ray_worker(shell, monkeypatch, where):
    if where == "environment":
        monkeypatch.setenv("WANDB_API_KEY", "wk-test")
    else:
        (shell / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password wk-test\n")
        (shell / ".netrc").chmod(0o600)
    monkeypatch.setenv("WANDB_ENTITY", "lab")
    cfg = _compose(LOCAL, *GRPO, WANDB)
    assert check_run_config(cfg) is None
    import os

    environ = dict(os.environ)
    assert run_env.pass_run_env(cfg, environ) == ["WANDB_API_KEY", "WANDB_ENTITY"]
    for name in ("RAY_RUNTIME_ENV_HOOK", "SETGRPO_RAY_FORWARD", "WANDB_API_KEY"):
        monkeypatch.setenv(name, environ[name])
    job = runtime_env_with_judge_key({"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})["env_vars"]
    assert job == {"TOKENIZERS_PARALLELISM": "true", "WANDB_API_KEY": "wk-test", "WANDB_ENTITY": "lab"}
    assert "wk-test" not in str(cfg)


def test_run_folders_on_a_node_local_file_system_are_refused_on_several_nodes(shell, monkeypatch):
    cfg = _compose(LOCAL, *GRPO, "trainer.logger=[console,file]", "trainer.nnodes=2", "trainer.default_local_dir=/home/u/runs/x",
                   "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=/shared/runs/x/metrics.jsonl")
    with pytest.raises(ValueError, match=r"trainer.default_local_dir: /home/u/runs/x is on a node-local file system "
                                         r"\(ext4\), but trainer.nnodes=2"):
        run_env.check_run_env(cfg, {}, MOUNTS)
    cfg.trainer.default_local_dir = "/shared/runs/x"
    run_env.check_run_env(cfg, {}, MOUNTS)
    cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH = "/tmp/x/metrics.jsonl"
    with pytest.raises(ValueError, match=r"VERL_FILE_LOGGER_PATH: /tmp/x is on a node-local file system"):
        run_env.check_run_env(cfg, {}, MOUNTS)
    run_env.check_run_env(cfg, {run_env.SHARED_FS_ENV: "1"}, MOUNTS)  # the user says it is shared
    cfg.trainer.nnodes = 1
    run_env.check_run_env(cfg, {}, MOUNTS)  # one node: every folder is the TaskRunner's own
