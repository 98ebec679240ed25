"""Host facts in one round trip: pipe the stdlib-only payload to the host's python, read one JSON.

``gather_facts`` runs ``PYTHON - REQUEST_JSON`` with ``dflashops/payloads/facts.py`` on stdin (so
nothing has to be on the host first) and validates what comes back into ``HostFacts``. Anything
short of a complete, valid report (python missing, no output, garbage, an unknown schema) is a
``FactsError`` naming the host: an empty answer is never read as "no units".

A single broken file in a unit directory (unit.json, pid, exit written by hand or half-written)
does not fail the whole host: it lands in that unit's ``*_error`` field, like the payload's own
parse errors do.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflashops.errors import HostError
from dflashops.hosts.connection import Command, Connection, Result, tail

SCHEMA = 1


class FactsError(HostError):
    """The facts payload did not produce a usable report."""


class FactsModel(BaseModel):
    """Strict (no coercion between JSON types), frozen; unknown keys from newer payloads ignored."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


def summarize(exc: ValidationError, limit: int = 8) -> str:
    """`loc: message` for the first few errors of a pydantic ValidationError, on one line each."""
    errors = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in errors[:limit]]
    if len(errors) > limit:
        parts.append(f"... and {len(errors) - limit} more")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------- host


class DiskFacts(FactsModel):
    path: str  # nearest existing ancestor of the workdir
    free_bytes: int  # available to unprivileged users
    total_bytes: int


class GpuDevice(FactsModel):
    index: int
    uuid: str
    name: str
    memory_used_mib: int | None  # None: nvidia-smi said [N/A]
    memory_total_mib: int | None


class GpuProcess(FactsModel):
    pid: int
    gpu_uuid: str
    gpu_index: int | None  # None when the uuid matches no listed device
    used_mib: int | None
    process_name: str


class GpuFacts(FactsModel):
    available: bool  # the GPU query worked (devices are listed)
    error: str | None  # "nvidia-smi not found", its stderr, or a failed compute-apps query
    devices: list[GpuDevice]
    processes: list[GpuProcess]


class Listener(FactsModel):
    address: str  # "127.0.0.1", "0.0.0.0", "::", "::1", ...
    port: int
    inode: int
    pids: list[int]  # processes holding the socket (only those we may read)


class ImportCheck(FactsModel):
    ok: bool
    version: str | None
    error: str | None  # last lines of the import's stderr
    seconds: float


class PathCheck(FactsModel):
    exists: bool
    is_dir: bool


# ---------------------------------------------------------------------------------------- units


class UnitRecord(FactsModel):
    """units/<unit>/unit.json, written at deploy."""

    unit: str | None = None
    fingerprint: str | None = None
    engine: str | None = None
    kind: str | None = None
    port: int | None = None
    gpus: list[int] = Field(default_factory=list)
    tp: int | None = None
    dp: int | None = None
    playbook: str | None = None
    deployed_at: str | None = None


class PidRecord(FactsModel):
    """units/<unit>/pid, written when the unit starts."""

    pid: int
    pgid: int | None = None
    start_time: int | None = None  # clock ticks after boot, /proc/PID/stat field 22
    boot_id: str | None = None
    started_at: str | None = None
    log: str | None = None


class ExitRecord(FactsModel):
    """units/<unit>/exit, written by the unit's wrapper when the process ends."""

    code: int | None = None
    finished_at: str | None = None


class StoppedRecord(FactsModel):
    """units/<unit>/stopped, written by `dflashops stop`: the exit code that follows a stop is
    the signal's doing, not the unit's outcome."""

    stopped_at: str | None = None
    pids: list[int] = Field(default_factory=list)
    killed: bool | None = None


class ProcessFacts(FactsModel):
    """What is at the recorded pid now (pgid, state, start time and cmdline are the live ones)."""

    alive: bool  # the pid exists and is not a zombie
    ours: bool  # alive, and start time and boot id match the pid record: safe to signal
    pid: int | None
    pgid: int | None
    state: str | None
    start_time: int | None
    cmdline: list[str]
    reason: str | None = None  # why it is not ours, for messages


class LogFacts(FactsModel):
    count: int  # timestamped logs kept (current.log itself not counted)
    current: str | None  # current.log's symlink target
    current_size: int | None
    current_mtime: float | None = None


# (field, model, error field, file name) for the per-unit records the payload reads as raw JSON.
_RECORDS: tuple[tuple[str, type[FactsModel], str, str], ...] = (
    ("unit", UnitRecord, "unit_error", "unit.json"),
    ("pid", PidRecord, "pid_error", "pid"),
    ("exit", ExitRecord, "exit_error", "exit"),
    ("stopped", StoppedRecord, "stopped_error", "stopped"),
)


class UnitFacts(FactsModel):
    name: str
    script_sha256: str | None  # of launch.sh; None when absent
    script_error: str | None = None
    unit: UnitRecord | None
    unit_error: str | None = None
    pid: PidRecord | None
    pid_error: str | None = None
    process: ProcessFacts
    group_pids: list[int]  # live members of the recorded process group (only when ours)
    exit: ExitRecord | None
    exit_error: str | None = None
    stopped: StoppedRecord | None = None
    stopped_error: str | None = None
    logs: LogFacts
    progress: dict[str, Any] | None
    progress_error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _demote_bad_records(cls, data: Any) -> Any:
        """A record file of the wrong shape becomes that record's error, not the host's."""
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] | None = None
        for key, model, error_key, filename in _RECORDS:
            raw = data.get(key)
            if raw is None:
                continue
            try:
                model.model_validate(raw)
            except ValidationError as exc:
                out = dict(data) if out is None else out
                out[key] = None
                out[error_key] = f"{filename}: {summarize(exc, 3)}"
        return data if out is None else out

    @property
    def running(self) -> bool:
        """The recorded process is alive and provably the one dflashops started."""
        return self.process.ours and self.process.alive

    @property
    def fingerprint(self) -> str | None:
        return self.unit.fingerprint if self.unit is not None else None


