"""From a trained draft to a served one: the exact `vllm serve` line, and the vLLM-ready folder.

    serve = serve_settings(cfg, k=3, method="eagle3")             # target, k and the engine settings
    serve_command(serve, "/path/to/draft")                         # the one line every report prints
    export_draft(store, train_digest, "out/", serve)               # draft/ + vocab maps + README.md
    export_draft(store, train_digest, "s3://bucket/drafts/x", serve)

The line names the target as vLLM loads it (a preset's local folder, a folder's absolute path, or the hub id),
the draft with `--speculative-config '{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}'`, and
the engine settings the benchmark measured it at (dtype, max_model_len, eager mode, seed, ...): the flags of
`vllm serve` for the `vllm.LLM` keyword arguments tasks/engine/settings.py gives every engine. K is the best k
the benchmark measured (highest mean speedup over evals and batch sizes, then highest acceptance length), or
the draft's trained speculative tokens when it was not measured.

`serve_command` is the only place the line is built: the run summary (cli/local_run.py), report.md and the
terminal table (tasks/benchmark/report.py), the UI's benchmark artifact (flows/report_artifacts.py), the
export's README.md and `draftline export` all print what it returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from tasks.core.errors import DraftlineError
from tasks.core.owners import owned_temporary_directory
from tasks.formats.vocab_file import read_maps

# The benchmark engine's booleans whose `vllm serve` default is false: left out of the line when false (every other
# false boolean is written `--no-NAME`, vLLM's spelling for it).
FALSE_BY_DEFAULT = ("enforce_eager", "trust_remote_code", "language_model_only", "disable_log_stats")
DEFAULT_HOST = "127.0.0.1"
DRAFT_FILES = ("draft/config.json", "draft/model.safetensors")


class ExportError(DraftlineError, ValueError):
    """An export that cannot be made; the message says what to give instead."""


def serve_settings(cfg: Any, *, k: int, method: str = "eagle3", measured: bool = True,
                   engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the serve line needs besides the draft's path: the target as `vllm serve` loads it (the hub id when it
    came from the hub, with its commit as `revision`; else the folder), the method, k, the host and the engine's
    arguments. `engine`: the `vllm.LLM` arguments the benchmark engine at this k ran with (tasks/engine/settings.py
    `benchmark_kwargs`, the draft's path left out: the line names the exported one); None (not benchmarked): what
    that same function gives for this config on this machine."""
    from tasks.engine.target import resolve_model
    from tasks.engine.weights import is_hub_id

    hub = is_hub_id(cfg.target.model)
    if engine is None:
        from tasks.engine.settings import benchmark_kwargs

        # a hub id's config is all it reads: its weights are not fetched for a line
        engine = benchmark_kwargs(cfg, {"method": method, "num_speculative_tokens": int(k)},
                               resolve_model(cfg.target, weights=not hub))
    engine = {key: v for key, v in engine.items() if key != "speculative_config"}
    serve = {"target": cfg.target.model if hub else resolve_model(cfg.target, weights=False), "method": method,
             "k": int(k), "engine": engine, "measured": measured, "host": cfg.engines.serve_host}
    if cfg.target.chat_template:  # a frontend setting of `vllm serve` (the benchmark sends token ids)
        serve["chat_template"] = str(Path(cfg.target.chat_template).expanduser().resolve())
    return serve


def _flag(key: str, value: Any) -> list[str]:
    name = "--" + key.replace("_", "-")
    if value is True:
        return [name]
    if value is False:
        return [] if key in FALSE_BY_DEFAULT else ["--no-" + key.replace("_", "-")]
    if value is None:
        return []
    if isinstance(value, dict):
        return [name, json.dumps(value, sort_keys=True)]
    if isinstance(value, (list, tuple)):
        return [name, *map(str, value)]
    return [name, str(value)]


