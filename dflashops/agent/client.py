"""The controller's one call path to the host agent: every action goes through ``Agent.call``.

It pipes the bundle and the request to the host's python (``~/`` resolved there), and turns
anything short of a complete, valid answer into an ``AgentError`` naming the host: python
missing or not executable, a refused request, a crash, no output, garbage, an answer of another
schema or for another action. An empty answer is never read as "nothing there". Single units
that fail are not errors of the call: their results say ``ok: false`` and why.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dflashops.agent.answers import (
    BuildResult,
    CopyResult,
    HostFacts,
    ProbeResult,
    ProbeSpec,
    ReceiveResult,
    ScanResult,
    SendResult,
    StartResult,
    StopResult,
    TailResult,
    UnitProbe,
    WriteResult,
    summarize,
)
from dflashops.agent.bundle import bundle, command
from dflashops.errors import HostError, TransferError
from dflashops.hosts.connection import Connection, Input, Result, tail

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
        self,
        action: str,
        request: dict[str, Any],
        *,
        data: Input = b"",
        timeout: float,
        frames: Frames | None = None,
    ) -> dict[str, Any]:
        """Run one action. ``data`` follows the request on stdin (bytes or chunks made while
        it runs); ``frames`` takes a streamed answer's files (``send``) as they come."""
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        head = bundle() + line + b"\n"
        stdin: Input = (
            head + data if isinstance(data, bytes) else itertools.chain((head,), data or ())
        )
        result = self.conn.run(
            command(self.python),
            input=stdin,
            timeout=timeout,
            check=False,
            stdout=frames.feed if frames is not None else None,
        )
        if frames is not None:
            frames.close()
            result = Result(result.command, result.exit_code, frames.tail, result.stderr)
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
        files: Sequence[dict[str, Any]] = (),
        envs: Sequence[dict[str, Any]] = (),
        env_imports: Sequence[dict[str, Any]] = (),
        timeout: float = 180.0,
    ) -> HostFacts:
        """Everything about the host in one remote call (files: [{key, dest, expect, src,
        listing}], envs: [{name, path, hash}], env_imports: [{env, module, python}])."""
        request = {
            "workdir": workdir,
            "imports": list(imports),
            "paths": list(paths),
            "files": list(files),
            "envs": list(envs),
            "env_imports": list(env_imports),
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

    def observe(
        self, workdir: str, probes: Sequence[ProbeSpec], *, http_timeout: float = 5.0
    ) -> ProbeResult:
        """What `top` shows of a host in one call: every unit's probe (metrics included) and
        nvidia-smi, with the host's clock."""
        request = observe_request(workdir, probes, http_timeout)
        data = self.call("probe", request, timeout=http_timeout + SLACK)
        self.per_unit(UnitProbe, data, [p.name for p in probes])
        return self.validate(ProbeResult, data, "probe")

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

    # -- node state ---------------------------------------------------------------------------

    def scan(
        self,
        workdir: str,
        root: str | None,
        *,
        cache: str = "src",
        job: str | None = None,
        listing: bool = True,
        timeout: float = 3600.0,
    ) -> ScanResult:
        """A tree's manifest on the host (hashing only what changed since the last scan)."""
        request = {"workdir": workdir, "root": root, "cache": cache, "job": job, "listing": listing}
        return self.validate(ScanResult, self.call("scan", request, timeout=timeout), "scan")

    def receive(
        self,
        workdir: str,
        dest: str,
        files: Sequence[dict[str, Any]],
        data: Input,
        *,
        delete: Sequence[str] = (),
        need_bytes: int = 0,
        timeout: float | None = None,
    ) -> ReceiveResult:
        """Stream ``files`` ([{rel, size, sha256, offset, mode}], their bytes from offset in
        ``data``) into ``dest``; each verified and renamed on arrival."""
        request = {
            "workdir": workdir,
            "dest": dest,
            "files": list(files),
            "delete": list(delete),
            "need_bytes": need_bytes,
        }
        budget = timeout if timeout is not None else 600.0 + need_bytes / 20e6  # >= 20 MB/s
        data_answer = self.call("receive", request, data=data, timeout=budget)
        return self.validate(ReceiveResult, data_answer, "receive")

    def send(
        self,
        workdir: str,
        root: str,
        files: Sequence[tuple[str, int]],
        frames: Frames,
        *,
        timeout: float,
    ) -> SendResult:
        """Stream files (rel, offset) out of ``root`` on the host into ``frames``."""
        request = {
            "workdir": workdir,
            "root": root,
            "files": [{"rel": r, "offset": o} for r, o in files],
        }
        return self.validate(
            SendResult, self.call("send", request, timeout=timeout, frames=frames), "send"
        )

    def copy(
        self,
        workdir: str,
        dest: str,
        *,
        src: str | None = None,
        hub: dict[str, Any] | None = None,
        secrets: dict[str, str] | None = None,
        delete: bool = False,
        mode: int | None = None,
        timeout: float = 6 * 3600.0,
    ) -> CopyResult:
        """Make ``dest`` hold what a host path (or a hub repo at a revision) holds."""
        request = {
            "workdir": workdir,
            "dest": dest,
            "src": src,
            "hub": hub,
            "secrets": secrets or {},
            "delete": delete,
            "mode": mode,
            "hub_timeout": max(1.0, timeout - 60.0),
        }
        return self.validate(CopyResult, self.call("copy", request, timeout=timeout), "copy")

    def build(
        self, workdir: str, envs: Sequence[dict[str, Any]], *, timeout: float = 3600.0
    ) -> dict[str, BuildResult]:
        """Build environments (each once per content, switched in only when complete)."""
        if not envs:
            return {}
        request = {"workdir": workdir, "envs": list(envs), "timeout": timeout}
        data = self.call("build", request, timeout=timeout * len(envs) + SLACK)
        built = data.get("envs")
        if not isinstance(built, dict):
            raise AgentError(self.host, "the build answer has no envs")
        out = {name: self.validate(BuildResult, value, "build") for name, value in built.items()}
        missing = [str(e["name"]) for e in envs if e["name"] not in out]
        if missing:
            raise AgentError(self.host, f"the build answer misses {', '.join(missing)}")
        return out


class Session:
    """One agent kept running on a host (``serve``): each call is a request line and an answer
    line on the same channel, no new interpreter, no bundle sent again. For `top`."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.stream = agent.conn.stream(command(agent.python))
        self.stream.send(bundle() + b'{"action":"serve"}\n')

    def call(self, action: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        line = json.dumps({"action": action, **request}, separators=(",", ":")).encode()
        self.stream.send(line + b"\n")
        got = self.stream.readline(timeout)
        return self.agent.answer(action, Result(f"agent session: {action}", 0, got, b""))

    def observe(
        self, workdir: str, probes: Sequence[ProbeSpec], http_timeout: float = 5.0
    ) -> ProbeResult:
        data = self.call(
            "probe", observe_request(workdir, probes, http_timeout), http_timeout + SLACK
        )
        self.agent.per_unit(UnitProbe, data, [p.name for p in probes])
        return self.agent.validate(ProbeResult, data, "probe")

    def close(self) -> None:
        self.stream.close()


def observe_request(
    workdir: str, probes: Sequence[ProbeSpec], http_timeout: float
) -> dict[str, Any]:
    return {
        "workdir": workdir,
        "units": [p.model_dump() for p in probes],
        "http_timeout": http_timeout,
        "log_lines": 0,
        "gpus": True,
    }


class Frames:
    """A ``send`` answer as it streams: each file's header line and bytes go to the file that
    ``open_file(header)`` returns (append mode, from the header's offset); what follows the
    last file is the answer line."""

    def __init__(self, open_file: Any) -> None:
        self.open_file = open_file
        self.buffer = bytearray()
        self.current: Any = None
        self.left = 0
        self.tail = b""

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while self.buffer:
            if self.current is not None:
                take = min(self.left, len(self.buffer))
                self.current.write(bytes(self.buffer[:take]))
                del self.buffer[:take]
                self.left -= take
                if self.left == 0:
                    self.current.close()
                    self.current = None
                continue
            end = self.buffer.find(b"\n")
            if end < 0:
                return
            line = bytes(self.buffer[: end + 1])
            header = last_json_object(line.decode("utf-8", "replace").strip())
            if header is None or "rel" not in header or "schema" in header:
                self.tail += line  # the answer (or a login banner before the first file)
                del self.buffer[: end + 1]
                continue
            del self.buffer[: end + 1]
            self.current = self.open_file(header)
            self.left = int(header["size"]) - int(header["offset"])
            if self.left == 0:
                self.current.close()
                self.current = None

    def close(self) -> None:
        """The stream ended: a file cut short stays as it is (a partial, resumed next time)."""
        if self.current is not None:
            self.current.close()
            self.current = None
        self.tail += bytes(self.buffer)
        self.buffer.clear()


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
