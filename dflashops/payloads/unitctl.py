"""unitctl.py: start, stop, probe and tail dflashops units on a host (dflashops payload).

Stdlib only, Python 3.9+. The controller pipes this file to the host's python, one call per
action for any number of units::

    PYTHON - '{"action": "start", "workdir": "~/dflashops", "units": [...]}' < unitctl.py

It prints exactly one JSON line ``{"schema": 1, "action": ..., ...}`` and exits 0, even when
single units fail (their ``ok``/``error`` say why). It exits 2 only for a malformed request.

Layout under ``WORKDIR/units/<unit>/`` (the facts payload reads the same files)::

    launch.sh     the rendered launch script, written by the controller before start
    unit.json     written by the controller
    pid           {"pid", "pgid", "start_time", "boot_id", "started_at", "log", "run_id"} (start)
    exit          {"code", "signal", "finished_at", "child_pid"}   (the supervisor, at exit)
    stopped       {"stopped_at", "pids", "killed"}   (stop)
    logs/<UTC YYYYmmddTHHMMSSZ>[-N].log, logs/current.log -> the newest (relative symlink)

Every write of pid, exit, stopped and current.log is atomic (temporary name + os.replace).

Actions:

- ``start`` ``{"units": [{"name", "keep_logs"}]}`` -> ``{"units": {name: {name, ok, pid, pgid,
  start_time, log, error}}}``. Refuses while anything of the previous start is still alive.
  Opens a new timestamped log (old logs are kept, the oldest beyond ``keep_logs`` rotated out)
  and spawns the unit's supervisor as the leader of a new session. Returns at once.
- ``stop`` ``{"units": [{"name", "grace"}], "kill_wait", "gpu_timeout"}`` -> ``{"units": {name:
  {name, ok, was_running, pids, killed, stale_pid, unproven_pids, gpu_freed, gpu_held, gpu_error,
  error, seconds}}}``. Signals only the recorded process group, and only once the record is
  proven to be ours (boot id and leader start time; with the leader gone, the start's run id in
  each member's environment); TERM, then KILL after the grace; then waits until nvidia-smi no
  longer lists the stopped pids.
- ``probe`` ``{"units": [{"name", "host", "port", "health_path", "identity_paths", "headers"}],
  "http_timeout", "log_lines"}`` (``port`` or ``health_path`` null: no HTTP) -> ``{"units": {name: {alive, ours, pid, log, exit, stopped,
  health, identity, banner, log_tail}}}``; every unit in parallel, about ``http_timeout`` at most.
- ``tail`` ``{"unit", "lines", "offset", "log"}`` -> ``{log, size, text, offset, rotated,
  truncated}``: the last lines, or (with ``offset``) the bytes since the last call, for --follow.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    Json = dict[str, Any]

SCHEMA = 1
ACTIONS = ("start", "stop", "probe", "tail")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
LOG_RE = re.compile(r"^(\d{8}T\d{6}Z)(?:-(\d+))?\.log$")
SMALL_FILE_MAX = 1024 * 1024  # pid, exit, stopped: anything bigger is not ours to parse
BODY_MAX = 256 * 1024  # identity answers
TAIL_MAX = 1024 * 1024  # bytes of log per tail call
BANNER_PREFIX = "[dflashops] unit="
BANNER_LINES = 64
POLL_S = 0.1
RUN_ID_VAR = "DFLASHOPS_RUN_ID"
GPU_POLL_S = 0.25

# The unit's supervisor: the session leader that start spawns, running launch.sh as its child.
#
# Why it exists: a job's outcome is its exit code (`done` on 0, `failed` otherwise), and nobody
# else can learn it: start returns at once and the SSH session that ran it is gone by the time the
# process ends. So the supervisor waits for `bash launch.sh` (which execs the engine, so the
# engine's own pid is the supervisor's child) and writes the `exit` record. It is also what makes
# the process group provable: its pid is the recorded pid and pgid, its start time the recorded
# start time.
#
# Its handlers for TERM/INT/HUP do nothing, so the group-wide TERM of stop does not kill it before
# it has recorded how the engine ended. Handlers, unlike SIG_IGN, are reset to the default by
# exec, so the engine (and bash before it) still die on TERM. KILL takes everything down; stop
# then records the stop itself.
SUPERVISOR_SOURCE = r"""# dflashops unit supervisor: runs launch.sh, records its exit (dflashops/payloads/unitctl.py)
import json, os, signal, subprocess, sys, time
def _ignore(signum, frame):
    pass
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_sig, _ignore)
unit_dir = sys.argv[1]
record = {"code": None, "signal": None, "finished_at": None, "child_pid": None}
try:
    child = subprocess.Popen(["bash", "launch.sh"], cwd=unit_dir, stdin=subprocess.DEVNULL)
except OSError as exc:
    sys.stdout.write("[dflashops] supervisor: cannot run launch.sh: %s\n" % exc)
    record["code"] = 127
else:
    record["child_pid"] = child.pid
    rc = child.wait()
    if rc < 0:
        try:
            record["signal"] = signal.Signals(-rc).name
        except ValueError:
            record["signal"] = "SIG%d" % -rc
        record["code"] = 128 - rc
    else:
        record["code"] = rc
