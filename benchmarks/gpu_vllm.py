"""The steps of benchmarks/gpu_vllm.sh that are more than one command (issue 35, item 4), all through draftline's
own commands and stage code:

    python3 benchmarks/gpu_vllm.py serve --config benchmarks/gpu_vllm_demo.yaml --dest DIR --out serve.json
    python3 benchmarks/gpu_vllm.py kimi --root DIR --out kimi.json
    python3 benchmarks/gpu_vllm.py dspark --config benchmarks/gpu_vllm_demo.yaml --out dspark.json [--k 3]
    python3 benchmarks/gpu_vllm.py report --dir /tmp/gv --out gpu_vllm.json [--cpu-store DIR]

`serve` (item d): `draftline export CONFIG DEST --json`, then the serve line it prints, run as printed (`vllm
serve ...`), one chat request through the OpenAI API, and the spec-decode counters of /metrics: drafts and
accepted tokens above zero, the server's start seconds.

`kimi` (item e): a tiny random-init Kimi-K2.5-layout repository built as the hub has it (tests/e2e/test_kimi_layout.py
`tiny_kimi`: MLA, routed + shared experts, the VLM wrapper), served by the stand-in hub (tests/support/hub_server.py),
fetched with `draftline weights`, then `draftline run --until extract` through vLLM from exactly what was fetched.

`dspark`: the pipeline's DSpark draft (its train artifact on the config's store, found by head kind) measured in
vLLM at k=3 by draftline's benchmark stage against the same baseline; engines the pipeline's benchmark already
committed there are reused (tasks/benchmark/engine_runs.py), so a pipeline whose benchmark ran starts none or one.

`report`: the figures of every step (bench_gpu.json, the pipeline's and the eager regeneration's summaries and
stores, serve.json, kimi.json) as one JSON and a markdown summary on stdout; `--cpu-store` adds the acceptance
lengths the CPU machine's benchmark measured for the same drafts and prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "benchmarks")]

import gpu_pipeline  # noqa: E402  (its data and tokenizer helpers)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def draftline(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli.app", *args]
    log("$ draftline " + shlex.join(args))
    return subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout)


def get(url: str, data: dict | None = None, timeout: float = 60) -> str:
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def counters(metrics: str) -> dict[str, float]:
    """vLLM's spec-decode counters from a /metrics page (summed over label sets)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:spec_decode_num_") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# =========================================================================== (d) serve


