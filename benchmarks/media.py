"""Where bytes go and how fast the medium itself takes them: shared by bench_write.py and bench_gpu.py.

`medium(folder)` names the filesystem under a folder (its `df -PT` line: device, type, mount point), so every
figure can say whether its bytes went to tmpfs (RAM) or a disk. `dd_rate` is the medium's own rate: `writers`
`dd` processes at once copying the same serialized bytes (a file in RAM) into `copies` files in the folder,
no fsync (the store path does not fsync either: both land in the page cache of a disk filesystem).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path


def medium(folder: str | os.PathLike) -> dict:
    """{"folder", "device", "fstype", "mount", "avail_gb", "df"} of the filesystem holding `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    line = subprocess.run(["df", "-PT", str(folder)], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    dev, fstype, _size, _used, avail, _pct, mount = line.split(None, 6)
    kind = "tmpfs (RAM)" if fstype in ("tmpfs", "ramfs") else ("network" if fstype in ("nfs", "nfs4", "fuse", "cifs")
                                                                else "disk")
    return {"folder": str(folder), "device": dev, "fstype": fstype, "kind": kind, "mount": mount,
            "avail_gb": round(int(avail) * 1024 / 1e9, 1), "df": line}


def dd_rate(src: str | os.PathLike, dest: str | os.PathLike, copies: int, writers: int, bs: str = "16M") -> dict:
    """`copies` copies of the file `src` into the folder `dest` by `writers` concurrent `dd` loops; the folder is
    emptied afterwards (outside the timing). Returns bytes, seconds and GB/s."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    size = os.path.getsize(src)
    loops = []
    for k in range(writers):
        mine = " ".join(str(i) for i in range(k, copies, writers))
        if mine:
            loops.append(f"for i in {mine}; do dd if={src} of={dest}/dd-$i.bin bs={bs} status=none || exit 1; done")
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["bash", "-c", cmd]) for cmd in loops]
    rcs = [p.wait() for p in procs]
    secs = time.perf_counter() - t0
    shutil.rmtree(dest, ignore_errors=True)
    if any(rcs):
        raise RuntimeError(f"dd into {dest} failed (exit codes {rcs})")
    return {"bytes": size * copies, "seconds": round(secs, 3), "gb_per_s": round(size * copies / secs / 1e9, 3),
            "writers": writers, "copies": copies}
