"""A run's page in the Prefect UI, opened in a real browser, at two task-run counts (issue 43, item 4).

    .venv/bin/pip install playwright==1.65.3; apt-get install chromium      # once; the browser is Debian's
    PYTHONPATH=$PWD .venv/bin/python benchmarks/ui_page.py --tasks 128 1024 [--fail 4] [--out FILE]

For each count: a fresh real `prefect server` (its own home and SQLite database), then a real Prefect flow named
like draftline's (`draftline`) run against it with that many tasks named as the extract stage names its shards
(`tasks.core.stages.task_name`, e.g. `extract-shard-17`), `--fail` of them failing, so the run ends Failed with
a page the size of the hero run's (the Kimi preset: 512 regeneration and 512 extraction shards). Then headless
Chromium (Debian's /usr/bin/chromium, driven by playwright) opens the run's page, `/runs/flow-run/<id>`, as a
user following `draftline ui` would, and the script measures:

- until the run's name is on the page (the page usable), and until its header shows "N Task runs" (and N);
- from a click on the page's Task Runs tab until the first shard's row is listed, and the rows on that first view;
- how long after the flow returned the server held every task run's final state (states travel over Prefect's
  events stream and are written behind it);
- the tab's own summary by state ("(1020 Completed, 4 Failed)") against the failed task runs the server counts
  (the run must end Failed with exactly --fail of them);
- screenshots of the page and of its Task Runs tab (--shots DIR).

The run is a plain flow run, not a deployment's, so the UI shows no Retry button on it (Prefect offers Retry
only where a worker can pick the run up again); the Retry of a deployment's run is what `draftline retry` and
benchmarks/rehearse.py exercise. Results: one JSON object per count into --out, and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from prefect_server import PrefectServer  # noqa: E402

CHROMIUM = os.environ.get("DRAFTLINE_CHROMIUM", "/usr/bin/chromium")

FLOW = textwrap.dedent('''
    import sys
    from prefect import flow, task
    from prefect.futures import wait
    from tasks.core.stages import task_name

    N, FAIL = int(sys.argv[1]), int(sys.argv[2])

    @task(retries=0)
    def shard(i: int) -> int:
        if i >= N - FAIL:
            raise RuntimeError(f"shard {i}: a node was lost (rehearsed)")
        return i

    @flow(name="draftline")
    def run() -> None:
        futures = [shard.with_options(task_run_name=task_name("extract", i)).submit(i) for i in range(N)]
        wait(futures)
        failed = [f for f in futures if f.state.is_failed()]
        if failed:
            raise RuntimeError(f"{len(failed)} of {N} extraction shards not finished")

    if __name__ == "__main__":
        state = run(return_state=True)
        print("FLOW_RUN_ID", state.state_details.flow_run_id, state.type.value, flush=True)
''')


def make_run(server: PrefectServer, tmp: Path, tasks: int, fail: int) -> tuple[str, float]:
    """Run the flow with `tasks` task runs against the server; its id and the seconds it took."""
    script = tmp / "flow.py"
    script.write_text(FLOW)
    env = dict(os.environ, **server.env(), PYTHONPATH=str(ROOT), PREFECT_LOGGING_LEVEL="WARNING",
               PREFECT_TASK_RUNNER_THREAD_POOL_MAX_WORKERS="8")
    t0 = time.time()
    out = subprocess.run([sys.executable, str(script), str(tasks), str(fail)], env=env, capture_output=True,
                         text=True, timeout=3600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FLOW_RUN_ID")), None)
    if line is None:
        raise RuntimeError(f"the flow did not report its run:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return line.split()[1], time.time() - t0


def count_on_server(server: PrefectServer, run_id: str, state: str | None = None) -> int:
    """The run's task runs the server holds (of one state type, if given)."""
    import urllib.request
    f: dict = {"flow_run_id": {"any_": [run_id]}}
    if state:
        f["state"] = {"type": {"any_": [state]}}
    body = json.dumps({"task_runs": f}).encode()
    req = urllib.request.Request(server.api_url + "/task_runs/count", data=body,
                                 headers={"Content-Type": "application/json"})
    return int(urllib.request.urlopen(req, timeout=30).read())


