"""The controller's agent on one host: ``Agent`` is the call path (``calling``) with every
action (``unit_actions``, ``node_actions``) and the kept session (``session``) a deploy and
`top` ride on. Every action goes through ``Agent.call``; anything short of a complete, valid
answer is an ``AgentError`` naming the host.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Generator, Sequence
from typing import Any

from dflashops.agent.answers import ProbeSpec, UnitProbe, WaitReport
from dflashops.agent.bundle import bundle, command
from dflashops.agent.calling import SLACK, AgentError, PythonMissing
from dflashops.agent.lock_answers import LockAnswer
from dflashops.agent.node_actions import NodeActions
from dflashops.agent.reading import Frames
from dflashops.agent.remote.main import SCHEMA
from dflashops.agent.session import Session
from dflashops.agent.unit_actions import UnitActions, observe_request
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import CommandTimeout, Result, StreamEnded
from dflashops.output import trace, verbose

__all__ = [
    "SCHEMA",
    "SLACK",
    "Agent",
    "AgentError",
    "Frames",
    "PythonMissing",
    "Session",
    "observe_request",
]
RELOCK_WAIT = 10.0  # s a new session waits for the deploy lock its ended predecessor held


class Agent(UnitActions, NodeActions):
    """The agent on one host, reached through ``conn`` with the host's ``python``."""

    def __init__(self, conn: BaseConnection, python: str, *, keep: bool = False) -> None:
        super().__init__(conn, python, keep=keep)
        self.session: Session | None = None
        # The deploy lock this agent's session holds (its request), taken again by the next
        # session when one ends mid-run (see kept).
        self.locked: dict[str, Any] | None = None

    def close(self) -> None:
        """End the kept agent, if any (its interpreter exits when its stdin ends)."""
        if self.session is not None:
            self.session.close()
            self.session = None

    def kept(self) -> Session:
        if self.session is None:
            self.session = Session(self)
            if self.locked is not None:
                self._relock(self.session, self.locked)
        return self.session

    def _relock(self, session: Session, request: dict[str, Any]) -> None:
        """A session ended mid-run (a wait cut short, a timeout) and took the deploy lock with
        it: the new one holds it again before anything else, or the run stops on this host.
        The ended session's agent may still be exiting: a few seconds' wait covers it."""
        data = session.call("lock", dict(request, wait=RELOCK_WAIT), timeout=RELOCK_WAIT + SLACK)
        got = self.validate(LockAnswer, data, "lock")
        if not got.ok:
            self.locked = None
            self.close()
            holder = got.holder.describe() if got.holder is not None else "another actor"
            raise AgentError(
                self.host,
                f"lost the deploy lock when the agent session ended, and {holder} holds it "
                f"now: this run stops on this host{f' ({got.error})' if got.error else ''}",
            )

    def wait(
        self,
        workdir: str,
        units: Sequence[tuple[ProbeSpec, float]],
        *,
        poll: float,
        report_every: float,
        abort: threading.Event,
        http_timeout: float = 5.0,
        hold: Collection[str] = (),
    ) -> Generator[WaitReport, None, None]:
        """Wait on the host for each ``(spec, seconds left)`` unit to be ready, dead or out of
        time: ONE remote command, whose reports come as they happen (a unit done) and every
        ``report_every`` seconds. Units named in ``hold`` are done only when they die (or are
        out of time): ranks with no readiness of their own, watched until their unit is ready.
        Setting ``abort`` ends it within a fraction of a second: the stream is closed and the
        host side stops when its stdin ends."""
        request = {
            "action": "wait",
            "workdir": workdir,
            "units": [
                {**spec.model_dump(), "timeout_s": left, "hold": spec.name in hold}
                for spec, left in units
            ],
            "poll": poll,
            "report_every": report_every,
            "http_timeout": http_timeout,
            "log_lines": 30,
        }
        line = json.dumps(request, separators=(",", ":")).encode()
        silence = report_every + 2 * http_timeout + SLACK  # longer without a line: lost
        started = time.monotonic()
        self.round_trips += 1
        kept = self.kept() if self.keep else None
        if kept is not None:
            kept.settle(timeout=silence)  # what rides ahead is answered before the reports
        stream = kept.stream if kept is not None else self.conn.stream(command(self.python))
        done = False
        try:
            stream.send((line if kept is not None else bundle() + line) + b"\n")
            heard = time.monotonic()
            while not abort.is_set():
                try:
                    raw = stream.readline(0.2)
                except CommandTimeout:
                    if time.monotonic() - heard > silence:
                        raise AgentError(
                            self.host, f"the wait sent nothing for {silence:.0f}s: link lost?"
                        ) from None
                    continue
                except StreamEnded:
                    self.answer("wait", stream.ending())  # raises, saying why
                    raise AgentError(self.host, "the wait ended without its last report") from None
                heard = time.monotonic()
                data = self.answer("wait", Result("agent wait", 0, raw, b""))
                self.per_unit(UnitProbe, data, [])
                report = self.validate(WaitReport, data, "wait")
                done = report.final
                yield report
                if done:
                    return
        finally:
            if verbose():
                what = f"wait ({len(units)} unit(s)){'' if done else ' (ended early)'}"
                trace(self.host, what, time.monotonic() - started)
            # Interrupted, failed or abandoned: the host side must stop now, so its stream
            # goes (a kept agent with it: the next call starts another).
            if kept is None or not done:
                if kept is not None:
                    self.close()
                else:
                    stream.close()
