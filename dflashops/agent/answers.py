"""What the host agent answers, as typed models: strict JSON types, frozen, and unknown keys
from a newer agent ignored. A record file of the wrong shape (unit.json, pid, exit, stopped
written by hand or half-written) becomes that record's error, never the whole host's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflashops.agent.remote import layout


class FactsModel(BaseModel):
    """Strict (no coercion between JSON types), frozen; unknown keys from newer payloads ignored."""

    # defer_build: a model is built the first time it validates (a no-op deploy builds the
    # facts models only, not the answers of actions it never calls).
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", defer_build=True)


def summarize(exc: ValidationError, limit: int = 8) -> str:
    """`loc: message` for the first few errors of a pydantic ValidationError, on one line each."""
    errors = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in errors[:limit]]
    if len(errors) > limit:
        parts.append(f"... and {len(errors) - limit} more")
    return "; ".join(parts)


def invalid_records(data: Any, checks: list[tuple[str, type[BaseModel]]]) -> dict[str, str]:
    """key -> why, for each record in ``data`` (a raw answer) that its model rejects."""
    if not isinstance(data, dict):
        return {}
    bad = {}
    for key, model in checks:
        if data.get(key) is not None:
            try:
                model.model_validate(data[key])
            except ValidationError as exc:
                bad[key] = summarize(exc, 3)
    return bad


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
    utilization_pct: int | None = None


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
    skipped: bool = False  # not gathered: nothing the facts call was told of could start

    def device(self, index: int) -> GpuDevice | None:
        return next((d for d in self.devices if d.index == index), None)


class Holder(FactsModel):  # a listener's holder when not all this workdir's units are
    pid: int
    cmdline: list[str]
    unit: str | None  # the dflashops unit it is (of any workdir), if it is one
    workdir: str | None  # that unit's workdir
    this_workdir: bool  # ... is the one asked about


class Listener(FactsModel):
    address: str  # "127.0.0.1", "0.0.0.0", "::", "::1", ...
    port: int
    inode: int
    pids: list[int]  # processes holding the socket (only those we may read)
    user: str | None = None  # the socket's owner, when no holder is visible to us
    holders: list[Holder] = []  # who they are, when not all ours


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

    unit_schema: int | None = None  # layout.UNIT_SCHEMA when written; None: written before it
    unit: str | None = None
    fingerprint: str | None = None
    engine: str | None = None
    kind: str | None = None
    port: int | None = None
    gpus: list[int] = Field(default_factory=list)
    tp: int | None = None
    dp: int | None = None
    playbook: str | None = None
    stop_grace: float | None = None  # kept so that an orphan stops as it was meant to
    content: dict[str, str | None] = Field(default_factory=dict)  # files key -> digest run on
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
    """units/<unit>/exit, written by the unit's supervisor when launch.sh ends."""

    code: int | None = None  # 128 + signal number when killed by a signal
    signal: str | None = None  # "SIGKILL", ...
    finished_at: str | None = None
    child_pid: int | None = None
    reason: str | None = None  # "liveness": its supervisor ended it after failed probes


class StoppedRecord(FactsModel):
    """units/<unit>/stopped, written by `dflashops stop`: the exit code that follows a stop is
    the signal's doing, not the unit's outcome."""

    stopped_at: str | None = None
    pids: list[int] = Field(default_factory=list)
    killed: bool | None = None


class SupervisorState(FactsModel):
    """units/<unit>/supervisor.json, kept by the unit's supervisor on the host."""

    state: str  # running | backoff | waiting-gpu | crashed | ended
    since: str | None = None
    child_pid: int | None = None
    restarts: int = 0
    history: list[dict[str, Any]] = Field(default_factory=list)  # the last crashes
    next_start_in: float | None = None

    @property
    def restarting(self) -> bool:
        """The unit crashed and its supervisor is about to start it again."""
        return self.state in ("backoff", "waiting-gpu")


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
    ("unit", UnitRecord, "unit_error", layout.UNIT_RECORD),
    ("pid", PidRecord, "pid_error", layout.PID),
    ("exit", ExitRecord, "exit_error", layout.EXIT),
    ("stopped", StoppedRecord, "stopped_error", layout.STOPPED),
    ("supervisor", SupervisorState, "supervisor_error", layout.SUPERVISOR),
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
    group_pids: list[int]  # live processes of the unit's group provably ours (see ownership)
    unproven_pids: list[int] = Field(default_factory=list)  # in its group, not provably ours
    exit: ExitRecord | None
    exit_error: str | None = None
    stopped: StoppedRecord | None = None
    stopped_error: str | None = None
    supervisor_error: str | None = None
    logs: LogFacts
    progress: dict[str, Any] | None
    progress_error: str | None = None
    supervisor: SupervisorState | None = None
    crashed: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _demote_bad_records(cls, data: Any) -> Any:
        """A record file of the wrong shape becomes that record's error, not the host's."""
        bad = invalid_records(data, [(key, model) for key, model, _, _ in _RECORDS])
        if not bad:
            return data
        out = dict(data, **dict.fromkeys(bad))
        for key, _, error_key, filename in _RECORDS:
            if key in bad:
                out[error_key] = f"{filename}: {bad[key]}"
        return out

    @property
    def running(self) -> bool:
        """The recorded process is alive and provably the one dflashops started."""
        return self.process.ours and self.process.alive

    @property
    def fingerprint(self) -> str | None:
        return self.unit.fingerprint if self.unit is not None else None


class FreeSpace(FactsModel):
    path: str  # the nearest existing folder of the place asked about
    free_bytes: int


class SourceState(FactsModel):
    exists: bool
    digest: str | None  # None: not every file could be hashed within the facts budget
    bytes: int


