"""verl's plugin discovery: a fresh `import verl` registers everything; a broken plugin says so loudly."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import ray
from omegaconf import OmegaConf

from verl.trainer.ppo.utils import Role

from setgrpo_verl.integration.trainer import SetGRPOTrainer
from setgrpo_verl.integration.worker import SetGRPOActorRolloutRefWorker
from setgrpo_verl.models import embedded_model_dir

_PROBE = """
import json, verl
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
print(json.dumps({
    "estimator": ADV_ESTIMATOR_REGISTRY.get("setgrpo").__module__ if "setgrpo" in ADV_ESTIMATOR_REGISTRY else None,
    "trainer": TRAINER_REGISTRY["setgrpo"].__module__ if "setgrpo" in TRAINER_REGISTRY else None,
    "reward_managers": {k: v.__module__ for k, v in REWARD_MANAGER.items()},
}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_fresh_import_verl_registers_estimator_trainer_and_reward_manager():
    proc = _run(_PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["estimator"] == "setgrpo_verl.integration.estimator"
    assert found["trainer"] == "setgrpo_verl.integration.trainer"
    assert "setgrpo_verl.integration.reward_manager" in found["reward_managers"].values(), found["reward_managers"]
    assert "FAILED" not in proc.stderr


@pytest.mark.slow
def test_importing_a_submodule_before_verl_loads_the_plugin_cleanly():
    # the package imports verl first, so verl's plugin loading never meets a half-initialised submodule
    proc = _run("from setgrpo_verl.integration.estimator import setgrpo_step\n" + _PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr and "circular import" not in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["trainer"] == "setgrpo_verl.integration.trainer"


@pytest.mark.slow
def test_broken_plugin_is_reported_loudly():
    # make the core library unimportable: verl swallows the plugin's exception, our plugin must still shout
    proc = _run("import sys; sys.modules['setgrpo_verl.core'] = None\n" + _PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]  # verl itself keeps going
    assert "setgrpo_verl verl plugin FAILED to load setgrpo_verl.integration.estimator" in proc.stderr
    assert "Traceback" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["estimator"] is None


def _trainer_config(**algorithm):
    return OmegaConf.create({
        "algorithm": {"adv_estimator": "setgrpo", "setgrpo": {}, **algorithm},
        "actor_rollout_ref": {"rollout": {"n": 8}, "actor": {"use_kl_loss": False}, "model": {}},
        "critic": {"enable": False},
        "reward": {"reward_model": {"enable_resource_pool": False, "nnodes": 0, "n_gpus_per_node": 0}},
        "trainer": {"n_gpus_per_node": 2, "nnodes": 1, "v1": {"trainer_mode": "setgrpo"}},
    })


def test_trainer_mode_requires_the_setgrpo_estimator():
    with pytest.raises(ValueError, match="algorithm.adv_estimator=setgrpo"):
        SetGRPOTrainer(_trainer_config(adv_estimator="grpo"))
    cfg = _trainer_config()
    cfg.actor_rollout_ref.rollout.n = 1
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        SetGRPOTrainer(cfg)


def test_trainer_mode_looks_like_sync_to_verl_and_uses_the_sketch_worker():
    trainer = SetGRPOTrainer.__new__(SetGRPOTrainer)
    trainer.trainer_mode = "setgrpo"
    assert trainer.trainer_mode == "sync"  # verl's replay buffer / refill / checkpoint logic: the sync path
    with pytest.raises(ValueError, match="trainer_mode=setgrpo"):
        trainer.trainer_mode = "colocate_async"
    trainer.config = _trainer_config()
    trainer._init_resource_pool_mgr()
    actor = trainer.role_worker_mapping[Role.ActorRollout]
    assert isinstance(actor, ray.actor.ActorClass)
    assert actor.__ray_metadata__.modified_class.__mro__[1] is SetGRPOActorRolloutRefWorker
    # the GRPO baseline's trainer mode: verl's worker that checks its GPU environment before any model loads
    from setgrpo_verl.integration.sync_mode import GradedSyncTrainer
    from setgrpo_verl.integration.worker import CheckedActorRolloutRefWorker

    graded = GradedSyncTrainer.__new__(GradedSyncTrainer)
    graded.config = _trainer_config()
    graded._init_resource_pool_mgr()
    actor = graded.role_worker_mapping[Role.ActorRollout]
    assert actor.__ray_metadata__.modified_class.__mro__[1] is CheckedActorRolloutRefWorker


def _record_trainer(tmp_path, **setgrpo):
    from setgrpo_verl.integration.config import setgrpo_config_from

    trainer = SetGRPOTrainer.__new__(SetGRPOTrainer)  # record handling only: no workers, no rollout servers
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "setgrpo", "norm_adv_by_std_in_grpo": True,
                      "setgrpo": {"alpha": 0.1, "beta": 0.3, "delta": 0.1, "monitor": {"enable": True}, **setgrpo}},
        "actor_rollout_ref": {"rollout": {"n": 4, "temperature": 1.0, "top_p": 1.0},
                              "actor": {"loss_agg_mode": "token-mean"}, "model": {"path": str(embedded_model_dir())}},
        "data": {"max_response_length": 64},
        "reward": {"reward_manager": {"name": "setgrpo_dual"},
                   "reward_kwargs": {"grader": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "judge"}}},
        "trainer": {"default_local_dir": str(tmp_path)},
    })
    trainer.setgrpo = setgrpo_config_from(trainer.config.algorithm)
    trainer.sketch_config = trainer.setgrpo.sketch.to_sketch_config()
    trainer.global_steps = 1
    return trainer


