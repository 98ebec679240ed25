"""Start, stop, probe and tail units: one remote call per action, for any number of units.

Same pattern as facts: ``PYTHON - REQUEST_JSON`` with ``dflashops/payloads/unitctl.py`` on stdin,
one JSON line back, validated here into typed models. Anything short of a complete, valid answer
(python missing, no output, garbage, a unit missing from the answer) is a ``UnitctlError``
naming the host. A unit that could not be started or stopped is not an error of the call: its
result says ``ok: false`` and why, so one bad unit does not hide the others.

What the payload guarantees (see its docstring): start never runs a second copy and returns at
once, with the unit's supervisor leading its own session and a new timestamped log; stop signals
only the recorded process group once it is proven ours (boot id, start time), TERM then KILL, and
waits for nvidia-smi to stop listing the stopped pids; probe checks every unit in parallel within
about one HTTP timeout; tail reads the current log's end or follows it from an offset.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflashops.errors import HostError
from dflashops.hosts.connection import Connection, Result, tail

# Reused from facts (same transport, same tolerance of a login banner before the JSON line).
from dflashops.hosts.facts import FactsModel, load_json_report, payload_command, summarize

SCHEMA = 1
START_TIMEOUT = 60.0
TAIL_TIMEOUT = 60.0
SLACK = 30.0  # on top of the payload's own waits: interpreter start, /proc scans, the link


M = TypeVar("M", bound=BaseModel)


class UnitctlError(HostError):
    """The unitctl payload did not produce a usable answer."""


@cache
def payload_source() -> bytes:
    """The payload's source, read once from the installed package."""
    return resources.files("dflashops.payloads").joinpath("unitctl.py").read_bytes()


# ---------------------------------------------------------------------------------------- start


class StartResult(FactsModel):
    name: str
    ok: bool
    pid: int | None = None  # the supervisor (session and group leader); on refusal, the running one
    pgid: int | None = None
    start_time: int | None = None  # clock ticks after boot, /proc/PID/stat field 22
    log: str | None = None  # "logs/<UTC time>.log", relative to the unit directory
    error: str | None = None  # why it did not start ("already running (pid N)", ...)


# ---------------------------------------------------------------------------------------- stop


class GpuHeld(FactsModel):
    pid: int
    gpu_index: int | None  # None: nvidia-smi listed a GPU uuid it did not list as a device
    used_mib: int | None


class StopResult(FactsModel):
    name: str
    ok: bool  # false: survivors of KILL, GPU memory held, unproven members, an unusable record
    was_running: bool
    pids: list[int]  # every member of the unit's group seen while stopping
    killed: bool  # KILL was needed after the grace period
    stale_pid: int | None  # the record's pid now belongs to another process: nothing signalled
    # in the recorded group, leader gone, without the start's run id: not signalled, ok false
    unproven_pids: list[int] = Field(default_factory=list)
    gpu_freed: bool | None  # None: no nvidia-smi on the host (or it failed: see gpu_error)
    gpu_held: list[GpuHeld] = Field(default_factory=list)
    gpu_error: str | None = None
    error: str | None = None
    seconds: float


# ---------------------------------------------------------------------------------------- probe