def seen(page, text: str, timeout_s: float = 300) -> None:
    """Wait until `text` is visible on the page (a hidden copy of it, in a tooltip or a closed tab, does not count)."""
    page.get_by_text(text, exact=False).filter(visible=True).first.wait_for(timeout=timeout_s * 1000)


def open_page(server: PrefectServer, run_id: str, run_name: str, tasks: int, shot: Path | None) -> dict:
    """Open the run's page in headless Chromium: seconds until usable, until it shows the task-run count, and
    from a click on its Task Runs tab until the first row is listed."""
    from playwright.sync_api import sync_playwright

    url = f"{server.ui_url}/runs/flow-run/{run_id}"
    out: dict = {"url": url}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        t0 = time.time()
        page.goto(url, wait_until="domcontentloaded", timeout=120_000)
        seen(page, run_name)
        out["usable_s"] = round(time.time() - t0, 2)
        header = page.get_by_text(re.compile(r"^\s*\d+ Task runs\s*$")).filter(visible=True).first
        header.wait_for(timeout=300_000)
        out["count_shown_s"] = round(time.time() - t0, 2)  # the header's "N Task runs", as the server counts
        out["count_shown"] = int(header.inner_text().split()[0])
        if shot:
            page.screenshot(path=str(shot), full_page=False)
        t1 = time.time()
        page.get_by_text("Task Runs", exact=True).filter(visible=True).first.click()
        seen(page, "extract-shard-")
        out["task_runs_tab_s"] = round(time.time() - t1, 2)
        out["rows_first_page"] = page.get_by_text("extract-shard-", exact=False).count()
        if shot:
            page.screenshot(path=str(shot.with_name(shot.stem + "-task-runs.png")), full_page=False)
        # the tab's own count by state, e.g. "(1020 Completed, 4 Failed)", once it has loaded
        deadline, summary = time.time() + 120, None
        while summary is None and time.time() < deadline:
            summary = re.search(r"\(([^()]*\d+ Failed[^()]*)\)", page.inner_text("body"))
            if summary is None:
                time.sleep(0.5)
        out["tab_summary"] = summary.group(1) if summary else None
        out["failed_shown"] = int(re.search(r"(\d+) Failed", summary.group(1)).group(1)) if summary else None
        browser.close()
    return out


def run_name(server: PrefectServer, run_id: str) -> str:
    import urllib.request
    with urllib.request.urlopen(f"{server.api_url}/flow_runs/{run_id}", timeout=30) as r:
        return json.loads(r.read())["name"]


def measure(tasks: int, fail: int, tmp: Path, shots: Path | None) -> dict:
    server = PrefectServer(tmp / f"prefect-{tasks}").start()
    try:
        run_id, made_s = make_run(server, tmp, tasks, fail)
        # task-run states reach the server over its events stream and are written behind it: wait until it holds
        # every task run's final state (the lag is measured: `draftline status` right after a run reads the same)
        t0, lag = time.time(), None
        while time.time() - t0 < 600:
            if count_on_server(server, run_id, "FAILED") + count_on_server(server, run_id, "COMPLETED") == tasks:
                lag = round(time.time() - t0, 1)
                break
            time.sleep(0.5)
        name = run_name(server, run_id)
        shot = shots / f"ui-run-page-{tasks}.png" if shots else None
        page = open_page(server, run_id, name, tasks, shot)
        return {"tasks": tasks, "fail": fail, "run_id": run_id, "run_name": name, "flow_s": round(made_s, 1),
                "server_caught_up_s": lag,
                "failed_on_server": count_on_server(server, run_id, "FAILED"), **page,
                "screenshot": str(shot) if shot else None}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--fail", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shots", type=Path, default=None, help="a folder for the pages' screenshots")
    a = ap.parse_args()
    if a.shots:
        a.shots.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="ui-page-") as t:
        for n in a.tasks:
            r = measure(n, a.fail, Path(t), a.shots)
            print(json.dumps(r), flush=True)
            results.append(r)
    print("\n| task runs | shown | failed (server) | failed (page) | flow s | page usable s | count shown s | Task Runs tab s "
          "| rows listed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['tasks']} | {r['count_shown']} | {r['failed_on_server']} | {r['failed_shown']} | {r['flow_s']} | {r['usable_s']} | {r['count_shown_s']} "
              f"| {r['task_runs_tab_s']} | {r['rows_first_page']} |")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
