"""Settings that would fail after Ray started (in core after the calibration rollouts, in verl's reward worker, in the
sketch pass) are refused by the pre-Ray check `check_run_config`, on configs composed by verl's own `main_ppo`."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

import verl.trainer.main_ppo as main_ppo

from setgrpo_verl.runner import launch
from setgrpo_verl.core import CalibrationSettings
from setgrpo_verl.integration.run_check import check_run_config
from setgrpo_verl.integration.micro_batch import sketch_micro_batch_error
from setgrpo_verl.models import embedded_model_dir

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hydra_configs")  # the YAML sources
LOCAL = "+reward.reward_kwargs.grader.type=local_hf"
SKETCH_4 = ("actor_rollout_ref.rollout.n=3", "data.train_batch_size=3", "algorithm.setgrpo.calibration.batch_size=35",
            "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4")
TABLE3_LENGTHS = ("data.max_prompt_length=2048", "data.max_response_length=4096")
CAL_ONLY = "algorithm.setgrpo.calibration.only=true"
OPENAI_TYPO = "+reward.reward_kwargs.grader={type:openai,base_url:'http://127.0.0.1:9/v1',model:m,max_token:2048}"
OPENAI_JUDGE = "+reward.reward_kwargs.grader={type:openai,base_url:'http://127.0.0.1:9/v1',model:m}"


EAGER = "+actor_rollout_ref.model.override_config.attn_implementation=eager"  # what CPU runs set


def _compose(*overrides: str, config: str = "setgrpo_trainer", cfg: str = "job", attention: str | None = EAGER):
    """verl's `main_ppo --cfg job` in this process (composition only: no callback, no Ray); `attention=None` keeps
    verl's default attn_implementation (flash_attention_2)."""
    old = sys.argv
    path = ["--config-path", CONFIG_DIR] if config == "setgrpo_trainer" else []  # ppo_trainer: main_ppo's own
    # a policy whose configuration exists (the check before Ray builds it on the meta device), overridable
    policy = [f"actor_rollout_ref.model.path={embedded_model_dir()}"] if config == "setgrpo_trainer" else []
    policy += [attention] if attention else []
    sys.argv = ["main_ppo", *path, "--config-name", config, *policy, *overrides, "--cfg", cfg]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main_ppo.main()
    except SystemExit as exc:
        assert not exc.code, exc.code
    finally:
        sys.argv = old
    return OmegaConf.create(out.getvalue())


