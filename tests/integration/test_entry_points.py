"""verl's usual command lines: the Hydra search-path plugin, ``algorithm.adv_estimator=setgrpo`` on verl's default
config, and a cheap plugin import."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from setgrpo_verl.integration import plugin

MAIN_PPO = [sys.executable, "-m", "verl.trainer.main_ppo"]


def _run(argv: list[str], cwd, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ------------------------------------------------------------------------------------------------ Hydra search path
def test_search_path_plugin_is_discovered_by_hydra():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    found = {f"{p.__module__}.{p.__name__}" for p in Plugins.instance().discover(SearchPathPlugin)}
    assert "hydra_plugins.setgrpo_verl_searchpath.SetGRPOSearchPathPlugin" in found, found


_SETGRPO_OVERRIDES = ["algorithm.setgrpo.alpha=0.1", "algorithm.setgrpo.beta=0.2", "algorithm.setgrpo.delta=0.3",
                      "algorithm.setgrpo.sketch.copies=8", "algorithm.setgrpo.record_path=/runs/record.json"]


@pytest.mark.slow
def test_plain_main_ppo_command_composes_exactly_the_setgrpo_config(tmp_path):
    # the shortest documented forms, run from a directory that holds no config: only the plugins can find it
    named = _run([*MAIN_PPO, "--config-name", "setgrpo_trainer", *_SETGRPO_OVERRIDES, "--cfg", "job"], cwd=tmp_path)
    assert named.returncode == 0, named.stderr[-3000:]
    plain = _run([*MAIN_PPO, "algorithm.adv_estimator=setgrpo", *_SETGRPO_OVERRIDES, "--cfg", "job"], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    cfg = OmegaConf.create(named.stdout)
    assert OmegaConf.to_container(OmegaConf.create(plain.stdout)) == OmegaConf.to_container(cfg)
    assert plain.stderr.count(plugin.REDIRECT_MESSAGE) == 1 and plugin.REDIRECT_MESSAGE not in named.stderr
    assert (cfg.algorithm.setgrpo.alpha, cfg.algorithm.setgrpo.beta, cfg.algorithm.setgrpo.delta) == (0.1, 0.2, 0.3)
    assert cfg.algorithm.setgrpo.sketch.copies == 8 and cfg.algorithm.setgrpo.record_path == "/runs/record.json"
    assert cfg.algorithm.setgrpo.rho == 0.1  # untouched default
    assert cfg.algorithm.adv_estimator == "setgrpo" and cfg.trainer.v1.trainer_mode == "setgrpo"
    assert cfg.reward.reward_manager.name == "setgrpo_dual"
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256  # verl's own ppo_trainer underneath


@pytest.mark.slow
def test_plain_main_ppo_command_on_the_cpu_backend_composes_the_setgrpo_config(tmp_path):
    """``VERL_PLATFORM=cpu`` with the CPU overrides: the plain command still composes exactly ``setgrpo_trainer``."""
    from setgrpo_verl.launch import cpu_overrides

    cpu = {"VERL_PLATFORM": "cpu"}
    extra = [*cpu_overrides(precision="fp32"), *_SETGRPO_OVERRIDES, "--cfg", "job"]
    named = _run([*MAIN_PPO, "--config-name", "setgrpo_trainer", *extra], cwd=tmp_path, env=cpu)
    assert named.returncode == 0, named.stderr[-3000:]
    plain = _run([*MAIN_PPO, "algorithm.adv_estimator=setgrpo", *extra], cwd=tmp_path, env=cpu)
    assert plain.returncode == 0, plain.stderr[-3000:]
    cfg = OmegaConf.create(named.stdout)
    assert OmegaConf.to_container(OmegaConf.create(plain.stdout)) == OmegaConf.to_container(cfg)
    assert plain.stderr.count(plugin.REDIRECT_MESSAGE) == 1
    assert cfg.trainer.device == "cpu" and cfg.algorithm.setgrpo.beta == 0.2
    assert cfg.trainer.v1.trainer_mode == "setgrpo" and cfg.reward.reward_manager.name == "setgrpo_dual"


def test_main_ppo_default_config_name_fingerprint():
    """The redirect relies on verl 0.9.1's main_ppo composing ``ppo_trainer`` by default through ``hydra.main``
    (whose ``--config-name`` Hydra reads from ``sys.argv`` when ``main()`` is called)."""
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("verl.trainer.main_ppo").origin).read_text()
    assert '@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)' in source
    assert plugin.STOCK_CONFIG == "ppo_trainer"


# ------------------------------------------------------------------------------------------------ stock config
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["algorithm.adv_estimator=setgrpo"], True),
        (["algorithm.adv_estimator=setgrpo", "algorithm.setgrpo.beta=0.1"], True),
        (["++algorithm.adv_estimator='setgrpo'", "trainer.v1.trainer_mode=setgrpo"], True),
        (["--config-name=ppo_trainer", "algorithm.adv_estimator=setgrpo"], True),
        (["-cn", "ppo_trainer.yaml", "algorithm.adv_estimator=setgrpo"], True),
        (["--config-dir", "/extra", "algorithm.adv_estimator=setgrpo"], True),
        (["--config-name", "setgrpo_trainer", "algorithm.adv_estimator=setgrpo"], False),
        (["-cn", "setgrpo_trainer", "algorithm.adv_estimator=setgrpo"], False),
        (["--config-name=my_own", "algorithm.adv_estimator=setgrpo"], False),
        (["--config-path", "/mine", "algorithm.adv_estimator=setgrpo"], False),
        (["-cp=/mine", "-cn", "ppo_trainer", "algorithm.adv_estimator=setgrpo"], False),
        (["algorithm.adv_estimator=grpo"], False),
        ([], False),
    ],
)
def test_stock_config_detection(arguments, expected):
    assert plugin.stock_config_requests_setgrpo(arguments) is expected


def test_only_main_ppo_command_lines_are_redirected(capsys):
    assert plugin._main_ppo_arguments(["python", "-m", "verl.trainer.main_ppo", "a=1"]) == ["a=1"]
    assert plugin._main_ppo_arguments(["python", "/x/verl/trainer/main_ppo.py", "a=1"]) == ["a=1"]
    assert plugin._main_ppo_arguments(["python", "-m", "pytest", "algorithm.adv_estimator=setgrpo"]) is None
    assert plugin._main_ppo_arguments(["ray::default_worker.py"]) is None
    # while `python -m` imports the module's packages (and so verl's plugins), sys.argv[0] is "-m"
    for args in (["algorithm.adv_estimator=setgrpo", "x=1"], ["--config-name", "ppo_trainer", "x=1",
                                                             "algorithm.adv_estimator=setgrpo"]):
        argv = ["-m", *args]
        assert plugin.redirect_invocation(["python", "-m", "verl.trainer.main_ppo", *args], argv)
        assert argv[:2] == ["-m", "--config-name=setgrpo_trainer"]
        assert [a for a in argv[2:] if a not in ("--config-name", "ppo_trainer")] == [
            a for a in args if a not in ("--config-name", "ppo_trainer")]
        assert "--config-name" not in argv[2:] and "ppo_trainer" not in argv
    assert capsys.readouterr().err.splitlines() == [plugin.REDIRECT_MESSAGE] * 2
    # a user's own config, other estimators and other programs are left alone
    for orig in (["python", "-m", "verl.trainer.main_ppo", "--config-name", "mine", "algorithm.adv_estimator=setgrpo"],
                 ["python", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo"],
                 ["python", "-m", "pytest", "algorithm.adv_estimator=setgrpo"]):
        argv = ["-m", *orig[3:]]
        assert not plugin.redirect_invocation(orig, argv) and argv == ["-m", *orig[3:]]
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------------ cheap plugin import
_MODULES = "import json, sys, verl; print(json.dumps(sorted(sys.modules)))"


@pytest.mark.slow
def test_plugin_import_adds_only_its_own_module(tmp_path):
    on = set(json.loads(_run([sys.executable, "-c", _MODULES], cwd=tmp_path).stdout.splitlines()[-1]))
    off_proc = _run([sys.executable, "-c", _MODULES], cwd=tmp_path, env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    off = set(json.loads(off_proc.stdout.splitlines()[-1]))
    assert "setgrpo_verl.integration.plugin" in on and "setgrpo_verl.integration.plugin" not in off
    extra = on - off
    ours = {"setgrpo_verl", "setgrpo_verl.integration", "setgrpo_verl.integration.plugin"}
    assert {m for m in extra if m.split(".")[0] not in sys.stdlib_module_names} == ours, sorted(extra)
    # the registries stay unimported (their hooks pending) and so does everything the registrations need
    for heavy in ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.v1", "verl.experimental.reward_loop.reward_manager",
                  "verl.workers.engine_workers", "setgrpo_verl.core", "setgrpo_verl.grading", "scipy.stats"):
        assert heavy not in on, heavy


# ------------------------------------------------------------------------------------------------ post-import hooks
@pytest.fixture
def demo_modules(tmp_path, monkeypatch):
    (tmp_path / "setgrpo_demo_registry.py").write_text("REGISTRY = []\n")
    (tmp_path / "setgrpo_demo_target.py").write_text(
        "import setgrpo_demo_registry\n"
        "def register():\n    setgrpo_demo_registry.REGISTRY.append('demo')\n"
        "def broken():\n    raise RuntimeError('demo registration failed')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("setgrpo_demo_registry", "setgrpo_demo_target"):
        sys.modules.pop(name, None)


def test_registration_runs_when_its_registry_module_is_imported(demo_modules):
    reg = plugin.Registration(when="setgrpo_demo_registry", target="setgrpo_demo_target:register", what="the demo")
    plugin.install((reg,))
    assert "setgrpo_demo_target" not in sys.modules  # nothing imported before the registry is
    import setgrpo_demo_registry

    assert setgrpo_demo_registry.REGISTRY == ["demo"]
    assert setgrpo_demo_registry.__loader__.__class__.__name__ == "SourceFileLoader"  # the real loader is back
    assert "setgrpo_demo_registry" not in plugin._finder.pending


def test_registration_runs_at_once_when_the_registry_is_already_imported(demo_modules):
    import setgrpo_demo_registry

    plugin.install((plugin.Registration("setgrpo_demo_registry", "setgrpo_demo_target:register", "the demo"),))
    assert setgrpo_demo_registry.REGISTRY == ["demo"]


def test_failed_registration_is_logged_loudly_and_the_registry_still_imports(demo_modules, caplog):
    plugin.install((plugin.Registration("setgrpo_demo_registry", "setgrpo_demo_target:broken", "the demo"),))
    with caplog.at_level(logging.ERROR, logger="setgrpo_verl.plugin"):
        import setgrpo_demo_registry
    assert setgrpo_demo_registry.REGISTRY == []
    assert "setgrpo_verl verl plugin FAILED to load setgrpo_demo_target:broken" in caplog.text
    assert "demo registration failed" in caplog.text and "The demo is unavailable" in caplog.text