record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
how = ("killed by %s, " % record["signal"]) if record["signal"] else ""
sys.stdout.write("[dflashops] launch.sh ended (%sexit code %d) at %s\n" % (how, record["code"], record["finished_at"]))
sys.stdout.flush()
tmp = os.path.join(unit_dir, ".exit.tmp.%d" % os.getpid())
with open(tmp, "w") as f:
    json.dump(record, f)
os.replace(tmp, os.path.join(unit_dir, "exit"))
"""


class BadRequest(ValueError):
    """The request itself is malformed: exit 2, nothing done."""


# ----------------------------------------------------------------------------------------------
# small helpers (the facts payload has twins of some: each payload travels alone, as one file)


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_json_object(path: str) -> Json | None:
    """The JSON object in ``path``; None when it does not exist; ValueError when broken."""
    try:
        with open(path, "rb") as f:
            data = f.read(SMALL_FILE_MAX + 1)
    except FileNotFoundError:
        return None
    if len(data) > SMALL_FILE_MAX:
        raise ValueError(f"larger than {SMALL_FILE_MAX // 1024} KiB")
    try:
        value = json.loads(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (got {type(value).__name__})")
    return value


def write_json_atomic(path: str, obj: Json) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...].

    Index i here is field i + 3 of proc(5): state 0, pgrp 2, session 3, start time (22) 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return [x.decode("ascii", "replace") for x in fields]


def read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def which(name: str) -> str | None:
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def unit_dir_of(workdir: str, name: str) -> str:
    return os.path.join(workdir, "units", name)


# ----------------------------------------------------------------------------------------------
# ownership: which processes are provably the ones a start of this unit made


class Record:
    """A pid record checked for shape; ValueError (with the reason) when it cannot be used."""

    def __init__(self, raw: Json) -> None:
        pid = raw.get("pid")
        pgid = raw.get("pgid")
        start = raw.get("start_time")
        boot = raw.get("boot_id")
        if isinstance(start, str) and start.strip().isdigit():
            start = int(start)
        if not is_int(pid) or pid <= 0:
            raise ValueError("no valid pid")
        if not is_int(pgid) or pgid != pid:
            raise ValueError(f"pgid {pgid!r} is not the pid {pid}: not written by dflashops start")
        if not is_int(start):
            raise ValueError("no start_time: cannot tell whether the pid is ours")
        if not isinstance(boot, str) or not boot.strip():
            raise ValueError("no boot_id: cannot tell whether the pid is ours")
        self.pid: int = pid
        self.pgid: int = pgid
        self.start_time: int = start
        self.boot_id: str = boot.strip()
        run_id = raw.get("run_id")
        self.run_id: str | None = run_id if isinstance(run_id, str) and run_id else None


def load_record(unit_dir: str) -> tuple[Record | None, str | None]:
    """(record, None), (None, None) when there is no pid file, (None, reason) when unusable."""
    try:
        raw = read_json_object(os.path.join(unit_dir, "pid"))
    except (OSError, ValueError) as exc:
        return None, f"pid record unreadable: {exc}"
    if raw is None:
        return None, None
    try:
        return Record(raw), None
    except ValueError as exc:
        return None, f"pid record unusable: {exc}"


def leader_state(rec: Record, boot_id: str | None) -> str:
    """What is at the recorded pid now.

    ``other-boot``: recorded before a reboot (nothing of it can be alive); ``reused``: the pid
    belongs to another process (start time differs); ``gone``; ``zombie``; ``alive`` (ours)."""
    if boot_id is None or rec.boot_id != boot_id:
        return "other-boot"
    stat = proc_stat(rec.pid)
    if stat is None:
        return "gone"
    if int(stat[19]) != rec.start_time:
        return "reused"
    return "zombie" if stat[0] in ("Z", "X") else "alive"


def scan_groups(pgids: set[int]) -> dict[int, list[tuple[int, int, int]]]:
    """One pass over /proc: pgid -> [(pid, session, start_time)] of live (non-zombie) members."""
    out: dict[int, list[tuple[int, int, int]]] = {g: [] for g in pgids}
    if not pgids:
        return out
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        pgid = int(stat[2])
        if pgid in out:
            out[pgid].append((pid, int(stat[3]), int(stat[19])))
    return out


def has_run_id(pid: int, run_id: str) -> bool:
    """Whether the process was started with this unit start's DFLASHOPS_RUN_ID in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(4 * 1024 * 1024)
    except OSError:
        return False
    return f"\0{RUN_ID_VAR}={run_id}\0".encode() in b"\0" + env + b"\0"