Listing = dict[str, list[Any]]  # rel -> [size, sha256 or None]
Parts = dict[str, dict[str, int]]  # rel -> {sha16 of the file being sent: bytes already there}


class FileState(FactsModel):
    """A files entry's dest on the host, from its manifest (and a host source's digest)."""

    exists: bool
    digest: str | None
    free: FreeSpace
    src: SourceState | None = None
    files: Listing | None = None  # only where dest does not hold what was expected
    parts: Parts | None = None
    origin: dict[str, Any] | None = None  # a hub download's repo, revision, commit, digest


class EnvState(FactsModel):
    state: str  # ok (the build of this content is in place) | missing | other | unmanaged | broken
    current: str | None  # the build PATH links to now
    note: str | None = None  # broken: why (its interpreter no longer runs)


class HostFacts(FactsModel):
    host: str = ""  # the inventory name (set by the client, not by the agent)
    hostname: str
    time: float
    python: str
    python_executable: str
    boot_id: str | None
    node_id: str | None = None  # WORKDIR/node.json, written at the first deploy; None: absent
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
    files: dict[str, FileState] = Field(default_factory=dict)  # by the entry's key
    envs: dict[str, EnvState] = Field(default_factory=dict)
    tools: dict[str, str | None] = Field(default_factory=dict)  # uv, hf: where, or None
    notify_sha256: str | None = None  # of WORKDIR/notify.json, the host's webhook
    probe: ProbeResult | None = None  # the units asked about, probed in the same call
    interfaces: list[str] = Field(default_factory=list)  # network interfaces (/sys/class/net)
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
    pruned_to: str | None = None  # units/.pruned/<unit>-<UTC time>, relative to the workdir
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
    metrics_path: str | None = None  # fetched as text; parsed on the controller
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


class UnitProbe(FactsModel):
    name: str = ""
    alive: bool  # the recorded pid exists and is not a zombie
    ours: bool  # and it is provably the process dflashops started
    pid: int | None
    started_at: str | None = None
    crashed: dict[str, Any] | None = None  # the supervisor gave up (restart_limit)
    supervisor: SupervisorState | None = None
    progress: dict[str, Any] | None = None
    metrics: str | None = None  # /metrics as the server answered it
    reason: str | None = None  # why not alive/ours
    log: str | None = None  # current log, "logs/<name>.log"
    exit: ExitRecord | None
    stopped: StoppedRecord | None = None
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
        checks: list[tuple[str, type[BaseModel]]] = [
            ("exit", ExitRecord),
            ("stopped", StoppedRecord),
            ("banner", Banner),
            ("supervisor", SupervisorState),
        ]
        bad = invalid_records(data, checks)
        if not bad:
            return data
        errors = [*(data.get("errors") or []), *(f"{k}: {why}" for k, why in bad.items())]
        return dict(data, **dict.fromkeys(bad), errors=errors)

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
    time: float | None = None  # the host's clock
    gpus: GpuFacts | None = None  # when asked for
    elapsed_s: float | None = None


class WaitReport(ProbeResult):
    """One line of a ``wait``: the probes of the units still waited for when it was sent
    (none in a heartbeat, sent when nothing happened for ``report_every`` seconds); ``done``
    are those whose wait is over (ready, dead or out of time), ``final`` the last."""

    done: list[str] = Field(default_factory=list)
    final: bool = False


# ---------------------------------------------------------------------------------------- tail


class TailResult(FactsModel):
    log: str | None  # "logs/<name>.log" read, None when the unit has no log yet
    size: int  # of that log, when read
    text: str
    offset: int  # pass back (with log) to get what comes next
    rotated: bool = False  # current.log moved to a newer log: text is from its start
    truncated: bool = False  # the log is shorter than the offset: text is from its start


# ---------------------------------------------------------------------------------------- write


class WriteResult(FactsModel):
    ok: bool
    written: list[str]
    error: str | None = None


# ---------------------------------------------------------------------------------------- files


class TreeScan(FactsModel):
    exists: bool
    kind: str  # file | tree
    digest: str | None
    files: Listing = Field(default_factory=dict)
    parts: Parts = Field(default_factory=dict)
    hashed_bytes: int = 0


class JobState(FactsModel):
    state: str  # never | running | done | failed | stopped
    exit: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None


class ScanResult(FactsModel):
    tree: TreeScan | None = None  # None: only the job was asked about
    job: JobState | None = None


class ReceiveResult(FactsModel):
    ok: bool
    written: list[str]
    failed: dict[str, str]
    deleted: list[str]
    digest: str | None
    error: str | None = None
    elapsed_s: float | None = None  # on the host, from the request to the answer


class CopyResult(FactsModel):
    ok: bool
    copied: list[str]
    bytes: int
    deleted: list[str]
    digest: str | None
    src_digest: str | None = None
    origin: dict[str, Any] | None = None
    failed: dict[str, str] = Field(default_factory=dict)
    error: str | None = None


class SendResult(FactsModel):
    sent: list[str]
    missing: list[str]


class BuildResult(FactsModel):
    ok: bool
    built: bool = False
    build: str | None = None
    installer: str | None = None
    seconds: float = 0.0
    log: str | None = None
    error: str | None = None
    note: str | None = None  # what the build found first (a killed build, a broken one)


class Listening(FactsModel):
    """The head's side of a rendezvous check, as it starts (``listening``) and as it ends."""

    listening: bool
    held: bool = False  # the port is taken (by the unit's own engine, or by someone else)
    error: str | None = None
    peers: list[dict[str, str]] = Field(default_factory=list)  # {name, from}


class Dialled(FactsModel):
    ok: bool
    error: str | None = None
    seconds: float | None = None


HostFacts.model_rebuild()  # its probe field names a model defined below it
