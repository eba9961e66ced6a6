"""A real `prefect server start` on loopback, with its own Prefect home (and database)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    def __init__(self, home: Path, port: int | None = None):
        self.home = Path(home)
        self.port = port or free_port()
        self._port_picked = port is None
        self.proc: subprocess.Popen | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home)}

    def start(self, timeout: float = 300, retries: int = 2) -> "PrefectServer":
        self.home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_UI_API_URL=self.api_url)
        env.pop("PREFECT_API_URL", None)
        prefect = str(Path(sys.executable).parent / "prefect")
        self.log = open(self.home / "server.log", "ab")
        logged = self.log.tell()
        self.proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                said = (self.home / "server.log").read_bytes()[logged:].decode(errors="replace")
                if self._port_picked and "already in use" in said and retries:
                    # the port found free was taken before the server bound it (the suite's other xdist worker
                    # starting its servers): another free port
                    self.port = free_port()
                    return self.start(timeout, retries - 1)
                raise RuntimeError("prefect server exited:\n" + said[-3000:])
            try:
                with urllib.request.urlopen(self.api_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
