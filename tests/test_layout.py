"""The code's layout as the README promises it: stages build on shared parts, never on each other; no
import cycle among the project's modules; and the README's layout table names exactly the modules
that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("prepare", "regenerate", "vocab", "extract", "train", "benchmark")
PACKAGES = ("tasks", "flows")


def modules() -> dict[str, Path]:
    return {f"{pkg}.{p.stem}": p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))
            if p.stem != "__init__"}


def imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_stage_imports_another_stage():
    """What `grep -rn "from tasks\\.\\(prepare\\|...\\) import" tasks/` checks, by file."""
    pattern = re.compile(r"from tasks\.(" + "|".join(STAGES) + r") import")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted((ROOT / "tasks").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-function-level"])
def test_no_import_cycle_among_project_modules(top_level_only):
    """Not even through an import inside a function: two modules that need each other are one
    concern split badly (the CLI and the operations commands were, and the train stage and its ranks)."""
    mods = modules()
    graph = {m: {i for i in imports(p, top_level_only) if i in mods and i != m} for m, p in mods.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_readme_layout_table_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    named = set(re.findall(r"`([a-z_]+)\.py`", table))
    present = {p.stem for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
    assert sorted(present - named) == [], "modules the README's layout table does not name"
    assert sorted(named - present) == [], "modules the README's layout table names that do not exist"