def members(
    rec: Record, boot_id: str | None, groups: dict[int, list[tuple[int, int, int]]]
) -> tuple[list[int], list[int]]:
    """Live processes of the unit's recorded group: (provably ours, not provably ours).

    While the recorded leader (same boot, same start time) exists, even as a zombie, its pid is
    taken, so every process in its group is ours: the supervisor made that group in a session
    of its own (sid == pgid), and only processes of the session can join it. A reused pid means
    the group ended and the id is someone else's: nothing is ours.

    When the leader is gone, Linux still does not hand its pid out again while the group has
    members, so those are normally orphans of a killed supervisor. But if the whole group ended
    and the pid was then reused by a process that made its own session and left children behind
    (a daemon's double fork), those children look exactly the same. So with the leader gone, a
    member must also carry this start's DFLASHOPS_RUN_ID in its environment (inherited from the
    supervisor) to count as ours. Members must also have started no earlier than the leader."""
    state = leader_state(rec, boot_id)
    if state in ("other-boot", "reused"):
        return [], []
    found = sorted(
        pid
        for pid, sid, start in groups.get(rec.pgid, [])
        if sid == rec.pgid and start >= rec.start_time
    )
    if state != "gone":
        return found, []
    run_id = rec.run_id
    ours = [pid for pid in found if run_id is not None and has_run_id(pid, run_id)]
    return ours, [pid for pid in found if pid not in ours]


def signal_members(rec: Record, boot_id: str | None, pids: list[int], sig: int) -> str | None:
    """Signal the unit's processes: the whole group while its leader holds the pgid, else
    only the proven members one by one (a group call would reach unproven ones too)."""
    if leader_state(rec, boot_id) in ("alive", "zombie"):
        return killpg(rec.pgid, sig)
    problems = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except OSError as exc:
            problems.append(f"cannot send {signal.Signals(sig).name} to pid {pid}: {describe(exc)}")
    return "; ".join(problems) or None


def unproven_message(pids: list[int], rec: Record) -> str:
    return (
        f"process(es) {' '.join(map(str, pids))} are in the recorded process group {rec.pgid} "
        f"whose leader is gone, without this start's {RUN_ID_VAR}: not provably ours, so not "
        "signalled (a stranger after pid reuse, or an engine that cleared its environment); "
        "check them by hand, then remove the pid record"
    )


# ----------------------------------------------------------------------------------------------
# logs


def log_name_key(name: str) -> tuple[str, int] | None:
    m = LOG_RE.match(name)
    if m is None:
        return None
    return m.group(1), int(m.group(2) or 0)


def open_new_log(log_dir: str) -> tuple[str, int]:
    """Create ``logs/<UTC time>[-N].log`` (never an existing file); (name, fd)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    n = 0
    while True:
        name = f"{stamp}.log" if n == 0 else f"{stamp}-{n}.log"
        try:
            return name, os.open(os.path.join(log_dir, name), flags, 0o644)
        except FileExistsError:
            n += 1


def point_current(log_dir: str, name: str) -> None:
    """current.log -> name, atomically. A regular file in its place (not ours) is kept aside."""
    current = os.path.join(log_dir, "current.log")
    if os.path.lexists(current) and not os.path.islink(current):
        os.replace(current, os.path.join(log_dir, f"current.log.{int(time.time())}.kept"))
    tmp = os.path.join(log_dir, f".current.log.tmp.{os.getpid()}")
    remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, current)


def rotate_logs(log_dir: str, keep: int, current: str) -> list[str]:
    """Delete the oldest timestamped logs beyond ``keep`` (never ``current``); names deleted."""
    logs = []
    for name in os.listdir(log_dir):
        key = log_name_key(name)
        if key is not None and name != current and os.path.isfile(os.path.join(log_dir, name)):
            logs.append((key, name))
    logs.sort()
    excess = len(logs) + 1 - keep  # + the new current, which always stays
    deleted = []
    for _, name in logs[: max(0, excess)]:
        try:
            os.unlink(os.path.join(log_dir, name))
            deleted.append(name)
        except OSError:
            pass
    return deleted


def current_log(unit_dir: str) -> tuple[str | None, str | None]:
    """('logs/<name>', absolute path) of what current.log points at, or (None, None)."""
    log_dir = os.path.join(unit_dir, "logs")
    link = os.path.join(log_dir, "current.log")
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None, None
    except OSError:  # not a symlink: a plain file under that name
        if os.path.isfile(link):
            return "logs/current.log", link
        return None, None
    name = os.path.basename(target)
    return f"logs/{name}", os.path.join(log_dir, name)


def head_lines(path: str, count: int, limit: int = 64 * 1024) -> list[str]:
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", "replace").splitlines()[:count]


def tail_bytes(path: str, count: int, limit: int = TAIL_MAX) -> tuple[bytes, int]:
    """The bytes of the last ``count`` lines (at most ``limit``) and the file size read."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if count <= 0:
            return b"", size
        pos = size
        data = b""
        while pos > 0 and len(data) < limit:
            step = min(64 * 1024, pos, limit - len(data))
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
            # count + 1 newlines: the last line may or may not end with one
            if data.count(b"\n") > count:
                break
    # With more than ``count`` newlines read, a partial first line is left out by the slice.
    return b"".join(data.splitlines(keepends=True)[-count:]), size