def serve(args) -> None:
    res: dict = {}
    p = draftline("export", args.config, args.dest, "--json")
    if p.returncode:
        raise SystemExit(f"export failed: {p.stderr[-2000:]}")
    exported = json.loads(p.stdout)
    line = exported["serve"].get("command") or exported["serve"]["lines"][-1]
    res["serve_line"] = line
    log(f"printed serve line: {line}")
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"], words
    port = 8000
    if "--port" in words:
        port = int(words[words.index("--port") + 1])
    logf = open(args.out + ".server.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(words, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited {proc.returncode}: {Path(args.out + '.server.log').read_text()[-3000:]}")
            try:
                get(base + "/health", timeout=2)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() - t0 > args.timeout:
                    raise SystemExit("vllm serve did not answer /health in time")
                time.sleep(1)
        res["server_start_s"] = round(time.time() - t0, 1)
        log(f"server up in {res['server_start_s']} s")
        model = json.loads(get(base + "/v1/models"))["data"][0]["id"]
        before = counters(get(base + "/metrics"))
        t1 = time.time()
        reply = json.loads(get(base + "/v1/chat/completions", {
            "model": model, "max_tokens": 128, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about your favourite season and why."}]}))
        res["chat_s"] = round(time.time() - t1, 2)
        res["reply"] = reply["choices"][0]["message"]["content"][:400]
        res["completion_tokens"] = reply["usage"]["completion_tokens"]
        after = counters(get(base + "/metrics"))
        res["counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
        drafts = res["counters"].get("vllm:spec_decode_num_draft_tokens_total", 0)
        accepted = res["counters"].get("vllm:spec_decode_num_accepted_tokens_total", 0)
        res["ok"] = drafts > 0 and accepted > 0
        log(f"chat: {res['completion_tokens']} tokens in {res['chat_s']} s; drafts {drafts}, accepted {accepted}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        Path(args.out).write_text(json.dumps(res, indent=2))


# =========================================================================== (e) kimi


def kimi(args) -> None:
    from hub_server import StandInHub

    root = Path(args.root)
    res: dict = {}
    t0 = time.time()
    repo = Path(args.repo) if args.repo else root / "repo"
    if not args.repo:  # built here (transformers with Kimi-K2.5's classes), else carried as built elsewhere
        from tests.e2e.test_kimi_layout import tiny_kimi  # the tests' builder (imports pytest)

        repo.mkdir(parents=True, exist_ok=True)
        tiny_kimi(repo)
        # the tests' word-level tokenizer cannot spell the chat masker's probe: a byte-level BPE with a ChatML
        # template instead (benchmarks/gpu_pipeline.py's), inside the model's 1,000 ids (998/999: media tokens)
        root.mkdir(parents=True, exist_ok=True)
        gpu_pipeline.write_data(root / "bpe.jsonl", 48, 1500)
        gpu_pipeline.write_tokenizer(repo, None, root / "bpe.jsonl", 900)
    if args.build_only:
        return
    res["repo_files"] = sorted(p.name for p in repo.iterdir())
    hub = StandInHub("moonshotai/Kimi-K2.5-tiny", repo).start()
    gpu_pipeline.write_data(root / "data.jsonl", 32, 600)
    cfg = root / "kimi.yaml"
    cfg.write_text(json.dumps({
        "name": "kimi-tiny-gpu", "target": {"model": hub.repo, "max_model_len": 512},
        "data": {"sources": [{"path": str(root / "data.jsonl"), "name": "tiny"}], "max_length": 256, "num_shards": 1,
                 "heldout": 2},
        "regenerate": {"enabled": False}, "vocab": {"draft_vocab_size": 256},
        "extract": {"backend": "vllm", "batch_tokens": 2048},
        "benchmark": {"enabled": False}, "store": {"uri": f"file://{root}/store"}}))
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(root / "hf"),
           "DRAFTLINE_HOME": str(root / "home")}
    try:
        p = draftline("weights", str(cfg), "--json", env=env)
        res["weights_rc"] = p.returncode
        res["weights"] = p.stdout[-2000:] if p.returncode == 0 else p.stderr[-3000:]
        log(f"weights rc={p.returncode}")
        env["HF_HUB_OFFLINE"] = "1"  # the engine starts from exactly what was fetched
        t1 = time.time()
        p = draftline("run", str(cfg), "--until", "extract", "--json", env=env, timeout=args.timeout)
        res["run_rc"] = p.returncode
        res["run_s"] = round(time.time() - t1, 1)
        if p.returncode == 0:
            summary = json.loads(p.stdout)
            res["summary"] = summary
        else:
            res["run_error"] = p.stderr[-4000:]
        log(f"run --until extract rc={p.returncode} in {res['run_s']} s")
    finally:
        hub.stop()
        res["total_s"] = round(time.time() - t0, 1)
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))


# =========================================================================== DSpark in vLLM


def dspark(args) -> None:
    """The pipeline's DSpark draft (the store's train artifact of head kind dspark) measured in vLLM at k=`args.k`
    by draftline's own benchmark stage (run_benchmark), against the config's baseline, on the same store: engines
    the pipeline's benchmark already measured there (its baseline, the DSpark head at that k) are reused, not
    started again. Writes the acceptance per eval and batch size, the engines started or reused, and the
    draft's fc-sizing block (what vLLM 0.26 reads) to `args.out`."""
    from tasks.benchmark.results import load_report
    from tasks.benchmark.stage import run_benchmark
    from tasks.core.config_load import load_config
    from tasks.core.home import apply_env_defaults
    from tasks.store.artifacts import Store

    apply_env_defaults()  # what `draftline` sets for its engines
    res: dict = {"k": args.k}
    try:
        cfg = load_config(args.config, [f"benchmark.num_speculative_tokens=[{args.k}]"])
        store = Store.from_config(cfg.store)
        found = [m for m in store.list("train") if m.stats.get("head_kind") == "dspark"]
        if not found:
            raise SystemExit(f"no train artifact of head kind dspark in {cfg.store.uri}: run the pipeline step first")
        m = found[-1]
        label = m.stats.get("head") or "dspark"
        heads = [h for h in cfg.train.heads if h.label == label]
        if not heads:
            raise SystemExit(f"{args.config} has no head labelled {label!r} (the stored DSpark draft's)")
        cfg.train.heads = heads
        trained = store.open("train", m.digest)
        conf = trained.read_json("draft/config.json")
        res.update({"train_digest": m.digest, "head": label, "steps": m.stats.get("steps"),
                    "layer_ids": m.stats.get("layer_ids"),  # the auxiliary layers, then the last one
                    "num_layers": conf["transformer_layer_config"].get("num_hidden_layers"),
                    "dflash_config": conf["transformer_layer_config"].get("dflash_config"),
                    "simulated_acceptance_length": m.stats.get("simulated_acceptance_length")})
        # the data the pipeline's benchmark read: its extraction's (regenerated, else prepared) conversations
        shard = store.manifest("extract", m.inputs["extract"].split(",")[0])
        data_digest = shard.inputs["data"]
        data = next(store.open(st, data_digest).ref() for st in ("regenerate", "prepare")
                    if store.manifest(st, data_digest) is not None)
        t0 = time.time()
        try:
            ref = run_benchmark(cfg, store, [(label, trained.ref())], data, on_log=log)
        except Exception as exc:  # noqa: BLE001 - the engine's own error line is the finding (the baseline stays)
            from tasks.benchmark.stage import engine_error_text

            res["error"] = engine_error_text(exc)
            raise SystemExit(f"DSpark k={args.k}: not measured: {res['error']}") from None
        finally:
            res["benchmark_s"] = round(time.time() - t0, 1)
        rep = load_report(store, ref)
        head = rep["heads"][label]
        res.update({"benchmark_digest": ref.digest, "measured": head.get("measured"), "errors": head.get("errors"),
                    "acceptance": _acceptance({"heads": {label: head}}).get(label, {}),
                    "engines": {n: {"start_s": e.get("start_s"), "reused": e.get("reused")}
                                for n, e in (rep.get("engines") or {}).items()}})
        log(f"DSpark k={args.k}: {res['measured']}; acceptance {res['acceptance']}; errors {res['errors']}")
    finally:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))


