"""The Prefect UI shows a draftline run: per-shard task runs and the run's artifacts.

A headless Chromium (Debian's `chromium`; `make test` installs it) opens the flow
run of the deployment scenario (tests/support/deploy_harness.py) in the real Prefect UI,
driven over the DevTools protocol, reads what a person would see and saves
screenshots under the test's tmp folder.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import deploy_harness as harness

CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1600,1000", "--remote-debugging-address=127.0.0.1",
                  "--remote-debugging-port=0"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("Chromium is missing: `make test` installs it (apt-get install -y chromium)")


class Page:
    """A page in a fresh headless Chromium, driven over the DevTools protocol (websockets)."""

    def __init__(self, profile: Path):
        self.profile = profile
        self.proc = subprocess.Popen([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError("Chromium did not start (no DevToolsActivePort)")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        self.ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = None
        self.n = 0

    async def __aenter__(self) -> "Page":
        import websockets

        self.ws = await websockets.connect(self.ws_url, max_size=64 << 20)
        await self.call("Page.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(20)

    async def call(self, method: str, **params):
        self.n += 1
        mid = self.n
        await self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    async def text(self) -> str:
        r = await self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                            returnByValue=True)
        return r["result"].get("value", "")

    async def wait_for(self, *needles: str, timeout: float = 90, after: str = "") -> str:
        """Wait until every needle shows (in the text after `after`, when given)."""
        deadline = time.time() + timeout
        while True:
            text = await self.text()
            part = text.split(after, 1)[-1] if after else text
            if all(n in part for n in needles):
                return part
            if time.time() > deadline:
                missing = [n for n in needles if n not in part]
                raise AssertionError(f"the page never showed {missing}; it shows:\n{part[:3000]}")
            await asyncio.sleep(1)

    async def click(self, label: str) -> None:
        js = ("(() => { const el = Array.from(document.querySelectorAll('button, a, [role=tab], li'))"
              f".find(e => e.innerText && e.innerText.trim() === {json.dumps(label)});"
              " if (!el) return false; el.click(); return true })()")
        r = await self.call("Runtime.evaluate", expression=js, returnByValue=True)
        assert r["result"].get("value") is True, f"no {label!r} tab on the page"

    async def screenshot(self, path: Path) -> Path:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def pairs(text: str) -> set[tuple[str, str]]:
    """(task run, state) pairs of the Task Runs list: each name line is followed by its state."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return {(a, b) for a, b in zip(lines, lines[1:]) if a.startswith(("extract-shard-", "prepare", "vocab"))}


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.xdist_group("deploy-scenario")  # the scenario tests/integration/test_deploy.py's tests read: run once
def test_flow_run_page_shows_shard_task_runs_and_artifacts(prefect_server, s3_server, tmp_path_factory, tmp_path):
    scenario = harness.run_scenario(prefect_server, s3_server, tmp_path_factory.mktemp("deploy"))
    url = scenario["ui"]
    assert url.startswith(prefect_server.ui_url)
    name = scenario["status_done"]["name"]

    async def look() -> dict:
        seen = {}
        async with Page(tmp_path / "chromium-profile") as page:
            await page.call("Page.navigate", url=url)
            seen["header"] = await page.wait_for(name, "Completed", "Task Runs", "Artifacts")
            seen["overview.png"] = await page.screenshot(tmp_path / "flow-run.png")

            await page.click("Task Runs")
            seen["tasks"] = await page.wait_for(*(f"extract-shard-{i}" for i in range(4)), "Cached",
                                                after="Job Variables")
            seen["task-runs.png"] = await page.screenshot(tmp_path / "flow-run-task-runs.png")

            await page.click("Artifacts")
            seen["artifacts"] = await page.wait_for("run-summary", "extract-progress", "draftline run: COMPLETED",
                                                    after="Job Variables")
            seen["artifacts.png"] = await page.screenshot(tmp_path / "flow-run-artifacts.png")
        return seen

    seen = asyncio.run(look())
    for key in ("overview.png", "task-runs.png", "artifacts.png"):
        print(f"screenshot: {seen[key]}")
        assert seen[key].stat().st_size > 20_000  # a rendered page, not a blank one

    shown = pairs(seen["tasks"])
    # the story of the run, as the UI tells it: shards 1 and 3 failed, then ran; 0 and 2 were reused
    for shard in harness.FAULTY:
        assert (f"extract-shard-{shard}", "Failed") in shown, shown
        assert (f"extract-shard-{shard}", "Completed") in shown, shown
    for shard in (0, 2):
        assert (f"extract-shard-{shard}", "Completed") in shown and (f"extract-shard-{shard}", "Cached") in shown
    assert ("prepare", "Cached") in shown and ("vocab", "Cached") in shown
    # the artifacts: the run summary table and the extraction progress, per attempt
    assert seen["artifacts"].count("run-summary") >= 2 and "Extraction: 4/4 shards, 0 failed" in seen["artifacts"]
