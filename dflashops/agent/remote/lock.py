"""``lock``: the host's deploy lock, held by the agent session itself (one actor per host).

``op: "acquire"`` (in a ``serve`` session): ``flock(LOCK_EX|LOCK_NB)`` on ``WORKDIR/deploy.lock``,
retried every ``poll`` s for up to ``wait`` s; the descriptor then stays open for the rest of
this process, so the kernel releases the lock when the session ends however it ends (the
controller killed with -9, a dropped link: stdin ends and the agent exits). It is opened
close-on-exec and forked supervisors close every inherited descriptor (start.py), so no unit
ever holds it. The holder record (``WORKDIR/deploy.holder.json``, 0600, written atomically
once the lock is held: who, command, since, controller pid, agent pid and its start time) names
the holder to whoever is refused. Answer: ``{ok, holder, holder_alive, error}``; on refusal
``holder`` is the current holder's record.

``op: "show"``: the record, whether the lock is held and whether the recorded agent is alive.
``op: "release"`` (``pid``, ``start_time`` as shown): end the holding agent, only when that pid
still is the recorded process (start time), a dflashops agent (its command line) and holds this
very lock file open (``/proc/PID/fd``): TERM, then KILL when it has not let go in ``grace`` s.
Nothing else is ever signalled.
"""

from __future__ import annotations

import os
import signal
import time

from . import identity, layout, procfs
from .common import (
    BadRequest,
    Json,
    describe,
    is_int,
    now_iso,
    number,
    private_dir,
    read_json_object,
    write_json_atomic,
)

LOCK_FILE = layout.DEPLOY_LOCK
HOLDER_FILE = layout.LOCK_HOLDER
AGENT_MARK = "<dflashops-agent>"  # in every agent's command line (bundle.LOADER)
OPS = ("acquire", "show", "release")
HOLDER_KEYS = ("who", "command", "controller_pid")

HELD: dict[str, int] = {}  # workdir -> the open descriptor holding its lock (this session)


