"""Playbook files: the services and jobs that should run on a set of hosts."""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from dflashops.config.inventory import StrictModel
from dflashops.config.job_metrics import JobMetrics
from dflashops.config.nodestate import Environment, FileEntry
from dflashops.config.types import (
    FLAG_RE,
    Env,
    EnvName,
    Name,
    PathStr,
    Port,
    Seconds,
    Size,
    Text,
)

Scalar = str | int | float | bool
# `key: value` -> --key value; true -> --key; false/null -> omitted; a list -> --key v1 v2;
# a mapping -> --key '<compact JSON>' (vLLM's --speculative-config and friends take JSON).
ArgValue = Scalar | None | list[str | int | float] | dict[str, Any]
Args = dict[str, ArgValue]
GpuList = list[Annotated[int, Field(ge=0, le=63)]]


def _flag_name(value: str) -> str:
    if not FLAG_RE.match(value) or value.startswith("-") or value.endswith("\n"):
        raise ValueError(
            f"{value!r} is not a flag name: write it without leading dashes "
            "(letters, digits, '-', '_', '.')"
        )
    return value


FlagName = Annotated[str, AfterValidator(_flag_name)]


def _check_args(args: dict[str, Any]) -> dict[str, Any]:
    for key in args:
        if not FLAG_RE.fullmatch(key) or key.startswith("-"):
            raise ValueError(
                f"argument name {key!r} is not a flag name: write it without leading dashes "
                "(letters, digits, '-', '_', '.')"
            )
    for key, value in args.items():
        try:
            # Mappings become --key '<JSON>', and every string lands in a script: both must be
            # plain JSON-able text (no YAML dates or binary, no lone surrogates, string keys).
            json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError):
            raise ValueError(
                f"argument {key!r} must be plain text, numbers, booleans, lists or mappings with string keys"
            ) from None
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str) and "\x00" in item:
                raise ValueError(f"argument {key!r} contains a NUL character")
    return args


class Ready(StrictModel):
    """How readiness is probed: HTTP GET on the unit's port until 200, never a sleep."""

    timeout: Annotated[Seconds, Field(description="Give up after this long ('20m', '90s').")] = (
        1200.0
    )
    interval: Annotated[Seconds, Field(description="Time between probes ('5s').")] = 5.0
    path: Annotated[
        Text | None,
        Field(description="HTTP path probed for a 200 (default: the engine's health endpoint)."),
    ] = None

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or any(c.isspace() for c in value)):
            raise ValueError("a probe path starts with '/' and has no spaces")
        return value


RestartPolicy = Literal["no", "on-failure", "always"]


class Backoff(StrictModel):
    """Time between a crash and the restart: ``initial``, doubling after each crash in a row,
    at most ``max`` (a unit that stayed up longer than ``max`` starts again from ``initial``)."""

    initial: Annotated[Seconds, Field(description="Wait before the first restart ('10s').")] = 10.0
    max: Annotated[Seconds, Field(description="The longest wait ('5m').")] = 300.0


class RestartLimit(StrictModel):
    """More than ``count`` restarts within ``window``: the unit is `crashed` and stays down."""

    count: Annotated[int, Field(ge=1, le=1000, description="Restarts allowed per window.")] = 5
    window: Annotated[Seconds, Field(description="The window ('1h').")] = 3600.0


class Liveness(StrictModel):
    """An HTTP probe run on the host by the unit's supervisor once the unit has answered it
    once: after ``failures`` failures in a row the unit is restarted as if it had crashed."""

    path: Annotated[
        Text,
        Field(description="Path probed for a 200 (SGLang's /health_generate runs a generation)."),
    ] = "/health_generate"
    interval: Annotated[Seconds, Field(description="Time between probes ('60s').")] = 60.0
    timeout: Annotated[Seconds, Field(description="A probe slower than this fails ('30s').")] = 30.0
    failures: Annotated[int, Field(ge=1, le=100, description="Failures in a row that restart.")] = 3

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or any(c.isspace() for c in value):
            raise ValueError("a probe path starts with '/' and has no spaces")
        return value


KEEP_TO_RE = re.compile(r"^(?P<host>[a-z0-9][a-z0-9-]*):(?P<path>(?:/|~/).*)$")


