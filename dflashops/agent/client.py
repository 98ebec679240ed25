"""The controller's one call path to the host agent: every action goes through ``Agent.call``.

It pipes the bundle and the request to the host's python (``~/`` resolved there), and turns
anything short of a complete, valid answer into an ``AgentError`` naming the host: python
missing or not executable, a refused request, a crash, no output, garbage, an answer of another
schema or for another action. An empty answer is never read as "nothing there". Single units
that fail are not errors of the call: their results say ``ok: false`` and why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dflashops.agent.answers import (
    HostFacts,
    ProbeResult,
    ProbeSpec,
    StartResult,
    StopResult,
    TailResult,
    UnitProbe,
    WriteResult,
    summarize,
)
from dflashops.agent.bundle import bundle, command
from dflashops.errors import HostError, TransferError
from dflashops.hosts.connection import Connection, Result, tail

SCHEMA = 2  # what dflashops_agent.main answers with
SLACK = 30.0  # on top of an action's own waits: interpreter start, /proc scans, the link
M = TypeVar("M", bound=BaseModel)


class AgentError(HostError):
    """The agent did not produce a usable answer."""


class Agent:
    """The agent on one host, reached through ``conn`` with the host's ``python``."""

    def __init__(self, conn: Connection, python: str) -> None:
        self.conn = conn
        self.python = python

    @property
    def host(self) -> str:
        return self.conn.host

    # -- the call path ------------------------------------------------------------------------

    def call(
        self, action: str, request: dict[str, Any], *, data: bytes = b"", timeout: float
    ) -> dict[str, Any]:
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        result = self.conn.run(
            command(self.python), input=bundle() + line + b"\n" + data, timeout=timeout, check=False
        )
        return self.answer(action, result)

    def answer(self, action: str, result: Result) -> dict[str, Any]:
        """The answer as a dict, checked for exit code, shape, schema and action."""
        code, py = result.exit_code, self.python
        stderr = f"\n  stderr (last lines):\n{tail(result.err)}" if result.err.strip() else ""
        what = f"the dflashops agent ({action})"
        if code == 127:
            raise AgentError(
                self.host,
                f"python {py!r} not found on the host; set `python:` for this host in the inventory{stderr}",
            )
        if code == 126:
            raise AgentError(
                self.host,
                f"python {py!r} cannot be executed on the host (permissions?); set `python:` for this host in the inventory{stderr}",
            )
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
        data = last_json_object(text)
        if data is None:
            shown = text[:200] + ("..." if len(text) > 200 else "")
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

    # -- actions ------------------------------------------------------------------------------

    def facts(
        self,
        workdir: str,
        *,
        imports: Sequence[str] = (),
        paths: Sequence[str] = (),
        timeout: float = 180.0,
    ) -> HostFacts:
        """Everything about the host in one remote call."""
        request = {
            "workdir": workdir,
            "imports": list(imports),
            "paths": list(paths),
            # Imports and nvidia-smi run in parallel on the host; leave room for the rest.
            "import_timeout": max(1.0, min(120.0, timeout - 20.0)),
            "nvidia_smi_timeout": max(1.0, min(30.0, timeout / 2)),
        }
        data = self.call("facts", request, timeout=timeout)
        data["host"] = self.host
        return self.validate(HostFacts, data, "facts")

    def start(self, workdir: str, units: Sequence[tuple[str, int]]) -> dict[str, StartResult]:
        """Start each ``(name, keep_logs)`` unit; returns at once (it never waits for the engine)."""
        if not units:
            return {}
        request = {"workdir": workdir, "units": [{"name": n, "keep_logs": k} for n, k in units]}
        data = self.call("start", request, timeout=60.0)
        return self.per_unit(StartResult, data, [n for n, _ in units])

    def stop(
        self,
        workdir: str,
        units: Sequence[tuple[str, float | None]],
        *,
        prune: bool = False,
        gpu_timeout: float = 60.0,
        kill_wait: float = 10.0,
    ) -> dict[str, StopResult]:
        """Stop each ``(name, grace)`` unit (grace None: the one recorded at deploy): TERM to
        all, KILL after each grace, then GPU memory; ``prune`` moves their folders aside."""
        if not units:
            return {}
        request = {
            "workdir": workdir,
            "units": [{"name": n, "grace": g, "prune": prune} for n, g in units],
            "kill_wait": kill_wait,
            "gpu_timeout": gpu_timeout,
        }
        longest = max(g if g is not None else 3600.0 for _, g in units)
        data = self.call("stop", request, timeout=longest + kill_wait + gpu_timeout + SLACK)
        return self.per_unit(StopResult, data, [n for n, _ in units])

    def probe(
        self,
        workdir: str,
        probes: Sequence[ProbeSpec],
        *,
        http_timeout: float = 5.0,
        log_lines: int = 30,
    ) -> dict[str, UnitProbe]:
        """Process state, health, identity, banner (and a dead unit's log tail) for every unit."""
        if not probes:
            return {}
        request = {
            "workdir": workdir,
            "units": [p.model_dump() for p in probes],
            "http_timeout": http_timeout,
            "log_lines": log_lines,
        }
        data = self.call("probe", request, timeout=http_timeout + SLACK)
        names = [p.name for p in probes]
        self.per_unit(UnitProbe, data, names)  # every unit answered, each valid
        return self.validate(ProbeResult, data, "probe").units

    def tail(
        self,
        workdir: str,
        unit: str,
        lines: int = 100,
        offset: int | None = None,
        log: str | None = None,
    ) -> TailResult:
        """The last ``lines`` of the unit's current log; with ``offset`` (and the ``log`` it
        came with) what was written since, to follow a log by polling."""
        request = {"workdir": workdir, "unit": unit, "lines": lines, "offset": offset, "log": log}
        return self.validate(TailResult, self.call("tail", request, timeout=60.0), "tail")

    def write(
        self, workdir: str, files: Sequence[tuple[bytes, str, int]], timeout: float = 600.0
    ) -> None:
        """Write (data, absolute path, mode) files in ONE round trip, each verified on the
        host; none is renamed unless all arrived intact (TransferError says why)."""
        if not files:
            return
        manifest = [
            {
                "path": path,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "mode": mode,
            }
            for data, path, mode in files
        ]
        paths = ", ".join(p for _, p, _ in files)
        try:
            data = self.call(
                "write",
                {"workdir": workdir, "files": manifest},
                data=b"".join(d for d, _, _ in files),
                timeout=timeout,
            )
        except HostError as exc:
            why = str(exc).removeprefix(f"[{self.host}] ")
            raise TransferError(
                self.host, f"shipping {paths} failed, previous versions left in place: {why}"
            ) from None
        result = self.validate(WriteResult, data, "write")
        if not result.ok:
            raise TransferError(
                self.host, f"shipping failed, previous versions left in place: {result.error}"
            )
        if result.written != [p for _, p, _ in files]:
            raise TransferError(
                self.host,
                f"the host did not confirm the files it was sent (got {result.written!r})",
            )


def last_json_object(text: str) -> dict[str, Any] | None:
    """The answer: the whole output, or else its last line (a login shell that prints a banner
    to stdout must not break the call). None when neither is a JSON object."""
    for candidate in (text, text.rsplit("\n", 1)[-1]):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