@pytest.mark.parametrize(("overrides", "message"), [
    ((OPENAI_TYPO,), "reward.reward_kwargs.grader: unknown keys for a openai grader: ['max_token']"),
    ((LOCAL, "+reward.reward_kwargs.grader.temprature=0.5"), "unknown keys for a local_hf grader: ['temprature']"),
    # a deterministic judge scores a response twice alike: the conformal set is a point and SetGRPO would be GRPO
    ((LOCAL, "+reward.reward_kwargs.grader.temperature=0", CAL_ONLY),
     "grader temperature 0 (reward.reward_kwargs.grader.temperature, --judge-temperature): SetGRPO calibrates a "
     "stochastic grader"),
    # so does a rules grader, bare or under flips at rate 0, wherever SetGRPO reads the second scoring
    (("+reward.reward_kwargs.grader={type:rules}", CAL_ONLY),
     "reward.reward_kwargs.grader is a rules grader, which scores every response the same way twice"),
    (("+reward.reward_kwargs.grader={type:noisy,flip_prob:0,base:{type:rules}}", "algorithm.setgrpo.variant=reliability"),
     "reward.reward_kwargs.grader is a noisy grader with flip_prob 0 over a rules grader"),
    (("+reward.reward_kwargs.grader={type:noisy,flip_prob:0,base:{type:noisy,flip_prob:0,base:{type:rules}}}",
      CAL_ONLY), "reward.reward_kwargs.grader is a noisy grader with flip_prob 0 over a rules grader"),
    (("+reward.reward_kwargs.grader={type:noisy,flip_prob:0,base:{type:local_hf,temperature:0}}", CAL_ONLY),
     "grader temperature 0 (reward.reward_kwargs.grader.temperature, --judge-temperature)"),
    ((LOCAL, "algorithm.setgrpo.rho=0"), "algorithm.setgrpo.rho=0.0 must be > 0"),
    ((LOCAL, "algorithm.setgrpo.variant=reliabilty"), "algorithm.setgrpo.variant='reliabilty': choose one of "
                                                      "('paper', 'reliability')"),
    # the reliability variant has no record or threshold: a key of the calibrated method would be ignored
    ((LOCAL, "algorithm.setgrpo.variant=reliability", "algorithm.setgrpo.ablation=spherical_set"),
     "algorithm.setgrpo.ablation=spherical_set: the reliability variant has no calibration, record or threshold"),
    ((LOCAL, "algorithm.setgrpo.variant=reliability", "algorithm.setgrpo.calibration.only=true"),
     "algorithm.setgrpo.calibration.only=True: the reliability variant"),
    ((LOCAL, "+reward.reward_kwargs.point=mean"), "reward.reward_kwargs.point=mean: SetGRPO reads the two scorings apart"),
    ((LOCAL, "algorithm.setgrpo.variant=reliability", "trainer.use_v1=false"),
     "trainer.use_v1=false: main_ppo then runs verl's v0 trainer"),
    ((LOCAL, "algorithm.setgrpo.variant=reliability", "actor_rollout_ref.actor.strategy=megatron"),
     "the SetGRPO trainer mode's actor worker extends verl's FSDP engine worker only"),
    ((LOCAL, "algorithm.setgrpo.variant=reliability", "+reward.reward_kwargs.scorings=1"),
     "set reward.reward_kwargs.scorings=2 or leave it unset"),
    ((LOCAL, "algorithm.setgrpo.tau_grid=[0.5,0.2]"), "algorithm.setgrpo.tau_grid=[0.5, 0.2] must be non-empty, "
                                                       "strictly increasing and strictly inside (-1, 1)"),
    ((LOCAL, "algorithm.setgrpo.tau_grid=[0.0,1.0]"), "strictly inside (-1, 1)"),
    ((LOCAL, "algorithm.setgrpo.recovery_grid=0"), "algorithm.setgrpo.recovery_grid=0 must be an integer >= 1"),
    ((LOCAL, "+reward.reward_kwargs.reference_score_key=r2"), "the reference-score key is set once, as "
                                                              "algorithm.setgrpo.reference_score_key"),
    # calibration and training both read r' of the second scoring
    ((LOCAL, CAL_ONLY, "+reward.reward_kwargs.scorings=1"),
     "reward.reward_kwargs.scorings=1: SetGRPO needs the reference score r' of a second scoring"),
    ((LOCAL, "+reward.reward_kwargs.scorings=1"), "set reward.reward_kwargs.scorings=2 or leave it unset"),
    ((LOCAL, "+reward.reward_kwargs.scorings=3"), "reward.reward_kwargs.scorings=3: set 1 (the point score alone, "
                                                  "the GRPO baseline) or 2"),
    ((LOCAL, *SKETCH_4, "trainer.n_gpus_per_node=1"),
     "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4 does not divide the 9 responses that each of the 1 actor "
     "rank(s) gets in a training step (data.train_batch_size=3)"),
    # verl pads a calibration batch of 37 x 3 = 111 responses to 117 (a multiple of 3 prompts x 3)
    ((LOCAL, *SKETCH_4[:2], "algorithm.setgrpo.calibration.batch_size=37", SKETCH_4[3], "trainer.n_gpus_per_node=1",
      "algorithm.setgrpo.calibration.only=true"),
     "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4 does not divide the 117 responses that each of the 1 actor "
     "rank(s) gets in a calibration batch (algorithm.setgrpo.calibration.batch_size=37) (37 prompts x "
     "actor_rollout_ref.rollout.n=3, padded to 117)"),
    ((LOCAL, *SKETCH_4, "trainer.n_gpus_per_node=1", "algorithm.setgrpo.calibration.only=true",
      "algorithm.setgrpo.calibration.batch_size=36", "algorithm.setgrpo.calibration.num_prompts=50"),
     "does not divide the 45 responses that each of the 1 actor rank(s) gets in the last calibration batch"),
    # verl's v0 trainer (main_ppo_v0's TaskRunner): its workers have no sketch RPC
    ((LOCAL, CAL_ONLY, "trainer.use_v1=false"), "trainer.use_v1=false: main_ppo then runs verl's v0 trainer, whose workers "
                                      "have no SetGRPO sketch RPC"),
    # the recipes' budget of 6144 tokens with 8192-token responses: verl's max_token_len >= max_seq_len assertion
    ((LOCAL, CAL_ONLY, *TABLE3_LENGTHS, "data.max_response_length=8192", "algorithm.setgrpo.sketch.max_token_len_per_gpu=6144"),
     "algorithm.setgrpo.sketch.max_token_len_per_gpu=6144 is below one full-length sequence, data.max_prompt_length "
     "+ data.max_response_length = 2048 + 8192 = 10240"),
    ((LOCAL, CAL_ONLY, *TABLE3_LENGTHS, "actor_rollout_ref.actor.use_dynamic_bsz=true",
      "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096"),
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (the sketch pass's token budget when "
     "algorithm.setgrpo.sketch.max_token_len_per_gpu is null)=4096 is below one full-length sequence"),
    # verl places reward workers on every node: a loopback judge serves one of them
    ((OPENAI_JUDGE, CAL_ONLY, "trainer.nnodes=2"),
     "reward.reward_kwargs.grader.base_url=http://127.0.0.1:9/v1 is a loopback address, but trainer.nnodes=2"),
    ((OPENAI_JUDGE.replace("127.0.0.1", "localhost"), CAL_ONLY, "trainer.nnodes=2"), "is a loopback address"),
    ((OPENAI_JUDGE.replace("127.0.0.1", "0.0.0.0"), CAL_ONLY, "trainer.nnodes=3"), "is a loopback address"),
    ((OPENAI_JUDGE.replace("'http://127.0.0.1:9/v1'", "'http://[::1]:9/v1'"), CAL_ONLY, "trainer.nnodes=2"),
     "is a loopback address"),
    # a key in the config lands in verl's printed config and the command line
    ((OPENAI_JUDGE.replace("model:m", "model:m,api_key:sk-x"), CAL_ONLY),
     "reward.reward_kwargs.grader.api_key: a key in the config is printed with verl's config"),
    # the sketch pass hooks verl's FSDP engine: any other training engine stops at the first sketch
    *[((LOCAL, CAL_ONLY, f"actor_rollout_ref.actor.strategy={strategy}"),
       f"actor_rollout_ref.actor.strategy={strategy}: the SetGRPO sketch pass runs on verl's FSDP engine only")
      for strategy in ("megatron", "veomni", "torchtitan", "automodel", "fsdp_turbo")],
    ((LOCAL, CAL_ONLY, "model_engine=megatron"), "actor_rollout_ref.actor.strategy=megatron"),
    # a part of a sharded calibration that holds no batch would start verl, calibrate nothing and end complete
    ((LOCAL, CAL_ONLY, "algorithm.setgrpo.calibration.num_prompts=12", "algorithm.setgrpo.calibration.batch_size=4",
      "algorithm.setgrpo.calibration.shard=3/4"),
     "algorithm.setgrpo.calibration.shard=3/4 (--shard): part 3 holds no batch, since the calibration has 3 "
     "batch(es) (12 prompts in batches of 4)"),
    # verl's DAPO recipes filter on 'acc', which the dual reward manager does not emit (verl fails after Ray)
    ((LOCAL, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"),
     "algorithm.filter_groups.metric='acc': the setgrpo_dual reward manager does not emit it (verl's DAPO recipes "
     "set 'acc' for their math reward); it emits reward, score, reference_score, judged_disagreement, unparsed, "
     "judged, scorings"),
    # filtering selects groups by their scores: calibration groups would no longer be exchangeable
    ((LOCAL, CAL_ONLY, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reward"),
     "algorithm.filter_groups.enable=true in a calibration run"),
    ((LOCAL, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reference_score"),
     "algorithm.filter_groups.metric='reference_score' selects SetGRPO's training groups by something other than "
     "their point scores"),
])
def test_check_before_ray_refuses(overrides, message):
    """Each of these passed the pre-Ray check and failed later, after Ray and the models had started."""
    cfg = _compose(*overrides)
    with pytest.raises(ValueError) as exc:
        check_run_config(cfg)
    assert message in str(exc.value), str(exc.value)


def test_a_grader_random_in_either_layer_is_admitted_and_grpo_may_use_plain_rules():
    """Flips over rules, or no flips over a judge at temperature > 0, score twice independently; plain GRPO with the
    dual reward manager reads no second scoring, so an exact rules grader is its to use."""
    for grader in ("{type:noisy,flip_prob:0.06,base:{type:rules}}", "{type:noisy,flip_prob:0,base:{type:local_hf}}"):
        assert check_run_config(_compose(f"+reward.reward_kwargs.grader={grader}", CAL_ONLY)) is not None
    grpo = _compose("+reward.reward_kwargs.grader={type:rules}", "algorithm.adv_estimator=grpo",
                    "trainer.v1.trainer_mode=graded_sync")
    assert check_run_config(grpo) is None


def test_reliability_variant_skips_the_sketch_and_record_checks():
    """No sketch pass runs: a sketch micro-batch that would not divide a rank's batch is not its concern."""
    cfg = _compose(LOCAL, "algorithm.setgrpo.variant=reliability", *SKETCH_4, "trainer.n_gpus_per_node=1")
    assert check_run_config(cfg).variant == "reliability"


def test_a_loopback_judge_serves_one_node_and_fsdp2_is_a_sketch_backend(monkeypatch):
    monkeypatch.setenv("SETGRPO_SHARED_FS", "1")  # the two-node run's folders: tests/integration/test_run_env.py
    assert check_run_config(_compose(OPENAI_JUDGE, CAL_ONLY)) is not None
    assert check_run_config(_compose(OPENAI_JUDGE.replace("127.0.0.1", "judge.internal"), CAL_ONLY,
                                     "trainer.nnodes=2")) is not None
    assert check_run_config(_compose(LOCAL, CAL_ONLY, "actor_rollout_ref.actor.strategy=fsdp2")) is not None


@pytest.mark.parametrize("config", ["setgrpo_trainer", "ppo_trainer"])
def test_a_driver_with_an_nvidia_driver_checks_its_gpu_environment(monkeypatch, config):
    """Every trainer mode: torch 2.11's CUDA 13.0 on a driver of the R550 branch sees no GPU."""
    from setgrpo_verl.integration import gpu_env

    cfg = _compose(LOCAL, CAL_ONLY) if config == "setgrpo_trainer" else _compose(LOCAL, config=config)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(gpu_env, "read_gpu_environment", lambda **kw: gpu_env.GpuEnvironment(
        "2.11.0+cu130", "13.0", False, "550.54.15"))
    monkeypatch.setattr(gpu_env, "has_nvidia_driver", lambda: False)
    check_run_config(cfg)  # no NVIDIA driver on the driver's machine: the workers check their GPUs
    monkeypatch.setattr(gpu_env, "has_nvidia_driver", lambda: True)
    with pytest.raises(ValueError, match=r"the driver \(where main_ppo starts\): CUDA is not available .*: the NVIDIA "
                                         r"driver 550.54.15 is older than R580, which CUDA 13.0"):
        check_run_config(cfg)


def test_rho_zero_is_admissible_for_dr_grpo():
    cfg = _compose(LOCAL, "algorithm.setgrpo.rho=0", "algorithm.norm_adv_by_std_in_grpo=false", CAL_ONLY)
    setgrpo = check_run_config(cfg)
    assert setgrpo.calibration_settings(norm_by_std=False) == CalibrationSettings(rho=0.0, norm_by_std=False)


def test_reference_score_key_has_one_source():
    """The reward manager writes r' under the key the trainer reads: algorithm.setgrpo.reference_score_key."""
    from setgrpo_verl.integration.reward_config import reference_score_key

    cfg = _compose(LOCAL, "algorithm.setgrpo.reference_score_key=r_prime", CAL_ONLY)
    assert check_run_config(cfg).reference_score_key == reference_score_key(cfg) == "r_prime"
    assert reference_score_key(_compose(LOCAL, config="ppo_trainer")) == "reference_score"


def test_grpo_stage_runs_the_same_check_before_ray():
    """verl's stock ppo_trainer has no callback: the GRPO stage adds ours, so a grader typo stops it before Ray."""
    overrides = [o for o in launch.stage_overrides("grpo", "/tmp/run") if o.startswith("+hydra.")]
    hydra = _compose(*overrides, config="ppo_trainer", cfg="hydra")
    assert hydra.hydra.callbacks.setgrpo_check._target_ == "setgrpo_verl.integration.run_check.SetGRPOConfigCheck"
    cfg = _compose(OPENAI_TYPO, "reward.reward_manager.name=setgrpo_dual", config="ppo_trainer")
    with pytest.raises(ValueError, match=r"unknown keys for a openai grader: \['max_token'\]"):
        check_run_config(cfg)


def test_sketch_micro_batch_arithmetic():
    fits = dict(k=3, ranks=1, micro=3, source="m")
    assert sketch_micro_batch_error(prompts={"a step": 4, "a calibration batch": 12}, **fits) is None
    text = sketch_micro_batch_error(prompts={"a step": 3, "the last calibration batch": 5}, k=3, ranks=1, micro=4,
                                    source="m")
    assert text.startswith("m=4 does not divide the 9 responses") and "e.g. 3" in text
    # two ranks: 4 prompts x 3 = 12 responses, 6 per rank; micro 4 does not divide 6, micro 3 does
    assert "6 responses" in sketch_micro_batch_error(prompts={"a step": 4}, k=3, ranks=2, micro=4, source="m")
    assert sketch_micro_batch_error(prompts={"a step": 4}, k=3, ranks=2, micro=3, source="m") is None


def test_reward_manager_writes_the_reference_score_under_the_trainers_key():
    from setgrpo_verl.integration.reward_manager import SetGRPODualRewardManager

    cfg = OmegaConf.create({"algorithm": {"setgrpo": {"reference_score_key": "r_prime"}},
                            "reward": {"reward_kwargs": {"grader": {"type": "rules"}}}})
    assert SetGRPODualRewardManager(cfg, tokenizer=None).reference_key == "r_prime"
    cfg.reward.reward_kwargs.reference_score_key = "r2"  # the second source it used to read
    with pytest.raises(ValueError, match="reward.reward_kwargs.reference_score_key is not read"):
        SetGRPODualRewardManager(cfg, tokenizer=None)


def test_verls_calibration_batches_carry_each_rows_identity(tmp_path):
    """The trainer fingerprints calibration prompts from verl's own dataset batches (reward_model, extra_info,
    raw_prompt): they give back exactly the ids and questions of data/calibration.parquet."""
    import json

    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer

    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    from setgrpo_verl.integration.prompts import prompt_identity, read_prompt_identities

    rows = [{"id": f"q{i}", "question": f"Say the number {i}.", "rubrics": [{"criterion": "Says it.", "points": 1}]}
            for i in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = launch.split_data(data=str(data), model_path=embedded_model_dir(), max_prompt_length=64,
                              calibration_prompts=5, seed=0)
    paths = launch.write_data(tmp_path / "run", split)
    cfg = _compose(LOCAL, f"data.train_files={paths['train']}", "data.max_prompt_length=64")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    dataset = create_rl_dataset(str(paths["calibration"]), cfg.data, tokenizer, None, is_train=True, max_samples=5)
    seen = []
    for batch in StatefulDataLoader(dataset=dataset, batch_size=2, collate_fn=collate_fn):
        seen += [prompt_identity(rm, info, raw)[:2] for rm, info, raw in
                 zip(batch["reward_model"], batch["extra_info"], batch["raw_prompt"])]
    expected = [(r["extra_info"]["id"], rows[int(r["extra_info"]["id"][1:])]["question"]) for r in split["calibration"]]
    assert sorted(seen) == sorted(expected) == sorted(read_prompt_identities(paths["calibration"]))


# ------------------------------------------------------------------------------- attention kernels of verl's FSDP workers
FLASH_PIN = "flash-attn==2.8.3"  # verl 0.9.1's fsdp extra (through its flash-attn-cu130torch211 sub-extra)


def _package(monkeypatch, module: str, present: bool) -> None:
    """Make `module` importable (a stand-in with a spec) or not (None in sys.modules) for importlib's find_spec."""
    import importlib.machinery
    import types

    fake = types.ModuleType(module)
    fake.__spec__ = importlib.machinery.ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, module, fake if present else None)


def test_verl_loads_the_policy_with_flash_attention_2_unless_told_otherwise():
    """verl 0.9.1's HFModelConfig reads attn_implementation from override_config with flash_attention_2 as default,
    and the FSDP engine's from_pretrained takes that hf_config (the check's VERL_DEFAULT_ATTENTION)."""
    import inspect

    from verl.workers.config.model import HFModelConfig
    from verl.workers.engine.fsdp import transformer_impl

    from setgrpo_verl.integration.support import VERL_DEFAULT_ATTENTION

    assert VERL_DEFAULT_ATTENTION == "flash_attention_2"
    assert 'self.override_config.get("attn_implementation", "flash_attention_2")' in inspect.getsource(HFModelConfig)
    assert "config=self.model_config.hf_config" in inspect.getsource(transformer_impl.FSDPEngine._build_module)


def test_flash_attention_2_without_flash_attn_fails_in_from_pretrained(tmp_path):
    """What a worker hit after Ray: transformers refuses to load the policy with verl's default attention."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from setgrpo_verl.integration.support import VERL_DEFAULT_ATTENTION
    from tests.sketch._tiny import tiny_qwen3

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    tiny_qwen3().save_pretrained(tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path, attn_implementation=VERL_DEFAULT_ATTENTION)  # as verl does
    with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=hf_config)


@pytest.mark.parametrize("config", ["setgrpo_trainer", "ppo_trainer"])
def test_default_attention_without_its_package_is_refused_naming_package_and_extra(verl_default_attention,
                                                                                   monkeypatch, config):
    cfg = verl_default_attention if config == "setgrpo_trainer" else _compose(LOCAL, config=config, attention=None)
    assert "attn_implementation" not in cfg.actor_rollout_ref.model.override_config  # verl's default applies
    _package(monkeypatch, "flash_attn", present=False)
    with pytest.raises(ValueError) as exc:
        check_run_config(cfg)
    text = str(exc.value)
    assert text.startswith("actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2 "
                           "(verl's default) needs the package flash_attn")
    for needle in (FLASH_PIN, "verl 0.9.1's fsdp extra", "pip install --no-build-isolation flash-attn==2.8.3",
                   "docs/verl_integration.md#installing-on-a-gpu-cluster",
                   "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"):
        assert needle in text, (needle, text)
    _package(monkeypatch, "flash_attn", present=True)
    if config == "setgrpo_trainer":
        assert check_run_config(cfg) is not None
    else:
        assert check_run_config(cfg) is None  # verl's stock trainer: checked, nothing SetGRPO to return


@pytest.fixture(scope="module")
def verl_default_attention():
    """A SetGRPO config composed by main_ppo with verl's default attn_implementation (the key unset)."""
    return _compose(LOCAL, CAL_ONLY, attention=None)


def _with_attention(cfg, value: str):
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    cfg.actor_rollout_ref.model.override_config.attn_implementation = value
    return cfg


@pytest.mark.parametrize(("value", "module", "needle"), [
    ("flash_attention_3", "flash_attn_interface", "needs the package flash_attn_interface (FlashAttention-3"),
    ("kernels-community/flash-attn", "kernels", "needs the package kernels (pip install kernels"),
])
def test_other_kernel_attention_needs_its_package(verl_default_attention, monkeypatch, value, module, needle):
    cfg = _with_attention(verl_default_attention, value)
    _package(monkeypatch, module, present=False)
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_run_config(cfg)
    _package(monkeypatch, module, present=True)
    check_run_config(cfg)


def test_torch_attention_needs_no_package(verl_default_attention, monkeypatch):
    _package(monkeypatch, "flash_attn", present=False)
    for value in ("eager", "sdpa", "flex_attention"):
        check_run_config(_with_attention(verl_default_attention, value))


def test_verl_extra_requirements_expand_its_sub_extras():
    from setgrpo_verl.integration.support import verl_extra_requirements

    fsdp = {r.name: str(r.specifier) for r in verl_extra_requirements("fsdp")}
    assert fsdp["flash-attn"] == "==2.8.3" and fsdp["cupy-cuda13x"] == "==14.0.1"  # from two sub-extras
    assert fsdp["flash-linear-attention"] == "==0.5.2" and "verl" in fsdp  # verl[verl-core] kept as it is


def test_padded_linear_attention_without_its_kernels_says_transformers_takes_the_slow_path(
        verl_default_attention, tmp_path, monkeypatch, caplog):
    """Padded, a Qwen3.5 policy without flash-linear-attention is logged (packed, it is refused: see
    tests/integration/test_support.py)."""
    import logging

    from setgrpo_verl.integration.support import check_sketch_support
    from setgrpo_verl.sketch import SketchConfig
    from tests.sketch._tiny import qwen35_vl_config, qwen3_config, save_config_dir

    qwen35 = save_config_dir(qwen35_vl_config(), "Qwen3_5ForConditionalGeneration", tmp_path / "qwen35")
    qwen3 = save_config_dir(qwen3_config(), "Qwen3ForCausalLM", tmp_path / "qwen3")
    cfg = OmegaConf.create(OmegaConf.to_container(verl_default_attention))
    cfg.actor_rollout_ref.model.use_remove_padding = False
    for present in (False, True):
        _package(monkeypatch, "fla", present=present)
        for path in (qwen35, qwen3):
            cfg.actor_rollout_ref.model.path = str(path)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="setgrpo_verl.integration.support"):
                check_sketch_support(cfg, SketchConfig())
            # one message, however many handlers the logger has by then (records can repeat in a long session)
            warned = sorted({r.getMessage() for r in caplog.records if "has linear-attention layers" in r.getMessage()})
            if present or path == qwen3:
                assert not warned, (present, path, warned)
            else:
                (text,) = warned
                assert "Qwen3_5ForConditionalGeneration" in text and "its torch gated delta rule" in text
                assert "flash-linear-attention==0.5.2" in text and "gpu extra" in text


def test_verl_v0_trainer_runs_stock_workers_without_the_sketch_rpc():
    """What trainer.use_v1=false meets after Ray: main_ppo hands the run to main_ppo_v0's TaskRunner, whose actor is
    verl's stock ActorRolloutRefWorker (no compute_sketches) under the RayPPOTrainer."""
    import inspect

    import verl.trainer.main_ppo_v0 as v0
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from setgrpo_verl.integration.worker import SetGRPOActorRolloutRefWorker

    assert "if config.trainer.use_v1:" in inspect.getsource(main_ppo.main)
    assert "actor_rollout_cls = ActorRolloutRefWorker" in inspect.getsource(v0)
    assert hasattr(SetGRPOActorRolloutRefWorker, "compute_sketches")
    assert not hasattr(ActorRolloutRefWorker, "compute_sketches")


def test_verls_micro_batching_asserts_a_budget_of_one_full_length_sequence():
    """What a budget below prompt + response length meets on every rank: verl's rearrange_micro_batches (the sketch
    pass's dynamic micro-batches) asserts max_token_len >= the longest sequence of the shard."""
    from tensordict import TensorDict

    from verl.utils.seqlen_balancing import rearrange_micro_batches

    lengths = [2048 + 8192, 300]  # a full-length sequence of prompt 2048 + response 8192, and a short one
    ids = torch.nested.as_nested_tensor([torch.ones(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
    batch = TensorDict({"input_ids": ids}, batch_size=[2])
    with pytest.raises(AssertionError, match=r"max_token_len=6144 and max_seq_len=(tensor\()?10240"):
        rearrange_micro_batches(batch, max_token_len=6144)
    micro, _ = rearrange_micro_batches(batch, max_token_len=10240)
    assert sum(len(m) for m in micro) == 2


def test_calibrating_and_training_on_shared_prompts_is_refused(tmp_path):
    """One main_ppo run that calibrates and then trains: calibration prompts must stay out of training."""
    from setgrpo_verl.grading import rubrics_to_verl_rows, write_verl_parquet
    from setgrpo_verl.integration.prompts import check_calibration_disjoint

    rows = [{"id": f"p{i}", "question": f"Question number {i}?", "rubrics": [{"criterion": "Is short.", "points": 1}]}
            for i in range(6)]
    train = write_verl_parquet(rubrics_to_verl_rows(rows[:4]), tmp_path / "train.parquet")
    overlap = write_verl_parquet(rubrics_to_verl_rows(rows[3:]), tmp_path / "overlap.parquet")
    disjoint = write_verl_parquet(rubrics_to_verl_rows(rows[4:]), tmp_path / "calibration.parquet")
    data = f"data.train_files={train}"
    with pytest.raises(ValueError, match=r"calibration.files=null calibrates on the first calibration.num_prompts "
                                         "prompts of data.train_files, and this run then trains on the same file"):
        check_calibration_disjoint(_compose(LOCAL, data))
    with pytest.raises(ValueError, match=r"data.train_files shares 1 prompt\(s\) with algorithm.setgrpo.calibration."
                                         r"files, the first 'p3' \('Question number 3\?'\)"):
        check_calibration_disjoint(_compose(LOCAL, data, f"algorithm.setgrpo.calibration.files={overlap}"))
    check_calibration_disjoint(_compose(LOCAL, data, f"algorithm.setgrpo.calibration.files={disjoint}"))
    check_calibration_disjoint(_compose(LOCAL, data, CAL_ONLY))  # calibration alone trains on nothing


def test_the_command_line_and_the_run_build_the_settings_in_one_place():
    """The launcher's check asks SetGRPOConfig for the settings: the same object as the run's own, errors named by
    the flag where there is one and by the algorithm.setgrpo key otherwise."""
    from setgrpo_verl.integration.config import SetGRPOCalibrationConfig, SetGRPOConfig

    values = {"algorithm.setgrpo.alpha": 0.2, "algorithm.setgrpo.tau_grid": [0.0, 0.5], "algorithm.setgrpo.rho": 0.0,
              "algorithm.norm_adv_by_std_in_grpo": False, "algorithm.setgrpo.calibration.coverage_groups": None,
              "algorithm.setgrpo.srgo_procedure": "fixed_sequence", "algorithm.setgrpo.tau_start": 0.5}
    config = SetGRPOConfig(alpha=0.2, tau_grid=[0.0, 0.5], rho=0.0, srgo_procedure="fixed_sequence", tau_start=0.5,
                           calibration=SetGRPOCalibrationConfig(coverage_groups=None))
    want = CalibrationSettings(alpha=0.2, tau_grid=(0.0, 0.5), rho=0.0, norm_by_std=False, coverage_groups=None,
                               srgo_procedure="fixed_sequence", tau_start=0.5)
    assert launch.requested_settings(values) == config.calibration_settings(norm_by_std=False) == want
    for key, value, message in (
            ("calibration.on_infeasible", "ignore",
             "--on-infeasible: calibration.on_infeasible='ignore': choose one of ('error', 'reject_all')"),
            ("calibration.coverage_groups", 0,
             "algorithm.setgrpo.calibration.coverage_groups: calibration.coverage_groups=0 must be an integer >= 1"),
            ("recovery_grid", 0, "algorithm.setgrpo.recovery_grid: recovery_grid=0 must be an integer >= 1")):
        with pytest.raises(launch.LaunchError) as exc:
            launch.requested_settings({f"algorithm.setgrpo.{key}": value})
        assert str(exc.value).startswith(message), str(exc.value)
    with pytest.raises(ValueError, match=r"^algorithm\.setgrpo\.calibration\.on_infeasible='ignore': choose one"):
        SetGRPOConfig(calibration=SetGRPOCalibrationConfig(on_infeasible="ignore"))


def test_one_scoring_is_refused_by_the_callback_before_ray_and_admitted_for_grpo():
    """The Hydra callback stops a SetGRPO run with one scoring per response; the GRPO stage's overrides (one scoring,
    the graded sync trainer) pass the same check, and a bad value stops it too."""
    from setgrpo_verl.integration.run_check import SetGRPOConfigCheck

    with pytest.raises(SystemExit, match="setgrpo_verl config error: reward.reward_kwargs.scorings=1: SetGRPO needs"):
        SetGRPOConfigCheck().on_job_start(_compose(LOCAL, CAL_ONLY, "+reward.reward_kwargs.scorings=1"))
    grpo = [o for o in launch.stage_overrides("grpo", "/tmp/run") if "scorings" in o or "trainer_mode" in o]
    assert grpo == ["+reward.reward_kwargs.scorings=1", "trainer.v1.trainer_mode=graded_sync"]
    cfg = _compose(LOCAL, "reward.reward_manager.name=setgrpo_dual", *grpo, config="ppo_trainer")
    assert check_run_config(cfg) is None
    assert (cfg.reward.reward_kwargs.scorings, cfg.trainer.v1.trainer_mode) == (1, "graded_sync")
    bad = _compose(LOCAL, "reward.reward_manager.name=setgrpo_dual", "+reward.reward_kwargs.scorings=0",
                   config="ppo_trainer")
    with pytest.raises(ValueError, match=r"reward\.reward_kwargs\.scorings=0: set 1"):
        check_run_config(bad)


def test_dapo_filter_metrics_are_the_ones_the_reward_manager_emits():
    """The GRPO baseline (one scoring) may filter on any numeric key the manager emits, a noisy grader adds the
    noise-free score, and SetGRPO's training filters on the point score."""
    from setgrpo_verl.integration.reward_config import check_filter_groups, filter_metrics

    grpo = ("reward.reward_manager.name=setgrpo_dual", "+reward.reward_kwargs.scorings=1",
            "trainer.v1.trainer_mode=graded_sync", "algorithm.filter_groups.enable=true")
    cfg = _compose(LOCAL, *grpo, "algorithm.filter_groups.metric=acc", config="ppo_trainer")
    with pytest.raises(ValueError, match=r"it emits reward, score, unparsed, judged, scorings: set "
                                         r"algorithm.filter_groups.metric=reward"):
        check_run_config(cfg)
    assert check_run_config(_compose(LOCAL, *grpo, "algorithm.filter_groups.metric=judged", config="ppo_trainer")) is None
    noisy = _compose("+reward.reward_kwargs.grader={type:noisy,flip_prob:0.1,seed:0,base:{type:rules}}", CAL_ONLY)
    assert filter_metrics(noisy) == ("reward", "score", "reference_score", "judged_disagreement", "truth_score",
                                     "unparsed", "judged", "scorings")
    for metric in ("reward", "score"):
        check_filter_groups(_compose(LOCAL, "algorithm.filter_groups.enable=true",
                                     f"algorithm.filter_groups.metric={metric}"), setgrpo=True, calibration_only=False)


def test_a_pilot_of_the_same_prompts_is_refused_before_ray(tmp_path):
    """tau_start_pilot is checked against the calibration files before Ray, as the calibration checks it again before
    its first rollout: a pilot sharing a prompt, or one that lists none, is no pilot."""
    from setgrpo_verl.core import calibrate
    from setgrpo_verl.core.record import content_sha256
    from setgrpo_verl.grading import rubrics_to_verl_rows, write_verl_parquet
    from setgrpo_verl.integration.config import setgrpo_config_from
    from setgrpo_verl.integration.prompts import calibration_fingerprints, check_start_pilot

    from ..core.synthetic import make_groups

    rows = [{"id": f"p{i}", "question": f"Question number {i}?", "rubrics": [{"criterion": "Is short.", "points": 1}]}
            for i in range(8)]
    calib = write_verl_parquet(rubrics_to_verl_rows(rows[:4]), tmp_path / "calibration.parquet")
    grid = (0.0, 0.2, 0.4, 0.6)
    settings = CalibrationSettings(alpha=0.5, beta=0.65, delta=0.2, tau_grid=grid, on_infeasible="reject_all")
    groups = make_groups(200, k=4, seed=3)

    def pilot(name: str, prompts: list[dict]) -> tuple[str, float]:
        record = calibrate(*groups, settings, metadata={"calibration_prompts": prompts})
        record.to_json(tmp_path / name)
        return str(tmp_path / name), record.tau_sel

    def config(path: str, tau: float):
        return _compose(LOCAL, CAL_ONLY, f"algorithm.setgrpo.calibration.files={calib}", "algorithm.setgrpo.tau_grid="
                        "[0.0,0.2,0.4,0.6]", "algorithm.setgrpo.srgo_procedure=fixed_sequence",
                        f"algorithm.setgrpo.tau_start={tau}", f"algorithm.setgrpo.tau_start_pilot={path}")

    same, tau = pilot("same.json", calibration_fingerprints(calib)[1:3])
    with pytest.raises(ValueError, match=r"tau_start_pilot=.*same.json: 2 calibration prompt\(s\) were also the "
                                         r"pilot's, the first 'p1'"):
        check_run_config(config(same, tau))
    blind, tau = pilot("blind.json", [])
    with pytest.raises(ValueError, match=rf"blind.json: the pilot record lists no calibration prompts.*"
                                         rf"tau_start={tau} without a pilot"):
        check_run_config(config(blind, tau))
    other = calibration_fingerprints(write_verl_parquet(rubrics_to_verl_rows(rows[4:]), tmp_path / "other.parquet"))
    fine, tau = pilot("fine.json", other)
    cfg = config(fine, tau)
    from setgrpo_verl.core import CalibrationRecord

    want = {"kind": "pilot", "record_sha256": content_sha256(CalibrationRecord.from_json(fine))}
    assert check_start_pilot(cfg, setgrpo_config_from(cfg.algorithm)) == want
    # the command line's split, known before its files are written, stands for the files
    with pytest.raises(ValueError, match="were also the pilot's, the first 'p4'"):
        check_run_config(cfg, calibration_prompts=other[:1])