def test_trainer_loads_validates_and_never_overwrites_records(tmp_path):
    from .test_estimator import _record

    trainer = _record_trainer(tmp_path)
    identity = trainer._run_identity()
    assert identity["grader"]["name"].startswith("rubric+") and identity["grader"]["model"] == "judge"
    policy = identity["policy"]
    assert policy["model"] == str(embedded_model_dir()) and len(policy["weights_sha256"]) == 64
    assert {k: policy[k] for k in ("temperature", "top_p", "top_k", "response_length", "dtype")} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": 64, "dtype": "bfloat16"}
    assert identity["training"]["lora_rank"] == 0 and identity["training"]["param_dtype"] == "bfloat16"
    path = tmp_path / "setgrpo_calibration.json"
    _record(metadata=identity).to_json(path)

    trainer = _record_trainer(tmp_path, record_path=str(path))
    logged = []
    trainer.logger = SimpleNamespace(log=lambda data, step: logged.append((data, step)))
    trainer.on_train_begin()
    assert trainer.record.K == 4 and trainer.monitor is not None
    assert logged[0][0]["setgrpo/calibration/q_alpha"] == trainer.record.q_alpha and logged[0][1] == 1

    trainer = _record_trainer(tmp_path, record_path=str(path))
    trainer.config.actor_rollout_ref.rollout.n = 8
    with pytest.raises(ValueError, match="mismatch in K"):
        trainer.on_train_begin()
    trainer = _record_trainer(tmp_path, record_path=str(path))
    trainer.config.reward.reward_kwargs.grader.model = "another-judge"
    with pytest.raises(ValueError, match="grader.model"):
        trainer.on_train_begin()
    trainer = _record_trainer(tmp_path, record_path=str(path), beta=0.2)
    with pytest.raises(ValueError, match="mismatch in beta"):
        trainer.on_train_begin()

    # no record_path: a fresh run refuses to overwrite an existing record; a resumed run reuses it
    trainer = _record_trainer(tmp_path)
    with pytest.raises(ValueError, match="already exists"):
        trainer.on_train_begin()
    from setgrpo_verl.integration.resume import record_sha256, write_state

    write_state(str(tmp_path / "global_step_50"), step=50, record_sha256=record_sha256(str(path)), monitor=None,
                group_log_bytes=None)  # what the SetGRPO trainer saved with verl's checkpoint of step 50
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("50")  # verl's tracker of that checkpoint
    trainer.global_steps = 51
    trainer.on_train_begin()
    assert trainer.record == _record(metadata=identity).__class__.from_json(path)
    trainer = _record_trainer(tmp_path / "elsewhere")
    trainer.global_steps = 51
    with pytest.raises(ValueError, match="initial policy"):
        trainer.on_train_begin()