def complete_utf8(data: bytes) -> bytes:
    """``data`` without a trailing, incomplete UTF-8 sequence (it comes whole next time)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


def parse_banner(line: str) -> Json:
    """``[dflashops] unit=NAME fingerprint=HEX engine=E tp=N dp=N port=P gpus=G started=ISO``."""
    out: Json = {"line": line}
    for token in line[len("[dflashops] ") :].split():
        key, eq, value = token.partition("=")
        if eq:
            out[key] = value
    for key in ("tp", "dp", "port"):
        if key in out:
            out[key] = int(out[key]) if out[key].isdigit() else None
    if "gpus" in out:
        parts = [p for p in out["gpus"].split(",") if p.strip()]
        out["gpus"] = [int(p) for p in parts if p.strip().isdigit()]
    return out


SERVER_ARGS_MARKER = "non-default args: "  # vLLM logs what it parsed: its own report of TP/DP


def read_server_args(path: str) -> str | None:
    """The text after vLLM's `non-default args: ` in the head of the log, if any."""
    for line in head_lines(path, 400, 256 * 1024):
        at = line.find(SERVER_ARGS_MARKER)
        if at >= 0:
            return line[at + len(SERVER_ARGS_MARKER) :].strip()[:16384]
    return None


def read_banner(path: str) -> Json | None:
    for line in head_lines(path, BANNER_LINES):
        if line.startswith(BANNER_PREFIX):
            return parse_banner(line.rstrip())
    return None


# ----------------------------------------------------------------------------------------------
# start


def start_one(workdir: str, spec: Json, boot_id: str | None) -> Json:
    name = spec["name"]
    out: Json = {
        "name": name,
        "ok": False,
        "pid": None,
        "pgid": None,
        "start_time": None,
        "log": None,
        "error": None,
    }
    unit_dir = unit_dir_of(workdir, name)
    if not os.path.isfile(os.path.join(unit_dir, "launch.sh")):
        out["error"] = f"launch.sh missing: {os.path.join(unit_dir, 'launch.sh')}"
        return out
    if boot_id is None:
        out["error"] = "cannot read /proc/sys/kernel/random/boot_id: cannot record a provable pid"
        return out
    with start_lock(unit_dir):
        return start_locked(unit_dir, spec, boot_id, out)


@contextlib.contextmanager
def start_lock(unit_dir: str) -> Iterator[None]:
    """One start of a unit at a time: two controllers starting it together make one copy."""
    import fcntl

    fd = os.open(os.path.join(unit_dir, ".start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def start_locked(unit_dir: str, spec: Json, boot_id: str, out: Json) -> Json:
    import subprocess

    # Never a second copy: refuse while anything of the previous start is alive.
    rec, problem = load_record(unit_dir)
    if problem is not None:
        out["error"] = f"{problem}; run stop for this unit first"
        return out
    if rec is not None:
        state = leader_state(rec, boot_id)
        alive, unproven = members(rec, boot_id, scan_groups({rec.pgid}))
        if alive or unproven:
            out["pid"] = rec.pid
        if state == "alive":
            out["error"] = f"already running (pid {rec.pid})"
            return out
        if alive:
            shown = " ".join(map(str, alive))
            out["error"] = (
                f"already running: processes of the previous start are alive (pids {shown}) "
                f"though its leader pid {rec.pid} is gone; stop the unit first"
            )
            return out
        if unproven:
            out["error"] = unproven_message(unproven, rec)
            return out

    # The previous run's outcome and progress must not be read as this run's.
    for stale in ("exit", "stopped", "progress.json"):
        remove(os.path.join(unit_dir, stale))
    log_dir = os.path.join(unit_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    log_name, fd = open_new_log(log_dir)
    try:
        point_current(log_dir, log_name)
        rotate_logs(log_dir, int(spec["keep_logs"]), log_name)
        # The supervisor leads a new session (and process group: pgid == pid), so it outlives
        # this call and the SSH session, and stop can signal exactly its group.
        # Every process of this start inherits the run id: proof of membership for stop when
        # the leader is gone (see members).
        run_id = os.urandom(8).hex()
        proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR_SOURCE, unit_dir],
            env=dict(os.environ, **{RUN_ID_VAR: run_id}),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            cwd=unit_dir,
            close_fds=True,
        )
    finally:
        os.close(fd)
    # Still our child until we exit, so its /proc entry is there even if it already ended.
    # Popen returns only after the exec, so setsid() has happened: pgid == pid.
    stat = proc_stat(proc.pid)
    if stat is None or int(stat[2]) != proc.pid:
        out["error"] = f"the supervisor (pid {proc.pid}) is not the leader of its own process group"
        return out
    record = {
        "pid": proc.pid,
        "pgid": int(stat[2]),
        "start_time": int(stat[19]),
        "boot_id": boot_id,
        "started_at": now_iso(),
        "log": f"logs/{log_name}",
        "run_id": run_id,
    }
    write_json_atomic(os.path.join(unit_dir, "pid"), record)
    out.update(
        ok=True,
        pid=record["pid"],
        pgid=record["pgid"],
        start_time=record["start_time"],
        log=record["log"],
    )
    return out


def do_start(request: Json) -> Json:
    workdir = request["workdir"]
    boot_id = read_boot_id()
    units: Json = {}
    for spec in request["units"]:
        try:
            units[spec["name"]] = start_one(workdir, spec, boot_id)
        except Exception as exc:  # one unit's trouble must not hide the others' results
            units[spec["name"]] = {
                "name": spec["name"],
                "ok": False,
                "pid": None,
                "pgid": None,
                "start_time": None,
                "log": None,
                "error": describe(exc),
            }
    return {"units": units}


# ----------------------------------------------------------------------------------------------
# stop


def nvidia_smi_rows(exe: str, query: str, timeout: float) -> list[list[str]]:
    import subprocess

    try:
        proc = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"nvidia-smi {query} timed out after {timeout:g}s") from None
    text = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        msg = proc.stderr.decode("utf-8", "replace").strip() or text.strip()
        raise RuntimeError(f"nvidia-smi exited with {proc.returncode}: {msg[-500:]}")
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def to_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        try:
            return int(float(text))
        except ValueError:
            return None


