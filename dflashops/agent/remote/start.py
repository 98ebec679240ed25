"""``start``: spawn each unit's supervisor as the leader of a new session; returns at once.

Request: ``units: [{name, keep_logs}]``. Answer: ``units: {name: {name, ok, pid, pgid,
start_time, log, error}}``. Never a second copy: a unit is refused while anything of its
previous start is alive, and one start per unit runs at a time (a lock in its folder). The
previous run's exit, stopped and progress records go, a new timestamped log is opened (old ones
kept, the oldest beyond ``keep_logs`` rotated out), and the pid record names the supervisor.

The supervisor runs from ``WORKDIR/agent/<sha256[:16]>.py``, a copy of this very bundle written
here when missing: content-addressed, so a running supervisor's code never changes under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator

from . import logs, ownership, procfs
from .common import (
    Json,
    describe,
    integer,
    now_iso,
    remove,
    unit_dir,
    unit_list,
    write_atomic,
    write_json_atomic,
)
from .supervisor import STOP_MARK

RESULT_KEYS = ("pid", "pgid", "start_time", "log", "error")


def check(request: Json) -> None:
    for i, u in enumerate(unit_list(request)):
        u["keep_logs"] = integer(u.get("keep_logs", 20), f"units[{i}].keep_logs", 1)


def agent_file(workdir: str) -> str:
    """This bundle on the host's disk (written once per version), for supervisors to run."""
    from . import BUNDLE

    if not BUNDLE:
        raise RuntimeError("the agent is not running from its bundle: cannot start supervisors")
    data = BUNDLE.encode()
    path = os.path.join(workdir, "agent", hashlib.sha256(data).hexdigest()[:16] + ".py")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, data, 0o644)
    return path


@contextlib.contextmanager
def lock(folder: str) -> Iterator[None]:
    """One start of a unit at a time: two controllers starting it together make one copy."""
    import fcntl

    fd = os.open(os.path.join(folder, ".start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def still_running(folder: str, boot: str) -> tuple[int | None, str | None]:
    """(pid, why not) when anything of the previous start lives or cannot be judged."""
    rec, problem = ownership.load_record(folder)
    if problem is not None:
        return None, f"{problem}; run stop for this unit first"
    if rec is None:
        return None, None
    alive, unproven = ownership.members(rec, boot, ownership.group_scan([rec]))
    if ownership.leader_state(rec, boot) == "alive":
        return rec.pid, f"already running (pid {rec.pid})"
    if alive:
        return rec.pid, (
            f"already running: processes of the previous start are alive (pids "
            f"{' '.join(map(str, alive))}) though its leader pid {rec.pid} is gone; stop the unit first"
        )
    if unproven:
        return rec.pid, ownership.unproven_message(unproven, rec)
    return None, None


def spawn(folder: str, agent: str, keep_logs: int, boot: str) -> Json:
    """Start the supervisor with a new log; the pid record it gets. Used by start and by the
    supervisor itself when it restarts a crashed unit (then without a new session)."""
    import subprocess

    # A new start: the previous run's outcome, stop request and restart history go with it.
    for stale in ("exit", "stopped", "progress.json", STOP_MARK, "crashed", "supervisor.json"):
        remove(os.path.join(folder, stale))
    log_name, fd = logs.new_log(folder, keep_logs)
    # Every process of this start inherits the run id: proof of membership for stop when the
    # leader is gone (see ownership).
    run_id = os.urandom(8).hex()
    try:
        proc = subprocess.Popen(
            # -S: no site (nor the host's .pth files): 90 ms less CPU per unit start.
            [sys.executable, "-S", agent, "supervise", folder, str(keep_logs)],
            env=dict(os.environ, **{ownership.RUN_ID_VAR: run_id}),
            start_new_session=True,  # outlives this call and the SSH session; pgid == pid
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            cwd=folder,
            close_fds=True,
        )
    finally:
        os.close(fd)
    # Our child until we exit, so its /proc entry is there even if it already ended; Popen
    # returns only after the exec, so setsid() has happened.
    stat = procfs.proc_stat(proc.pid)
    if stat is None or int(stat[procfs.PGRP]) != proc.pid:
        raise RuntimeError(f"the supervisor (pid {proc.pid}) does not lead its own process group")
    record = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_time": int(stat[procfs.START_TIME]),
        "boot_id": boot,
        "started_at": now_iso(),
        "log": f"logs/{log_name}",
        "run_id": run_id,
    }
    write_json_atomic(os.path.join(folder, "pid"), record)
    return record


def start_one(workdir: str, spec: Json, boot: str | None, agent: str) -> Json:
    out: Json = dict.fromkeys(RESULT_KEYS)
    out.update(name=spec["name"], ok=False)
    folder = unit_dir(workdir, spec["name"])
    if not os.path.isfile(os.path.join(folder, "launch.sh")):
        out["error"] = f"launch.sh missing: {os.path.join(folder, 'launch.sh')}"
        return out
    if boot is None:
        out["error"] = "cannot read /proc/sys/kernel/random/boot_id: cannot record a provable pid"
        return out
    with lock(folder):
        out["pid"], out["error"] = still_running(folder, boot)
        if out["error"] is None:
            record = spawn(folder, agent, spec["keep_logs"], boot)
            out.update({k: record[k] for k in ("pid", "pgid", "start_time", "log")}, ok=True)
    return out


def run(request: Json) -> Json:
    workdir = request["workdir"]
    boot = procfs.boot_id()
    units: Json = {}
    try:
        agent = agent_file(workdir)
    except Exception as exc:
        problem = f"cannot place the supervisor under {workdir}/agent: {describe(exc)}"
        for spec in request["units"]:
            units[spec["name"]] = dict(dict.fromkeys(RESULT_KEYS), name=spec["name"], ok=False)
            units[spec["name"]]["error"] = problem
        return {"units": units}
    for spec in request["units"]:
        try:
            units[spec["name"]] = start_one(workdir, spec, boot, agent)
        except Exception as exc:  # one unit's trouble must not hide the others' results
            units[spec["name"]] = dict(dict.fromkeys(RESULT_KEYS), name=spec["name"], ok=False)
            units[spec["name"]]["error"] = describe(exc)
    return {"units": units}