def _kept_path(value: str) -> str:
    """Absolute on the host or relative to its workdir; never '..', '/' or the workdir."""
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} contains '..': name the place itself")
    if value.startswith("~") and not value.startswith("~/"):
        raise ValueError(f"{value!r}: '~' must be followed by '/'")
    if keep_name(value) in ("", ".", "~"):
        raise ValueError(f"{value!r} names no file or folder to keep (like completions/)")
    return value


def keep_name(path: str) -> str:
    """The name a kept path has in its copy (``KEEP/HOST/JOB/NAME/...``): its last part."""
    return posixpath.basename(path.rstrip("/"))


class Keep(StrictModel):
    """A job's outputs, mirrored off the node while it runs and restored before it starts on a
    host that lost them (DESIGN "Nothing lost when a node is lost" 1-2)."""

    paths: Annotated[
        list[Annotated[PathStr, AfterValidator(_kept_path)]],
        Field(
            min_length=1,
            description="Files or folders the job writes: absolute on the host (/..., ~/...) or "
            "relative to its workdir. Each is kept as NAME (its last part) in the copy.",
        ),
    ]
    to: Annotated[
        Text,
        Field(
            description="controller (.dflashops/keep/HOST/JOB/ beside the inventory) or "
            "'HOST:/path' on another inventory host (relayed through the controller's copy)."
        ),
    ] = "controller"
    every: Annotated[Seconds, Field(description="How often `watch` mirrors (at least 5s).")] = 60.0
    limit: Annotated[
        Size | None, Field(description="Bytes per second one mirror may send ('20MiB').")
    ] = None

    @field_validator("to")
    @classmethod
    def _to(cls, value: str) -> str:
        if value != "controller" and (not KEEP_TO_RE.fullmatch(value) or "/../" in f"{value}/"):
            raise ValueError(f"{value!r} is neither `controller` nor 'HOST:/absolute/path'")
        return value

    @field_validator("every")
    @classmethod
    def _every(cls, value: float) -> float:
        if value < 5:
            raise ValueError(f"every must be at least 5s (got {value:g}s)")
        return value

    @field_validator("paths")
    @classmethod
    def _distinct_names(cls, value: list[str]) -> list[str]:
        names = [keep_name(p) for p in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two paths would both be kept as {twice[0]!r}: keep one of them")
        return value

    @property
    def target(self) -> tuple[str, str] | None:
        """(host, path) of ``to: HOST:/path``; None for the controller."""
        m = KEEP_TO_RE.fullmatch(self.to)
        return (m.group("host"), m.group("path").rstrip("/") or "/") if m else None


def keep_target_problem(keep: Keep, host: str, hosts: Collection[str]) -> str | None:
    """Why ``to: HOST:/path`` cannot take the copy of a job on ``host`` (None: it can)."""
    target = keep.target
    if target is not None and target[0] not in hosts:
        return f"keep.to names {target[0]!r}, which is not a host of the inventory"
    if target is not None and target[0] == host:
        return f"keep.to names {host}, the job's own host: the copy would be lost with it"
    return None


class UnitBase(StrictModel):
    name: Annotated[
        Name, Field(description="Unit name (lowercase letters, digits, '-'); unique per host.")
    ]
    env: Annotated[Env, Field(description="Environment variables for this unit.")] = Field(
        default_factory=dict
    )
    secret_env: Annotated[
        dict[EnvName, EnvName],
        Field(
            description="VAR_ON_HOST: VAR_ON_CONTROLLER. Taken from the controller's environment at deploy "
            "time, written to a 0600 file on the host, never into the script or any output."
        ),
    ] = Field(default_factory=dict)
    secret_args: Annotated[
        dict[FlagName, EnvName],
        Field(
            description="FLAG: VAR_ON_CONTROLLER. An engine flag (without dashes) whose value is "
            "taken from the controller's environment at deploy time and reaches the engine "
            "without argv: vLLM's api-key as VLLM_API_KEY, SGLang's (and vLLM's other) flags "
            "in a 0600 file given with the engine's own --config; a command or job reads it "
            "from a 0600 file into the flag at exec time. Never in the script or any output."
        ),
    ] = Field(default_factory=dict)
    stop_grace: Annotated[
        Seconds, Field(description="Time between SIGTERM and SIGKILL when stopping ('30s').")
    ] = 30.0
    log_max_size: Annotated[
        Size | None,
        Field(
            description="The unit's current log is rotated at this size ('256MiB'; default "
            "1GiB) while the unit runs on; the newest 20 logs are kept."
        ),
    ] = None
    environment: Annotated[
        Name | None,
        Field(description="Run with that environment's python (`environments:` of a playbook)."),
    ] = None
    restart: Annotated[
        RestartPolicy | None,
        Field(
            description="Restarted by its supervisor on the host when it ends: no | on-failure | "
            "always (default: on-failure for services, no for jobs)."
        ),
    ] = None
    restart_backoff: Annotated[Backoff, Field(description="Waits between restarts.")] = Field(
        default_factory=Backoff
    )
    restart_limit: Annotated[
        RestartLimit, Field(description="How many restarts, per window, before `crashed`.")
    ] = Field(default_factory=RestartLimit)

    @model_validator(mode="after")
    def _env_disjoint(self) -> UnitBase:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"variables set in both env and secret_env: {', '.join(both)}")
        both = sorted(set(getattr(self, "args", {})) & set(self.secret_args))
        if both:
            raise ValueError(f"flags set in both args and secret_args: {', '.join(both)}")
        return self


