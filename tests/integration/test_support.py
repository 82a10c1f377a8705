"""The actor settings the sketch pass cannot run under are refused before Ray, each in one line naming the fix, and
the policy built on the meta device as verl builds it tells which parameters the sketch covers
(docs/sketch.md#supported-settings)."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from omegaconf import OmegaConf

import verl.trainer.main_ppo as main_ppo

from setgrpo_verl.integration.support import build_meta_policy, check_sketch_settings, check_sketch_support
from setgrpo_verl.sketch import SketchConfig, sketch_coverage
from tests.sketch._tiny import (
    qwen3_config,
    qwen3_moe_config,
    qwen35_vl_config,
    save_config_dir,
    tiny_qwen3,
    tiny_qwen3_moe,
    tiny_qwen35_text,
    tiny_qwen35_vl,
    with_lora,
)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hydra_configs")  # the YAML sources

FUSED = "actor_rollout_ref.model.use_fused_kernels=true"
ULYSSES = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
OFFLOAD = ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
           "actor_rollout_ref.actor.fsdp_config.offload_policy=true"]


def _config(**model):
    return OmegaConf.create({"actor_rollout_ref": {
        "model": {"path": "unused", "lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear",
                  "exclude_modules": None, "use_fused_kernels": False, **model},
        "actor": {"strategy": "fsdp", "ulysses_sequence_parallel_size": 1,
                  "fsdp_config": {"strategy": "fsdp", "offload_policy": False, "param_offload": False,
                                  "ulysses_sequence_parallel_size": 1}},
    }})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {
        "qwen3": save_config_dir(qwen3_config(), "Qwen3ForCausalLM", root / "qwen3"),
        "qwen35_vl": save_config_dir(qwen35_vl_config(), "Qwen3_5ForConditionalGeneration", root / "qwen35"),
        "moe": save_config_dir(qwen3_moe_config(), "Qwen3MoeForCausalLM", root / "moe"),
        "qwen35_text": save_config_dir(tiny_qwen35_text().config, "Qwen3_5ForCausalLM", root / "qwen35_text"),
    }


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"actor_rollout_ref.model.use_fused_kernels": True}, "set actor_rollout_ref.model.use_fused_kernels=false"),
    ({"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2},
     "set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"),
    ({"actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": 4},
     "set actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1"),
    ({"actor_rollout_ref.actor.strategy": "fsdp2", "actor_rollout_ref.actor.fsdp_config.offload_policy": True},
     "set actor_rollout_ref.actor.fsdp_config.offload_policy=false"),
])
def test_unsupported_settings_are_refused_in_one_line(overrides, needle):
    cfg = _config()
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ValueError) as exc:
        check_sketch_settings(cfg)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_supported_offload_settings_pass():
    cfg = _config()
    OmegaConf.update(cfg, "actor_rollout_ref.actor.fsdp_config.param_offload", True)  # loaded for each pass
    OmegaConf.update(cfg, "actor_rollout_ref.actor.fsdp_config.offload_policy", True)  # FSDP1 ignores it
    check_sketch_settings(cfg)


@pytest.mark.parametrize(("family", "make", "lora"), [
    ("qwen3", tiny_qwen3, False), ("qwen3", tiny_qwen3, True), ("qwen35_vl", tiny_qwen35_vl, False),
    ("qwen35_vl", tiny_qwen35_vl, True),
])
def test_meta_build_has_the_real_models_coverage(dirs, family, make, lora):
    """The meta-device build (no weights) is verl's module: same parameters, same coverage as the real model."""
    # padded: packing on Qwen3.5 needs flash-linear-attention (test_packed_linear_attention_needs_...)
    cfg = _config(path=str(dirs[family]), lora_rank=4 if lora else 0, use_remove_padding=family != "qwen35_vl")
    meta = build_meta_policy(cfg.actor_rollout_ref.model)
    assert all(p.is_meta for p in meta.parameters())
    real = make()
    if lora:
        real = with_lora(real)
    for config in (SketchConfig(), SketchConfig(include_embeddings=True, include_norms=True)):
        a, b = sketch_coverage(meta, config), sketch_coverage(real, config)
        assert a == b and a.sketched and not a.refused
    coverage = check_sketch_support(cfg, SketchConfig())
    assert coverage == sketch_coverage(real)
    if family == "qwen35_vl":
        assert coverage.outside_text and all(".visual." in f".{n}" for n in coverage.outside_text)
    if lora:
        assert all(".lora_A." in n or ".lora_B." in n for n in coverage.sketched)