class HostFacts(FactsModel):
    host: str = ""  # the inventory name (set by gather_facts, not by the payload)
    schema_version: Literal[1] = Field(alias="schema")
    hostname: str
    time: float
    python: str
    python_executable: str
    boot_id: str | None
    clock_ticks: int | None
    uptime_s: float | None
    workdir: str
    workdir_exists: bool
    disk: DiskFacts | None
    gpus: GpuFacts
    listening: list[Listener]
    payloads: dict[str, str]  # "<hash16>/<name>" -> full sha256 of the file on the host
    units: dict[str, UnitFacts]
    imports: dict[str, ImportCheck]
    paths: dict[str, PathCheck]
    errors: dict[str, str] = Field(default_factory=dict)  # parts of the payload that failed
    elapsed_s: float | None = None

    def unit(self, name: str) -> UnitFacts | None:
        return self.units.get(name)

    def listener(self, port: int) -> Listener | None:
        """The first listening socket on ``port`` (any address), or None."""
        return next((entry for entry in self.listening if entry.port == port), None)

    def gpu_used_mib(self, index: int) -> int:
        """Memory in use on GPU ``index`` (falls back to the sum over its processes when
        nvidia-smi says [N/A]; 0 for an unknown GPU)."""
        for device in self.gpus.devices:
            if device.index == index and device.memory_used_mib is not None:
                return device.memory_used_mib
        return sum(p.used_mib or 0 for p in self.gpus.processes if p.gpu_index == index)

    def gpu_pids(self, index: int) -> list[int]:
        """Pids of compute processes on GPU ``index``, sorted, without repeats."""
        return sorted({p.pid for p in self.gpus.processes if p.gpu_index == index})

    def has_payload(self, key: str, sha256: str) -> bool:
        """Whether ``payloads/<key>`` is on the host with exactly this content."""
        return self.payloads.get(key) == sha256


# ---------------------------------------------------------------------------------------- gather


@cache
def payload_source() -> bytes:
    """The payload's source, read once from the installed package."""
    return resources.files("dflashops.payloads").joinpath("facts.py").read_bytes()


def payload_command(python: str, request: str) -> Command:
    if python.startswith("~/"):  # a quoted ~ would not expand: spell the home directory out
        return f'"$HOME"/{shlex.quote(python[2:])} - {shlex.quote(request)}'
    return [python, "-", request]


def gather_facts(
    conn: Connection,
    python: str,
    workdir: str,
    *,
    imports: Sequence[str] = (),
    paths: Sequence[str] = (),
    timeout: float = 180.0,
) -> HostFacts:
    """Everything about the host in one remote call; FactsError when the report is unusable."""
    request = {
        "workdir": workdir,
        "imports": list(imports),
        "paths": list(paths),
        # Imports and nvidia-smi run in parallel on the host; leave room for the rest.
        "import_timeout": max(1.0, min(120.0, timeout - 20.0)),
        "nvidia_smi_timeout": max(1.0, min(30.0, timeout / 2)),
    }
    result = conn.run(
        payload_command(python, json.dumps(request)),
        input=payload_source(),
        timeout=timeout,
        check=False,
    )
    return parse_facts(conn.host, python, result)


def parse_facts(host: str, python: str, result: Result) -> HostFacts:
    """Check and validate the payload's answer (split out so it can be tested on its own)."""
    code = result.exit_code
    stderr = f"\n  stderr (last lines):\n{tail(result.err)}" if result.err.strip() else ""
    if code == 127:
        raise FactsError(
            host,
            f"python {python!r} not found on the host; set `python:` for this host in the inventory{stderr}",
        )
    if code == 126:
        raise FactsError(
            host,
            f"python {python!r} cannot be executed on the host (permissions?); set `python:` for this host in the inventory{stderr}",
        )
    text = result.out.strip()
    if code != 0:
        hint = " (the payload needs Python 3.9 or newer)" if "SyntaxError" in result.err else ""
        raise FactsError(
            host,
            f"the facts payload failed with exit code {code} using python {python!r}{hint}{stderr}",
        )
    if not text:
        raise FactsError(
            host,
            f"the facts payload printed nothing (python {python!r}, exit code 0); "
            f"this is not a report of an empty host{stderr}",
        )
    data = load_json_report(text)
    if data is None:
        shown = text[:200] + ("..." if len(text) > 200 else "")
        raise FactsError(
            host,
            f"the facts payload printed something that is not a JSON report (python {python!r}?): {shown!r}",
        )
    schema = data.get("schema")
    if schema != SCHEMA:
        raise FactsError(
            host,
            f"the facts payload answered with schema {schema!r}, this dflashops reads schema {SCHEMA}: "
            "controller and payload versions do not match",
        )
    data["host"] = host
    try:
        return HostFacts.model_validate(data)
    except ValidationError as exc:
        raise FactsError(host, f"the facts report does not validate: {summarize(exc)}") from None


def load_json_report(text: str) -> dict[str, Any] | None:
    """The report: the whole output, or else its last line (a login shell that prints a banner
    to stdout must not break facts). None when neither is a JSON object."""
    for candidate in (text, text.rsplit("\n", 1)[-1]):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