class ProbeSpec(BaseModel):
    """What to probe for one unit; ``port`` or ``health_path`` None: only process state and log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    host: str = "127.0.0.1"
    port: int | None = None
    health_path: str | None = "/health"
    identity_paths: list[str] = Field(default_factory=list)
    headers: dict[str, str] = Field(default_factory=dict)


class HttpCheck(FactsModel):
    status: int | None  # None: no HTTP answer (see error)
    error: str | None  # "connection refused", "timed out", ...


class Identity(FactsModel):
    path: str | None  # the path that answered (or the last one tried)
    status: int | None
    body: Any = None  # the parsed JSON answer
    error: str | None = None


class Banner(FactsModel):
    """The launch script's banner line, ``[dflashops] unit=... fingerprint=... ...``, typed.

    ``UnitProbe.banner`` keeps the payload's dict (the identity check reads it by key); this
    is the typed view of it, ``UnitProbe.banner_info``."""

    line: str
    unit: str | None = None
    fingerprint: str | None = None
    engine: str | None = None
    tp: int | None = None
    dp: int | None = None
    port: int | None = None  # None for "-" (a unit without a port)
    gpus: list[int] = Field(default_factory=list)
    started: str | None = None


class UnitExit(FactsModel):
    """units/<unit>/exit, written by the supervisor when launch.sh ends."""

    code: int | None = None  # 128 + signal number when killed by a signal
    signal: str | None = None  # "SIGTERM", ...
    finished_at: str | None = None
    child_pid: int | None = None


class UnitStopped(FactsModel):
    """units/<unit>/stopped, written by stop."""

    stopped_at: str | None = None
    pids: list[int] = Field(default_factory=list)
    killed: bool | None = None


class UnitProbe(FactsModel):
    name: str = ""
    alive: bool  # the recorded pid exists and is not a zombie
    ours: bool  # and it is provably the process dflashops started
    pid: int | None
    reason: str | None = None  # why not alive/ours
    log: str | None = None  # current log, "logs/<name>.log"
    exit: UnitExit | None
    stopped: UnitStopped | None = None
    health: HttpCheck | None  # None: no port or health path to probe
    identity: Identity | None  # None: not asked, or health was not 200
    banner: dict[str, Any] | None  # Banner's keys, checked against it (see banner_info)
    server_args: str | None = None  # vLLM's own "non-default args: {...}" from the log
    log_tail: list[str] | None  # only when the process is not running (alive and ours)
    errors: list[str] = Field(default_factory=list)  # unreadable records or logs

    @model_validator(mode="before")
    @classmethod
    def _demote_bad_records(cls, data: Any) -> Any:
        """An exit/stopped file of the wrong shape becomes an entry in errors, not a failure."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        errors = list(out.get("errors") or [])
        for key, model in (("exit", UnitExit), ("stopped", UnitStopped), ("banner", Banner)):
            raw = out.get(key)
            if raw is None:
                continue
            try:
                model.model_validate(raw)
            except ValidationError as exc:
                out[key] = None
                errors.append(f"{key}: {summarize(exc, 3)}")
        out["errors"] = errors
        return out

    @property
    def banner_info(self) -> Banner | None:
        return Banner.model_validate(self.banner) if self.banner is not None else None

    @property
    def running(self) -> bool:
        return self.alive and self.ours

    @property
    def healthy(self) -> bool:
        return self.health is not None and self.health.status == 200


class ProbeResult(FactsModel):
    units: dict[str, UnitProbe]
    elapsed_s: float | None = None


# ---------------------------------------------------------------------------------------- tail


class TailResult(FactsModel):
    log: str | None  # "logs/<name>.log" read, None when the unit has no log yet
    size: int  # of that log, when read
    text: str
    offset: int  # pass back (with log) to get what comes next
    rotated: bool = False  # current.log moved to a newer log: text is from its start
    truncated: bool = False  # the log is shorter than the offset: text is from its start


# ---------------------------------------------------------------------------------------- calls


def start_units(
    conn: Connection, python: str, workdir: str, units: Sequence[tuple[str, int]]
) -> dict[str, StartResult]:
    """Start each ``(name, keep_logs)`` unit; returns at once (it never waits for the engine)."""
    if not units:
        return {}
    request = {
        "action": "start",
        "workdir": workdir,
        "units": [{"name": name, "keep_logs": keep} for name, keep in units],
    }
    data = _call(conn, python, request, START_TIMEOUT)
    return _results(conn.host, data, [name for name, _ in units], StartResult)


def stop_units(
    conn: Connection,
    python: str,
    workdir: str,
    units: Sequence[tuple[str, float]],
    *,
    gpu_timeout: float = 60.0,
    kill_wait: float = 10.0,
) -> dict[str, StopResult]:
    """Stop each ``(name, grace)`` unit: TERM to all, KILL after each grace, then GPU memory."""
    if not units:
        return {}
    request = {
        "action": "stop",
        "workdir": workdir,
        "units": [{"name": name, "grace": grace} for name, grace in units],
        "kill_wait": kill_wait,
        "gpu_timeout": gpu_timeout,
    }
    timeout = max(grace for _, grace in units) + kill_wait + gpu_timeout + SLACK
    data = _call(conn, python, request, timeout)
    return _results(conn.host, data, [name for name, _ in units], StopResult)


