"""The Kimi preset's shape rehearsed on the CPUs (issue 43): what one shard costs in orchestration.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/rehearse.py --shards 8 64 [--db sqlite|postgres] [--out FILE]

For each shard count: a fresh real `prefect server` (SQLite, or PostgreSQL started by
`infra/local-stack.sh postgres`), a fresh SeaweedFS with its Prometheus metrics on, `draftline deploy`,
four process-worker nodes (`prefect worker start --limit 1`, each its own Prefect home), then
`draftline submit benchmarks/rehearsal.yaml --deployment local --until extract` with extract.nodes=4
and 2 samples per shard. The target (--target): `tiny` (default), the demo model's architecture and tokenizer
at 4 layers of width 64 with random weights, so that a shard's compute is near zero and what is left is
orchestration; or `demo`, the 135M demo model itself (the earlier rows of RESULTS). Measured, for the run from
submit to Completed:

- wall: seconds from submit to Completed; compute: the extraction shards' own seconds (manifests'
  `seconds`: the engine's forward passes and the shard's writes), divided by the 4 nodes;
  overhead = wall - compute/4; per shard, and the marginal cost between two counts;
- Prefect: rows the run added to the server's database by table (task runs, their states, logs, events,
  flow runs) and the database's growth in bytes; HTTP API requests from the server's access log (uvicorn's,
  at PREFECT_SERVER_LOGGING_LEVEL=INFO), less this script's own polling; task-run states and events
  travel over Prefect's events websocket, one connection per process, so they show as rows, not requests;
- peak RSS of the parent flow-run process and of the largest child (sampled every 0.5 s);
- the store: SeaweedFS's own request counters by kind (LIST, GET -- it counts HEAD as GET --, PUT,
  DELETE...) and bytes in and out.

With --kill-after K a node is lost mid-stage (the first node running a child slice is SIGKILLed once it
finished K shards): the run must fail naming exactly the shards not on the store, `draftline status` must
list them, and `draftline retry --watch` (or, with --retry-with ui, the Prefect UI's Retry button clicked in
headless Chromium) must complete the run committing only those.

Results go to --out (a JSON list, one object per run); without --shards the script runs nothing and prints
--out's results as benchmarks/RESULTS.md's table (--plot FILE also draws them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

import deploy_harness as harness  # noqa: E402
from prefect_server import PrefectServer, free_port  # noqa: E402
from s3server import S3Server  # noqa: E402

NODES = 4
CONFIG = ROOT / "benchmarks" / "rehearsal.yaml"
TINY = Path(tempfile.gettempdir()) / "draftline-rehearsal-tiny-target"
TABLES = ("flow_run", "flow_run_state", "task_run", "task_run_state", "log", "events", "event_resources",
          "artifact")


def conversations(path: Path, n: int) -> None:
    """N short, distinct conversations (a user question, an assistant answer) as JSONL."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {i} plus {i + 7}?"},
                {"role": "assistant", "content": f"{i} plus {i + 7} is {2 * i + 7}."}]}) + "\n")


def tiny_target(folder: Path) -> Path:
    """The demo model's tokenizer and architecture at a stand-in's size (4 layers, width 64, random weights):
    the engine's compute per shard is then near zero and what a shard costs is orchestration."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.core.config import TargetConfig
    from tasks.engine.target import load_tokenizer, resolve_model

    if (folder / "model.safetensors").exists():
        return folder
    demo = TargetConfig(model="smollm2-135m-instruct")
    cfg = AutoConfig.from_pretrained(resolve_model(demo))
    cfg.update({"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    load_tokenizer(demo).save_pretrained(folder)
    return folder


def store_counters(port: int) -> dict[str, float]:
    """SeaweedFS's S3 counters: requests by kind (code 2xx/3xx/4xx together) and bytes in/out."""
    txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in txt.splitlines():
        m = re.match(r'SeaweedFS_s3_request_total\{bucket="([^"]*)",code="(\d+)",type="(\w+)"\} (\S+)', line)
        if m and m.group(1) == "draftline-test":
            out[m.group(3)] = out.get(m.group(3), 0) + float(m.group(4))
        m = re.match(r'SeaweedFS_s3_bucket_traffic_(received|sent)_bytes_total\{bucket="draftline-test"\} (\S+)', line)
        if m:
            out[f"bytes_{m.group(1)}"] = float(m.group(2))
    return out


