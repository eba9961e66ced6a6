"""The code's layout as the README promises it: three floors, tasks/ (plain Python) under flows/ (what runs
inside a flow run) under cli/ (the command line), none reaching up; tasks/ in packages by what things are,
each saying what lives there; stages build on shared parts, never on each other; commands never on each
other; imports at the top of a command's file unless they are heavy; no import cycle among the project's
modules; no module reaching for another's private names; and the README's layout table names exactly
the modules that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.stages import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
# the stages of the DAG, each a module of its package (the registry names them: tasks/core/stages.py)
STAGES = tuple(e.module for e in REGISTRY)
# the packages from the bottom up: each imports only those before it (the README's layout table lists them so)
TASK_PACKAGES = ("core", "store", "formats", "engine", "address", "data", "extract", "train", "benchmark", "cost")
# the floors of the house from the bottom up: each imports only the floors below it
FLOORS = ("tasks", "flows", "cli")
# libraries that take seconds to import: a command imports them (or a module that does) only inside the
# function that needs them, so that `draftline --help` and every command's help answer at once
HEAVY = ("prefect", "prefect_aws", "torch", "vllm", "transformers", "speculators", "datasets")


def modules() -> dict[str, Path]:
    """Every project module by its dotted name; a package's `__init__.py` is the package itself."""
    out = {}
    for floor in FLOORS:
        for p in sorted((ROOT / floor).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name not in FLOORS:
                out[name] = p
    return out


def import_nodes(path: Path, top_level_only: bool) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    return [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]


def imports(path: Path, top_level_only: bool) -> set[str]:
    out = set()
    for node in import_nodes(path, top_level_only):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_tasks_is_packages_each_saying_what_lives_there():
    found = sorted(p.name for p in (ROOT / "tasks").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert found == sorted(TASK_PACKAGES)
    assert sorted(p.name for p in (ROOT / "tasks").glob("*.py")) == ["__init__.py"], "a module outside the packages"
    for pkg in TASK_PACKAGES:
        init = ROOT / "tasks" / pkg / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc, f"tasks/{pkg}/__init__.py says what lives in the package"
        unnamed = [m.name for m in sorted((ROOT / "tasks" / pkg).glob("*.py"))
                   if m.name != "__init__.py" and m.name not in doc]
        assert unnamed == [], f"tasks/{pkg}/__init__.py does not say what {unnamed} hold"
        heavy = {(n.module or "") if isinstance(n, ast.ImportFrom) else a.name
                 for n in import_nodes(init, True) for a in n.names}
        heavy = {m for m in heavy if m.split(".")[0] not in sys.stdlib_module_names
                 and m not in ("__future__", "tasks.core.errors")}
        assert heavy == set(), f"tasks/{pkg}/__init__.py imports (at its top) only the standard library and the error root"


def test_each_floor_imports_only_the_floors_below_it():
    """tasks/ < flows/ < cli/, at module or function level: the flow never reaches for a command, and plain
    Python never for Prefect's flow nor the command line."""
    rank = {f: i for i, f in enumerate(FLOORS)}
    found = [f"{m} imports {i}" for m, p in modules().items() for i in sorted(imports(p, top_level_only=False))
             if rank.get(i.split(".")[0], -1) > rank[m.split(".")[0]]]
    assert found == []


def test_no_command_imports_another_command():
    """A command module (cli/commands/) builds on the shared modules of cli/, flows/ and tasks/, never on
    another command: what two commands share is a module of its own."""
    mods = modules()
    commands = {m for m in mods if m.startswith("cli.commands.")}
    assert len(commands) >= 10
    found = [f"{m} imports {i}" for m in sorted(commands) for i in sorted(imports(mods[m], top_level_only=False))
             if i.startswith("cli.commands") and i != m and i not in ("cli.commands",)]
    found += [f"{m} imports cli.commands.{a.name}" for m in sorted(commands) for n in import_nodes(mods[m], False)
              if isinstance(n, ast.ImportFrom) and n.module == "cli.commands" for a in n.names]
    assert found == []


def heavy_modules() -> set[str]:
    """The project's modules that import a HEAVY library at their top, themselves or through another."""
    mods = modules()
    top = {m: imports(p, top_level_only=True) for m, p in mods.items()}
    heavy = {m for m, i in top.items() if any(x.split(".")[0] in HEAVY for x in i)}
    while True:
        more = {m for m, i in top.items() if m not in heavy and i & heavy}
        if not more:
            return heavy
        heavy |= more


def test_imports_are_at_the_top_unless_an_import_is_heavy():
    """The top of a file in cli/ or flows/ says what it depends on: an import inside a function is one that
    would make `--help` (or a run that stops before the stage needing it) wait for a HEAVY library, itself or
    through a module that imports one, and the module says so in a comment."""
    mods = modules()
    heavy = heavy_modules()
    assert "flows.pipeline" in heavy  # the rule sees what it is about
    found = []
    for m, p in mods.items():
        if not m.startswith(("cli.", "flows.")):
            continue
        if m == "cli.app" or m.startswith("cli.commands."):  # what `--help` imports
            assert not (imports(p, top_level_only=True) & heavy), f"{m} imports a heavy module at its top"
        text = p.read_text()
        tree = ast.parse(text)
        inner = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in tree.body]
        for node in inner:
            names = ([f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
                     if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
            if not any(n.split(".")[0] in HEAVY or n in heavy for n in names):
                found.append(f"{m}:{node.lineno}: {text.splitlines()[node.lineno - 1].strip()}")
        if inner:
            assert re.search(r"#.*(heavy|slow to import|takes seconds)", text, re.I), \
                f"{m} imports inside functions and does not say why"
    assert found == [], "imports inside functions that are not heavy: move them to the top"


@pytest.mark.parametrize("argv", [["--help"], ["deploy", "--help"], ["ls", "--store", "file://{tmp}/store"]],
                         ids=["help", "deploy-help", "ls"])
def test_help_answers_without_importing_the_heavy_libraries(argv, tmp_path):
    """`--help` and the commands that do not run the flow import neither Prefect nor torch (the flow module,
    flows/pipeline.py, loads both: only `draftline run` and Prefect's own processes import it)."""
    argv = ["draftline"] + [a.format(tmp=tmp_path) for a in argv]
    code = (f"import sys; sys.argv = {argv!r}\nfrom cli.app import app\ntry:\n    app()\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_each_package_imports_only_the_packages_below_it():
    """core < store < formats < engine < address < data < extract < train < benchmark < cost, at module or
    function level: a shared room that reaches up into one built on it is the layering gone wrong."""
    rank = {f"tasks.{p}": i for i, p in enumerate(TASK_PACKAGES)}
    mods = modules()
    found = [f"{m} imports {i}" for m, p in mods.items() if package_of(m) in rank
             for i in sorted(imports(p, top_level_only=False))
             if i in mods and package_of(i) in rank and rank[package_of(i)] > rank[package_of(m)]]
    assert found == []
    readme = (ROOT / "README.md").read_text()
    listed = [m.group(1) for m in re.finditer(r"^\| `tasks/(\w+)/` \|", readme, re.M)]
    assert listed == list(TASK_PACKAGES), "the README's layout table lists the packages from the bottom up"


def imported_by(code: str) -> list[str]:
    """The HEAVY libraries a fresh interpreter has loaded after running CODE in this checkout."""
    code += "\nimport sys; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])  # a list of module names this test printed


def test_the_stage_registry_imports_neither_torch_nor_prefect():
    """The registry (tasks/core/stages.py) and what derives from it outside the flow (the config's STAGES, the
    store folders, the task-name parser) load no HEAVY library, as vLLM's CLI and model registry do not."""
    assert imported_by("import tasks.core.stages") == []
    assert imported_by("import tasks.core.config, tasks.core.config_load, tasks.address.digests, cli.prefect_api") == []
    assert "tasks.core.stages" not in heavy_modules()


THROWAWAY = '''
from tasks.store.stages import Stage
STAGE_DEF = Stage(name="distill", inputs=("train",), address=lambda cfg, store, train: "d", run=lambda *a, **k: None)
'''


def test_a_stage_is_one_registry_line(tmp_path):
    """A reader adds a seventh stage by writing its module and one registry line: every list of stages outside
    the stage modules derives from it (`--until`'s names, `ls --stage`'s folders, the flow's stage objects and
    the task names it gives, their parser in cli/), with nothing in flows/ or cli/ changed."""
    (tmp_path / "throwaway_distill.py").write_text(THROWAWAY)
    code = f"""import sys; sys.path.insert(0, {str(tmp_path)!r})
from tasks.core import stages
stages.register(stages.StageEntry("distill", "throwaway_distill", folder="distill-stage", shard_folder="distill-shard"))
for taken in (stages.StageEntry("distill", "m"), stages.StageEntry("other", "m", shard_folder="extract")):
    try:
        stages.register(taken)
        raise SystemExit(f"{{taken}} registered twice")
    except ValueError as e:
        assert "is registered already" in str(e), e
from tasks.core.config import STAGES
from tasks.core.stages import check_until
from tasks.address.digests import STAGE_FOLDERS
from cli.prefect_api import shard_of, stage_of
assert STAGES[-1] == "distill" and check_until("distill") == "distill", STAGES
assert STAGE_FOLDERS["distill"] == ("distill-stage", "distill-shard"), STAGE_FOLDERS
name = stages.task_name("distill", shard=7)
assert (name, stage_of(name), shard_of(name)) == ("distill-shard-7", "distill", 7)
assert (stage_of("distill"), shard_of("distill"), stage_of("distill-progress")) == ("distill", None, "distill")
assert (stage_of("train-eagle3"), shard_of("train-shard-2")) == ("train", None)  # train is not sharded
from tasks.store.stages import stage_defs
stages.REGISTRY[:] = [stages.StageEntry("distill", "throwaway_distill")]
assert [st.name for st in stage_defs()] == ["distill"]
stages.REGISTRY[:] = [stages.StageEntry("distill", "throwaway_distill", folder="distill-stage")]
stage_defs.cache_clear()
try:
    stage_defs()
except RuntimeError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "registry line says 'distill' in ('distill-stage',)" in out.stdout, out.stdout


def test_the_registry_names_the_stage_modules_and_their_folders():
    """Each registry line's module defines the STAGE_DEF of that stage, sharded exactly when the line gives
    a shard folder (read from the source: importing the stages would load torch); the folders are distinct."""
    folders = [f for e in REGISTRY for f in e.folders]
    assert len(folders) == len(set(folders))
    mods = modules()
    for e in REGISTRY:
        tree = ast.parse(mods[e.module].read_text())
        defs = [n.value for n in tree.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["STAGE_DEF"]]
        assert [ast.unparse(d.func) for d in defs] == ["ShardedStage" if e.sharded else "Stage"], e


# each stage's entries (tasks/__init__.py: the stage interface)
STAGE_ENTRIES = {"tasks.data.prepare": ["run_prepare"], "tasks.data.regenerate": ["regenerate_shard", "assemble_regenerate"],
                 "tasks.data.vocab": ["run_vocab"], "tasks.extract.stage": ["extract_shard", "assemble_extract"],
                 "tasks.train.stage": ["run_train"], "tasks.benchmark.stage": ["run_benchmark"]}


@pytest.mark.parametrize("module", sorted(STAGE_ENTRIES))
def test_every_stage_has_the_one_interface(module):
    """(cfg, store, inputs...) -> ArtifactRef through Store.found_or_compute, callbacks keyword-only on_*; the
    module exports the one object the flow iterates (`STAGE_DEF`: a Stage, or a ShardedStage with plan / shard
    / assemble; tasks/store/stages.py)."""
    assert set(STAGE_ENTRIES) == set(STAGES)
    tree = ast.parse(modules()[module].read_text())
    defs = [n.value for n in tree.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["STAGE_DEF"]]
    assert len(defs) == 1 and isinstance(defs[0], ast.Call) and ast.unparse(defs[0].func) in ("Stage", "ShardedStage"), \
        f"{module} exports one STAGE_DEF = Stage(...) or ShardedStage(...)"
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for name in STAGE_ENTRIES[module]:
        f = funcs[name]
        assert [a.arg for a in f.args.args[:2]] == ["cfg", "store"], f"{module}.{name}"
        assert f.returns is not None and ast.unparse(f.returns) == "ArtifactRef", f"{module}.{name}"
        positional_hooks = [a.arg for a in f.args.args if a.arg.startswith(("on_", "log", "progress"))]
        assert positional_hooks == [], f"{module}.{name}: callbacks are keyword-only on_<event>"
        calls = [n for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "found_or_compute"]
        assert calls, f"{module}.{name} finds or computes its artifact through Store.found_or_compute"
    for f in funcs.values():
        hooks = [a.arg for a in f.args.kwonlyargs if a.arg.startswith(("log", "progress"))]
        assert hooks == [], f"{module}.{f.name}: callbacks are named on_<event>"


# the training components, siblings over tasks/train's shared parts (RunState, DistEnv, the package's helpers)
TRAIN_COMPONENTS = ("tasks.train.schedule", "tasks.train.checkpoints", "tasks.train.metrics", "tasks.train.evaluation")


def test_the_training_components_are_siblings():
    """The schedule, the checkpoints, the metrics and the evaluation each build on what the package shares,
    never on another component (type-checking and function-level imports included): the loop composes them."""
    mods = modules()
    found = [f"{m} imports {i}" for m in TRAIN_COMPONENTS
             for i in sorted(imports(mods[m], top_level_only=False) | type_checking_imports(mods[m]))
             if i in TRAIN_COMPONENTS and i != m]
    assert found == []


def type_checking_imports(path: Path) -> set[str]:
    """What `if TYPE_CHECKING:` blocks import (ast.walk sees them too; named here so the rule says so)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for n in ast.walk(node):
                if isinstance(n, ast.ImportFrom) and n.module:
                    out.add(n.module)
    return out


def test_no_stage_imports_another_stage():
    """A stage module is imported only by the flow and by its own package's helpers (never by another
    stage, nor by a shared package), at module or function level."""
    found = []
    for m, p in modules().items():
        if not m.startswith("tasks."):
            continue
        for i in imports(p, top_level_only=False):
            if i in STAGES and i != m and (m in STAGES or package_of(m) != package_of(i)):
                found.append(f"{m} imports {i}")
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


def test_no_module_imports_a_private_name_of_another():
    """`from tasks.x import _helper` couples two modules through what one of them calls internal: the
    helper is either public (renamed) or stays where it is used."""
    mods = modules()
    found = [f"{m}: from {n.module} import {a.name}"
             for m, p in mods.items() for n in import_nodes(p, False)
             if isinstance(n, ast.ImportFrom) and n.module in mods
             for a in n.names if a.name.startswith("_")]
    assert found == []


def test_the_readme_layout_table_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    table = table[table.index("| path"):].split("\n\n")[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z/]+)` \| (.*)$", table, re.M)}
    for folder in ("cli/", "cli/commands/", "flows/"):
        listed = set(re.findall(r"`([a-z_]+)\.py`", rows[folder]))
        assert listed == {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}, folder
    named = {row.split("/")[1] for row in rows if row.startswith("tasks/") and row != "tasks/"}
    assert sorted(named) == sorted(TASK_PACKAGES), "a package the README's layout table has no row for"
    for pkg in TASK_PACKAGES:
        listed = set(re.findall(r"`([a-z_]+)\.py`", rows[f"tasks/{pkg}/"]))
        present = {p.stem for p in (ROOT / "tasks" / pkg).glob("*.py") if p.stem != "__init__"}
        assert sorted(present - listed) == [], f"modules of tasks/{pkg}/ the README's layout table does not name"
        assert sorted(listed - present) == [], f"modules the README's tasks/{pkg}/ row names that do not exist"
    for stage in STAGES:
        assert f"`{stage.split('.', 1)[1].replace('.', '/')}.py`" in rows["tasks/"], stage


def test_every_error_has_the_one_root():
    """Every exception class the project defines derives `DraftlineError` (which the command line catches
    once), keeping the built-in base callers catch; `Stopped` is a request to stop, not an error."""
    builtin = {"Exception", "ValueError", "RuntimeError", "LookupError", "OSError", "KeyError"}
    found = []
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and node.name not in ("Stopped", "DraftlineError"):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & builtin and "DraftlineError" not in bases:
                    found.append(f"{m}.{node.name}")
    assert found == []


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports, also inside a
    top-level if/try/with), as `from MODULE import NAME` finds them."""
    out: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                out.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
        elif isinstance(n, (ast.If, ast.Try, ast.With, ast.For)):
            todo += [c for c in ast.iter_child_nodes(n) if isinstance(c, ast.stmt)]
            todo += [s for h in getattr(n, "handlers", []) for s in h.body]
    return out


def test_every_name_imported_from_the_project_exists():
    """A benchmark, a test or a module that imports a name a project module no longer defines fails only when
    it runs (benchmarks/bench_identity.py imported the benchmark stage's removed `engine_kwargs`): every
    `from tasks/flows/cli... import NAME` here, at any depth, names what that module defines or a submodule."""
    mods = modules()
    files = [p for d in ("tasks", "flows", "cli", "benchmarks", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    defined: dict[str, set[str]] = {}
    missing = []
    for p in files:
        for node in import_nodes(p, top_level_only=False):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in mods:
                continue
            have = defined.setdefault(node.module, defined_names(mods[node.module]))
            missing += [f"{p.relative_to(ROOT)}:{node.lineno} imports {a.name} from {node.module}"
                        for a in node.names if a.name != "*" and a.name not in have
                        and f"{node.module}.{a.name}" not in mods]
    assert missing == []
