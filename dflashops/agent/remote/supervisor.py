"""The unit's supervisor: session leader of the unit, runs ``launch.sh``, records how it ended.

Run as ``python WORKDIR/agent/<sha>.py supervise UNIT_DIR`` by ``start``. A job's outcome is its
exit code and nobody else can learn it (start returned long ago, its SSH session is gone), so
the supervisor waits for ``bash launch.sh`` (which execs the engine) and writes ``exit``. Its
pid is the recorded pid and pgid, which makes the unit's process group provable.

Its TERM/INT/HUP handlers do nothing, so the group-wide TERM of stop does not end it before it
has recorded how the engine ended. Handlers, unlike SIG_IGN, are reset by exec, so bash and the
engine still die on TERM. KILL takes everything down; stop then records the stop itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from .common import Json, now_iso, write_json_atomic


def say(line: str) -> None:
    sys.stdout.write(f"[dflashops] {line}\n")
    sys.stdout.flush()


def run_once(folder: str) -> Json:
    """Run launch.sh to its end: the exit record."""
    record: Json = {"code": None, "signal": None, "finished_at": None, "child_pid": None}
    try:
        child = subprocess.Popen(["bash", "launch.sh"], cwd=folder, stdin=subprocess.DEVNULL)
    except OSError as exc:
        say(f"supervisor: cannot run launch.sh: {exc}")
        record["code"] = 127
    else:
        record["child_pid"] = child.pid
        rc = child.wait()
        if rc < 0:
            try:
                record["signal"] = signal.Signals(-rc).name
            except ValueError:
                record["signal"] = f"SIG{-rc}"
            record["code"] = 128 - rc
        else:
            record["code"] = rc
    record["finished_at"] = now_iso()
    return record


def main(folder: str) -> int:
    def ignore(signum: int, frame: Any) -> None:
        pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, ignore)
    started = time.monotonic()
    record = run_once(folder)
    how = f"killed by {record['signal']}, " if record["signal"] else ""
    say(
        f"launch.sh ended ({how}exit code {record['code']}) at {record['finished_at']} "
        f"after {time.monotonic() - started:.1f}s"
    )
    write_json_atomic(os.path.join(folder, "exit"), record)
    return 0