def test_moe_is_refused_before_ray_naming_the_experts(dirs):
    cfg = _config(path=str(dirs["moe"]))
    assert sketch_coverage(build_meta_policy(cfg.actor_rollout_ref.model)) == sketch_coverage(tiny_qwen3_moe())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*3-D MoE expert"):
        check_sketch_support(cfg, SketchConfig())
    # LoRA on the attention projections freezes the experts: supported
    cfg = _config(path=str(dirs["moe"]), lora_rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert check_sketch_support(cfg, SketchConfig()).sketched


def test_packed_linear_attention_needs_a_forward_that_takes_cu_seqlens(dirs):
    """verl passes cu_seqlens only to a forward that takes them: the text-only Qwen3.5 class does not (refused with
    packing, accepted padded); verl's patched Qwen3_5ForConditionalGeneration does. The check leaves the classes
    unpatched in this process."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = m.Qwen3_5ForConditionalGeneration.forward
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM.*set actor_rollout_ref.model.use_remove_padding=false"):
        check_sketch_support(_config(path=str(dirs["qwen35_text"]), use_remove_padding=True), SketchConfig())
    assert check_sketch_support(_config(path=str(dirs["qwen35_text"]), use_remove_padding=False), SketchConfig())
    # without flash-linear-attention the Gated DeltaNet's delta rule is transformers' torch fallback, which ignores
    # cu_seqlens: packing is refused, naming the package and the setting ...
    assert m.chunk_gated_delta_rule is None
    for lora in (0, 4):
        with pytest.raises(ValueError, match=r"flash-linear-attention.*use_remove_padding=false"):
            check_sketch_support(_config(path=str(dirs["qwen35_vl"]), use_remove_padding=True, lora_rank=lora),
                                 SketchConfig())
    # ... and accepted with a delta rule that names cu_seqlens (flash-linear-attention's signature)
    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
               cu_seqlens=None, **kwargs):
        raise AssertionError("not run: the check builds the model on the meta device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "chunk_gated_delta_rule", kernel)
        for lora in (0, 4):
            assert check_sketch_support(_config(path=str(dirs["qwen35_vl"]), use_remove_padding=True,
                                                lora_rank=lora), SketchConfig())
    assert m.Qwen3_5ForConditionalGeneration.forward is before
    assert "cu_seqlens" not in inspect.signature(before).parameters  # so the accepted case above is verl's patch


def test_unreadable_model_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read the model configuration of actor_rollout_ref.model.path="):
        check_sketch_support(_config(path=str(tmp_path / "missing")), SketchConfig())


def _main_ppo(overrides: list[str]) -> str:
    old = sys.argv
    # Hydra's run directory in a temporary folder, not outputs/ under the checkout
    run_dir = f"hydra.run.dir={tempfile.mkdtemp(prefix='setgrpo_verl_tests_hydra_')}"
    sys.argv = ["main_ppo", "--config-path", CONFIG_DIR, "--config-name", "setgrpo_trainer", run_dir, *overrides]
    try:
        with pytest.raises(SystemExit) as exc:
            main_ppo.main()
    finally:
        sys.argv = old
    assert isinstance(exc.value.code, str), exc.value.code
    return exc.value.code


@pytest.mark.parametrize(("overrides", "needle"), [
    ([FUSED], "use_fused_kernels=false"),
    ([ULYSSES], "ulysses_sequence_parallel_size=1"),
    (OFFLOAD, "offload_policy=false"),
    (["MOE"], "mlp.experts.gate_up_proj"),
    (["QWEN35_TEXT", "actor_rollout_ref.model.use_remove_padding=true"], "use_remove_padding=false"),
])
def test_main_ppo_stops_before_ray(dirs, overrides, needle):
    """The Hydra callback of setgrpo_trainer.yaml refuses each setting before main_ppo's task (and Ray) starts."""
    path = dirs["moe"] if "MOE" in overrides else dirs["qwen35_text"] if "QWEN35_TEXT" in overrides else dirs["qwen3"]
    overrides = [o for o in overrides if o not in ("MOE", "QWEN35_TEXT")] + [f"actor_rollout_ref.model.path={path}"]
    message = _main_ppo(overrides)
    assert message.startswith("setgrpo_verl config error: ") and needle in message and "\n" not in message


@pytest.mark.slow
def test_main_ppo_command_line_refuses_moe_before_ray(dirs, tmp_path):
    start = time.monotonic()
    # RAY_ADDRESS points nowhere: had main_ppo reached ray.init it would fail with a connection error instead
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "setgrpo_trainer",
         f"actor_rollout_ref.model.path={dirs['moe']}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"},
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("setgrpo_verl config error: ") and "mlp.experts.gate_up_proj" in last, proc.stderr[-3000:]
    assert "Ray instance" not in proc.stderr and time.monotonic() - start < 120


