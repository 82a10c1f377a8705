"""Fixtures of the CPU-backend tests: a tiny random Llama with the embedded tokenizer, rubric prompts as verl parquet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: A function reward of the response text only, in [0, 1): distinct responses get distinct rewards (almost surely),
#: so that groups of sampled responses have spread (a group with tied scores is degenerate).
REWARD_PY = '''
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return int(hashlib.sha256(solution_str.encode()).hexdigest()[:8], 16) / 16**8
'''


def reward_of(text: str) -> float:
    """The reward that ``REWARD_PY`` gives a decoded response."""
    import hashlib

    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama (hidden 64) saved with the embedded SmolLM2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from setgrpo_verl.models import embedded_model_dir

    out = tmp_path_factory.mktemp("tiny_llama")
    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def rubric_parquet(tmp_path_factory) -> Path:
    """8 short IFBench rubric prompts as verl RL rows (rubric in reward_model.ground_truth)."""
    from setgrpo_verl.grading import load_ifbench_rubrics, rubrics_to_verl_rows, write_verl_parquet

    rows = sorted(load_ifbench_rubrics(), key=lambda r: len(r["question"]))[:8]
    return write_verl_parquet(rubrics_to_verl_rows(rows), tmp_path_factory.mktemp("data") / "prompts.parquet")


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD_PY)
    return path


def read_metrics(path: Path) -> list[dict]:
    """verl's file-logger rows, flattened: ``{"training/global_step": n, **metrics}`` per line."""
    from setgrpo_verl.report import load_metrics

    return load_metrics(path)


def run_main_ppo(overrides: list[str], *, workdir: Path, config_name: str = "ppo_trainer", env: dict | None = None,
                 timeout: int = 600, rollout: str = "transformers", precision: str | None = None
                 ) -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo`` on the CPU backend with :func:`setgrpo_verl.runner.launch.cpu_overrides`
    (``precision``: ``bf16``, ``fp32`` or None for the machine's default); verl's file logger writes
    ``workdir/metrics.jsonl``."""
    from setgrpo_verl.runner.launch import cpu_environment, cpu_overrides, main_ppo_command

    cpu = [o if not o.startswith("actor_rollout_ref.rollout.name=") else f"actor_rollout_ref.rollout.name={rollout}"
           for o in cpu_overrides(precision=precision)]
    cmd = main_ppo_command(cpu + overrides, config_name=config_name)
    run_env = cpu_environment({**os.environ, **(env or {})})
    run_env["VERL_FILE_LOGGER_PATH"] = str(workdir / "metrics.jsonl")
    proc = subprocess.run(cmd, cwd=workdir, env=run_env, capture_output=True, text=True, timeout=timeout)
    (workdir / "main_ppo.log").write_text(proc.stdout + proc.stderr)
    return proc


def tail(proc: subprocess.CompletedProcess, n: int = 6000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["read_metrics", "reward_of", "run_main_ppo", "tail", "jsonl", "sys"]
