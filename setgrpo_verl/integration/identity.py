"""The run identity that a calibration record and its shards carry (docs/record.md#run-identity): what decides
whether a calibration applies to a run, read from the composed verl config and from the policy's own files.

The weights and the tokenizer are identified by their content, not by their path: the same files under another
path are the same policy, other files saved at the same path are not. Everything is read on the driver before Ray
(:func:`~setgrpo_verl.integration.run_check.check_run_config`), so a model that cannot be read there is refused
before anything starts. A hub id is resolved as verl resolves it: from the Hugging Face cache, downloaded into it
when missing (the files ``from_pretrained`` loads). The driver's fingerprints travel to the Ray workers
(:func:`carry_policy_files`, the environment variable :data:`POLICY_FILES_ENV`), so that verl's TaskRunner, on
another node or with another ``HF_HOME``, computes the identity the driver accepted instead of reading another
cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .dotted import config_value
from .reward_config import REWARD_MANAGER_NAME, grader_identity

__all__ = ["IDENTITY_SOURCES", "POLICY_FILES_ENV", "carry_policy_files", "model_config_sha256", "model_files",
           "model_overrides", "policy_identity", "run_identity", "tokenizer_sha256", "training_identity",
           "weights_fingerprint"]

#: The environment variable that carries the driver's fingerprints of the policy's files (JSON, ``"<kind>:<path>"``
#: -> fingerprint) to the Ray workers (:func:`carry_policy_files`).
POLICY_FILES_ENV = "SETGRPO_POLICY_FILES"
#: The files of a hub model that ``from_pretrained`` (verl's model, tokenizer and config loads) reads: configs,
#: safetensors weights, tokenizer files, chat templates, remote code; ``*.bin`` only for a repo without safetensors.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
#: The fingerprints this process computed from files, by ``"<kind>:<path>"``.
_COMPUTED: dict[str, dict[str, str]] = {}

#: The config key behind each identity field, named next to the field when a record or shard refuses a run.
IDENTITY_SOURCES = {
    "policy.weights": "actor_rollout_ref.model.path (the weight files)",
    "policy.weights_sha256": "actor_rollout_ref.model.path (the weight files)",
    "policy.tokenizer_sha256": "actor_rollout_ref.model.tokenizer_path (null: the model's own tokenizer files)",
    "policy.custom_chat_template_sha256": "actor_rollout_ref.model.custom_chat_template",
    "policy.chat_template_kwargs": "data.apply_chat_template_kwargs",
    "policy.temperature": "actor_rollout_ref.rollout.temperature",
    "policy.top_p": "actor_rollout_ref.rollout.top_p",
    "policy.top_k": "actor_rollout_ref.rollout.top_k",
    "policy.repetition_penalty": "actor_rollout_ref.rollout.repetition_penalty",
    "policy.response_length": "actor_rollout_ref.rollout.response_length (where the rollout and verl's agent loop cut "
                               "responses; default ${data.max_response_length})",
    "policy.ignore_eos": "actor_rollout_ref.rollout.ignore_eos",
    "policy.prompt_length": "actor_rollout_ref.rollout.prompt_length (where verl's agent loop left-truncates prompts; "
                            "default ${data.max_prompt_length})",
    "policy.prompt_filter": "data.max_prompt_length with data.filter_overlong_prompts (verl's dataset drops longer "
                            "prompts)",
    "policy.model_config_sha256": "actor_rollout_ref.model.hf_config_path (null: the model's own config.json)",
    "policy.dtype": "actor_rollout_ref.rollout.dtype",
    "policy.model_overrides": "actor_rollout_ref.model.override_config (its model_config block when it has one, as "
                              "verl applies it)",
    "training.lora_rank": "actor_rollout_ref.model.lora_rank",
    "training.lora_alpha": "actor_rollout_ref.model.lora_alpha",
    "training.target_modules": "actor_rollout_ref.model.target_modules",
    "training.target_parameters": "actor_rollout_ref.model.target_parameters",
    "training.exclude_modules": "actor_rollout_ref.model.exclude_modules",
    "training.lora_adapter_sha256": "actor_rollout_ref.model.lora_adapter_path",
    "training.param_dtype": "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    "training.model_dtype": "actor_rollout_ref.actor.fsdp_config.model_dtype",
}

#: Bytes read at the start, the middle and the end of every tensor (and of every non-safetensors weight file).
_SAMPLE_BYTES = 1024
#: Weight files other than safetensors, fingerprinted by size and sampled bytes when a directory has no safetensors.
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                    "chat_template.json")
#: verl's precision spellings (``PrecisionType``) -> torch's dtype name.
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                "float": "float32", "32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
                "16": "float16"}


def _plain(value: Any) -> Any:
    """A config value as JSON gives it back (OmegaConf containers resolved, tuples as lists)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return json.loads(json.dumps(value, sort_keys=True))


