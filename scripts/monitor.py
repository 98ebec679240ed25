#!/usr/bin/env python3
"""Training monitor (example user script, CPU only, stdlib only).

Every --interval seconds prints one line: GPU memory per GPU (from nvidia-smi, when present), the
newest file under --watch with its age, and free disk there. It runs as its own dflashops unit,
so restarting the training never touches it (INCIDENTS.md #2: `pkill -9 -f python` killed it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time


def gpu_summary() -> str:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,memory.used,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"gpus: unavailable ({exc.__class__.__name__})"
    parts = []
    for line in out.strip().splitlines():
        index, used, total = (f.strip() for f in line.split(","))
        parts.append(f"{index}:{int(used) // 1024}/{int(total) // 1024}G")
    return "gpus: " + " ".join(parts)


def newest(path: str) -> str:
    best = None
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                mtime = os.stat(full).st_mtime
            except OSError:
                continue
            if best is None or mtime > best[0]:
                best = (mtime, full)
    if best is None:
        return f"newest: nothing under {path} yet"
    return f"newest: {best[1]} ({int(time.time() - best[0])}s ago)"


def disk(path: str) -> str:
    probe = path
    while not os.path.exists(probe) and probe not in ("", "/"):
        probe = os.path.dirname(probe)
    usage = shutil.disk_usage(probe or "/")
    return f"disk free: {usage.free // 2**30} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--watch", required=True, help="directory the training writes checkpoints to"
    )
    parser.add_argument("--interval", type=float, default=60.0)
    args = parser.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while not stop:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(f"{stamp} {gpu_summary()} | {newest(args.watch)} | {disk(args.watch)}", flush=True)
        deadline = time.monotonic() + args.interval
        while not stop and time.monotonic() < deadline:
            time.sleep(min(1.0, args.interval))
    print("monitor: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