def gpu_apps(exe: str, timeout: float, uuids: dict[str, int]) -> list[Json]:
    """[{pid, gpu_index, used_mib}] of compute processes; fills ``uuids`` (uuid -> index) once."""
    if not uuids:
        for cells in nvidia_smi_rows(exe, "--query-gpu=index,uuid", timeout):
            if len(cells) >= 2 and to_int(cells[0]) is not None:
                uuids[cells[1]] = int(to_int(cells[0]) or 0)
    apps = []
    for cells in nvidia_smi_rows(exe, "--query-compute-apps=pid,gpu_uuid,used_memory", timeout):
        if len(cells) < 3 or to_int(cells[0]) is None:
            continue
        apps.append(
            {
                "pid": to_int(cells[0]),
                "gpu_index": uuids.get(cells[1]),
                "used_mib": to_int(cells[2]),
            }
        )
    return apps


def killpg(pgid: int, sig: int) -> str | None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return None  # the group ended meanwhile
    except OSError as exc:
        return f"cannot send {signal.Signals(sig).name} to process group {pgid}: {describe(exc)}"
    return None


class Stopping:
    """One unit on its way down."""

    def __init__(self, workdir: str, spec: Json) -> None:
        self.name: str = spec["name"]
        self.dir = unit_dir_of(workdir, self.name)
        self.grace = float(spec["grace"])
        self.rec: Record | None = None
        self.done = False
        self.write = True  # pid removed and `stopped` written at the end
        self.seen: set[int] = set()
        self.survivors: list[int] = []
        self.kill_deadline: float | None = None
        self.finished: float | None = None
        self.gpu_pending = False
        self.result: Json = {
            "name": self.name,
            "ok": True,
            "was_running": False,
            "pids": [],
            "killed": False,
            "stale_pid": None,
            "unproven_pids": [],
            "gpu_freed": None,
            "gpu_held": [],
            "gpu_error": None,
            "error": None,
            "seconds": 0.0,
        }

    def fail(self, message: str) -> None:
        self.result["ok"] = False
        self.result["error"] = (
            message if not self.result["error"] else f"{self.result['error']}; {message}"
        )