def check(request: Json) -> None:
    op = request.get("op")
    if op not in OPS:
        raise BadRequest(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "acquire":
        holder = request.get("holder")
        if not isinstance(holder, dict) or not all(k in holder for k in HOLDER_KEYS):
            raise BadRequest(f"holder must be an object with {', '.join(HOLDER_KEYS)}")
        request["wait"] = number(request.get("wait", 0.0), "wait")
        request["poll"] = number(request.get("poll", 0.2), "poll", 0.01)
    if op == "release":
        for key in ("pid", "start_time"):
            if not is_int(request.get(key)):
                raise BadRequest(f"{key} must be an integer")
        request["grace"] = number(request.get("grace", 5.0), "grace")


def paths(workdir: str) -> tuple[str, str]:
    return os.path.join(workdir, LOCK_FILE), os.path.join(workdir, HOLDER_FILE)


def run(request: Json) -> Json:
    workdir = request["workdir"]
    try:
        if request["op"] == "acquire":
            return acquire(workdir, request["holder"], request["wait"], request["poll"])
        if request["op"] == "show":
            return show(workdir)
        return release(workdir, request["pid"], request["start_time"], request["grace"])
    except OSError as exc:
        return {"ok": False, "error": f"{os.path.join(workdir, LOCK_FILE)}: {describe(exc)}"}


# -- acquire -----------------------------------------------------------------------------------


def acquire(workdir: str, holder: Json, wait: float, poll: float) -> Json:
    lock_path, record_path = paths(workdir)
    if workdir in HELD:  # this session holds it already (asked again after a retry)
        return {"ok": True, "holder": read_record(record_path), "holder_alive": True}
    private_dir(workdir)  # made 0700, or tightened at every deploy (DESIGN trust 4)
    deadline = time.monotonic() + wait
    while True:
        fd = try_lock(lock_path)
        if fd is not None:
            break
        if time.monotonic() >= deadline:
            record = read_record(record_path)
            return {"ok": False, "holder": record, "holder_alive": holds(record, lock_path)}
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
    record = dict(
        {k: holder.get(k) for k in HOLDER_KEYS},
        since=now_iso(),
        agent_pid=os.getpid(),
        agent_start_time=start_time(os.getpid()),
        boot_id=procfs.boot_id(),
    )
    try:
        write_json_atomic(record_path, record, 0o600)
    except BaseException:
        os.close(fd)  # a lock nobody could name would be refused without a holder: let it go
        raise
    HELD[workdir] = fd
    # The first deploy here (or the first since the workdir was emptied) gives the node its
    # id, under the lock: facts report it, and the controller tells a new node by it.
    return dict({"ok": True, "holder": record, "holder_alive": True}, **identity.ensure(workdir))


def try_lock(path: str) -> int | None:
    """The descriptor holding the lock, or None when another process holds it. Opened only
    for the attempt: a waiting agent keeps no descriptor of it open between attempts."""
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_record(path: str) -> Json | None:
    try:
        return read_json_object(path)
    except (OSError, ValueError) as exc:
        return {"error": f"{path}: {describe(exc)}"}


# -- who holds it --------------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    stat = procfs.proc_stat(pid)
    if stat is None or stat[procfs.STATE] in procfs.DEAD:
        return None
    return int(stat[procfs.START_TIME])


def opens(pid: int, target: os.stat_result) -> bool:
    """Whether process ``pid`` has the file ``target`` open (one of its descriptors)."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    for name in names:
        try:
            st = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def holders(lock_path: str) -> list[int]:
    """Processes (other than this one) with the lock file open: the holder, as every attempt
    closes its descriptor when refused. Processes of other users cannot be looked into."""
    try:
        target = os.stat(lock_path)
    except OSError:
        return []
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != me and opens(int(entry.name), target):
            found.append(int(entry.name))
    return sorted(found)


def holds(record: Json | None, lock_path: str) -> bool:
    """Whether the record's agent is alive (same start time) and holds the lock file open."""
    if not record or not isinstance(record.get("agent_pid"), int):
        return False
    pid = record["agent_pid"]
    if start_time(pid) != record.get("agent_start_time"):
        return False
    try:
        return opens(pid, os.stat(lock_path))
    except OSError:
        return False


def is_agent(pid: int) -> bool:
    return any(AGENT_MARK in arg for arg in procfs.cmdline(pid))


# -- show and release ----------------------------------------------------------------------------


def show(workdir: str) -> Json:
    lock_path, record_path = paths(workdir)
    record = read_record(record_path)
    found = holders(lock_path)
    return {
        "ok": True,
        "holder": record,
        "held": bool(found) or locked_by_others(lock_path),
        "holder_alive": holds(record, lock_path),
        "pids": found,
    }


def locked_by_others(lock_path: str) -> bool:
    """/proc/locks has a lock on the file's inode (one whose holder we cannot look into)."""
    try:
        inode = os.stat(lock_path).st_ino
        with open("/proc/locks") as f:
            lines = f.read(4 * 1024 * 1024).splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


def release(workdir: str, pid: int, started: int, grace: float) -> Json:
    lock_path, record_path = paths(workdir)
    record = read_record(record_path)
    out: Json = {"ok": False, "holder": record, "signalled": None, "error": None}
    if not holders(lock_path) and not locked_by_others(lock_path):
        out.update(ok=True)  # free already (its holder ended meanwhile): nothing to signal
        return out
    why = refuse_signal(record, pid, started, lock_path)
    if why is not None:
        out["error"] = why
        return out
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        # A pid that ended between two checks is not signalled: the start time says so.
        if start_time(pid) != started:
            break
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        out["signalled"] = signal.Signals(sig).name
        if let_go(pid, started, lock_path, wait):
            break
    if holders(lock_path) or locked_by_others(lock_path):
        out["error"] = f"the lock is still held after {out['signalled']} to pid {pid}"
        return out
    out["ok"] = True
    return out


def refuse_signal(record: Json | None, pid: int, started: int, lock_path: str) -> str | None:
    """Why ``pid`` must not be signalled (None: it is the recorded agent holding the lock)."""
    if not record or record.get("agent_pid") != pid or record.get("agent_start_time") != started:
        return f"pid {pid} is not the holder recorded in {HOLDER_FILE} (it changed): look again"
    if start_time(pid) != started:
        return f"pid {pid} is gone or is another process now: look again"
    if not is_agent(pid):
        return f"pid {pid} is not a dflashops agent: not signalled"
    if not holds(record, lock_path):
        return f"pid {pid} does not hold {lock_path}: not signalled"
    return None


def let_go(pid: int, started: int, lock_path: str, wait: float) -> bool:
    """Whether ``pid`` ended (or closed the lock file) within ``wait`` s."""
    target = os.stat(lock_path)
    deadline = time.monotonic() + wait
    while True:
        if start_time(pid) != started or not opens(pid, target):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