class Launcher(StrictModel):
    """A wrapper script that starts vLLM itself, e.g. speculators' launch_vllm.py:
    `python SCRIPT MODEL [args] -- VLLM_ARGS`."""

    script: Annotated[
        PathStr,
        Field(
            description="Script shipped to the host (relative to the playbook), or 'host:/abs/path' for "
            "one already on the host (e.g. inside a speculators checkout)."
        ),
    ]
    args: Annotated[Args, Field(description="The launcher's own flags, placed before '--'.")] = (
        Field(default_factory=dict)
    )

    _args = field_validator("args")(_check_args)


class ServiceBase(UnitBase):
    engine: Annotated[
        Literal["sglang", "vllm", "stub", "command"],
        Field(description="sglang | vllm | stub (dflashops' CPU stand-in) | command (any argv)."),
    ]
    replicas: Annotated[
        int,
        Field(ge=1, le=64, description="Independent copies; replica i is unit NAME-i on port + i."),
    ] = 1
    port: Annotated[
        Port | None, Field(description="Port of replica 0; replica i listens on port + i.")
    ] = None
    bind: Annotated[Text, Field(description="Address the server listens on (engines' --host).")] = (
        "127.0.0.1"
    )
    gpus: Annotated[
        Literal["auto"] | GpuList,
        Field(
            description="'auto' (allocated in playbook order) or an explicit list of GPU indices, "
            "tp*dp per replica, in replica order."
        ),
    ] = "auto"
    ready: Annotated[Ready, Field(description="Readiness probe settings.")] = Field(
        default_factory=Ready
    )
    liveness: Annotated[
        Liveness | None,
        Field(description="Health probed on the host all along; failures restart the unit."),
    ] = None
    args: Annotated[
        Args, Field(description="Extra engine flags: `key: value` -> --key value, true -> --key.")
    ] = Field(default_factory=dict)

    _args = field_validator("args")(_check_args)


class ModelService(ServiceBase):
    model: Annotated[PathStr, Field(description="Model path on the host or hub id.")]
    tp: Annotated[int, Field(ge=1, le=64, description="Tensor parallel size per replica.")] = 1
    dp: Annotated[int, Field(ge=1, le=64, description="Data parallel size per replica.")] = 1


class SglangService(ModelService):
    engine: Literal["sglang"]
    nodes: Annotated[
        list[Name] | None,
        Field(
            min_length=1,
            description="Hosts (or groups) the service spans, in rank order: the first is the head "
            "(node 0). Each runs SGLang's own multi-node launch (--nnodes, --node-rank, "
            "--dist-init-addr); tp and dp count every node, so each node runs tp*dp/len(nodes) GPUs.",
        ),
    ] = None
    dist_port: Annotated[
        Port, Field(description="Rendezvous port on the head of a multi-node service.")
    ] = 29500

    @model_validator(mode="after")
    def _one_replica_over_nodes(self) -> SglangService:
        if self.nodes is not None and self.replicas != 1:
            raise ValueError("a service over several nodes has one replica (`replicas: 1`)")
        return self