# =========================================================================== a draft back from the device


def split_draft(args) -> None:
    """A draft folder as files under 16 MB each (what comes back from the device machine): config.json, its
    tensors in two safetensors files WITHOUT embed_tokens (the target's own embedding, frozen in training: the
    same bits on both machines), and the embedding's sha256 so `join-draft` can prove the one it puts back is equal."""
    import hashlib

    from safetensors.torch import load_file, save_file

    src, out = Path(args.src), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = load_file(str(src / "model.safetensors"))
    embed = w.pop("embed_tokens.weight")
    (out / "draft-embed.sha256").write_text(hashlib.sha256(embed.contiguous().view(-1).view(torch_uint8()).numpy()
                                                           .tobytes()).hexdigest())
    names = sorted(w, key=lambda k: -w[k].numel())
    halves: list[dict] = [{}, {}]
    sizes = [0, 0]
    for k in names:  # largest first, each into the lighter half
        i = 0 if sizes[0] <= sizes[1] else 1
        halves[i][k] = w[k].contiguous()
        sizes[i] += w[k].numel() * w[k].element_size()
    for i, h in enumerate(halves):
        save_file(h, str(out / f"draft-{'ab'[i]}.safetensors"))
    (out / "draft-config.json").write_text((src / "config.json").read_text())
    log(f"split {src} into {out}: {sizes} bytes + the embedding's hash")


def torch_uint8():
    import torch

    return torch.uint8


