"""Test-only (tests/rehearsal): a GPU node's CUDA and driver facts, for every process of a declared-GPU rehearsal.

Loaded by Python at start-up where this folder is on PYTHONPATH, and active only with ``SETGRPO_REHEARSAL_GPU`` set
(the driver, Ray's raylets and through them the TaskRunner and every worker inherit both). It replaces one seam,
``setgrpo_verl.integration.gpu_env``'s facts, when that module is imported; everything else (torch, Ray, verl) stays
real. The facts come from the environment:

* ``SETGRPO_REHEARSAL_GPU``: ``cuda`` (torch can use the GPU) or ``none`` (CUDA is not available);
* ``SETGRPO_REHEARSAL_DRIVER``: the loaded NVIDIA driver's version, empty for no driver.

A process that Ray started with ``CUDA_VISIBLE_DEVICES=""`` (an actor without GPUs under Ray 2.41-2.55) sees no GPU,
as torch does on a GPU node. ``flash_attn`` and ``fla`` (CUDA-only packages of the ``gpu`` extra) are found as
installed (``importlib.util.find_spec``, what the check before Ray asks), but they are empty: transformers reads them
as absent and anything that uses them stops there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_SEAM = "setgrpo_verl.integration.gpu_env"
_CUDA_ONLY = ("flash_attn", "flash_attn_2_cuda", "fla")
CUDA_ONLY_MARK = "CUDA-only package, absent from this CPU rehearsal"


def _facts():
    driver = os.environ.get("SETGRPO_REHEARSAL_DRIVER") or None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    available = os.environ.get("SETGRPO_REHEARSAL_GPU") == "cuda" and visible != ""
    return available, driver


def _patch(module) -> None:
    available, driver = _facts()
    seam = getattr(module, "REHEARSAL_SEAM", "read_gpu_environment")
    original = getattr(module, seam)

    def fake(*args, **kwargs):
        real = original(*args, **kwargs)
        fields = {"cuda_available": available, "driver_version": driver, "torch_cuda": "13.0",
                  "flash_attn_error": None}
        facts = real.__class__(**{**real.__dict__, **{k: v for k, v in fields.items() if hasattr(real, k)}})
        _log(seam, facts)
        return facts

    fake.__wrapped__ = original
    setattr(module, seam, fake)
    if hasattr(module, "has_nvidia_driver"):  # until the seam carries the driver too
        module.has_nvidia_driver = lambda: driver is not None
        module.nvidia_driver_version = lambda proc_text=None: driver


def _log(seam, facts) -> None:
    """One JSON line per call in ``$SETGRPO_REHEARSAL_LOG``: the process, what it saw, and this package's frames."""
    path = os.environ.get("SETGRPO_REHEARSAL_LOG")
    if not path:
        return
    import json
    import traceback

    frames = [f"{os.path.basename(f.filename)[:-3]}:{f.name}" for f in traceback.extract_stack()
              if "/setgrpo_verl/" in f.filename]
    line = {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_available": facts.cuda_available, "driver": facts.driver_version, "frames": frames}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")


class _CudaOnlyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # no __file__ and no __version__: transformers reads it as absent (a shadowing namespace package), and
        # ``from flash_attn.x import y`` raises ModuleNotFoundError
        module.__doc__ = CUDA_ONLY_MARK


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _CUDA_ONLY:
            return importlib.machinery.ModuleSpec(fullname, _CudaOnlyLoader())
        if fullname != _SEAM:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SETGRPO_REHEARSAL_GPU"):
    sys.meta_path.insert(0, _Finder())
