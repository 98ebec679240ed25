"""The controller's one call path to the host agent: every action goes through ``Agent.call``.

It pipes the bundle and the request to the host's python (``~/`` resolved there), and turns
anything short of a complete, valid answer into an ``AgentError`` naming the host: python
missing or not executable, a refused request, a crash, no output, garbage, an answer of another
schema or for another action. An empty answer is never read as "nothing there". Single units
that fail are not errors of the call: their results say ``ok: false`` and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dflashops.agent.answers import (
    BuildResult,
    CopyResult,
    Dialled,
    GpuFacts,
    HostFacts,
    Listening,
    ProbeResult,
    ProbeSpec,
    ReceiveResult,
    ScanResult,
    SendResult,
    StartResult,
    StopResult,
    TailResult,
    UnitProbe,
    WaitReport,
    WriteResult,
    summarize,
)
from dflashops.agent.bundle import bundle, command
from dflashops.agent.lock_answers import LockAnswer
from dflashops.agent.reading import Frames, last_json_object
from dflashops.agent.remote.main import SERVED as KEPT  # what a session serves
from dflashops.errors import HostError, TransferError
from dflashops.hosts.connection import (
    CommandTimeout,
    Connection,
    Input,
    Result,
    StreamEnded,
    chunks,
    tail,
)
from dflashops.hosts.untrusted import Bounded, HostileHost, TooDeep, loads

SCHEMA = 2  # what dflashops_agent.main answers with
SLACK = 30.0  # on top of an action's own waits: interpreter start, /proc scans, the link
RELOCK_WAIT = 10.0  # s a new session waits for the deploy lock its ended predecessor held
M = TypeVar("M", bound=BaseModel)


class AgentError(HostError):
    """The agent did not produce a usable answer."""


class Agent:
    """The agent on one host, reached through ``conn`` with the host's ``python``."""

    def __init__(self, conn: Connection, python: str, *, keep: bool = False) -> None:
        self.conn = conn
        self.python = python
        # keep: the KEPT actions go to one agent kept running (a session) until close().
        self.keep = keep
        self.session: Session | None = None
        # The deploy lock this agent's session holds (its request), taken again by the next
        # session when one ends mid-run (see kept).
        self.locked: dict[str, Any] | None = None
        self.round_trips = 0  # requests answered (one per call; a session's are on one command)

    @property
    def host(self) -> str:
        return self.conn.host

    def close(self) -> None:
        """End the kept agent, if any (its interpreter exits when its stdin ends)."""
        if self.session is not None:
            self.session.close()
            self.session = None

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
        try:
            data = last_json_object(text)
        except TooDeep as exc:
            raise HostileHost(
                self.host, f"{what} answered with {exc}: refused (a broken or hostile host)"
            ) from None
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
        ports: Sequence[int] | None = None,
        probes: Sequence[ProbeSpec] = (),
        settled: dict[str, dict[str, Any]] | None = None,
        timeout: float = 180.0,
    ) -> HostFacts:
        """Everything about the host in one remote call (files: [{key, dest, expect, src,
        listing}], envs: [{name, path, hash}], env_imports: [{env, module, python}]).
        ``ports``: the listeners whose holders matter (None: all); ``probes``: units probed in
        the same call (``HostFacts.probe``), so that a deploy with nothing to do needs no other;
        ``settled`` ({unit: {fingerprint, job}}): when all of them run (or finished) as given,
        nvidia-smi is skipped (``gpus.skipped``; ask ``gpus`` if something starts after all)."""
        request: dict[str, Any] = {
            "workdir": workdir,
            "imports": list(imports),
            "paths": list(paths),
            "files": list(files),
            "envs": list(envs),
            "env_imports": list(env_imports),
            "ports": None if ports is None else sorted(set(ports)),
            # Imports and nvidia-smi run in parallel on the host; leave room for the rest.
            "import_timeout": max(1.0, min(120.0, timeout - 20.0)),
            "nvidia_smi_timeout": max(1.0, min(30.0, timeout / 2)),
            "probe": None,
            "settled": settled,
        }
        if probes:
            request["probe"] = {
                "units": [p.model_dump() for p in probes],
                "http_timeout": 5.0,
                "log_lines": 30,
            }
        data = self.call("facts", request, timeout=timeout)
        data["host"] = self.host
        if probes:
            if not isinstance(data.get("probe"), dict):
                problem = (data.get("errors") or {}).get("probe", "no probe in the answer")
                raise AgentError(self.host, f"the facts call did not probe the units: {problem}")
            data["probe"]["action"] = "facts"
            self.per_unit(UnitProbe, data["probe"], [p.name for p in probes])
        return self.validate(HostFacts, data, "facts")

    def gpus(self, workdir: str, timeout: float = 30.0) -> GpuFacts:
        """nvidia-smi alone (after a facts call that skipped it)."""
        request = {"workdir": workdir, "units": [], "http_timeout": timeout, "gpus": True}
        found = self.validate(
            ProbeResult, self.call("probe", request, timeout=timeout + SLACK), "probe"
        )
        if found.gpus is None:
            raise AgentError(self.host, "the probe answered without the GPUs asked for")
        return found.gpus

    # -- a multi-node unit's rendezvous, before any GPU is touched -----------------------------

    @contextlib.contextmanager
    def listening(
        self, workdir: str, address: str, port: int, expect: int, timeout: float
    ) -> Iterator[tuple[Listening, Callable[[], Listening]]]:
        """The head listens on ``address``:``port`` for ``expect`` peers. Yields what it said as
        it started (listening, or why not) and a function that waits for its final answer."""
        request = {
            "action": "rendezvous",
            "workdir": workdir,
            "role": "listen",
            "address": address,
            "port": port,
            "expect": expect,
            "timeout": timeout,
        }
        self.round_trips += 1
        stream = self.conn.stream(command(self.python))
        try:
            stream.send(bundle() + json.dumps(request).encode() + b"\n")
            first = self._rendezvous_line(stream, timeout=30.0)
            if not first.listening:
                yield first, lambda: first
                return

            def finish() -> Listening:
                return self._rendezvous_line(stream, timeout=timeout + SLACK)

            yield first, finish
        finally:
            stream.close()

    def _rendezvous_line(self, stream: Any, timeout: float) -> Listening:
        try:
            raw = stream.readline(timeout)
        except StreamEnded:
            self.answer("rendezvous", stream.ending())  # raises, saying why
            raise AgentError(self.host, "the rendezvous check ended without an answer") from None
        if raw.startswith(b'{"listening"'):  # the head's "I am listening" line
            try:
                return self.validate(Listening, loads(raw), "rendezvous")
            except (ValueError, TooDeep) as exc:
                raise AgentError(
                    self.host, f"the rendezvous line is not an answer: {exc}"
                ) from None
        data = self.answer("rendezvous", Result("agent rendezvous", 0, raw, b""))
        return self.validate(Listening, data, "rendezvous")

    def dial(self, workdir: str, address: str, port: int, name: str, timeout: float) -> Dialled:
        """Connect to the head's rendezvous as a worker rank would."""
        request = {
            "workdir": workdir,
            "role": "dial",
            "address": address,
            "port": port,
            "name": name,
            "timeout": timeout,
        }
        data = self.call("rendezvous", request, timeout=timeout + SLACK)
        return self.validate(Dialled, data, "rendezvous")

    def start(
        self,
        workdir: str,
        units: Sequence[tuple[str, int]],
        scripts: dict[str, str] | None = None,
    ) -> dict[str, StartResult]:
        """Start each ``(name, keep_logs)`` unit; returns at once (it never waits for the
        engine). ``scripts``: the sha256 of the launch.sh this run shipped, per unit: the host
        refuses a unit whose launch.sh on disk differs (another actor changed it)."""
        if not units:
            return {}
        shipped = scripts or {}
        request = {
            "workdir": workdir,
            "units": [
                {"name": n, "keep_logs": k, "launch_sha256": shipped.get(n)} for n, k in units
            ],
        }
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
            # Interrupted, failed or abandoned: the host side must stop now, so its stream
            # goes (a kept agent with it: the next call starts another).
            if kept is None or not done:
                if kept is not None:
                    self.close()
                else:
                    stream.close()

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


# A request riding ahead of a session's next call: its action, its line, what takes its answer.
Ahead = tuple[str, bytes, Callable[[dict[str, Any]], None]]


class Session:
    """One agent kept running on a host (``serve``): each call is a request line (and its
    data) and an answer line on the same channel: no new interpreter, no bundle sent again.
    A deploy's facts, write, stop, start and wait go this way, and `top`'s refreshes.
    Anything short of an answer ends it (the agent's state is then unknown)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.stream = agent.conn.stream(command(agent.python))
        self.stream.send(bundle() + b'{"action":"serve"}\n')
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
        try:
            for line in lines:
                self.stream.send(line + b"\n")
            for chunk in chunks(data):
                self.stream.send(chunk)
            return [self.stream.readline(timeout) for _ in lines]
        except StreamEnded:
            ending = self.stream.ending()
            self.agent.close()
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