def test_lora_adapter_path_gives_its_adapters(dirs, tmp_path):
    """``lora_adapter_path``: verl loads the adapter (trainable); the meta build reads its adapter_config.json."""
    from peft import LoraConfig, TaskType

    LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["q_proj", "v_proj"]).save_pretrained(tmp_path)
    cfg = _config(path=str(dirs["qwen3"]), lora_rank=8, lora_adapter_path=str(tmp_path))
    coverage = check_sketch_support(cfg, SketchConfig())
    assert coverage.sketched and all(n.split(".")[-4] in ("q_proj", "v_proj") for n in coverage.sketched)
    with pytest.raises(ValueError, match="cannot read the LoRA adapter configuration"):
        check_sketch_support(_config(path=str(dirs["qwen3"]), lora_rank=8, lora_adapter_path=str(tmp_path / "no")),
                             SketchConfig())


_HUB_CHECK = """
import sys
from omegaconf import OmegaConf
from setgrpo_verl.integration.support import build_meta_policy
for path in sys.argv[1:]:
    try:
        print(path, "BUILT", type(build_meta_policy(OmegaConf.create({"path": path}))).__name__)
    except ValueError as exc:
        print(path, "REFUSED", exc)
"""


@pytest.mark.slow
def test_hub_ids_offline_cached_work_uncached_name_the_id_and_the_fix(tmp_path):
    from transformers import LlamaConfig

    snapshot = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    proc = subprocess.run([sys.executable, "-c", _HUB_CHECK, "acme/tiny-llama", "acme/not-cached"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("acme/")]
    assert lines[0] == "acme/tiny-llama BUILT LlamaForCausalLM"
    assert lines[1].startswith("acme/not-cached REFUSED actor_rollout_ref.model.path=acme/not-cached: not a local "
                               "directory, and the hub model 'acme/not-cached' is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1 is set" in lines[1] and "Pass a local model directory" in lines[1]
    assert "`hf download acme/not-cached`" in lines[1]
    # no HF_HUB_OFFLINE, but a hub that refuses connections: the same refusal, saying the hub cannot be reached
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run([sys.executable, "-c", _HUB_CHECK, "acme/not-cached"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**env, "HF_HOME": str(tmp_path / "hf"),
                                                       "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("acme/"))
    assert line.startswith("acme/not-cached REFUSED actor_rollout_ref.model.path=acme/not-cached: not a local "
                           "directory") and "while the hub cannot be reached" in line
    assert "`hf download acme/not-cached`" in line
