"""The parts of a `status` row that come from one unit's records alone: how its process last
ended, its restarts, when its current run began (status.py builds the rows from them)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dflashops.agent.answers import ExitRecord, StoppedRecord, SupervisorState, UnitFacts
from dflashops.changes.identity import ISO
from dflashops.output import duration

REASONS = {"liveness": "liveness failed", "stop": "stopped"}  # why an exit happened, as shown


@dataclass(frozen=True)
class LastExit:
    """How a unit's process last ended: its exit record, else its supervisor's last crash."""

    code: int | None
    signal: str | None
    time: str | None  # ISO-8601 UTC, the host's clock
    reason: str | None  # liveness | stop | None

    def text(self, now: float) -> str:
        """`code 137 (SIGKILL) 3m05s ago`, `code 1 4s ago`."""
        why = ", ".join(w for w in (self.signal, REASONS.get(self.reason or "")) if w)
        ago = seconds_since(self.time, now)
        return (
            (f"code {self.code}" if self.code is not None else "no exit code")
            + (f" ({why})" if why else "")
            + (f" {duration(ago)} ago" if ago is not None else "")
        )

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "time": self.time, "reason": self.reason}


def last_exit(uf: UnitFacts | None) -> LastExit | None:
    """Kept from a crash through the restart that follows (exit is rewritten only by the next
    exit, and removed only by a new start from a deploy)."""
    return None if uf is None else ended(uf.exit, uf.stopped, uf.supervisor)


def ended(
    rec: ExitRecord | None, stopped: StoppedRecord | None, supervisor: SupervisorState | None
) -> LastExit | None:
    """The last exit from a unit's exit, stopped and supervisor records, as facts and probes
    both carry them: one rule for the status row and the dashboard."""
    if rec is not None and (rec.code is not None or rec.signal is not None):
        reason = "stop" if stopped is not None else rec.reason
        return LastExit(rec.code, rec.signal, rec.finished_at, reason)
    # An exit record that is unreadable: the supervisor's history says the same (host data).
    crashes = [h for h in (supervisor.history if supervisor else []) if "code" in h]
    if not crashes:
        return None
    h = crashes[-1]
    code = h.get("code")
    return LastExit(
        code if isinstance(code, int) and not isinstance(code, bool) else None,
        text_or_none(h.get("signal")),
        text_or_none(h.get("at")),
        text_or_none(h.get("reason")),
    )


def text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def restarts_of(supervisor: SupervisorState | None, running: bool) -> int:
    """Restarts its supervisor began: one under way (a backoff, the wait for GPU memory)
    counts, so the column and `restart N` in the health text say the same number."""
    if supervisor is None:
        return 0
    return supervisor.restarts + (1 if running and supervisor.restarting else 0)


def run_since(started_at: str | None, supervisor: SupervisorState | None) -> str | None:
    """When the unit's current run began: its supervisor's start of it (a restart begins a new
    run, so uptime and the last exit agree), else the start its pid record holds."""
    if supervisor is not None and supervisor.state == "running" and supervisor.since:
        return supervisor.since
    if supervisor is not None and supervisor.restarting:
        return None  # between two runs
    return started_at


def seconds_since(iso: str | None, now: float) -> int | None:
    if not iso:
        return None
    try:
        then = datetime.strptime(iso, ISO).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
    return max(0, int(now - then))


def run_time(uf: UnitFacts) -> str:
    if uf.pid is None or not uf.pid.started_at or uf.exit is None or not uf.exit.finished_at:
        return ""
    try:
        began, ended = (datetime.strptime(t, ISO) for t in (uf.pid.started_at, uf.exit.finished_at))
    except ValueError:
        return ""
    return duration((ended - began).total_seconds())
