"""``stop``: end units by their proven process group only: TERM, grace, KILL, GPU release.

Request: ``units: [{name, grace, prune}]`` (``grace`` null: the ``stop_grace`` recorded in the
unit's unit.json at deploy, so an orphan the playbooks forgot stops as it was meant to),
``kill_wait`` (s after KILL, 10), ``gpu_timeout`` (s, 60).
Answer: ``units: {name: {name, ok, was_running, pids, killed, stale_pid, unproven_pids,
gpu_freed, gpu_held, gpu_error, pruned_to, error, seconds}}``.

Every unit gets TERM before any is waited for; each gets KILL when its own grace runs out; then
one wait until nvidia-smi lists none of the stopped pids. A stale record (another boot, a reused
pid) is never signalled. With ``prune``, a cleanly stopped unit's folder (logs included) moves to
``units/.pruned/<unit>-<UTC time>/``, of which the newest ``bounded.PRUNED_KEEP`` are kept.
"""

from __future__ import annotations

import os
import signal
import time

from . import bounded, gpu, layout, ownership, procfs
from .common import (
    Json,
    describe,
    now_iso,
    number,
    read_json_object,
    remove,
    unit_list,
    which,
    write_json_atomic,
)
from .supervisor import STOP_MARK

POLL_S = 0.1
DEFAULT_GRACE = 30.0


def check(request: Json) -> None:
    for i, u in enumerate(unit_list(request)):
        if u.get("grace") is not None:
            u["grace"] = number(u["grace"], f"units[{i}].grace")
        u["prune"] = bool(u.get("prune", False))
    request["kill_wait"] = number(request.get("kill_wait", 10), "kill_wait")
    request["gpu_timeout"] = number(request.get("gpu_timeout", 60), "gpu_timeout")


def recorded_grace(folder: str) -> float:
    try:
        record = read_json_object(os.path.join(folder, layout.UNIT_RECORD)) or {}
    except (OSError, ValueError):
        record = {}
    grace = record.get("stop_grace")
    if isinstance(grace, (int, float)) and not isinstance(grace, bool) and grace >= 0:
        return float(grace)
    return DEFAULT_GRACE


class Stopping:
    """One unit on its way down."""

    def __init__(self, workdir: str, spec: Json) -> None:
        self.name: str = spec["name"]
        self.dir = layout.unit_dir(workdir, self.name)
        self.workdir = workdir
        self.prune: bool = spec["prune"]
        grace = spec.get("grace")
        self.grace = float(grace) if grace is not None else recorded_grace(self.dir)
        self.rec: ownership.Record | None = None
        self.done = False
        self.write = True  # pid removed and `stopped` written at the end
        self.seen: set[int] = set()
        self.survivors: list[int] = []
        self.kill_deadline: float | None = None
        self.finished: float | None = None
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
            "pruned_to": None,
            "error": None,
            "seconds": 0.0,
        }

    def fail(self, message: str) -> None:
        self.result["ok"] = False
        err = self.result["error"]
        self.result["error"] = message if not err else f"{err}; {message}"

    def end(self, now: float | None = None) -> None:
        self.done, self.finished = True, now if now is not None else time.monotonic()


def prove(u: Stopping, boot: str | None) -> None:
    """Load the record; settle the units that have nothing of ours to signal."""
    if not os.path.isdir(u.dir):
        u.done, u.write = True, False  # no such unit here: nothing to stop, nothing to write
        return
    rec, problem = ownership.load_record(u.dir)
    if problem is not None:
        # Nothing can be proven about an unusable record: signal nothing, keep it as evidence
        # under another name (so a following start is not blocked forever), fail loudly.
        try:
            os.replace(os.path.join(u.dir, layout.PID), os.path.join(u.dir, "pid.unusable"))
            where = "moved aside to pid.unusable"
        except OSError as exc:
            where = f"could not move it aside: {describe(exc)}"
        u.fail(f"{problem}; nothing signalled; {where}")
        u.done, u.write = True, False
        return
    u.rec = rec
    if rec is None:
        u.end()
        u.write = not os.path.exists(os.path.join(u.dir, layout.STOPPED))  # keep the first record
        return
    if ownership.leader_state(rec, boot) in ("reused", "other-boot"):
        if procfs.proc_stat(rec.pid) is not None:
            u.result["stale_pid"] = rec.pid  # someone else's now: never signalled
        u.end()


def terminate(units: list[Stopping], boot: str | None) -> None:
    groups = ownership.group_scan([u.rec for u in units if u.rec is not None and not u.done])
    for u in units:
        if u.done or u.rec is None:
            continue
        alive, unproven = ownership.members(u.rec, boot, groups)
        if unproven:
            u.result["unproven_pids"] = unproven
            u.fail(ownership.unproven_message(unproven, u.rec))
            u.write = False  # keep the record: a start must not run beside them
        if not alive:
            u.end()
            continue
        u.result["was_running"] = True
        u.seen.update(alive)
        # First: the supervisor must never start it again (even if it is crashing right now).
        write_json_atomic(os.path.join(u.dir, STOP_MARK), {"at": now_iso()})
        leader = leader_to_term(u.dir, alive)
        if leader is not None:
            try:
                os.kill(leader, signal.SIGTERM)
            except ProcessLookupError:
                pass  # it ended meanwhile: the rest goes at the grace
            except OSError as exc:
                u.fail(f"cannot send SIGTERM to pid {leader}: {describe(exc)}")
            continue
        problem = ownership.signal_members(u.rec, boot, alive, signal.SIGTERM)
        if problem:
            u.fail(problem)