def do_stop(request: Json) -> Json:
    started = time.monotonic()
    workdir = request["workdir"]
    kill_wait = float(request.get("kill_wait", 10))
    gpu_timeout = float(request.get("gpu_timeout", 60))
    boot_id = read_boot_id()
    units = [Stopping(workdir, spec) for spec in request["units"]]

    # 1. Prove what is ours; TERM every unit's group before waiting for any of them.
    for u in units:
        if not os.path.isdir(u.dir):
            u.done, u.write = True, False  # no such unit here: nothing to stop, nothing to write
            continue
        rec, problem = load_record(u.dir)
        if problem is not None:
            # Nothing can be proven about an unusable record: signal nothing, keep it as evidence
            # under another name (so a following start is not blocked forever), fail loudly.
            try:
                os.replace(os.path.join(u.dir, "pid"), os.path.join(u.dir, "pid.unusable"))
                where = "moved aside to pid.unusable"
            except OSError as exc:
                where = f"could not move it aside: {describe(exc)}"
            u.fail(f"{problem}; nothing signalled; {where}")
            u.done, u.write = True, False
            continue
        u.rec = rec
        if rec is None:
            u.done, u.finished = True, time.monotonic()
            # Already stopped: keep the first record of it rather than restamp it.
            u.write = not os.path.exists(os.path.join(u.dir, "stopped"))
            continue
        if leader_state(rec, boot_id) in ("reused", "other-boot"):
            # A stale record: the pid (if it exists) is someone else's. Signal nothing.
            if proc_stat(rec.pid) is not None:
                u.result["stale_pid"] = rec.pid
            u.done, u.finished = True, time.monotonic()
    first = scan_groups({u.rec.pgid for u in units if u.rec is not None and not u.done})
    for u in units:
        if u.done or u.rec is None:
            continue
        alive, unproven = members(u.rec, boot_id, first)
        if unproven:
            u.result["unproven_pids"] = unproven
            u.fail(unproven_message(unproven, u.rec))
            u.write = False  # keep the record: a start must not run beside them
        if not alive:
            u.done, u.finished = True, time.monotonic()
            continue
        u.result["was_running"] = True
        u.seen.update(alive)
        problem = signal_members(u.rec, boot_id, alive, signal.SIGTERM)
        if problem:
            u.fail(problem)

    # 2. Wait for all together; KILL each unit's leftovers when its own grace runs out.
    while any(not u.done for u in units):
        time.sleep(POLL_S)
        now = time.monotonic()
        pending = [u for u in units if not u.done and u.rec is not None]
        groups = scan_groups({u.rec.pgid for u in pending if u.rec is not None})
        for u in pending:
            assert u.rec is not None
            alive, _ = members(u.rec, boot_id, groups)
            u.seen.update(alive)
            if not alive:
                u.done, u.finished = True, now
            elif u.kill_deadline is None and now - started >= u.grace:
                u.result["killed"] = True
                u.kill_deadline = now + kill_wait
                problem = signal_members(u.rec, boot_id, alive, signal.SIGKILL)
                if problem:
                    u.fail(problem)
            elif u.kill_deadline is not None and now >= u.kill_deadline:
                u.done, u.finished = True, now
                u.survivors = alive
                u.write = False  # keep the pid record: these are still ours to find and stop
                u.fail(
                    f"{len(alive)} process(es) survived SIGKILL for {kill_wait:g}s "
                    f"(pids {' '.join(map(str, alive))}; uninterruptible I/O or a stuck driver?)"
                )

    # 3. GPU memory: wait until nvidia-smi no longer lists any stopped process.
    exe = which("nvidia-smi")
    if exe is not None:
        for u in units:
            if u.seen:
                u.gpu_pending = True
            elif u.result["error"] is None:
                u.result["gpu_freed"] = True  # nothing of ours ran, so nothing of ours holds memory
        uuids: dict[str, int] = {}
        deadline = time.monotonic() + gpu_timeout
        while any(u.gpu_pending for u in units):
            remaining = deadline - time.monotonic()
            try:
                apps = gpu_apps(exe, max(1.0, min(30.0, remaining + 1.0)), uuids)
            except Exception as exc:
                message = str(exc) if isinstance(exc, RuntimeError) else describe(exc)
                for u in units:
                    if u.gpu_pending:
                        u.gpu_pending = False
                        u.result["gpu_error"] = message
                break
            now = time.monotonic()
            for u in units:
                if not u.gpu_pending:
                    continue
                held = [dict(a) for a in apps if a["pid"] in u.seen]
                held.sort(
                    key=lambda a: (a["pid"], a["gpu_index"] if a["gpu_index"] is not None else -1)
                )
                u.result["gpu_held"] = held
                if not held:
                    u.gpu_pending = False
                    u.result["gpu_freed"] = True
                    u.finished = now
                elif u.survivors or now >= deadline:
                    u.gpu_pending = False
                    u.result["gpu_freed"] = False
                    u.finished = now
                    shown = ", ".join(
                        f"pid {a['pid']} on GPU {a['gpu_index']} ({a['used_mib']} MiB)"
                        for a in held
                    )
                    when = "" if u.survivors else f" after {gpu_timeout:g}s"
                    u.fail(f"GPU memory still held{when}: {shown}")
            if any(u.gpu_pending for u in units):
                time.sleep(GPU_POLL_S)

    # 4. Record the stop; the pid record goes (unless processes survived).
    for u in units:
        u.result["pids"] = sorted(u.seen)
        if u.write:
            try:
                if u.rec is not None:
                    # Remove the record only if it is still the one we acted on.
                    latest, _ = load_record(u.dir)
                    if latest is not None and (latest.pid, latest.start_time) == (
                        u.rec.pid,
                        u.rec.start_time,
                    ):
                        remove(os.path.join(u.dir, "pid"))
                write_json_atomic(
                    os.path.join(u.dir, "stopped"),
                    {
                        "stopped_at": now_iso(),
                        "pids": u.result["pids"],
                        "killed": u.result["killed"],
                    },
                )
            except OSError as exc:
                u.fail(f"recording the stop failed: {describe(exc)}")
        end = u.finished if u.finished is not None else time.monotonic()
        u.result["seconds"] = round(end - started, 3)
    return {"units": {u.name: u.result for u in units}}


# ----------------------------------------------------------------------------------------------
# probe


def http_get(host: str, port: int, path: str, headers: Json, timeout: float, limit: int) -> Json:
    """{status, error, body (bytes, up to ``limit`` + 1)}: one GET, never raises."""
    import http.client
    import socket

    out: Json = {"status": None, "error": None, "body": None}
    conn = http.client.HTTPConnection(host, port, timeout=max(0.05, timeout))
    try:
        hdrs = {"Connection": "close", "Accept": "application/json"}
        hdrs.update(headers)
        conn.request("GET", path, headers=hdrs)
        resp = conn.getresponse()
        out["status"] = resp.status
        out["body"] = resp.read(limit + 1)
    except ConnectionRefusedError:
        out["error"] = "connection refused"
    except (socket.timeout, TimeoutError):
        out["error"] = "timed out"
    except http.client.RemoteDisconnected:
        out["error"] = "connection closed without a response"
    except socket.gaierror as exc:
        out["error"] = f"cannot resolve {host}: {exc}"
    except ConnectionResetError:
        out["error"] = "connection reset"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = describe(exc)
    finally:
        conn.close()
    return out


