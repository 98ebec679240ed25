"""``start``: spawn each unit's supervisor as the leader of a new session; returns at once.

Request: ``units: [{name, keep_logs, launch_sha256}]``. Answer: ``units: {name: {name, ok, pid,
pgid, start_time, log, error}}``. Never a second copy: a unit is refused while anything of its
previous start is alive, and one start per unit runs at a time (a lock in its folder). Never
another actor's script: with ``launch_sha256`` (what the controller shipped), a launch.sh that
differs on disk is refused. The previous run's exit, stopped and progress records go, a new
timestamped log is opened (old ones kept, the oldest beyond ``keep_logs`` rotated out), and the
pid record names the supervisor.

The supervisor is forked from this agent, whose code is loaded already: no interpreter start
(44 ms of CPU a unit, most of what a deploy costs on the host). Its command line is the
agent's; ``ps -o comm``, top and pstree name it ``dfo:<unit>``. When another thread of the agent
is alive (a fork copies only the calling one), it runs instead from
``WORKDIR/agent/<sha256[:16]>.py``, a copy of this very bundle written here when missing:
content-addressed, so a running supervisor's code never changes under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from collections.abc import Iterator

from . import bounded, layout, logs, ownership, procfs
from .common import (
    BadRequest,
    Json,
    describe,
    integer,
    now_iso,
    remove,
    sha256_file,
    unit_list,
    write_atomic,
    write_json_atomic,
)
from .supervisor import STOP_MARK

RESULT_KEYS = ("pid", "pgid", "start_time", "log", "error")
SHA256_RE = re.compile(r"[0-9a-f]{64}")


def check(request: Json) -> None:
    for i, u in enumerate(unit_list(request)):
        u["keep_logs"] = integer(u.get("keep_logs", 20), f"units[{i}].keep_logs", 1)
        sha = u.get("launch_sha256")
        if sha is not None and not (isinstance(sha, str) and SHA256_RE.fullmatch(sha)):
            raise BadRequest(f"units[{i}].launch_sha256 must be a sha256 in hex")


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
        bounded.prune_agent_copies(workdir)  # a new version: the oldest unused copies go
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
    for stale in (
        layout.EXIT,
        layout.STOPPED,
        layout.PROGRESS,
        STOP_MARK,
        "crashed",
        layout.SUPERVISOR,
    ):
        remove(os.path.join(folder, stale))
    log_name, fd = logs.new_log(folder, keep_logs)
    # Every process of this start inherits the run id: proof of membership for stop when the
    # leader is gone (see ownership).
    run_id = os.urandom(8).hex()
    try:
        if may_fork():
            pid = fork_supervisor(folder, keep_logs, fd, run_id)
        else:
            pid = subprocess.Popen(
                # -S: no site (nor the host's .pth files): 90 ms less CPU per unit start.
                [sys.executable, "-S", agent, "supervise", folder, str(keep_logs)],
                env=dict(os.environ, **{ownership.RUN_ID_VAR: run_id}),
                start_new_session=True,  # outlives this call and the SSH session; pgid == pid
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                cwd=folder,
                close_fds=True,
            ).pid
    finally:
        os.close(fd)
    # Our child until we exit, so its /proc entry is there even if it already ended; both
    # ways return only once the child has called setsid().
    stat = procfs.proc_stat(pid)
    if stat is None or int(stat[procfs.PGRP]) != pid:
        raise RuntimeError(f"the supervisor (pid {pid}) does not lead its own process group")
    record = {
        "pid": pid,
        "pgid": pid,
        "start_time": int(stat[procfs.START_TIME]),
        "boot_id": boot,
        "started_at": now_iso(),
        "log": f"{layout.LOGS}/{log_name}",
        "run_id": run_id,
    }
    write_json_atomic(os.path.join(folder, layout.PID), record)
    return record


def may_fork() -> bool:
    """Fork the supervisor from this agent, whose code is loaded already, instead of starting
    an interpreter for it (44 ms of CPU a unit, most of a deploy's host-side cost): only with
    no other thread alive (a fork copies one thread; a lock another holds would stay held)."""
    import threading

    return hasattr(os, "fork") and threading.active_count() == 1


def fork_supervisor(folder: str, keep_logs: int, log_fd: int, run_id: str) -> int:
    """The supervisor as a forked child: its own session, the log as stdout and stderr, no
    other descriptor of this agent (not the SSH channel, not the start lock, not the deploy
    lock: a unit must never hold it), the run id in its environment (and so in its children's).
    It never returns into the agent: os._exit."""
    import gc

    from . import supervisor

    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 70
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.closerange(3, ready_w)
            os.closerange(ready_w + 1, max(ready_w + 1, os.sysconf("SC_OPEN_MAX")))
            # Objects of the agent stay referenced (this frame never returns) and out of the
            # collector's way: none of them can close a descriptor number the child reuses.
            gc.freeze()
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own descriptors
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.environ[ownership.RUN_ID_VAR] = run_id
            os.chdir(folder)
            name_process("dfo:" + os.path.basename(folder))
            os.write(ready_w, b"1")
            os.close(ready_w)
            code = supervisor.main(folder, keep_logs)
        except BaseException:
            try:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(ready_w)
    try:
        os.read(ready_r, 1)  # setsid() done (or the child died first: its stat says so)
    finally:
        os.close(ready_r)
    return pid


def name_process(name: str) -> None:
    """What ps -o comm, top and pstree call the forked supervisor (its command line is the
    agent's): ``dfo:<unit>``, at most 15 bytes (Linux's limit). Best effort."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except Exception:
        pass


def start_one(workdir: str, spec: Json, boot: str | None, agent: str) -> Json:
    out: Json = dict.fromkeys(RESULT_KEYS)
    out.update(name=spec["name"], ok=False)
    folder = layout.unit_dir(workdir, spec["name"])
    if not os.path.isfile(os.path.join(folder, layout.LAUNCH)):
        out["error"] = f"{layout.LAUNCH} missing: {os.path.join(folder, layout.LAUNCH)}"
        return out
    if boot is None:
        out["error"] = "cannot read /proc/sys/kernel/random/boot_id: cannot record a provable pid"
        return out
    with lock(folder):
        out["error"] = not_shipped(folder, spec)
        if out["error"] is not None:
            return out
        out["pid"], out["error"] = still_running(folder, boot)
        if out["error"] is None:
            record = spawn(folder, agent, spec["keep_logs"], boot)
            out.update({k: record[k] for k in ("pid", "pgid", "start_time", "log")}, ok=True)
    return out


def not_shipped(folder: str, spec: Json) -> str | None:
    """Why launch.sh on disk is not the script the controller shipped (None: it is, or the
    request did not say): two actors on one host must never start each other's script."""
    expected = spec.get("launch_sha256")
    if expected is None:
        return None
    found = sha256_file(os.path.join(folder, layout.LAUNCH))
    if found == expected:
        return None
    return (
        f"launch script of {spec['name']} on disk is not the one this deploy shipped "
        f"(sha256 {found[:12]}, shipped {expected[:12]}): another actor changed it; "
        "not started (`dflashops status` shows who runs what, deploy again to ship yours)"
    )


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