class StubService(ModelService):
    """dflashops' own CPU stand-in with SGLang's core flags and endpoints (not a real engine)."""

    engine: Literal["stub"]


class VllmService(ModelService):
    engine: Literal["vllm"]
    allow_dp: Annotated[
        bool,
        Field(
            description="Permit dp > 1. Dense models should use replicas of DP=1 servers instead "
            "(INCIDENTS.md #2); set this for MoE models that need vLLM's data parallelism."
        ),
    ] = False
    launcher: Annotated[
        Launcher | None, Field(description="Optional wrapper script that starts vLLM.")
    ] = None
    pp: Annotated[
        int, Field(ge=1, le=64, description="Pipeline parallel size (--pipeline-parallel-size).")
    ] = 1
    nodes: Annotated[
        list[Name] | None,
        Field(
            min_length=1,
            description="Hosts (or groups) the server spans, in rank order (the first serves the "
            "API). Needs `backend`; tp*pp*dp count every node, each node gives tp*pp*dp/len(nodes) GPUs.",
        ),
    ] = None
    backend: Annotated[
        Literal["native", "ray"] | None,
        Field(
            description="How vLLM spans nodes. native: vLLM's own --nnodes, --node-rank, "
            "--master-addr, --master-port (--headless on the other nodes). ray: a Ray cluster "
            "(`ray start --block`, unit NAME-ray on every node, head on the first), then "
            "`vllm serve --distributed-executor-backend ray` on the first node once the cluster "
            "shows every node with its GPUs."
        ),
    ] = None
    dist_port: Annotated[
        Port,
        Field(
            description="On the first node: vLLM's --master-port (native) or the Ray head's "
            "--port (ray)."
        ),
    ] = 29501

    @model_validator(mode="after")
    def _one_api_key(self) -> VllmService:
        # secret_args' api-key becomes VLLM_API_KEY: a second source would silently lose.
        if "api-key" in self.secret_args and "VLLM_API_KEY" in {*self.env, *self.secret_env}:
            raise ValueError(
                "secret_args' api-key is delivered as VLLM_API_KEY: do not set that variable too"
            )
        return self

    @model_validator(mode="after")
    def _nodes_need_a_backend(self) -> VllmService:
        if self.nodes is not None:
            if self.backend is None:
                raise ValueError(
                    "a vLLM service over several nodes needs `backend: native` or `backend: ray`"
                )
            if self.replicas != 1:
                raise ValueError("a service over several nodes has one replica (`replicas: 1`)")
            if self.launcher is not None:
                raise ValueError("a `launcher` cannot be combined with `nodes`")
        return self


class CommandService(ServiceBase):
    engine: Literal["command"]
    command: Annotated[
        list[Text],
        Field(
            min_length=1,
            description="argv of the server; no shell. Use {port} for the replica's port.",
        ),
    ]
    gpus_per_replica: Annotated[
        int, Field(ge=0, le=64, description="GPUs each replica needs when gpus is 'auto'.")
    ] = 0


Service = Annotated[
    SglangService | VllmService | StubService | CommandService,
    Field(discriminator="engine"),
]