def join_draft(args) -> None:
    """The inverse of split-draft on the CPU machine: the parts plus embed_tokens from a draft of the same target
    (checked equal by its sha256), as a draft folder vLLM loads."""
    import hashlib

    from safetensors.torch import load_file, save_file

    parts, dest = Path(args.parts), Path(args.dest)
    embed = load_file(str(Path(args.embed_from) / "model.safetensors"))["embed_tokens.weight"]
    have = hashlib.sha256(embed.contiguous().view(-1).view(torch_uint8()).numpy().tobytes()).hexdigest()
    want = (parts / "draft-embed.sha256").read_text().strip()
    if have != want:
        raise SystemExit(f"the embedding of {args.embed_from} is not the device draft's ({have} != {want})")
    w = {"embed_tokens.weight": embed}
    for half in ("a", "b"):
        w.update(load_file(str(parts / f"draft-{half}.safetensors")))
    dest.mkdir(parents=True, exist_ok=True)
    save_file(w, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text((parts / "draft-config.json").read_text())
    log(f"joined {dest}: {len(w)} tensors, embedding checked equal")


# =========================================================================== report


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _regen_rate(store: Path) -> dict:
    """Output tokens per second of a store's regenerate stage (its manifest's shard seconds)."""
    from tasks.store.artifacts import Store

    st = Store(f"file://{store}")
    best: dict = {}
    for m in st.list("regenerate"):
        s = m.stats
        tokens = s.get("generated_tokens") or s.get("output_tokens") or s.get("tokens")
        secs = s.get("seconds")
        if tokens and secs:
            best = {"generated_tokens": tokens, "seconds": secs, "tokens_per_s": round(float(tokens) / float(secs), 1),
                    "wall_seconds": s.get("wall_seconds")}
    return best


def report(args) -> None:
    d = Path(args.dir)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "bench_gpu": _load(d / "extract" / "bench_gpu.json"),
                 "pipeline": _load(d / "pipeline.json"), "serve": _load(d / "serve.json"), "kimi": _load(d / "kimi.json")}
    try:
        import torch
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        import vllm
        out["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - a report of what is there
        pass
    lines = [f"# vLLM on the lent GPU ({out.get('gpu')}, vLLM {out.get('vllm')}), {out['date']}", ""]
    ex = (out["bench_gpu"].get("extract") or {}).get("llama8b-shape") or {}
    if ex:
        bare = ex.get("bare_prefill", {}).get("tokens_per_s")
        tr = ex.get("stage", {})
        lines += ["## (a) extraction, 8B-shaped random-init target, same shard", "",
                  "| path | tok/s | x bare prefill | engine start s |", "|---|---|---|---|",
                  f"| bare prefill + hooks (transformers, in process) | {bare} | 1.00 | - |",
                  f"| extract_shard, transformers backend | {tr.get('tokens_per_s')} | {tr.get('over_bare')} | "
                  f"{ex.get('engine_start_s')} |"]
        for be, vl in (ex.get("backends") or {}).items():
            step = f", max_num_batched_tokens {be.partition('@')[2]}" if "@" in be else ""
            lines.append(f"| extract_shard, vLLM + hidden-states connector{step} | "
                         f"{vl.get('stage', {}).get('tokens_per_s')} | {vl.get('stage', {}).get('over_bare')} | "
                         f"{vl.get('engine_start_s')} |")
        lines.append("")
    graphs = _regen_rate(d / "store") if (d / "store").exists() else {}
    eager = _regen_rate(d / "store-eager") if (d / "store-eager").exists() else {}
    out["regenerate"] = {"cuda_graphs": graphs, "eager": eager}
    if graphs and eager:
        ratio = round(graphs["tokens_per_s"] / eager["tokens_per_s"], 2)
        out["regenerate"]["graphs_over_eager"] = ratio
        lines += ["## (b) regeneration (the demo's 512 chitchat prompts, 192 tokens, greedy)", "",
                  f"- CUDA graphs: {graphs['tokens_per_s']} output tok/s; eager: {eager['tokens_per_s']}: **{ratio}x**", ""]
    bench = _bench_report(d / "store")
    if bench:
        out["benchmark"] = bench
        lines += ["## (c) acceptance length in vLLM-CUDA (the pipeline's benchmark stage)", ""]
        for head, evs in bench.get("acceptance", {}).items():
            for ev, ks in evs.items():
                lines.append(f"- {head} / {ev}: " + ", ".join(f"k={k}: AL {v['al']} (by batch size {v['by_batch_size']}, "
                                                          f"speedup {v['speedup']})" for k, v in ks.items()))
        if bench.get("engine_start_s"):
            lines += ["", f"- (f) engine starts in the benchmark stage (s): {bench['engine_start_s']}"]
        lines.append("")
    cpu = _bench_report(Path(args.cpu_store)) if args.cpu_store else {}
    if cpu:  # the same drafts and prompts in vLLM's CPU build
        out["cpu_benchmark"] = cpu
        lines += ["## (c) the same drafts in vLLM's CPU build", ""]
        for head, evs in cpu["acceptance"].items():
            for ev, ks in evs.items():
                lines.append(f"- {head} / {ev}: " + ", ".join(f"k={k}: AL {v['al']} (by batch size "
                                                              f"{v['by_batch_size']})" for k, v in ks.items()))
        lines.append("")
    sv = out["serve"]
    if sv:
        lines += ["## (d) `vllm serve` with the printed line", "", f"`{sv.get('serve_line')}`", "",
                  f"- up in {sv.get('server_start_s')} s; {sv.get('completion_tokens')} tokens; counters "
                  f"{sv.get('counters')}; ok={sv.get('ok')}", ""]
    ds = out["dspark"] = _load(d / "dspark.json")
    if ds:
        lines += [f"## DSpark in vLLM at k={ds.get('k')} (the pipeline's draft, draftline's benchmark stage)", "",
                  f"- draft {ds.get('train_digest')}: {ds.get('num_layers')} layer(s) reading {ds.get('layer_ids')}; "
                  f"dflash_config {ds.get('dflash_config')}; training estimate {ds.get('simulated_acceptance_length')}",
                  f"- measured: {ds.get('measured')}; acceptance {ds.get('acceptance')}; errors "
                  f"{ds.get('errors') or ds.get('error')}",
                  f"- engines: {ds.get('engines')}", ""]
    km = out["kimi"]
    if km:
        lines += ["## (e) tiny Kimi-K2.5 layout, fetched from the stand-in hub", "",
                  f"- repo files: {km.get('repo_files')}", f"- weights rc={km.get('weights_rc')}; run --until extract "
                  f"rc={km.get('run_rc')} in {km.get('run_s')} s", ""]
        if km.get("run_error"):
            lines += ["```", km["run_error"][-1500:], "```", ""]
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print("\n".join(lines))


def _r(x):
    return round(float(x), 3) if x is not None else None


def _acceptance(report: dict) -> dict:
    """{head or draft: {eval: {k: {"al": mean acceptance length, "by_batch_size": {bs: al}, "speedup": {bs: x}}}}}
    from a benchmark stage's report.json (every head and benchmark.drafts entry is under report['heads'])."""
    out: dict = {}
    for head, h in (report.get("heads") or {}).items():
        for ev, ks in (h.get("benchmark") or {}).items():
            for k, fig in ks.items():
                by = fig.get("by_batch_size") or {}
                out.setdefault(head, {}).setdefault(ev, {})[k] = {
                    "al": _r(fig.get("mean_acceptance_length")),
                    "by_batch_size": {bs: _r(f.get("mean_acceptance_length")) for bs, f in by.items()},
                    "speedup": {bs: _r(f.get("speedup")) for bs, f in by.items()}}
    return out


def _bench_report(store: Path) -> dict:
    from tasks.store.artifacts import Store

    if not store.exists():
        return {}
    st = Store(f"file://{store}")
    reports = []
    for m in st.list("benchmark"):
        try:
            reports.append((m.digest, st.open("benchmark", m.digest).read_json("report.json")))
        except Exception:  # noqa: BLE001 - a report of what is there
            continue
    if not reports:
        return {}
    # the pipeline's (every head), not the dspark step's (one head) when both are on the store
    digest, rep = max(reports, key=lambda dr: len(dr[1].get("heads") or {}))
    return {"acceptance": _acceptance(rep), "engine_start_s": (rep.get("timing") or {}).get("engine_start_s"),
            "digest": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--config", required=True)
    s.add_argument("--dest", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--timeout", type=float, default=300)
    k = sub.add_parser("kimi")
    k.add_argument("--root", required=True)
    k.add_argument("--out", default=None)
    k.add_argument("--timeout", type=float, default=280)
    k.add_argument("--repo", default=None, help="the tiny repository, built earlier (default: build it under ROOT)")
    k.add_argument("--build-only", action="store_true", help="build the repository under ROOT/repo and stop")
    sp = sub.add_parser("split-draft")
    sp.add_argument("src")
    sp.add_argument("out")
    jn = sub.add_parser("join-draft")
    jn.add_argument("parts")
    jn.add_argument("embed_from")
    jn.add_argument("dest")
    ds = sub.add_parser("dspark")
    ds.add_argument("--config", required=True)
    ds.add_argument("--out", required=True)
    ds.add_argument("--k", type=int, default=3)
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--cpu-store", default=None, help="a CPU store whose benchmark measured the same drafts")
    args = ap.parse_args()
    {"serve": serve, "kimi": kimi, "report": report, "split-draft": split_draft,
     "join-draft": join_draft, "dspark": dspark}[args.cmd](args)


if __name__ == "__main__":
    main()
