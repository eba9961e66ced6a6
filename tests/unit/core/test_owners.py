"""Owner records live in folders others can write (/tmp, /dev/shm): `owners.read` believes one only when it is a
regular file of at most RECORD_CAP bytes holding a JSON object, and never blocks on a planted FIFO."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from tasks.core import owners
from tasks.core.capped import RECORD_CAP


def read_within(folder: Path, seconds: float = 10.0):
    got: list = []
    t = threading.Thread(target=lambda: got.append(owners.read(folder)), daemon=True)
    t.start()
    t.join(seconds)
    assert got, f"owners.read({folder}) still blocks after {seconds} s"
    return got[0]


def test_an_owner_record_is_believed_only_as_a_small_regular_file_of_a_json_object(tmp_path):
    mine = Path(owners.owned_tempdir("copy", str(tmp_path)))
    assert read_within(mine)["pid"] == os.getpid()

    def planted(name: str) -> Path:
        folder = tmp_path / f"draftline-{name}"
        folder.mkdir()
        return folder / owners.OWNER_FILE

    record = json.dumps(owners.me())
    os.mkfifo(planted("fifo"))  # nobody ever writes it: an uncapped read would wait forever
    pad = RECORD_CAP  # a record the cap allows, and one a byte over it (both valid JSON)
    small = json.dumps({**owners.me(), "pad": "x" * (pad - len(record) - 20)})
    planted("small").write_text(small)
    planted("huge").write_text(json.dumps({**owners.me(), "pad": "x" * pad}))
    planted("link").symlink_to(mine / owners.OWNER_FILE)
    planted("list").write_text("[1, 2]")
    assert len(small) <= RECORD_CAP and read_within(tmp_path / "draftline-small")["pid"] == os.getpid()
    for name in ("fifo", "huge", "link", "list"):
        assert read_within(tmp_path / f"draftline-{name}") is None, name
