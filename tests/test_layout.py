"""The package's folders are its architecture: the command line and its run directories live in
``setgrpo_verl.runner``, which nothing else imports; the leaves others share (``models``, ``rundir``, ``atomic``)
import no other module of the package but ``atomic``; no module grows past 550 lines."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import setgrpo_verl

PKG = Path(setgrpo_verl.__file__).parent
#: The modules that may import the runner: the runner itself, ``python -m setgrpo_verl``, and the re-export of
#: ``cpu_overrides`` at the path the README and docs/verl_integration.md name.
RUNNER_USERS = ("runner/", "__main__.py", "launch.py")


def _imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports, at the top or inside functions."""
    name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_nothing_outside_the_runner_imports_it():
    users = [str(p.relative_to(PKG)) for p in _modules()
             if any(m == "setgrpo_verl.runner" or m.startswith("setgrpo_verl.runner.") for m in _imports(p))]
    assert [u for u in users if not u.startswith(RUNNER_USERS)] == []


#: The leaves others share, and the leaves each may import.
LEAVES = {"models.py": {"setgrpo_verl.atomic", "setgrpo_verl.atomic.replace_durably"}, "rundir.py": {"setgrpo_verl.atomic", "setgrpo_verl.atomic.write_atomic"},
          "atomic.py": set()}


def test_shared_leaves_import_nothing_of_the_package_but_a_leaf():
    for leaf, allowed in LEAVES.items():
        assert {m for m in _imports(PKG / leaf) if m.startswith("setgrpo_verl")} == allowed, leaf


def test_no_module_over_550_lines():
    sizes = {str(p.relative_to(PKG)): len(p.read_text(encoding="utf-8").splitlines()) for p in _modules()}
    assert {name: n for name, n in sizes.items() if n > 550} == {}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts)


def test_no_import_circle():
    """No two modules import each other, directly or through others (imports inside functions count): a
    package ``__init__`` re-exports and is left out, its modules are not."""
    modules = {_module_name(p): p for p in _modules() if p.name != "__init__.py"}
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    circles = []
    for start in sorted(graph):
        seen, stack = set(), [(start, (start,))]
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(trail)
                elif nxt not in seen and nxt > start:
                    seen.add(nxt)
                    stack.append((nxt, trail + (nxt,)))
    assert circles == []