class Job(UnitBase):
    """A process that runs to completion (or until stopped), optionally after services are ready."""

    script: Annotated[
        PathStr | None,
        Field(
            description="File shipped and run: a path relative to the playbook, or 'dflashops:NAME' for a "
            "built-in payload, or 'host:/abs/path' for a file already on the host. .py runs with the host's "
            "python, .sh with bash, anything else directly."
        ),
    ] = None
    command: Annotated[
        list[Text] | None, Field(description="argv to run instead of a script; no shell.")
    ] = None
    args: Annotated[Args, Field(description="Flags appended: `key: value` -> --key value.")] = (
        Field(default_factory=dict)
    )
    servers: Annotated[
        Name | None,
        Field(description="A service on the same host: adds --servers with every replica's URL."),
    ] = None
    needs: Annotated[
        list[Name],
        Field(
            description="Units or services that must be ready, or named files entries that must "
            "be in place, before this job starts."
        ),
    ] = Field(default_factory=list)
    restart_with: Annotated[
        list[Name],
        Field(
            description="Services whose restart also restarts this job (otherwise it keeps running)."
        ),
    ] = Field(default_factory=list)
    gpus: Annotated[
        Annotated[int, Field(ge=0, le=64)] | GpuList,
        Field(
            description="A count (allocated after the host's services) or an explicit list of "
            "indices; per node for a job over several nodes."
        ),
    ] = 0
    launcher: Annotated[
        Literal["torchrun"] | None,
        Field(
            description="torchrun: the script runs under torchrun (--nnodes, --node-rank, "
            "--master-addr, --master-port, --nproc-per-node), the torchrun beside the unit's "
            "python, else on the host's PATH."
        ),
    ] = None
    nodes: Annotated[
        list[Name] | None,
        Field(
            min_length=1,
            description="Hosts (or groups) the job spans, in rank order (the first is the "
            "master); needs `launcher: torchrun`.",
        ),
    ] = None
    nproc_per_node: Annotated[
        int | None,
        Field(
            ge=1, le=64, description="Processes per node (default: the job's GPUs on it, else 1)."
        ),
    ] = None
    dist_port: Annotated[
        Port, Field(description="torchrun's --master-port, on the first node.")
    ] = 29500
    keep: Annotated[
        Keep | None, Field(description="Outputs mirrored off the node, restored before a start.")
    ] = None
    metrics: Annotated[
        JobMetrics | None,
        Field(description="Its own numbers to plot: {log: REGEX} (named groups) or {file: PATH}."),
    ] = None

    _args = field_validator("args")(_check_args)

    @model_validator(mode="after")
    def _script_or_command(self) -> Job:
        if (self.script is None) == (self.command is None):
            raise ValueError("a job needs exactly one of `script` or `command`")
        if self.nodes is not None and self.launcher is None:
            raise ValueError("a job over several nodes needs `launcher: torchrun`")
        if self.keep is not None and self.nodes is not None:
            raise ValueError("`keep` is for a job on one host, not one over several nodes")
        if self.launcher == "torchrun" and (
            self.script is None
            or not (self.script.endswith(".py") or self.script.startswith("dflashops:"))
        ):
            raise ValueError("`launcher: torchrun` runs a Python `script` (a .py file)")
        return self


class PlaybookHead(StrictModel):
    """What a playbook is called and where it goes. A playbook whose values use {{ vars }} is
    validated in full only per host, once the values are filled in (a port may come from a
    host's vars); the head is checked right away."""

    name: Annotated[Name, Field(description="Playbook name.")]
    hosts: Annotated[Name | list[Name], Field(description="A host, a group, or a list of them.")]
    vars: Annotated[
        dict[str, Any], Field(description="Template variables for {{ name }} in string values.")
    ] = Field(default_factory=dict)
    services: list[Any] = Field(default_factory=list)
    jobs: list[Any] = Field(default_factory=list)
    environments: dict[str, Any] = Field(default_factory=dict)
    files: list[Any] = Field(default_factory=list)

    @property
    def host_patterns(self) -> list[str]:
        return [self.hosts] if isinstance(self.hosts, str) else list(self.hosts)


class PlaybookFile(PlaybookHead):
    """One playbook: environments, files, services and jobs for a set of hosts."""

    environments: Annotated[
        dict[Name, Environment],
        Field(description="Python environments units run in, by name (built before files)."),
    ] = Field(default_factory=dict)
    files: Annotated[
        list[FileEntry],
        Field(description="Content that must be on the hosts (synced before services)."),
    ] = Field(default_factory=list)

    services: Annotated[list[Service], Field(description="Long-running servers.")] = Field(
        default_factory=list
    )
    jobs: Annotated[
        list[Job], Field(description="Jobs, started after the units they need are ready.")
    ] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> PlaybookFile:
        seen: set[str] = set()
        for unit in [*self.services, *self.jobs]:
            if unit.name in seen:
                raise ValueError(f"two services or jobs are named {unit.name!r}")
            seen.add(unit.name)
        for entry in self.files:
            if entry.name is not None and entry.name in seen:
                raise ValueError(f"{entry.name!r} names both a files entry and a unit or entry")
            if entry.name is not None:
                seen.add(entry.name)
        return self
