"""The CPU backend's precision: the GPU recipes' bf16 where the CPU has bf16 units, float32 elsewhere (one log line).

What must hold: the bf16 units are read from the CPU's feature flags; the default is bf16 exactly when they exist
and the fall-back to float32 says so once; verl composes the overrides into FSDP mixed precision (bf16 parameters
and compute, float32 reductions and buffers, float32 master weights) and a bf16 rollout; the transformers rollout
runs its model in verl's ``rollout.dtype`` and its log-probs are the model's own teacher-forced ones.
"""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from setgrpo_verl.runner import launch
from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer

_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\nflags\t\t: fpu sse2 {extra}\n"


def test_bf16_units_come_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(_FLAGS.format(extra="avx512_bf16 amx_tile amx_bf16"))
    assert launch.cpu_bf16_units(info) == ("avx512_bf16", "amx_bf16")
    info.write_text(_FLAGS.format(extra="amx_tile"))
    assert launch.cpu_bf16_units(info) == ()
    assert launch.cpu_bf16_units(tmp_path / "absent") == ()


@pytest.mark.parametrize(("units", "expected"), [(("amx_bf16",), "bf16"), ((), "fp32")])
def test_default_precision_and_the_one_fallback_line(monkeypatch, caplog, units, expected):
    monkeypatch.setattr(launch, "cpu_bf16_units", lambda: units)
    launch.cpu_precision.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="setgrpo_verl.runner.launch"):
            assert launch.cpu_precision() == expected
            assert launch.cpu_precision() == expected  # asked again: no second line
            overrides = launch.cpu_overrides()
    finally:
        launch.cpu_precision.cache_clear()
    lines = [r.getMessage() for r in caplog.records]
    if expected == "fp32":
        assert len(lines) == 1 and "float32" in lines[0] and "bf16" in lines[0]
    else:
        assert lines == []
    assert f"actor_rollout_ref.rollout.dtype={'bfloat16' if expected == 'bf16' else 'float32'}" in overrides


def test_unknown_precision_is_refused():
    with pytest.raises(launch.LaunchError, match="fp16"):
        launch.cpu_overrides(precision="fp16")


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "compute", "rollout"), [("bf16", "bf16", "bfloat16"), ("fp32", "fp32", "float32")])
def test_verl_composes_the_precision(tmp_path, precision, compute, rollout):
    cmd = launch.main_ppo_command(launch.cpu_overrides(precision=precision) + ["--cfg", "job"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch.cpu_environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = OmegaConf.create(proc.stdout).actor_rollout_ref
    for role in (cfg.actor, cfg.ref):
        assert dict(role.fsdp_config.mixed_precision) == {"param_dtype": compute, "reduce_dtype": "fp32",
                                                          "buffer_dtype": "fp32"}
    assert cfg.actor.fsdp_config.model_dtype == "fp32"  # float32 master weights and optimizer state
    assert cfg.rollout.dtype == rollout


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 5e-2), (torch.float32, 1e-5)])
def test_rollout_runs_in_its_dtype_and_returns_the_models_log_probs(tiny_model, dtype, tol):
    server = TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=2, seed=0, dtype=dtype)
    assert {p.dtype for p in server.model.parameters()} == {dtype}
    prompts = [[1, 17, 42, 99, 7], [1, 5, 8]]
    outs = server._generate_batch(prompts, (1.0, 1.0, -1, 6, True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = server.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.log_probs), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rollout_log_probs_are_those_of_generates_logits_over_the_temperature(tiny_model, monkeypatch, dtype,
                                                                              temperature):
    # bit for bit: log-softmax of generate's float32 logits divided by the temperature (none at 0), taken step by step
    # as over the stacked [B, T, V] tensor
    server = TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=4, seed=0, dtype=dtype)
    seen = []
    generate = server.model.generate
    monkeypatch.setattr(server.model, "generate", lambda **kw: seen.append(generate(**kw)) or seen[-1])
    prompts = [[1, 17, 42, 99, 7], [1, 5, 8], [1, 5, 8]]
    outs = server._generate_batch(prompts, (temperature, 1.0, -1, 6, True))
    logits = torch.stack(seen[0].logits, dim=1)
    assert logits.dtype == torch.float32
    if temperature > 0:
        logits = logits / temperature
    new_tokens = seen[0].sequences[:, -logits.shape[1]:]
    ref = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
    for i, out in enumerate(outs):
        assert out.log_probs == ref[i, : len(out.token_ids)].tolist()


def test_a_negative_temperature_is_refused(tiny_model):
    import asyncio

    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"temperature=-0.5: a sampling temperature is >= 0"):
        asyncio.run(server.generate(prompt_ids=[1, 5], sampling_params={"temperature": -0.5}))