class Database:
    """Row counts and size of the Prefect server's database, SQLite or PostgreSQL."""

    def __init__(self, sqlite_path: Path | None = None, pg_url: str | None = None):
        self.sqlite_path, self.pg_url = sqlite_path, pg_url

    def snapshot(self) -> dict[str, int]:
        if self.sqlite_path:
            con = sqlite3.connect(f"file:{self.sqlite_path}?mode=ro", uri=True, timeout=60)
            try:
                out = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
            finally:
                con.close()
            out["bytes"] = sum(p.stat().st_size for p in self.sqlite_path.parent.glob(self.sqlite_path.name + "*"))
            return out
        import asyncio

        import asyncpg

        async def q():
            con = await asyncpg.connect(self.pg_url.replace("postgresql+asyncpg", "postgresql"))
            try:
                out = {t: await con.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
                out["bytes"] = await con.fetchval("SELECT pg_database_size(current_database())")
                return out
            finally:
                await con.close()

        return asyncio.run(q())


class PeakRSS(threading.Thread):
    """Peak resident memory of every process under the workers (the flow-run processes), by pid."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.peak, self.stop_ = roots, {}, threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop_.is_set():
            for r in self.roots:
                try:
                    for p in psutil.Process(r).children(recursive=True):
                        try:
                            self.peak[p.pid] = max(self.peak.get(p.pid, 0), p.memory_info().rss)
                        except psutil.Error:
                            pass
                except psutil.Error:
                    pass
            self.stop_.wait(0.5)


def access_requests(log: Path) -> int:
    """Requests the server's access log shows (uvicorn's `"POST /api/... HTTP/1.1" 200`)."""
    if not log.exists():
        return 0
    return len(re.findall(rb'"(?:GET|POST|PATCH|PUT|DELETE) /api/', log.read_bytes()))


def start_postgres(tmp: Path) -> str:
    """A PostgreSQL server from infra/local-stack.sh's `postgres` command: the Prefect database URL."""
    env = dict(os.environ, DRAFTLINE_STACK_DIR=str(tmp / "stack"), PG_PORT=str(free_port()))
    out = subprocess.run(["bash", str(ROOT / "infra" / "local-stack.sh"), "postgres"], env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"local-stack.sh postgres: {out.stdout}\n{out.stderr}")
    return (tmp / "stack" / "postgres.url").read_text().strip()


def stop_postgres(tmp: Path) -> None:
    subprocess.run(["bash", str(ROOT / "infra" / "local-stack.sh"), "down"], timeout=120, capture_output=True,
                   env=dict(os.environ, DRAFTLINE_STACK_DIR=str(tmp / "stack")))


def shards_done(log: str) -> list[int]:
    """The extraction shards a node's worker log says it finished."""
    return [int(x) for x in re.findall(r"Task run 'extract-shard-(\d+)' - extract: shard", log)]