def _dtype_name(value: Any) -> str:
    """torch's name of a verl precision (``bf16`` -> ``bfloat16``); another value (``auto``) as written."""
    return _DTYPE_NAMES.get(str(value).lower(), str(value))


def model_files(path: Any, *, key: str) -> Path:
    """The local directory of a model path, resolved as verl 0.9.1 resolves ``actor_rollout_ref.model.path``: the
    directory itself, or a hub id's snapshot in this machine's Hugging Face cache, downloaded into that cache when it
    is not there (verl hands a hub id to ``from_pretrained``, which downloads it the same way; ``HF_HOME``,
    ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` apply).

    Args:
        path: the configured path or hub id.
        key: the config key that set it (named in the message).

    Raises:
        ValueError: a remote URL (``hdfs://`` ...), or a path that is neither a directory nor a hub model that is
            cached or can be downloaded; the message names the key and the fix.
    """
    text = str(path)
    why = "the calibration record identifies the policy by its files (docs/record.md#run-identity)"
    if "://" in text:
        raise ValueError(f"{key}={text}: a remote path cannot be read before Ray, and {why}; copy the model to a "
                         "local or shared directory and pass that")
    local = Path(text).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=text, local_files_only=True, allow_patterns=_HUB_FILES))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a hub id at all
        pass
    try:
        directory = Path(snapshot_download(repo_id=text, allow_patterns=_HUB_FILES))
        if not any(directory.glob("*.safetensors")):
            directory = Path(snapshot_download(repo_id=text, allow_patterns=[*_HUB_FILES, "*.bin"]))
        return directory
    except (OSError, ValueError) as exc:  # offline, unknown repo, gated without a token, not a hub id
        said = " ".join(str(exc).split())
        raise ValueError(f"{key}={text}: not a local directory, and not a Hugging Face model this machine has cached "
                         f"or could download ({type(exc).__name__}: {said}); {why}: pass a local model directory, or "
                         f"make the hub reachable (HF_TOKEN for a gated model; `hf download {text}` with the same "
                         "HF_HOME)") from None


