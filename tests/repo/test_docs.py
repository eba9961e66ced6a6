"""What the docs point a reader at exists: every file of the checkout a doc names, and every test it cites as
`FILE::NAME` (a name ending in `_` stands for the tests it begins). benchmarks/RESULTS.md is a log of what ran
then, so its paths may name files since moved."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PATH = re.compile(r"(?<![\w/.-])((?:tasks|flows|cli|tests|benchmarks|docs|configs|deployments|infra|requirements)"
                  r"/[\w./-]*\w)(?:::(\w+))?")


def defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_file_and_test_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        for m in PATH.finditer(doc.read_text()):
            path, name = m.group(1), m.group(2)
            if any(c in path for c in "*{<") or path.endswith("/"):
                continue
            where = f"{doc.relative_to(ROOT)} names {path}" + (f"::{name}" if name else "")
            if not (ROOT / path).exists():
                missing.append(where)
            elif name and path.endswith(".py"):
                names = defined(ROOT / path)
                if not (name in names or (name.endswith("_") and any(n.startswith(name) for n in names))):
                    missing.append(where)
    assert missing == []