def probe_http(spec: Json, timeout: float, slot: Json) -> None:
    """Health, then identity; results land in ``slot`` as they come (the caller may give up)."""
    deadline = time.monotonic() + timeout
    host, port, headers = spec["host"], spec["port"], spec["headers"]
    got = http_get(host, port, spec["health_path"], headers, timeout, 0)
    slot["health"] = {"status": got["status"], "error": got["error"]}
    if got["status"] != 200 or not spec["identity_paths"]:
        return
    identity: Json = {"path": None, "status": None, "body": None, "error": None}
    failures = []
    for path in spec["identity_paths"]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            failures.append(f"{path}: timed out")
            break
        got = http_get(host, port, path, headers, remaining, BODY_MAX)
        identity.update(path=path, status=got["status"])
        if got["status"] != 200:
            failures.append(f"{path}: {got['error'] or got['status']}")
            continue
        body = got["body"] or b""
        if len(body) > BODY_MAX:
            identity["error"] = f"{path}: body larger than {BODY_MAX // 1024} KiB"
        else:
            try:
                identity["body"] = json.loads(body.decode("utf-8", "replace"))
            except ValueError as exc:
                identity["error"] = f"{path}: not JSON ({exc})"
        slot["identity"] = identity
        return
    identity["error"] = "; ".join(failures) or "no identity path answered"
    slot["identity"] = identity


def unit_files_empty() -> Json:
    return {
        "alive": False,
        "ours": False,
        "pid": None,
        "reason": None,
        "log": None,
        "exit": None,
        "stopped": None,
        "banner": None,
        "log_tail": None,
        "errors": [],
    }


def unit_files(unit_dir: str, boot_id: str | None, log_lines: int) -> Json:
    """The process state, exit/stopped records, banner and (unless it runs) the log's tail.

    ``alive`` and ``ours`` mean what they mean in facts: the recorded pid exists and is not a
    zombie; and it is provably the process dflashops started (same boot, same start time)."""
    out = unit_files_empty()
    rec, problem = load_record(unit_dir)
    if problem is not None:
        out["reason"] = problem
    elif rec is None:
        out["reason"] = "no pid record"
    else:
        out["pid"] = rec.pid
        stat = proc_stat(rec.pid)
        out["alive"] = stat is not None and stat[0] not in ("Z", "X")
        state = leader_state(rec, boot_id)
        out["ours"] = state == "alive"
        if state == "reused":
            out["reason"] = f"pid {rec.pid} was reused by another process"
        elif state == "other-boot":
            out["reason"] = "recorded on another boot: the pid is not ours"
        elif state != "alive":
            out["reason"] = f"pid {rec.pid} is {state}"
    for key in ("exit", "stopped"):
        try:
            out[key] = read_json_object(os.path.join(unit_dir, key))
        except (OSError, ValueError) as exc:
            out["errors"].append(f"{key}: {exc}")
    log, path = current_log(unit_dir)
    out["log"] = log
    if path is not None:
        try:
            out["banner"] = read_banner(path)
            out["server_args"] = read_server_args(path)
            if not out["ours"]:
                data, _ = tail_bytes(path, log_lines)
                out["log_tail"] = data.decode("utf-8", "replace").splitlines()
        except OSError as exc:
            out["errors"].append(f"{log}: {describe(exc)}")
    return out


def http_wanted(spec: Json) -> bool:
    """A unit without a port or a health path is probed for its process and log only."""
    return spec["port"] is not None and spec["health_path"] is not None


def do_probe(request: Json) -> Json:
    import threading

    started = time.monotonic()
    workdir = request["workdir"]
    timeout = float(request.get("http_timeout", 5))
    log_lines = int(request.get("log_lines", 30))
    boot_id = read_boot_id()
    specs = request["units"]
    slots: dict[str, Json] = {s["name"]: {} for s in specs}

    def run(spec: Json) -> None:
        slot = slots[spec["name"]]
        try:
            probe_http(spec, timeout, slot)
        except Exception as exc:
            slot.setdefault("health", {"status": None, "error": describe(exc)})

    threads = [
        threading.Thread(target=run, args=(s,), daemon=True) for s in specs if http_wanted(s)
    ]
    for t in threads:
        t.start()
    units: Json = {}
    for spec in specs:
        try:
            units[spec["name"]] = unit_files(unit_dir_of(workdir, spec["name"]), boot_id, log_lines)
        except Exception as exc:
            units[spec["name"]] = dict(unit_files_empty(), errors=[describe(exc)])
    give_up = started + timeout + 0.5
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    for spec in specs:
        unit = units[spec["name"]]
        slot = dict(slots[spec["name"]])  # a snapshot: a late thread may still write
        unit["health"] = None
        unit["identity"] = None
        if not http_wanted(spec):
            continue
        unit["health"] = slot.get("health") or {"status": None, "error": "timed out"}
        if unit["health"]["status"] == 200 and spec["identity_paths"]:
            unit["identity"] = slot.get("identity") or {
                "path": None,
                "status": None,
                "body": None,
                "error": "timed out",
            }
    return {"units": units, "elapsed_s": round(time.monotonic() - started, 3)}


# ----------------------------------------------------------------------------------------------
# tail


