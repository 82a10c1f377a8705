"""The wheel carries the one copy of the Hydra config, and verl's ``main_ppo`` finds it there without --config-path.

The YAML is edited in the repository's top-level ``hydra_configs/`` and installed as the package
``setgrpo_verl.hydra_configs`` (``package-dir`` in ``pyproject.toml``). The wheel is built from a copy of the
source tree (so no stale ``build/`` folder of the checkout can leak into it) and installed without dependencies
into a fresh virtualenv whose only other import path is this environment's site-packages folder: that folder's
``.pth`` files (among them the editable install's finder) are not processed, so the fresh interpreter imports the
wheel's copy of the package and cannot see the repository.
"""

from __future__ import annotations

import email
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
#: Folders of a checkout that are not the repository's content (build outputs, environments, run outputs).
NOT_SOURCE = (".git", ".venv", "build", "dist", "runs", "outputs", "__pycache__", ".pytest_cache", "*.egg-info")
#: Source folder -> the folder it is installed as.
INSTALLED_AS = {"setgrpo_verl": "setgrpo_verl", "hydra_plugins": "hydra_plugins",
                "hydra_configs": "setgrpo_verl/hydra_configs"}


def _source_files(folder: str, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts)


def expected_wheel_files() -> set[str]:
    """Every module of the source tree, every file of ``hydra_configs/`` and the package data (``setgrpo_verl/data/``),
    at its installed path."""
    out = set()
    for folder, target in INSTALLED_AS.items():
        suffixes = (".py", ".yaml") if folder == "hydra_configs" else (".py",)
        out |= {f"{target}/{p.relative_to(REPO / folder).as_posix()}" for p in _source_files(folder, suffixes)}
    out |= {f"setgrpo_verl/data/{p.name}" for p in (REPO / "setgrpo_verl" / "data").iterdir() if p.is_file()}
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp / "dist"),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("setgrpo_verl-*.whl")
    return whl


def test_no_second_copy_of_any_yaml():
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not any(Path(d).match(p) for p in NOT_SOURCE)]
        found += [Path(root, f).relative_to(REPO) for f in files if f.endswith((".yaml", ".yml"))]
    assert found, "no YAML found: the Hydra configs moved?"
    assert all(p.parts[0] == "hydra_configs" for p in found), f"YAML outside hydra_configs/: {found}"
    assert not (REPO / "setgrpo_verl" / "hydra_configs").exists()
    texts = [(REPO / p).read_text() for p in found]
    assert len(set(texts)) == len(texts), f"two YAML files with the same content: {found}"


def test_wheel_carries_every_module_and_the_hydra_configs(wheel):
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    assert "setgrpo_verl/hydra_configs/setgrpo_trainer.yaml" in names
    assert names == expected_wheel_files()
    assert not any(n.startswith("hydra_configs/") for n in names)  # not a top-level package of its own
    text = zipfile.ZipFile(wheel).read("setgrpo_verl/hydra_configs/setgrpo_trainer.yaml").decode()
    assert text == (REPO / "hydra_configs" / "setgrpo_trainer.yaml").read_text()


#: What verl 0.9.1's ``vllm`` extra pins: the GPU set verl tests its vLLM rollout with.
VERL_VLLM_PINS = {"vllm": "==0.24.0", "torch": "==2.11.0", "torchvision": "==0.26.0", "torchaudio": "==2.11.0",
                  "transformers": "==5.9.0"}


def _extra_requirements(requires: list[str], extra: str) -> list[Requirement]:
    reqs = [Requirement(r) for r in requires]
    return [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})]


def _wheel_metadata(wheel: Path):
    name = f"setgrpo_verl-{wheel.name.split('-')[1]}.dist-info/METADATA"
    return email.message_from_bytes(zipfile.ZipFile(wheel).read(name))


