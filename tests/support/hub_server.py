"""A stand-in Hugging Face hub on loopback: one model repository served from a local folder, through the
routes huggingface_hub's `snapshot_download` calls (point it here with HF_ENDPOINT):

- GET  /api/models/{repo}/revision/{rev}      -> {"id", "sha", "siblings"}  (`repo_info`)
- GET  /api/models/{repo}/tree/{rev}          -> [{"type", "path", "size", "oid", "lfs"}]  (`list_repo_tree`)
- HEAD /{repo}/resolve/{rev}/{file}           -> ETag, X-Repo-Commit, Content-Length  (`get_hf_file_metadata`)
- GET  /{repo}/resolve/{rev}/{file}           -> the bytes (a Range is honoured: downloads resume)

Every request is recorded (method, path, Authorization header) so a test can count what reached the hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class StandInHub:
    def __init__(self, repo: str, folder: Path, delay_s: float = 0.0):
        self.repo, self.folder, self.delay_s = repo, Path(folder), delay_s
        self.files = sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())
        listing = "".join(f"{n}:{hashlib.sha256((self.folder / n).read_bytes()).hexdigest()}" for n in self.files)
        self.sha = hashlib.sha1(listing.encode()).hexdigest()  # a 40-hex commit of this content
        self.requests: list[dict] = []
        # draftline's liveness probe (tasks/engine/weights.py hub_reachable: a HEAD of the endpoint's root, before it
        # would call the hub at all): kept apart from the hub calls the tests count
        self.probes: list[dict] = []
        # stall(NAME): the next GET of NAME sends half its bytes, then holds the connection until release()
        self._stall: set[str] = set()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _sha256(self, name: str) -> str:
        return hashlib.sha256((self.folder / name).read_bytes()).hexdigest()

    def start(self) -> "StandInHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _record(self) -> None:
                with hub._lock:
                    probe = self.command == "HEAD" and urlparse(self.path).path == "/"
                    (hub.probes if probe else hub.requests).append({"method": self.command, "path": urlparse(self.path).path,
                                         "authorization": self.headers.get("Authorization"),
                                         "range": self.headers.get("Range")})

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self, head: bool) -> None:
                self._record()
                path = unquote(urlparse(self.path).path)
                api = f"/api/models/{hub.repo}/"
                if path.startswith(api + "revision/"):
                    return self._json({"id": hub.repo, "modelId": hub.repo, "sha": hub.sha, "private": False,
                                       "siblings": [{"rfilename": n} for n in hub.files]})
                if path.startswith(api + "tree/"):
                    entries = []
                    for n in hub.files:
                        size = (hub.folder / n).stat().st_size
                        e = {"type": "file", "path": n, "size": size, "oid": hub._sha256(n)[:40]}
                        if n.endswith(".safetensors"):
                            e["lfs"] = {"oid": hub._sha256(n), "size": size, "pointerSize": 134}
                        entries.append(e)
                    return self._json(entries)
                prefix = f"/{hub.repo}/resolve/"
                if path.startswith(prefix):
                    rev, _, name = path[len(prefix):].partition("/")
                    if rev not in (hub.sha, "main") or name not in hub.files:
                        self.send_response(404)
                        self.send_header("X-Error-Code", "EntryNotFound")
                        self.end_headers()
                        return
                    data = (hub.folder / name).read_bytes()
                    start = 0
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes=") and not head:
                        start = int(rng[6:].split("-")[0] or 0)
                    self.send_response(206 if start else 200)
                    self.send_header("ETag", f'"{hub._sha256(name)}"')
                    self.send_header("X-Repo-Commit", hub.sha)
                    self.send_header("Content-Length", str(len(data) - start))
                    if start:
                        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                    self.end_headers()
                    if not head:
                        import time

                        time.sleep(hub.delay_s)
                        if name in hub._stall:
                            hub._stall.discard(name)
                            half = (len(data) - start) // 2
                            self.wfile.write(data[start:start + half])
                            self.wfile.flush()
                            hub._released.wait(120)
                            return
                        self.wfile.write(data[start:])
                    return
                self.send_response(404)
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                self._route(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._route(head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stall(self, name: str) -> None:
        self._released.clear()
        self._stall.add(name)

    def release(self) -> None:
        self._released.set()

    def stop(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def count(self, method: str | None = None, contains: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if (method is None or r["method"] == method) and contains in r["path"])

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.probes.clear()