def do_tail(request: Json) -> Json:
    """The last ``lines`` of the current log, or (``offset`` given) what was added since.

    ``offset`` belongs to the log named ``log`` (as this call returned it last time): when
    current.log now points elsewhere, the new log is read from its start (``rotated``)."""
    unit_dir = unit_dir_of(request["workdir"], request["unit"])
    offset = request.get("offset")
    seen = request.get("log")
    out: Json = {
        "log": None,
        "size": 0,
        "text": "",
        "offset": 0,
        "rotated": False,
        "truncated": False,
    }
    log, path = current_log(unit_dir)
    if log is None or path is None:
        return out
    out["log"] = log
    if offset is None:
        try:
            data, size = tail_bytes(path, int(request.get("lines", 100)))
        except FileNotFoundError:
            return out
        kept = complete_utf8(data)
        out.update(size=size, offset=size - (len(data) - len(kept)))
        out["text"] = kept.decode("utf-8", "replace")
        return out
    if seen is not None and os.path.basename(seen) != os.path.basename(log):
        out["rotated"] = True
        offset = 0
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if offset > size:
                out["truncated"] = True
                offset = 0
            f.seek(offset)
            data = complete_utf8(f.read(TAIL_MAX))
    except FileNotFoundError:
        return out
    out.update(size=size, offset=offset + len(data))
    out["text"] = data.decode("utf-8", "replace")
    return out


# ----------------------------------------------------------------------------------------------
# request


def _number(value: Any, what: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise BadRequest(f"{what} must be a number >= {minimum:g}")
    return float(value)


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        raise BadRequest(f"{what} must be an integer >= {minimum}")
    return int(value)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise BadRequest(f"{what} must be a unit name ([a-z0-9][a-z0-9-]*), got {value!r}")
    return value


def parse_request(argv: list[str]) -> Json:
    if len(argv) < 2:
        raise BadRequest("no request given")
    try:
        request = json.loads(argv[1])
    except ValueError as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest("the request must be a JSON object")
    action = request.get("action")
    if action not in ACTIONS:
        raise BadRequest(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    workdir = request.get("workdir")
    if not isinstance(workdir, str) or not workdir.strip():
        raise BadRequest("workdir must be a non-empty string")
    request["workdir"] = os.path.abspath(os.path.expanduser(workdir))
    if action == "tail":
        request["unit"] = _name(request.get("unit"), "unit")
        request["lines"] = _int(request.get("lines", 100), "lines")
        if request.get("offset") is not None:
            request["offset"] = _int(request["offset"], "offset")
        if request.get("log") is not None and not isinstance(request["log"], str):
            raise BadRequest("log must be a string or null")
        return request
    units = request.get("units")
    if not isinstance(units, list) or not all(isinstance(u, dict) for u in units):
        raise BadRequest("units must be a list of objects")
    names = set()
    for i, u in enumerate(units):
        name = _name(u.get("name"), f"units[{i}].name")
        if name in names:
            raise BadRequest(f"unit {name} is listed twice")
        names.add(name)
        if action == "start":
            u["keep_logs"] = _int(u.get("keep_logs", 20), f"units[{i}].keep_logs", 1)
        elif action == "stop":
            u["grace"] = _number(u.get("grace", 30), f"units[{i}].grace")
        else:
            u.setdefault("host", "127.0.0.1")
            if not isinstance(u["host"], str) or not u["host"]:
                raise BadRequest(f"units[{i}].host must be a non-empty string")
            port = u.get("port")
            if port is not None:
                u["port"] = _int(port, f"units[{i}].port", 1)
            else:
                u["port"] = None
            u.setdefault("health_path", "/health")
            paths = u.setdefault("identity_paths", [])
            health = u["health_path"]
            if health is not None and (not isinstance(health, str) or not health.startswith("/")):
                raise BadRequest(f"units[{i}].health_path must start with / (or be null)")
            if not isinstance(paths, list) or not all(
                isinstance(p, str) and p.startswith("/") for p in paths
            ):
                raise BadRequest(f"units[{i}].identity_paths must be a list of paths")
            headers = u.setdefault("headers", {})
            if not isinstance(headers, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
            ):
                raise BadRequest(f"units[{i}].headers must map strings to strings")
    if action == "stop":
        request["kill_wait"] = _number(request.get("kill_wait", 10), "kill_wait")
        request["gpu_timeout"] = _number(request.get("gpu_timeout", 60), "gpu_timeout")
    if action == "probe":
        request["http_timeout"] = _number(request.get("http_timeout", 5), "http_timeout", 0.05)
        request["log_lines"] = _int(request.get("log_lines", 30), "log_lines")
    return request


def main(argv: list[str]) -> int:
    try:
        request = parse_request(argv)
    except BadRequest as exc:
        sys.stderr.write(f"dflashops unitctl: bad request: {exc}\n")
        return 2
    action = request["action"]
    handler = {"start": do_start, "stop": do_stop, "probe": do_probe, "tail": do_tail}[action]
    answer: Json = {"schema": SCHEMA, "action": action}
    answer.update(handler(request))
    sys.stdout.write(json.dumps(answer, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