def probe_units(
    conn: Connection,
    python: str,
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
        "action": "probe",
        "workdir": workdir,
        "units": [p.model_dump() for p in probes],
        "http_timeout": http_timeout,
        "log_lines": log_lines,
    }
    data = _call(conn, python, request, http_timeout + SLACK)
    names = [p.name for p in probes]
    units = data.get("units")
    if isinstance(units, dict):
        for name, unit in units.items():
            if isinstance(unit, dict):
                unit["name"] = name
    try:
        result = ProbeResult.model_validate(data)
    except ValidationError as exc:
        raise UnitctlError(
            conn.host, f"the probe answer does not validate: {summarize(exc)}"
        ) from None
    _check_names(conn.host, "probe", names, result.units)
    return result.units


def tail_log(
    conn: Connection,
    python: str,
    workdir: str,
    unit: str,
    lines: int = 100,
    offset: int | None = None,
    log: str | None = None,
) -> TailResult:
    """The last ``lines`` of the unit's current log; with ``offset`` (and the ``log`` it came
    with) what was written since, to follow a log by polling."""
    request = {
        "action": "tail",
        "workdir": workdir,
        "unit": unit,
        "lines": lines,
        "offset": offset,
        "log": log,
    }
    data = _call(conn, python, request, TAIL_TIMEOUT)
    try:
        return TailResult.model_validate(data)
    except ValidationError as exc:
        raise UnitctlError(
            conn.host, f"the tail answer does not validate: {summarize(exc)}"
        ) from None


# ---------------------------------------------------------------------------------------- plumbing


def _call(conn: Connection, python: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    result = conn.run(
        payload_command(python, json.dumps(request)),
        input=payload_source(),
        timeout=timeout,
        check=False,
    )
    return parse_answer(conn.host, python, str(request["action"]), result)


def parse_answer(host: str, python: str, action: str, result: Result) -> dict[str, Any]:
    """The payload's answer as a dict, checked for exit code, shape, schema and action."""
    code = result.exit_code
    stderr = f"\n  stderr (last lines):\n{tail(result.err)}" if result.err.strip() else ""
    what = f"unitctl {action}"
    if code == 127:
        raise UnitctlError(
            host,
            f"python {python!r} not found on the host; set `python:` for this host in the inventory{stderr}",
        )
    if code == 126:
        raise UnitctlError(
            host,
            f"python {python!r} cannot be executed on the host (permissions?); set `python:` for this host in the inventory{stderr}",
        )
    if code != 0:
        hint = " (the payload needs Python 3.9 or newer)" if "SyntaxError" in result.err else ""
        raise UnitctlError(
            host, f"{what} failed with exit code {code} using python {python!r}{hint}{stderr}"
        )
    text = result.out.strip()
    if not text:
        raise UnitctlError(
            host,
            f"{what} printed nothing (python {python!r}, exit code 0): no answer is not success{stderr}",
        )
    data = load_json_report(text)
    if data is None:
        shown = text[:200] + ("..." if len(text) > 200 else "")
        raise UnitctlError(
            host,
            f"{what} printed something that is not a JSON answer (python {python!r}?): {shown!r}",
        )
    if data.get("schema") != SCHEMA or data.get("action") != action:
        raise UnitctlError(
            host,
            f"{what}: the payload answered with schema {data.get('schema')!r} for action "
            f"{data.get('action')!r}; this dflashops reads schema {SCHEMA}: controller and payload "
            "versions do not match",
        )
    return data


def _results(host: str, data: dict[str, Any], names: list[str], model: type[M]) -> dict[str, M]:
    units = data.get("units")
    if not isinstance(units, dict):
        raise UnitctlError(host, "the unitctl answer has no units")
    try:
        out = {name: model.model_validate(value) for name, value in units.items()}
    except ValidationError as exc:
        raise UnitctlError(
            host, f"the unitctl answer does not validate: {summarize(exc)}"
        ) from None
    _check_names(host, str(data.get("action")), names, out)
    return out


def _check_names(host: str, action: str, names: list[str], got: dict[str, Any]) -> None:
    missing = [n for n in names if n not in got]
    if missing:
        raise UnitctlError(
            host,
            f"unitctl {action} answered without unit(s) {', '.join(missing)}: no answer is not success",
        )
