"""Fixtures of the declared-GPU rehearsal: a two-node Ray cluster with declared GPUs whose every process sees a GPU
node's CUDA and driver facts (``site/sitecustomize.py``), tiny random models of each recipe's family, small rubric
parquet files and a stub judge reached by the host's address (docs/verl_integration.md#the-declared-gpu-rehearsal)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent / "site"
#: GPUs declared on each of the two nodes: the widest recipe (qwen3_14b, rollout TP 4) on two nodes of 2.
GPUS_PER_NODE = 2
#: A GPU node's facts: CUDA works, driver R580 (torch 2.11's CUDA 13 needs it).
GPU_NODE = {"SETGRPO_REHEARSAL_GPU": "cuda", "SETGRPO_REHEARSAL_DRIVER": "580.65.06"}


def rehearsal_environ(facts: dict) -> dict:
    """The variables that put ``site/sitecustomize.py`` in front of every Python process started with them."""
    path = os.environ.get("PYTHONPATH")
    return {**facts, "PYTHONPATH": f"{SITE}{os.pathsep}{path}" if path else str(SITE)}


@pytest.fixture(scope="module")
def declared_gpu_cluster(tmp_path_factory):
    """Two Ray nodes on this machine, each declaring ``GPUS_PER_NODE`` GPUs; yields the address ``RAY_ADDRESS`` takes.

    The raylets inherit :func:`rehearsal_environ`, and with it every TaskRunner and worker Ray starts."""
    import ray
    from ray.cluster_utils import Cluster

    # Ray's Cluster writes its address to <temp dir>/ray/ray_current_cluster, where any ray.init() without an address
    # on this machine would find and join it (another test's run under pytest-xdist): a temp dir of its own keeps it
    # apart (short, for the raylets' socket paths); the runs reach it through RAY_ADDRESS
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", temp_dir)
        for key, value in rehearsal_environ(GPU_NODE).items():  # the raylets; each run sets its own
            mp.setenv(key, value)
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # Ray refuses declared GPUs that the variable hides
        mp.delenv("RAY_ADDRESS", raising=False)
        node = dict(num_cpus=32, num_gpus=GPUS_PER_NODE, object_store_memory=300 * 2**20)
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        try:
            yield cluster.address
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


class HostJudge:
    """A stub OpenAI-compatible judge on the host's address (a multi-node run refuses a loopback judge): every
    verdict is ``yes``; the requests' bodies are kept in ``requests``."""

    def __init__(self, host: str):
        self.requests: list[dict] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                judge.requests.append(json.loads(body or b"{}"))
                data = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": "yes"}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}/v1"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def host_judge():
    from ray.util import get_node_ip_address

    judge = HostJudge(get_node_ip_address())
    yield judge
    judge.close()


def _tokenizer():
    from transformers import AutoTokenizer

    from setgrpo_verl.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def tiny_model(family: str, out: Path) -> Path:
    """A randomly initialised model of ``family`` (``qwen3``, ``qwen3_5``, ``llama``) at hidden size 16, saved with
    the embedded SmolLM2 tokenizer: the class verl loads for that recipe's hub model."""
    import torch
    import transformers as tf

    tok = _tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=8192, **ids)
    torch.manual_seed(0)
    if family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, tie_word_embeddings=True, **text))
    elif family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(tie_word_embeddings=True, **text))
    elif family == "qwen3_5":  # verl loads Qwen3.5-4B/9B as the vision-language class
        text.update(head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                    linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2)
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision,
                                                                       tie_word_embeddings=True))
    else:
        raise ValueError(family)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rubric_data(tmp_path_factory) -> Path:
    """``train``, ``test`` and ``calib`` parquet files of 8 short IFBench rubric prompts, as
    recipes/prepare_rubrichub.sh names them."""
    from setgrpo_verl.grading import load_ifbench_rubrics, rubrics_to_verl_rows, write_verl_parquet

    out = tmp_path_factory.mktemp("rubrichub")
    rows = sorted(load_ifbench_rubrics(), key=lambda r: len(r["question"]))[:24]
    for i, name in enumerate(("train", "test", "calib")):
        write_verl_parquet(rubrics_to_verl_rows(rows[8 * i: 8 * i + 8]), out / f"{name}.parquet")
    return out
