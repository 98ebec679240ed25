"""One agent kept running on a host (``serve``), and the requests that ride with its calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dflashops.agent.bundle import bundle, command
from dflashops.agent.calling import AgentError, Caller
from dflashops.agent.remote.main import SCHEMA
from dflashops.hosts.connection import Input, Result, StreamEnded, chunks
from dflashops.hosts.untrusted import TooDeep, loads

# A request riding ahead of a session's next call: its action, its line, what takes its answer.
Ahead = tuple[str, bytes, Callable[[dict[str, Any]], None]]


class Session:
    """One agent kept running on a host (``serve``): each call is a request line (and its
    data) and an answer line on the same channel: no new interpreter, no bundle sent again.
    A deploy's facts, write, stop, start and wait go this way, and `top`'s refreshes.
    Anything short of an answer ends it (the agent's state is then unknown)."""

    def __init__(self, agent: Caller) -> None:
        self.agent = agent
        self.stream = agent.conn.stream(command(agent.python))
        try:
            self.stream.send(bundle() + b'{"action":"serve"}\n')
        except StreamEnded:
            # The shell ended before it took the bundle: a missing python (exit 127, 126) says
            # so (PythonMissing), not "broken pipe". Any other end is the caller's to handle
            # as before (a new session, or a call of its own).
            ending = self.stream.ending()
            if ending.exit_code in (126, 127):
                agent.close()
                agent.answer("serve", ending)
            raise
        # Requests that ride with the next call (the deploy lock): sent just before it and
        # answered just before it, so they cost no round trip of their own.
        self.ahead: list[Ahead] = []

    def send_ahead(
        self, action: str, request: dict[str, Any], then: Callable[[dict[str, Any]], None]
    ) -> None:
        """``request`` goes with the next call; ``then`` gets its checked answer (and may
        raise: the call's own answer has been read by then, so the session stays in step)."""
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        self.ahead.append((action, line, then))

    def settle(self, timeout: float) -> None:
        """Send what waits to ride ahead now, and handle its answers (before a stream of
        lines of another kind: wait)."""
        ahead, self.ahead = self.ahead, []
        if ahead:
            answers = self._exchange(ahead[0][0], [line for _, line, _ in ahead], b"", timeout)
            self._then(ahead, answers)

    def _then(self, ahead: list[Ahead], got: list[bytes]) -> None:
        for (action, _, then), raw in zip(ahead, got, strict=True):
            then(self.agent.answer(action, Result(f"agent session: {action}", 0, raw, b"")))

    def call(
        self, action: str, request: dict[str, Any], *, data: Input = b"", timeout: float
    ) -> dict[str, Any]:
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        ahead, self.ahead = self.ahead, []
        answers = self._exchange(action, [a[1] for a in ahead] + [line], data, timeout)
        self._then(ahead, answers[:-1])
        return self._answer(action, answers[-1])

    def _exchange(
        self, action: str, lines: list[bytes], data: Input, timeout: float
    ) -> list[bytes]:
        """Send request lines (``data`` after the last), read one answer line for each."""
        got: list[bytes] = []
        try:
            for line in lines:
                self.stream.send(line + b"\n")
            for chunk in chunks(data):
                self.stream.send(chunk)
            for _ in lines:
                got.append(self.stream.readline(timeout))
            return got
        except StreamEnded:
            ending = self.stream.ending()
            self.agent.close()
            if got:  # what it said before it ended says more than its end (a hostile answer)
                self.agent.answer(action, Result(f"agent session: {action}", 0, got[-1], b""))
            self.agent.answer(action, ending)  # raises, saying why (python missing, a crash)
            raise AgentError(self.host, f"the agent session ended during {action}") from None
        except BaseException:  # a timeout, Ctrl-C: the session's state is unknown
            self.agent.close()
            raise

    def _answer(self, action: str, got: bytes) -> dict[str, Any]:
        if got.startswith(b'{"schema":%d,"action":null' % SCHEMA):  # refused: the session ended
            self.agent.close()
            try:
                why = loads(got).get("error")
            except (ValueError, TooDeep, AttributeError):
                why = "a refusal that does not parse"
            raise AgentError(self.host, f"the dflashops agent ({action}): {why} (a dflashops bug)")
        return self.agent.answer(action, Result(f"agent session: {action}", 0, got, b""))

    @property
    def host(self) -> str:
        return self.agent.host

    def close(self) -> None:
        self.stream.close()