def leader_to_term(folder: str, alive: list[int]) -> int | None:
    """The one process a unit recorded as ``stop_signal_to: leader`` wants TERMed (what its
    launch script exec'd, e.g. ``ray start --block``, which ends its own children in order),
    when it is a proven member still running; else None: the whole group gets it."""
    try:
        record = read_json_object(os.path.join(folder, layout.UNIT_RECORD)) or {}
        if record.get("stop_signal_to") != "leader":
            return None
        child = (read_json_object(os.path.join(folder, layout.SUPERVISOR)) or {}).get("child_pid")
    except (OSError, ValueError):
        return None
    return child if isinstance(child, int) and child in alive else None


def wait_gone(units: list[Stopping], boot: str | None, started: float, kill_wait: float) -> None:
    """Wait for all together; KILL each unit's leftovers when its own grace runs out."""
    while any(not u.done for u in units):
        time.sleep(POLL_S)
        now = time.monotonic()
        pending = [u for u in units if not u.done and u.rec is not None]
        groups = ownership.group_scan([u.rec for u in pending if u.rec is not None])
        for u in pending:
            assert u.rec is not None
            alive, _ = ownership.members(u.rec, boot, groups)
            u.seen.update(alive)
            if not alive:
                u.end(now)
            elif u.kill_deadline is None and now - started >= u.grace:
                u.result["killed"] = True
                u.kill_deadline = now + kill_wait
                problem = ownership.signal_members(u.rec, boot, alive, signal.SIGKILL)
                if problem:
                    u.fail(problem)
            elif u.kill_deadline is not None and now >= u.kill_deadline:
                u.end(now)
                u.survivors = alive
                u.write = False  # keep the pid record: these are still ours to find and stop
                u.fail(
                    f"{len(alive)} process(es) survived SIGKILL for {kill_wait:g}s "
                    f"(pids {' '.join(map(str, alive))}; uninterruptible I/O or a stuck driver?)"
                )


def release_gpus(units: list[Stopping], gpu_timeout: float) -> None:
    """Wait until nvidia-smi lists no stopped process (units with KILL survivors: look once)."""
    for group, timeout in (
        ([u for u in units if u.seen and not u.survivors], gpu_timeout),
        ([u for u in units if u.survivors], 0.0),
    ):
        if not group:
            continue
        pids = {p for u in group for p in u.seen}
        found = gpu.wait_released(pids, timeout)
        now = time.monotonic()
        for u in group:
            held = [h for h in found["held"] if h["pid"] in u.seen]
            freed = None if found["freed"] is None else not held
            u.result.update(gpu_freed=freed, gpu_held=held)
            u.result["gpu_error"] = found["error"]
            if found["freed"] is False and held:
                when = "" if u.survivors else f" after {gpu_timeout:g}s"
                u.fail(f"GPU memory still held{when}: {gpu.held_text(held)}")
            u.finished = now
    for u in units:
        if not u.seen and u.result["error"] is None and which("nvidia-smi"):
            u.result["gpu_freed"] = True  # nothing of ours ran, so nothing of ours holds memory


def record(u: Stopping) -> None:
    """The pid record goes (unless processes survived), `stopped` is written, maybe pruned."""
    u.result["pids"] = sorted(u.seen)
    if u.write:
        try:
            if u.rec is not None:
                latest, _ = ownership.load_record(u.dir)  # still the record we acted on?
                if latest is not None and (latest.pid, latest.start_time) == (
                    u.rec.pid,
                    u.rec.start_time,
                ):
                    remove(os.path.join(u.dir, layout.PID))
            write_json_atomic(
                os.path.join(u.dir, layout.STOPPED),
                {"stopped_at": now_iso(), "pids": u.result["pids"], "killed": u.result["killed"]},
            )
        except OSError as exc:
            u.fail(f"recording the stop failed: {describe(exc)}")
    if u.prune and u.result["ok"] and os.path.isdir(u.dir):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = os.path.join(u.workdir, layout.UNITS, layout.PRUNED, f"{u.name}-{stamp}")
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            n = 0
            while os.path.exists(dest + (f"-{n}" if n else "")):
                n += 1
            dest += f"-{n}" if n else ""
            os.rename(u.dir, dest)
            u.result["pruned_to"] = os.path.relpath(dest, u.workdir)
            bounded.prune_pruned(u.workdir)  # days of deploys: the newest few are kept
        except OSError as exc:
            u.fail(f"stopped, but moving its folder to units/.pruned failed: {describe(exc)}")


def run(request: Json) -> Json:
    started = time.monotonic()
    boot = procfs.boot_id()
    units = [Stopping(request["workdir"], spec) for spec in request["units"]]
    for u in units:
        prove(u, boot)
    terminate(units, boot)
    wait_gone(units, boot, started, float(request["kill_wait"]))
    release_gpus(units, float(request["gpu_timeout"]))
    for u in units:
        record(u)
        end = u.finished if u.finished is not None else time.monotonic()
        u.result["seconds"] = round(end - started, 3)
    return {"units": {u.name: u.result for u in units}}