def kill_a_child_node(nodes: list, after: int, timeout: float) -> dict:
    """SIGKILL the first node running a child slice once it has finished AFTER shards (its worker's process
    group, with the flow-run process: the node is lost)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for n in nodes:
            log = n.read_log()
            done = shards_done(log)
            if re.search(r"Flow run '[^']*-extract-\d+of\d+-try1' - Beginning", log) and len(done) >= after:
                os.killpg(n.proc.pid, 9)
                n.proc.wait(30)
                every = {s for m in nodes for s in shards_done(m.read_log())}  # on all four nodes by then
                return {"node": n.name, "done_before_kill": sorted(done), "run_done_at_kill": len(every)}
        time.sleep(0.5)
    raise RuntimeError(f"no child node finished {after} shards in {timeout}s")


def retry_in_ui(server, run_id: str) -> float:
    """The Prefect UI's Retry of the failed run, clicked in headless Chromium (benchmarks/ui_page.py's browser):
    the run's page, its Retry button, the confirmation's Retry. Returns when it was clicked."""
    from playwright.sync_api import sync_playwright

    from ui_page import CHROMIUM, seen

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{server.ui_url}/runs/flow-run/{run_id}", wait_until="domcontentloaded", timeout=120_000)
        seen(page, "Failed")
        page.get_by_role("button", name="Retry").first.click()
        confirm = page.get_by_role("dialog").get_by_role("button", name="Retry")
        if confirm.count():  # the UI asks to confirm
            confirm.first.click()
        clicked = time.time()
        time.sleep(2)  # the request lands before the browser closes
        browser.close()
    return clicked


def retry_after_loss(server, run_id: str, cli: dict, store_uri: str, shards: int, killed: dict,
                     via: str = "cli") -> dict:
    """After a node was lost: the run failed naming its unfinished shards; `draftline status` lists them,
    `draftline retry` (VIA cli) or the Prefect UI's Retry button (VIA ui) runs exactly those; nothing committed
    before is committed again."""
    from tasks.core.config import StoreConfig
    from tasks.store.artifacts import Store

    store = Store.from_config(StoreConfig(uri=store_uri))
    before = {m.stats["shard"]: m.created for m in store.list("extract")}
    missing = sorted(set(range(shards)) - set(before))
    status = json.loads(harness.draftline("status", run_id, "--json", env=cli).stdout)
    named = re.search(r"shards not finished \(\[([\d, ]*)\]\)", status["message"] or "")
    listed = sorted(int(x) for x in named.group(1).split(",")) if named else None
    t0 = time.time()
    if via == "ui":
        clicked = retry_in_ui(server, run_id)
        run, _ = wait_final(server, run_id, not_before=clicked)
        rc = 0 if run.state.type.value == "COMPLETED" else 1
    else:
        rc = harness.draftline("retry", run_id, "--watch", "--timeout", "3600", env=cli, timeout=3700,
                               check=False).returncode
    after = {m.stats["shard"]: m.created for m in Store.from_config(StoreConfig(uri=store_uri)).list("extract")}
    return {"killed": killed, "missing_after_kill": missing, "status_lists": listed,
            "status_lists_exactly_missing": listed == missing, "retry_via": via, "retry_rc": rc,
            "retry_s": round(time.time() - t0, 1), "all_shards_after_retry": sorted(after) == list(range(shards)),
            "recommitted": sorted(s for s in before if after.get(s) != before[s]),
            "committed_by_retry": sorted(s for s in after if s not in before)}


def wait_final(server, run_id: str, every: float = 5.0, timeout: float = 6 * 3600, not_before: float = 0.0):
    """The run once it ended (in a state entered after NOT_BEFORE), and how many API requests this wait made
    (subtracted from the run's)."""
    polls, deadline = 0, time.time() + timeout
    with harness.client(server) as c:
        while time.time() < deadline:
            polls += 1
            try:
                run = c.read_flow_run(uuid.UUID(run_id))
            except Exception as exc:  # noqa: BLE001 - a server error of the moment (a 500 under load): ask again
                print(f"poll failed ({str(exc)[:120]}); asking again", file=sys.stderr)
                time.sleep(every)
                continue
            if run.state is not None and run.state.type.value in ("COMPLETED", "FAILED", "CRASHED") and \
                    run.state.timestamp.timestamp() > not_before:
                return run, polls
            time.sleep(every)
    raise RuntimeError(f"run {run_id} not finished after {timeout}s")


def rehearse(shards: int, db: str, tmp: Path, per_shard: int = 2, kill_after: int | None = None,
             target: str = "tiny", retry_via: str = "cli", sets: list[str] | None = None) -> dict:
    pg_url = start_postgres(tmp) if db == "postgres" else None
    saved = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
    if pg_url:
        os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = pg_url
    # uvicorn's access log (one line per API request) is at INFO; Prefect's server logs at WARNING by default
    os.environ["PREFECT_SERVER_LOGGING_LEVEL"] = "INFO"
    server = PrefectServer(tmp / "server")
    metrics_port = free_port()
    s3 = S3Server(tmp / "s3", metrics_port=metrics_port)
    nodes: list[harness.Worker] = []
    res: dict = {"shards": shards, "db": db, "nodes": NODES, "samples_per_shard": per_shard, "target": target,
                 "sets": list(sets or [])}
    # the demo's 135M model (earlier rows), or a stand-in of its shape at near-zero compute
    model = ["--set", f"target.model={tiny_target(TINY)}", "--set", "extract.layer_ids=[1,2,3,4]"] \
        if target == "tiny" else []
    try:
        server.start()
        s3.start()
        s3.make_bucket("draftline-test")
        os.environ.update(s3.env())  # this process reads the store too (this run's server, not an earlier one's)
        data = tmp / "conversations.jsonl"
        conversations(data, shards * per_shard + 8)
        store_uri = f"s3://draftline-test/rehearsal-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, **server.env(), **s3.env(), DRAFTLINE_STORE_URI=store_uri,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        env.pop("PREFECT_UI_URL", None)
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        env.pop("PREFECT_SERVER_LOGGING_LEVEL", None)
        cli = dict(env, PREFECT_HOME=str(tmp / "laptop-home"), COLUMNS="200")
        cli.pop("DRAFTLINE_STORE_URI")
        harness.draftline("deploy", "--name", "local", "--crash-after", "60", env=cli, timeout=900)
        for i in range(NODES):
            nodes.append(harness.Worker(["prefect", "worker", "start", "--pool", "draftline-local", "--limit", "1",
                                         "--name", f"draftline@node-{i}"], tmp, env).start())
        for n in nodes:
            n.wait_started(300)
        database = Database(sqlite_path=None if pg_url else server.home / "prefect.db", pg_url=pg_url)
        db0, s30, req0 = database.snapshot(), store_counters(metrics_port), access_requests(server.home / "server.log")
        rss = PeakRSS([n.proc.pid for n in nodes])
        rss.start()
        t0 = time.time()
        sub = harness.draftline(
            "submit", str(CONFIG), "--deployment", "local", "--until", "extract", "--json",
            "--set", f"data.sources=[{{path: {data}, name: rehearsal}}]", "--set", f"data.num_shards={shards}",
            "--set", f"data.max_samples={shards * per_shard + 4}", *model,
            *[a for x in sets or [] for a in ("--set", x)], env=cli)
        run_id = json.loads(sub.stdout.strip().splitlines()[-1])["id"]
        if kill_after is not None:
            res["killed"] = kill_a_child_node(nodes, kill_after, timeout=3600)
        run, polls = wait_final(server, run_id)
        res["own_api_requests"] = polls
        res["wall_s"] = round(time.time() - t0, 1)
        res["state"] = run.state.type.value
        time.sleep(2)  # the last events and logs land
        rss.stop_.set()
        db1, s31, req1 = database.snapshot(), store_counters(metrics_port), access_requests(server.home / "server.log")
        res["db_rows"] = {k: db1[k] - db0[k] for k in TABLES}
        res["db_bytes"] = db1["bytes"] - db0["bytes"]
        res["api_requests"] = req1 - req0 - polls  # the run's, not this script's own polling
        res["store"] = {k: s31.get(k, 0) - s30.get(k, 0) for k in sorted(set(s30) | set(s31))}
        parent_pid = int(str(run.infrastructure_pid).rsplit(":", 1)[-1]) if run.infrastructure_pid else None
        res["parent_peak_rss_mb"] = round(rss.peak.get(parent_pid, 0) / 2**20, 1)
        res["max_peak_rss_mb"] = round(max(rss.peak.values(), default=0) / 2**20, 1)
        from tasks.core.config import StoreConfig
        from tasks.store.artifacts import Store

        refs = Store.from_config(StoreConfig(uri=store_uri)).list("extract")
        res["extract_shards_on_store"] = len(refs)
        res["compute_s"] = round(sum(float(r.stats.get("seconds", 0)) for r in refs), 1)
        res["overhead_s"] = round(res["wall_s"] - res["compute_s"] / NODES, 1)
        res["overhead_per_shard_s"] = round(res["overhead_s"] / shards, 3)
        res["status"] = json.loads(harness.draftline("status", run_id, "--json", env=cli).stdout).get("state")
        if kill_after is not None:
            res["fault"] = retry_after_loss(server, run_id, cli, store_uri, shards, res["killed"], retry_via)
    finally:
        for n in nodes:
            n.stop()
        server.stop()
        s3.stop()
        if pg_url:
            stop_postgres(tmp)
        os.environ.pop("PREFECT_SERVER_LOGGING_LEVEL", None)
        if saved is None:
            os.environ.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        else:
            os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = saved
    return res


def series(r: dict) -> tuple[str, str, str]:
    """One line of the plot: the target (rows before --target were the demo model), the database, the code."""
    return r.get("target", "demo"), r["db"], r.get("code", "")


def plot(results: list[dict], path: Path) -> None:
    """Per shard, against the shard count: overhead seconds, Prefect API requests, store requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("overhead per shard (s)", lambda r: r["overhead_per_shard_s"]),
              ("Prefect API requests per shard", lambda r: r["api_requests"] / r["shards"]),
              ("store requests per shard", lambda r: sum(v for k, v in r["store"].items()
                                                         if not k.startswith("bytes")) / r["shards"]))
    for ax, (title, y) in zip(axes, panels):
        for key in sorted({series(r) for r in results if "fault" not in r}):
            rows = sorted((r for r in results if series(r) == key and "fault" not in r), key=lambda r: r["shards"])
            ax.plot([r["shards"] for r in rows], [y(r) for r in rows], marker="o", label=" ".join(key).strip())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shards (4 nodes)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    """The results as benchmarks/RESULTS.md's markdown table, per shard where it says so."""
    rows = ["| code | target | db | shards | wall s | compute s / 4 nodes | overhead s | **overhead per shard s** | API requests "
            "per shard | DB rows per shard (task-run states, events, logs) | DB growth KB per shard | parent peak "
            "RSS MB | store requests per shard (LIST, GET+HEAD, PUT, DELETE) | store KB in / out per shard |",
            "|" + "---|" * 14]
    for r in sorted(results, key=lambda r: (r.get("target", "demo"), r.get("code", ""), r["shards"], r["db"])):
        n, st, d = r["shards"], r["store"], r["db_rows"]
        rows.append(
            f"| {r.get('code', '')} | {r.get('target', 'demo')} | {r['db']} | {n} | {r['wall_s']:.0f} | {r['compute_s'] / NODES:.0f} | {r['overhead_s']:.0f} | "
            f"**{r['overhead_per_shard_s']:.2f}** | {r['api_requests'] / n:.1f} | "
            f"{d['task_run_state'] / n:.1f}, {d['events'] / n:.1f}, {d['log'] / n:.1f} | {r['db_bytes'] / n / 1024:.0f} | "
            f"{r['parent_peak_rss_mb']:.0f} | "
            + ", ".join(f"{st.get(k, 0) / n:.1f}" for k in ("LIST", "GET", "PUT", "DELETE"))
            + f" | {st.get('bytes_received', 0) / n / 1024:.0f} / {st.get('bytes_sent', 0) / n / 1024:.0f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--db", choices=["sqlite", "postgres"], nargs="+", default=["sqlite"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "rehearsal-results.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders (logs, databases)")
    ap.add_argument("--kill-after", type=int, default=None,
                    help="lose a node: SIGKILL the first node running a child slice once it finished this many "
                         "shards, then check `draftline status` and `draftline retry` (the run's figures then "
                         "cover the failed attempt)")
    ap.add_argument("--retry-with", choices=["cli", "ui"], default="cli",
                    help="with --kill-after: retry the failed run with `draftline retry --watch` (cli) or the Prefect "
                         "UI's Retry button, clicked in headless Chromium (ui: playwright and Debian's chromium, "
                         "as benchmarks/ui_page.py says)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override for the submitted run (repeatable), e.g. data.workers=2")
    ap.add_argument("--target", choices=["tiny", "demo"], default="tiny",
                    help="tiny: the demo model's shape at 4 layers of width 64, random weights (near-zero compute); "
                         "demo: the 135M demo model itself")
    ap.add_argument("--plot", type=Path, default=None, help="draw --out's results to this PNG")
    a = ap.parse_args()
    results = json.loads(a.out.read_text()) if a.out.exists() else []
    if "--shards" not in sys.argv:  # only draw and print what --out holds
        if a.plot:
            plot(results, a.plot)
        print(table(results))
        return
    for n in a.shards:
        for db in a.db:
            tmp = Path(tempfile.mkdtemp(prefix=f"rehearse-{db}-{n}-"))
            tmp.chmod(0o755)  # PostgreSQL runs as the postgres user when we are root: it must reach its folder
            try:
                code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip()  # the code the run starts with
                r = rehearse(n, db, tmp, kill_after=a.kill_after, target=a.target,
                             retry_via=a.retry_with, sets=a.sets)
                r["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                r["code"] = code
                print(json.dumps(r), flush=True)
                results.append(r)
                a.out.write_text(json.dumps(results, indent=1))
            finally:
                if not a.keep:
                    shutil.rmtree(tmp, ignore_errors=True)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
