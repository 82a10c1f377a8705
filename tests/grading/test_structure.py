"""The grading package's modules import each other without cycles; shared types sit in leaf modules."""

import ast
from pathlib import Path

import setgrpo_verl.grading as grading

PKG = Path(grading.__file__).parent


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (at the top or inside functions)."""
    graph = {}
    for path in PKG.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.add((node.module or "__init__").split(".")[0])
        graph[path.stem] = deps
    return graph


def test_no_import_cycles_in_grading():
    graph = _graph()
    cycles = []

    def walk(node, path):
        for dep in graph.get(node, ()):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            else:
                walk(dep, path + [dep])

    for module in graph:
        if module != "__init__":
            walk(module, [module])
    assert cycles == []
    assert graph["types"] == set()  # the leaf: errors, Rule, Verdict
    assert graph["rules"] <= {"types"} and "rubric" not in graph["rules"]
    assert {"rules", "types"} <= graph["rubric"]


def test_judges_are_split_by_job():
    graph = _graph()
    assert graph["protocol"] == {"types"}  # the reply protocol knows no client and no model
    assert "local_judge" not in graph["http_judge"] and "http_judge" not in graph["local_judge"]
    for module in ("protocol", "http_judge", "local_judge"):
        assert len((PKG / f"{module}.py").read_text(encoding="utf-8").splitlines()) < 400, module