def serve_command(serve: dict[str, Any], draft: str, host: str | None = None) -> str:
    """`vllm serve TARGET --speculative-config '{...}' FLAGS --host HOST`: one line, shell-quoted, ready to paste.
    FLAGS are the benchmark engine's arguments, every one (`--NAME VALUE`; dicts as JSON). HOST: `host`, else the
    settings' (engines.serve_host, `draftline export --host`), else 127.0.0.1: this machine only."""
    spec = json.dumps({"method": serve["method"], "model": draft, "num_speculative_tokens": int(serve["k"])})
    words = ["vllm", "serve", serve["target"], "--speculative-config", spec]
    for key, value in (serve.get("engine") or {}).items():
        words += _flag(key, value)
    if serve.get("chat_template"):
        words += ["--chat-template", serve["chat_template"]]
    words += ["--host", host or serve.get("host") or DEFAULT_HOST]
    return shlex.join(words)


def host_note(serve: dict[str, Any], host: str | None = None) -> str:
    """What the line's --host means, printed above it."""
    h = host or serve.get("host") or DEFAULT_HOST
    if h in ("127.0.0.1", "localhost", "::1"):
        return (f"# binds {h}: only this machine reaches the API (it has no authentication); to serve others, "
                "`draftline export ... --host ADDRESS` or engines.serve_host, behind your own access control")
    return f"# binds {h}: the API has no authentication; anyone who reaches {h} can use it"


def code_note(serve: dict[str, Any]) -> list[str]:
    """With the target's --trust-remote-code on the line, what it is for (printed above it): vLLM gives the draft the
    target's flag, and the draft folder an export writes holds no code for it to run."""
    if not (serve.get("engine") or {}).get("trust_remote_code"):
        return []
    return ["# --trust-remote-code is the target's (target.trust_remote_code), not the draft's: the exported draft "
            "folder holds config.json and model.safetensors only, no auto_map and a draft model type (draftline "
            "refuses any other), so no code of the draft's is run"]


def best_k(report: dict[str, Any]) -> int | None:
    """The k that served best in this report: highest mean speedup over its evals and batch sizes, then
    highest mean acceptance length; None when nothing was measured."""
    scores: dict[int, list[tuple[float, float]]] = {}
    for ks in (report.get("benchmark") or {}).values():
        for k, fig in ks.items():
            for f in (fig.get("by_batch_size") or {"": fig}).values():
                scores.setdefault(int(k), []).append((float(f.get("speedup") or 0.0),
                                                      float(f.get("mean_acceptance_length") or 0.0)))
    if not scores:
        return None

    def mean(k: int, i: int) -> float:
        return sum(s[i] for s in scores[k]) / len(scores[k])

    return max(scores, key=lambda k: (round(mean(k, 0), 6), round(mean(k, 1), 6)))


def export_command(train_digest: str, dest: str = "DRAFT_FOLDER") -> str:
    return shlex.join(["draftline", "export", train_digest, dest])


def export_folder(train_digest: str) -> str:
    """Where a run's printed line has the draft exported to first: a fresh folder of its files, never the store's
    own attempt folder (anything a store writer put beside the listed files would be in that one)."""
    return f"./draft-{train_digest[:8]}"


def serve_lines(serve: dict[str, Any]) -> list[str]:
    """The lines a report prints: the export command that writes the draft's files to a fresh folder, then the
    serve line for that folder."""
    folder = export_folder(serve["train_digest"])
    return [export_command(serve["train_digest"], folder) + "   # the draft files, in a folder of their own",
            host_note(serve), *code_note(serve), serve_command(serve, os.path.abspath(folder))]


