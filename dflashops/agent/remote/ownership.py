"""The one rule for "is this process the unit we started", used by every action.

``start`` spawns the unit's supervisor as the leader of a new session, so its pid is also its
process group and session id, and records {pid, pgid, start_time, boot_id, run_id} in
``units/<unit>/pid``. A record is usable only with exactly that shape (pgid == pid: anything else
was not written by start). What the record names is ours when:

- the leader is alive: same boot, same start time at that pid (a reused pid is never ours);
  every live process of its group in its session, started no earlier, is then ours too;
- the leader is gone: Linux does not hand out a pgid again while the group has members, so
  those are normally what a killed supervisor left behind; but after the whole group ended the
  id may be a stranger's, so a member also needs this start's DFLASHOPS_RUN_ID (inherited from
  the supervisor) in its environment. Members without it are reported as unproven, never
  signalled.
"""

from __future__ import annotations

import os
import signal

from . import layout
from .common import Json, describe, is_int, read_json_object
from .procfs import DEAD, PGRP, START_TIME, STATE, cmdline, has_env, proc_stat, scan

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

Groups = dict[int, list[tuple[int, int, int]]]

RUN_ID_VAR = "DFLASHOPS_RUN_ID"


class Record:
    """A pid record checked for shape; ValueError (with the reason) when it cannot be used."""

    def __init__(self, raw: Json) -> None:
        pid: Any = raw.get("pid")
        pgid: Any = raw.get("pgid")
        start: Any = raw.get("start_time")
        boot: Any = raw.get("boot_id")
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
    """(record, None); (None, None) when there is no pid file; (None, reason) when unusable."""
    try:
        raw = read_json_object(os.path.join(unit_dir, layout.PID))
    except (OSError, ValueError) as exc:
        return None, f"pid record unreadable: {exc}"
    if raw is None:
        return None, None
    try:
        return Record(raw), None
    except ValueError as exc:
        return None, f"pid record unusable: {exc}"


def leader_state(rec: Record, boot: str | None) -> str:
    """``other-boot`` (nothing of it can be alive), ``reused`` (the pid is another process's),
    ``gone``, ``zombie`` or ``alive`` (ours)."""
    if boot is None or rec.boot_id != boot:
        return "other-boot"
    stat = proc_stat(rec.pid)
    if stat is None:
        return "gone"
    if int(stat[START_TIME]) != rec.start_time:
        return "reused"
    return "zombie" if stat[STATE] in DEAD else "alive"


def members(rec: Record, boot: str | None, groups: Groups) -> tuple[list[int], list[int]]:
    """Live processes of the record's group: (provably ours, not provably ours)."""
    state = leader_state(rec, boot)
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
    ours = [pid for pid in found if run_id is not None and has_env(pid, RUN_ID_VAR, run_id)]
    return ours, [pid for pid in found if pid not in ours]


def group_scan(records: list[Record]) -> Groups:
    return scan({r.pgid for r in records}, set())[0]


def signal_members(rec: Record, boot: str | None, pids: list[int], sig: int) -> str | None:
    """Signal the unit's processes: the whole group while its leader holds the pgid, else only
    the proven members one by one (a group call would reach unproven ones too)."""
    if leader_state(rec, boot) in ("alive", "zombie"):
        try:
            os.killpg(rec.pgid, sig)
        except ProcessLookupError:
            return None  # the group ended meanwhile
        except OSError as exc:
            return f"cannot send {signal.Signals(sig).name} to process group {rec.pgid}: {describe(exc)}"
        return None
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


def view(rec: Record | None, problem: str | None, boot: str | None, groups: Groups) -> Json:
    """What facts and probe say about a unit's process, from the rule above:
    {alive, ours, pid, pgid, state, start_time, cmdline, reason, members, unproven}.
    ``alive``: something lives at the recorded pid; ``ours``: it is the leader we started."""
    out: Json = {
        "alive": False,
        "ours": False,
        "pid": None,
        "pgid": None,
        "state": None,
        "start_time": None,
        "cmdline": [],
        "reason": problem or ("no pid record" if rec is None else None),
        "members": [],
        "unproven": [],
    }
    if rec is None:
        return out
    out["pid"] = rec.pid
    stat = proc_stat(rec.pid)
    if stat is not None:
        out.update(state=stat[STATE], pgid=int(stat[PGRP]), start_time=int(stat[START_TIME]))
        out["alive"] = stat[STATE] not in DEAD
        out["cmdline"] = cmdline(rec.pid)
    state = leader_state(rec, boot)
    out["ours"] = state == "alive"
    out["reason"] = {
        "alive": None,
        "gone": f"pid {rec.pid} is gone",
        "zombie": f"pid {rec.pid} is a zombie (exited, not yet reaped)",
        "reused": f"pid {rec.pid} was reused: start time {out['start_time']} != recorded "
        f"{rec.start_time}",
        "other-boot": "recorded on another boot: the pid now belongs to another process",
    }[state]
    out["members"], out["unproven"] = members(rec, boot, groups)
    return out
