"""The controller's one call path to the host agent: every action goes through ``Caller.call``.

It pipes the bundle and the request to the host's python (``~/`` resolved there), and turns
anything short of a complete, valid answer into an ``AgentError`` naming the host: python
missing or not executable, a refused request, a crash, no output, garbage, an answer of another
schema or for another action. An empty answer is never read as "nothing there". Single units
that fail are not errors of the call: their results say ``ok: false`` and why.
The actions are grouped by what they do (``unit_actions``, ``node_actions``); ``client.Agent``
puts them together with the kept session (``session``).
"""

from __future__ import annotations

import abc
import itertools
import json
import time
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from dflashops.agent.answers import summarize
from dflashops.agent.bundle import bundle, command
from dflashops.agent.reading import Frames, last_json_object
from dflashops.agent.remote.main import SCHEMA  # what dflashops_agent.main answers with
from dflashops.agent.remote.main import SERVED as KEPT  # what a session serves
from dflashops.errors import HostError
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import Input, Result, tail
from dflashops.hosts.untrusted import Bounded, HostileHost, TooDeep
from dflashops.output import shorten, trace, verbose

SLACK = 30.0  # on top of an action's own waits: interpreter start, /proc scans, the link
M = TypeVar("M", bound=BaseModel)


class AgentError(HostError):
    """The agent did not produce a usable answer."""


class PythonMissing(AgentError):
    """The host answered, but the inventory's ``python:`` is not there or cannot run: the host
    failed (the inventory needs a fix), it is not unreachable."""

    reached = True


class Kept(Protocol):
    """An agent kept running (``session.Session``): one request line, one answer line."""

    def call(
        self, action: str, request: dict[str, Any], *, data: Input = b"", timeout: float
    ) -> dict[str, Any]: ...


class Caller(abc.ABC):
    """The call path every group of actions shares; ``client.Agent`` is the whole agent."""

    def __init__(self, conn: BaseConnection, python: str, *, keep: bool = False) -> None:
        self.conn = conn
        self.python = python
        # keep: the KEPT actions go to one agent kept running (a session) until close().
        self.keep = keep
        self.round_trips = 0  # requests answered (one per call; a session's are on one command)

    @property
    def host(self) -> str:
        return self.conn.host

    @abc.abstractmethod
    def close(self) -> None:
        """End the kept agent, if any (its interpreter exits when its stdin ends)."""

    @abc.abstractmethod
    def kept(self) -> Kept:
        """The agent kept running for this host (started on first use)."""

    def call(
        self,
        action: str,
        request: dict[str, Any],
        *,
        data: Input = b"",
        timeout: float,
        frames: Frames | None = None,
    ) -> dict[str, Any]:
        """Run one action. ``data`` follows the request on stdin (bytes or chunks made while
        it runs); ``frames`` takes a streamed answer's files (``send``) as they come. With
        ``-v`` each call is traced with its time, failed or not."""
        if not verbose():
            return self._call(action, request, data, timeout, frames)
        started = time.monotonic()
        failed = " (failed)"
        try:
            answer = self._call(action, request, data, timeout, frames)
            failed = ""
            return answer
        finally:
            trace(self.host, action + failed, time.monotonic() - started)

    def _call(
        self,
        action: str,
        request: dict[str, Any],
        data: Input,
        timeout: float,
        frames: Frames | None,
    ) -> dict[str, Any]:
        self.round_trips += 1
        if self.keep and action in KEPT and frames is None:
            return self.kept().call(action, request, data=data, timeout=timeout)
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        head = bundle() + line + b"\n"
        stdin: Input = (
            head + data if isinstance(data, bytes) else itertools.chain((head,), data or ())
        )
        # Never more than ANSWER_LIMIT bytes of an answer: one more ends the command at once.
        bounded = Bounded(self.host)
        result = self.conn.run(
            command(self.python),
            input=stdin,
            timeout=timeout,
            check=False,
            stdout=frames.feed if frames is not None else bounded,
        )
        if frames is not None:
            frames.close()
        out = frames.tail if frames is not None else bytes(bounded.data)
        return self.answer(action, Result(result.command, result.exit_code, out, result.stderr))

    def answer(self, action: str, result: Result) -> dict[str, Any]:
        """The answer as a dict, checked for exit code, shape, schema and action."""
        code, py = result.exit_code, self.python
        stderr = f"\n  stderr (last lines):\n{tail(result.err)}" if result.err.strip() else ""
        what = f"the dflashops agent ({action})"
        if code in (127, 126):
            raise self.python_missing(code, result.err)
        if code == 2 and "dflashops agent: bad request" in result.err:
            raise AgentError(self.host, f"{what} refused the request (a dflashops bug){stderr}")
        if code != 0:
            hint = " (the agent needs Python 3.9 or newer)" if "SyntaxError" in result.err else ""
            raise AgentError(
                self.host, f"{what} failed with exit code {code} using python {py!r}{hint}{stderr}"
            )
        text = result.out.strip()
        if not text:
            raise AgentError(
                self.host,
                f"{what} printed nothing (python {py!r}, exit code 0): no answer is not success{stderr}",
            )
        try:
            data = last_json_object(text)
        except TooDeep as exc:
            raise HostileHost(
                self.host, f"{what} answered with {exc}: refused (a broken or hostile host)"
            ) from None
        if data is None:
            shown = shorten(text, 200)
            raise AgentError(
                self.host,
                f"{what} printed something that is not a JSON answer (python {py!r}?): {shown!r}",
            )
        if data.get("schema") != SCHEMA or data.get("action") != action:
            raise AgentError(
                self.host,
                f"{what} answered with schema {data.get('schema')!r} for action "
                f"{data.get('action')!r}; this dflashops reads schema {SCHEMA}: controller and "
                "agent versions do not match",
            )
        return data

    def python_missing(self, code: int, stderr: str) -> PythonMissing:
        """Exit 127 (no such file) or 126 (cannot execute) from the shell that ran python: one
        line; the shell's own words only where they add something (126's reason)."""
        py, fix = self.python, "set `python:` for this host in the inventory"
        if code == 127:
            return PythonMissing(
                self.host,
                f"python {py!r} not found on the host {self.host}: {fix} "
                "(a stock RunPod pod has /usr/bin/python3)",
            )
        lines = stderr.strip().splitlines()
        why = f" ({lines[-1].strip()})" if lines else " (permissions?)"
        return PythonMissing(
            self.host, f"python {py!r} cannot be executed on the host {self.host}{why}: {fix}"
        )

    def validate(self, model: type[M], data: Any, what: str) -> M:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise AgentError(
                self.host, f"the {what} answer does not validate: {summarize(exc)}"
            ) from None

    def per_unit(self, model: type[M], data: dict[str, Any], names: list[str]) -> dict[str, M]:
        units = data.get("units")
        if not isinstance(units, dict):
            raise AgentError(self.host, f"the {data.get('action')} answer has no units")
        for name, unit in units.items():
            if isinstance(unit, dict):
                unit.setdefault("name", name)
        out = {
            name: self.validate(model, value, str(data.get("action")))
            for name, value in units.items()
        }
        missing = [n for n in names if n not in out]
        if missing:
            raise AgentError(
                self.host,
                f"the agent answered {data.get('action')} without unit(s) {', '.join(missing)}: "
                "no answer is not success",
            )
        return out