def test_gpu_extra_installs_the_set_verl_is_tested_with(wheel):
    """The gpu extra is verl 0.9.1's vllm extra plus its fsdp extra except flash-attn (a source build on PyPI: an
    install step of its own), read against the installed verl's metadata: a verl upgrade that moves a pin fails here."""
    from setgrpo_verl.integration.support import verl_extra_requirements

    metadata = _wheel_metadata(wheel)
    cluster = {"extra": "gpu", "python_version": "3.12", "platform_system": "Linux", "platform_machine": "x86_64"}
    gpu = {r.name: r for r in map(Requirement, metadata.get_all("Requires-Dist"))
           if r.marker is not None and r.marker.evaluate(cluster)}
    verl = gpu.pop("verl")
    assert (verl.extras, str(verl.specifier)) == ({"vllm", "cupy-cu130"}, "==0.9.1")
    assert md.version("verl") == "0.9.1"
    pins = {r.name: str(r.specifier) for r in _extra_requirements(md.requires("verl"), "vllm") if r.specifier}
    assert {name: pins.get(name) for name in VERL_VLLM_PINS} == VERL_VLLM_PINS
    # verl's fsdp extra, item by item: through verl's own extras (verl-core, vllm's torch set, cupy) or pinned here
    through_verl = {r.name for extra in ("vllm", "cupy-cu130") for r in verl_extra_requirements(extra)}
    fsdp = {r.name: r for r in verl_extra_requirements("fsdp")}
    assert set(fsdp) - through_verl - {"flash-attn"} == set(gpu), (set(fsdp) - through_verl, set(gpu))
    for name in gpu:
        assert str(gpu[name].specifier) == str(fsdp[name].specifier), name


def test_the_metadata_is_pypi_legal_and_matches_verls_python(wheel):
    """PyPI refuses direct-URL requirements; verl 0.9.1 installs on CPython 3.10 to 3.12; the license ships."""
    metadata = _wheel_metadata(wheel)
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    assert [str(r) for r in requirements if r.url] == []
    assert "flash-attn" not in {r.name for r in requirements}
    assert metadata["Requires-Python"] == md.metadata("verl")["Requires-Python"] == "<3.13,>=3.10"
    assert metadata["License-Expression"] == "Apache-2.0"
    names = zipfile.ZipFile(wheel).namelist()
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert text == (REPO / "LICENSE").read_text() and "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_constraints_pin_verls_gpu_set():
    """docker/constraints-gpu.txt holds every version pinned by verl 0.9.1's vllm and fsdp extras, flash-attn included,
    and verl itself: pip then keeps the install on the set verl tests."""
    from setgrpo_verl.integration.support import verl_extra_requirements

    lines = [line.split("#")[0].strip() for line in (REPO / "docker" / "constraints-gpu.txt").read_text().splitlines()]
    constraints = {r.name: str(r.specifier) for r in map(Requirement, filter(None, lines))}
    pinned = {r.name: str(r.specifier) for extra in ("vllm", "fsdp") for r in verl_extra_requirements(extra)
              if str(r.specifier).startswith("==")}
    assert constraints == {**pinned, "verl": "==0.9.1"}
    assert constraints["flash-attn"] == "==2.8.3" and constraints["torch"] == VERL_VLLM_PINS["torch"]


_WHERE = ("import json, importlib.resources as r, setgrpo_verl, hydra_plugins.setgrpo_verl_searchpath as p; "
          "print(json.dumps([setgrpo_verl.__file__, p.__file__, "
          "str(r.files('setgrpo_verl.hydra_configs') / 'setgrpo_trainer.yaml')]))")


@pytest.mark.slow
def test_installed_wheel_resolves_config_name_without_config_path(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies (verl, Hydra, torch, ...) from this environment, listed after the wheel's own folder
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run = tmp_path / "run"  # a working directory without any config or package
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    where = subprocess.run([str(python), "-c", _WHERE], cwd=run, env=env, capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    for path in json.loads(where.stdout):
        assert Path(path).resolve().is_relative_to(site.resolve()), (path, site)
        assert not Path(path).resolve().is_relative_to(REPO), path
    assert Path(json.loads(where.stdout)[2]).is_file()

    proc = subprocess.run([str(python), "-m", "verl.trainer.main_ppo", "--config-name", "setgrpo_trainer",
                           "algorithm.setgrpo.alpha=0.1", "--cfg", "job"], cwd=run, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.algorithm.setgrpo.alpha == 0.1 and cfg.algorithm.setgrpo.beta == 0.08
    assert cfg.algorithm.adv_estimator == "setgrpo" and cfg.trainer.v1.trainer_mode == "setgrpo"
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256  # verl's own ppo_trainer underneath