def _fingerprint(kind: str, path: Any, key: str) -> dict[str, str]:
    """``weights_fingerprint`` (``kind="weights"``), ``{"tokenizer_sha256": ...}`` (``"tokenizer"``) or
    ``{"model_config_sha256": ...}`` (``"config"``, the SHA-256 of its ``config.json``, None without one) of the
    model at ``path``: in a Ray worker, the driver's (:func:`carry_policy_files`) when it carried one for this path;
    else read from the files (:func:`model_files`), and kept for :func:`carry_policy_files`."""
    name = f"{kind}:{path}"
    from .gpu_env import in_ray_actor

    carried = os.environ.get(POLICY_FILES_ENV)
    if carried and in_ray_actor():
        value = json.loads(carried).get(name)
        if value is not None:
            return value
    directory = model_files(path, key=key)
    if kind == "weights":
        value = weights_fingerprint(directory)
    elif kind == "config":
        config = directory / "config.json"
        value = {"model_config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None}
    else:
        value = {"tokenizer_sha256": tokenizer_sha256(directory)}
    _COMPUTED[name] = value
    return value


def carry_policy_files(environ: Any = None) -> bool:
    """Give the next ``ray.init`` of this process (the driver) the fingerprints it computed of the policy's files, in
    :data:`POLICY_FILES_ENV` through the job's runtime environment
    (:func:`setgrpo_verl.integration.judge_access.forward_to_ray`): verl's TaskRunner then uses them instead of
    reading its own node's Hugging Face cache. Returns True when there was something to carry."""
    from .judge_access import forward_to_ray

    if not _COMPUTED:
        return False
    environ = os.environ if environ is None else environ
    environ[POLICY_FILES_ENV] = json.dumps(_COMPUTED, sort_keys=True)
    forward_to_ray([POLICY_FILES_ENV], environ)
    return True


def _safetensors_header(fh: Any, path: Path) -> bytes:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the header)."""
    head = fh.read(8)
    size = path.stat().st_size
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= length <= size - 8:
        raise ValueError(f"weight file {path} is not a safetensors file (header length {length}, file {size} "
                         "bytes): a partial download or another format; download the model again")
    return fh.read(length)


def _sample(fh: Any, start: int, end: int) -> bytes:
    """Up to 3 x ``_SAMPLE_BYTES`` of ``[start, end)``: its first, middle and last bytes."""
    out = b""
    for offset in sorted({start, max(start, (start + end - _SAMPLE_BYTES) // 2), max(start, end - _SAMPLE_BYTES)}):
        fh.seek(offset)
        out += fh.read(min(_SAMPLE_BYTES, end - offset))
    return out


def weights_fingerprint(directory: Path) -> dict[str, str]:
    """A cheap fingerprint of a model directory's weight files (docs/record.md#run-identity).

    For safetensors files: each file's name and size, its header (every tensor's name, dtype, shape and offsets)
    and the first, middle and last 1 KiB of every tensor's data; other weight files (``.bin``, ``.pt``, ``.gguf``,
    only when there is no safetensors file): name, size and the same samples of the whole file. Another checkpoint
    of the same architecture differs in every trained tensor, so it differs here; a change confined to bytes
    that are not sampled is not seen.

    Returns:
        ``{"weights": <summary: format, files, tensors, parameters, dtypes>, "weights_sha256": <64 hex>}``.

    Raises:
        ValueError: no weight file in ``directory``, or a safetensors file whose header cannot be read.
    """
    files = sorted(directory.glob("*.safetensors"))
    fmt = "safetensors"
    if not files:
        files = sorted(p for p in directory.iterdir() if p.suffix in _OTHER_WEIGHTS and p.is_file())
        fmt = "/".join(sorted({p.suffix.lstrip(".") for p in files}))
    if not files:
        raise ValueError(f"{directory} holds no weight files (*.safetensors, or {', '.join(_OTHER_WEIGHTS)}): a "
                         "model directory saved with save_pretrained, or a complete download, is needed")
    digest = hashlib.sha256()
    tensors, parameters, dtypes = 0, 0, set()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as fh:
            if path.suffix != ".safetensors":
                digest.update(_sample(fh, 0, size))
                continue
            header = _safetensors_header(fh, path)
            digest.update(header)
            try:
                entries = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
            except (ValueError, AttributeError):
                raise ValueError(f"weight file {path}: its safetensors header is not a JSON object; download the "
                                 "model again") from None
            base = 8 + len(header)
            for name in sorted(entries, key=lambda n: entries[n]["data_offsets"][0]):
                begin, end = entries[name]["data_offsets"]
                digest.update(_sample(fh, base + begin, base + end))
                tensors += 1
                parameters += math.prod(entries[name]["shape"])
                dtypes.add(entries[name]["dtype"])
    summary = f"{fmt}: {len(files)} file(s)"
    if fmt == "safetensors":
        summary += f", {tensors} tensors, {parameters:,} parameters ({', '.join(sorted(dtypes))})"
    return {"weights": summary, "weights_sha256": digest.hexdigest()}


def tokenizer_sha256(directory: Path) -> str:
    """SHA-256 of a tokenizer's files (``tokenizer.json``, ``tokenizer_config.json`` with its chat template,
    vocabularies, ``chat_template.jinja`` ...): names and contents of those present, in a fixed order.

    Raises:
        ValueError: none of them is in ``directory``.
    """
    files = [directory / name for name in _TOKENIZER_FILES if (directory / name).is_file()]
    if not files:
        raise ValueError(f"{directory} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...): set "
                         "actor_rollout_ref.model.tokenizer_path to the tokenizer's directory")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def policy_identity(config: Any) -> dict[str, Any]:
    """What samples the responses (record field ``policy``, docs/record.md#run-identity).

    ``model`` is the configured path, for people only (never compared); then the weights' fingerprint
    (:func:`weights_fingerprint`), the tokenizer's (:func:`tokenizer_sha256`), the SHA-256 of
    ``model.custom_chat_template`` (None: the tokenizer's own), ``data.apply_chat_template_kwargs``, the rollout's
    sampling settings (temperature, top_p, top_k with any value <= 0 as -1, i.e. off; repetition_penalty,
    ignore_eos), the lengths where they take effect (``rollout.response_length``, at which the rollout and verl's
    agent loop cut responses; ``rollout.prompt_length``, at which the agent loop left-truncates prompts;
    ``prompt_filter``, ``data.max_prompt_length`` when ``data.filter_overlong_prompts`` drops longer prompts, else
    None), the rollout's dtype, the SHA-256 of the ``config.json`` the network is built from
    (:func:`model_config_sha256`) and ``model_overrides`` (:func:`model_overrides`: verl applies them to the model's
    config, e.g. ``num_hidden_layers``, so the same files can load another network). Keys absent from ``config``
    read as verl 0.9.1's defaults.

    Raises:
        ValueError: the model or tokenizer files cannot be read (:func:`model_files`, :func:`weights_fingerprint`).
    """
    model = config.actor_rollout_ref.model
    rollout = config.actor_rollout_ref.rollout
    path = str(model.path)
    tokenizer = config_value(model, "tokenizer_path")
    template = config_value(model, "custom_chat_template")
    top_k = int(config_value(rollout, "top_k", -1))
    return {
        "model": path,
        **_fingerprint("weights", path, "actor_rollout_ref.model.path"),
        **(_fingerprint("tokenizer", tokenizer, "actor_rollout_ref.model.tokenizer_path") if tokenizer
           else _fingerprint("tokenizer", path, "actor_rollout_ref.model.path")),
        "custom_chat_template_sha256": (None if template is None
                                        else hashlib.sha256(str(template).encode()).hexdigest()),
        "chat_template_kwargs": _plain(config_value(config, "data.apply_chat_template_kwargs", {})),
        "temperature": float(rollout.temperature),
        "top_p": float(rollout.top_p),
        "top_k": top_k if top_k > 0 else -1,
        "repetition_penalty": float(config_value(rollout, "repetition_penalty", 1.0)),
        # absent from a hand-built config: verl's defaults, ${oc.select:data.max_response_length,512} and the like
        "response_length": int(config_value(rollout, "response_length",
                                            config_value(config, "data.max_response_length", 512))),
        "ignore_eos": bool(config_value(rollout, "ignore_eos", False)),
        "prompt_length": int(config_value(rollout, "prompt_length",
                                          config_value(config, "data.max_prompt_length", 512))),
        "prompt_filter": (int(config_value(config, "data.max_prompt_length", 512))
                          if config_value(config, "data.filter_overlong_prompts", False) else None),
        "dtype": _dtype_name(config_value(rollout, "dtype", "bfloat16")),
        "model_config_sha256": model_config_sha256(model),
        "model_overrides": model_overrides(config_value(model, "override_config", {})),
    }


def model_overrides(override_config: Any) -> dict[str, Any]:
    """The model-config overrides verl 0.9.1 applies (``HFModelConfig.__post_init__``): the ``model_config`` block of
    ``actor_rollout_ref.model.override_config`` when it has one, else the whole mapping; without
    ``attn_implementation`` at either level (the attention kernel computes the same function)."""
    overrides = _plain(override_config) or {}
    applied = overrides["model_config"] if "model_config" in overrides else overrides
    return {k: v for k, v in (applied or {}).items() if k != "attn_implementation"}


def model_config_sha256(model: Any) -> str | None:
    """SHA-256 of the ``config.json`` verl builds the network from: ``actor_rollout_ref.model.hf_config_path``'s
    when set, else the model's (None: the directory has none, as with a model only a remote-code hub loader reads).

    In a Ray worker the driver's value is used when it carried one (:func:`carry_policy_files`).

    Raises:
        ValueError: ``hf_config_path`` (or the model path) that is not a local or cached model directory
            (:func:`model_files`).
    """
    source = config_value(model, "hf_config_path")
    key = "actor_rollout_ref.model.hf_config_path" if source else "actor_rollout_ref.model.path"
    return _fingerprint("config", source or model.path, key)["model_config_sha256"]


def training_identity(config: Any) -> dict[str, Any]:
    """What the gradients are of, and in which precision (record field ``training``, docs/record.md#run-identity).

    ``lora_rank`` (0: full fine-tuning), then, with LoRA, ``lora_alpha``, ``target_modules`` (a list sorted),
    ``target_parameters``, ``exclude_modules`` and the fingerprint of ``lora_adapter_path``'s weights (None
    without LoRA or without an adapter); ``param_dtype``, the actor's compute precision (verl's FSDP mixed
    precision ``param_dtype``, bf16 when ``mixed_precision`` is unset, as verl's engine does), and ``model_dtype``,
    its master weights' dtype. The CPU backend writes both into the command line for the machine it runs on, so
    they are what was used.

    Raises:
        ValueError: a LoRA adapter directory that cannot be read.
    """
    model = config.actor_rollout_ref.model
    fsdp = config_value(config, "actor_rollout_ref.actor.fsdp_config")
    rank = int(config_value(model, "lora_rank", 0) or 0)
    lora = rank > 0

    def modules(key: str) -> Any:
        value = _plain(config_value(model, key)) if lora else None
        return sorted(value) if isinstance(value, list) else value

    adapter = config_value(model, "lora_adapter_path") if lora else None
    mixed = config_value(fsdp, "mixed_precision")
    return {
        "lora_rank": rank,
        "lora_alpha": float(config_value(model, "lora_alpha", 16)) if lora else None,
        "target_modules": modules("target_modules"),
        "target_parameters": modules("target_parameters"),
        "exclude_modules": modules("exclude_modules"),
        "lora_adapter_sha256": None if adapter is None else _fingerprint(
            "weights", adapter, "actor_rollout_ref.model.lora_adapter_path")["weights_sha256"],
        "param_dtype": _dtype_name(config_value(mixed, "param_dtype", "bf16") if mixed is not None else "bf16"),
        "model_dtype": _dtype_name(config_value(fsdp, "model_dtype", "fp32")),
    }


def run_identity(config: Any, setgrpo: Any) -> dict[str, Any]:
    """The record fields that identify a run (docs/record.md#run-identity): loss aggregation, sketch, grader,
    policy (:func:`policy_identity`) and training (:func:`training_identity`).

    ``grader`` is :func:`setgrpo_verl.integration.reward_config.grader_identity` for the ``setgrpo_dual`` reward
    manager (``{"name": "reward_manager:<name>"}`` otherwise).

    Args:
        config: the composed verl config.
        setgrpo: its validated ``algorithm.setgrpo`` block (a ``SetGRPOConfig``).

    Raises:
        ValueError: the policy's files cannot be read (see :func:`policy_identity`).
    """
    name = str(config.reward.reward_manager.name)
    grader = grader_identity(config) if name == REWARD_MANAGER_NAME else {"name": f"reward_manager:{name}"}
    return {
        "loss_agg_mode": str(config.actor_rollout_ref.actor.loss_agg_mode),
        "sketch": dataclasses.asdict(setgrpo.sketch.to_sketch_config()),
        "grader": grader,
        "policy": policy_identity(config),
        "training": training_identity(config),
    }