def run_serve(cfg: Any, store: Any, train_ref: Any, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serve settings of a run's (first) trained draft: measured ones from its benchmark report, else the
    config's with the draft's trained speculative tokens."""
    serve = dict((report or {}).get("serve") or {})
    if not serve:
        k = int(cfg.train.ttt_steps)
        serve = serve_settings(cfg, k=k, measured=False)
    serve["train_digest"] = train_ref.digest
    serve["draft"] = os.path.abspath(export_folder(train_ref.digest))
    serve["lines"] = serve_lines(serve)
    serve["command"] = serve["lines"][-1]
    return serve


# =========================================================================== draftline export

README = """# EAGLE-3 draft {digest}

Trained by draftline for `{target}`: train artifact `{uri}`.

- `draft/`: the draft as vLLM loads it (`config.json`, `model.safetensors` with the vocabulary maps `d2t`/`t2d`)
- `vocab/d2t.json`, `vocab/t2d.json`: its vocabulary maps (draft index i -> target token i + d2t[i]; the
  target tokens in the draft vocabulary), {draft_vocab} of {vocab} target tokens
- `serve.json`: the settings below, as data

Serve it {how}:

```
{command}
```
"""


def _vocab_maps(folder: str) -> tuple[list[int], list[int], int]:
    from safetensors.torch import load_file

    w = load_file(os.path.join(folder, "model.safetensors"))
    d2t, t2d = w.get("d2t"), w.get("t2d")
    if d2t is None or t2d is None:  # a draft over the whole target vocabulary
        n = int(json.loads(Path(folder, "config.json").read_text())["transformer_layer_config"]["vocab_size"])
        return [0] * n, list(range(n)), n
    return [int(x) for x in d2t.tolist()], [int(i) for i in t2d.nonzero().flatten().tolist()], int(t2d.shape[0])


def same_maps_as_training(store: Any, art: Any, folder: str) -> str | None:
    """The draft's d2t/t2d are, byte for byte, those of the vocab artifact its training read (the train
    manifest's `vocab` input), where that artifact is on the store: a draft whose ids drifted from training's
    would be served proposing other tokens than it learned. None when they were compared (and are equal); else
    why there was nothing to compare, for the caller to say."""
    from safetensors import safe_open

    from tasks.store.artifacts import ArtifactMissing, ArtifactRef

    vocab = art.manifest.inputs.get("vocab")
    # numpy, and only the two maps read (the weights may be bf16, which numpy has not): no torch import
    with safe_open(os.path.join(folder, "model.safetensors"), framework="np") as fh:
        w = {name: fh.get_tensor(name) for name in ("d2t", "t2d") if name in fh.keys()}
    if not vocab:
        return "its training read no vocab artifact"
    if "d2t" not in w:
        return "the draft holds no d2t/t2d (it predicts the whole target vocabulary)"
    try:
        maps = read_maps(store, ArtifactRef(stage="vocab", digest=vocab, uri=""), framework="np")
    except ArtifactMissing:
        return f"vocab/{vocab} is not on this store"  # a store holding the draft alone
    for name in ("d2t", "t2d"):
        a, b = w.get(name), maps.get(name)
        if b is None or a is None or a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            raise ExportError(f"{art.uri}: the draft's {name} differs from the one its training read (vocab/{vocab}): "
                              "the served draft would propose other ids than it learned; re-run the train stage")
    return None


EXPORT_RECORD = ".draftline-export.json"  # in DEST: the files an export wrote there, with their sha256


def _sha256(fs: Any, path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _not_ours(fs: Any, root: str, names: list[str]) -> list[str]:
    """The files of `names` that DEST already holds and no earlier export wrote (or that changed since)."""
    try:
        record = json.loads(fs.cat_file(f"{root}/{EXPORT_RECORD}")).get("files", {})
    except (FileNotFoundError, ValueError, AttributeError):
        record = {}
    return [n for n in names if fs.exists(f"{root}/{n}")
            and (not isinstance(record, dict) or record.get(n) != _sha256(fs, f"{root}/{n}"))]


def export_draft(store: Any, train_digest: str, dest: str, serve: dict[str, Any], force: bool = False,
                 host: str | None = None) -> dict[str, Any]:
    """Write DEST/draft/{config.json, model.safetensors} (verified against the manifest), DEST/vocab/*.json,
    DEST/serve.json and DEST/README.md with the serve line for DEST/draft. DEST: a local folder or an fsspec
    URL (s3://...). Files are written to a temporary folder first, so a failed export leaves no half draft.
    Every path is checked (`safe_join`: none leaves DEST, no symlink is followed); a file DEST holds that no
    export wrote (DEST/.draftline-export.json lists what one did) is replaced only with `force`."""
    import fsspec

    from tasks.formats.drafts import DraftError, draft_data_files, refuse_code
    from tasks.store.trust import refuse_link, safe_join, write_new_file

    art = store.open("train", train_digest)
    missing = [f for f in DRAFT_FILES if f not in art.files()]
    if missing:
        raise ExportError(f"{art.uri} has no {', '.join(missing)}: not a finished train artifact (re-run the "
                          "train stage)")
    try:  # drafts are data: no auto_map, only a draft's model type (before anything is written)
        refuse_code(json.loads(art.read_bytes("draft/config.json")), f"{art.uri}/draft")
    except (DraftError, ValueError) as exc:
        raise ExportError(str(exc)) from None
    remote = "://" in dest and not dest.startswith("file://")
    local_dest = dest.removeprefix("file://")
    draft_at = f"{dest.rstrip('/')}/draft" if remote else os.path.abspath(os.path.join(local_dest, "draft"))
    serve = {**serve, "draft": draft_at, "host": host or serve.get("host") or DEFAULT_HOST}
    if remote:  # vLLM loads a local folder: the line names where the export lands once copied here
        serve["lines"] = [f"# copy {draft_at}/ to a local folder first (aws s3 cp --recursive ...), then:",
                          host_note(serve), *code_note(serve), serve_command(serve, "./draft")]
    else:
        serve["lines"] = [host_note(serve), *code_note(serve), serve_command(serve, draft_at)]
    serve["command"] = serve["lines"][-1]
    with owned_temporary_directory("export") as work:  # gc keeps it while this process lives
        tmp = os.path.join(work, "out")
        os.makedirs(os.path.join(tmp, "draft"))
        os.makedirs(os.path.join(tmp, "vocab"))
        for name in draft_data_files(art.files("draft/")):  # never code, listed or not
            with art.local_copy(name) as src, open(src, "rb") as fh, open(safe_join(tmp, name), "wb") as out:
                while chunk := fh.read(8 << 20):
                    out.write(chunk)
        same_maps_as_training(store, art, os.path.join(tmp, "draft"))
        d2t, t2d, vocab = _vocab_maps(os.path.join(tmp, "draft"))
        Path(tmp, "vocab", "d2t.json").write_text(json.dumps(d2t))
        Path(tmp, "vocab", "t2d.json").write_text(json.dumps(t2d))
        Path(tmp, "serve.json").write_text(json.dumps({k: v for k, v in serve.items() if k != "lines"}, indent=2))
        how = ("at the settings its benchmark measured (k = the best speedup measured)" if serve.get("measured")
               else "(not benchmarked: k = its trained speculative tokens, the run's engine settings)")
        Path(tmp, "README.md").write_text(README.format(
            digest=train_digest, target=serve["target"], uri=art.uri, draft_vocab=len(d2t), vocab=vocab,
            how=how, command="\n".join(serve["lines"])))
        names = sorted(p.relative_to(tmp).as_posix() for p in Path(tmp).rglob("*") if p.is_file())
        same = remote and dest.split("://")[0] == store.uri.split("://")[0]
        fs, root = fsspec.core.url_to_fs(dest if remote else os.path.abspath(local_dest),
                                         **(store.fs.storage_options if same else {}))
        root = root.rstrip("/")
        if not remote:
            for n in names:  # no path through a planted symlink, before anything is written
                safe_join(root, n)
                safe_join(root, n + ".part")
            refuse_link(os.path.join(root, EXPORT_RECORD))
        theirs = _not_ours(fs, root, names)
        if theirs and not force:
            raise ExportError(f"{dest} already holds {', '.join(theirs)}, which no draftline export wrote (or which "
                              "changed since): not replacing them; export to an empty folder, or pass --force to "
                              "replace them")
        for n in sorted(names, key=lambda n: n == "README.md"):  # the README last: it marks a whole export
            if remote:
                fs.put_file(os.path.join(tmp, n), f"{root}/{n}")
                continue
            target = safe_join(root, n)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target + ".part")  # a stale one of a killed export (a link was refused above)
            shutil.copyfile(os.path.join(tmp, n), target + ".part")
            os.replace(target + ".part", target)
        ours = {n: _sha256(fsspec.filesystem("file"), os.path.join(tmp, n)) for n in names}
        record = json.dumps({"train_digest": train_digest, "files": ours}, indent=2).encode()
        if remote:
            fs.pipe_file(f"{root}/{EXPORT_RECORD}", record)
        else:  # a link planted there since the check above is replaced, never written through
            write_new_file(os.path.join(root, EXPORT_RECORD), record)
    return {"train_digest": train_digest, "dest": dest, "files": names, "serve": serve}
