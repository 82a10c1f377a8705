"""Test-only (tests/rehearsal): a GPU node's CUDA and driver facts, for every process of a declared-GPU rehearsal.

Loaded by Python at start-up where this folder is on PYTHONPATH, and active only with ``SETGRPO_REHEARSAL_GPU`` set
(the driver, Ray's raylets and through them the TaskRunner and every worker inherit both). It replaces one seam,
``setgrpo_verl.integration.gpu_env.gpu_facts``, when that module is imported; everything else (torch, Ray, verl)
stays real. The facts come from the environment:

* ``SETGRPO_REHEARSAL_GPU``: ``cuda`` (torch can use the GPU) or ``none`` (CUDA is not available);
* ``SETGRPO_REHEARSAL_DRIVER``: the loaded NVIDIA driver's version, empty for no driver.

A process that Ray started with ``CUDA_VISIBLE_DEVICES=""`` (an actor without GPUs under Ray 2.41-2.55) sees no GPU,
as torch does on a GPU node. With ``SETGRPO_REHEARSAL_LOG`` set, every call appends a JSON line there: the process,
its ``CUDA_VISIBLE_DEVICES``, the facts it got and this package's frames that asked.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_SEAM = "setgrpo_verl.integration.gpu_env"


def _fake_facts(real):
    """The GPU node's facts in place of ``real`` (this machine's): CUDA 13.0 torch, the driver and CUDA availability
    of ``SETGRPO_REHEARSAL_*``, and no GPU where Ray set ``CUDA_VISIBLE_DEVICES=""``; the rest as read."""
    import dataclasses

    driver = os.environ.get("SETGRPO_REHEARSAL_DRIVER") or None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    available = os.environ.get("SETGRPO_REHEARSAL_GPU") == "cuda" and visible != ""
    count = (len(visible.split(",")) if visible else 8) if available else 0
    return dataclasses.replace(real, torch_cuda="13.0", cuda_available=available, driver_version=driver,
                               device_count=count, visible_devices=visible, driver_device=driver is not None)


def _patch(module) -> None:
    original = module.gpu_facts

    def gpu_facts():
        facts = _fake_facts(original())
        _log(facts)
        return facts

    gpu_facts.__wrapped__ = original
    module.gpu_facts = gpu_facts


def _log(facts) -> None:
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


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
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
