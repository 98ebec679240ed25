"""The plan's values: a unit (one process on one host), a host's units and node state, the
whole plan with its problems."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dflashops.config.inventory import Host
from dflashops.config.load import Playbook
from dflashops.config.playbook import CommandService, Job, ModelService
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem
from dflashops.plan.nodestate import EnvPlan, NodeState

Spec = ModelService | CommandService | Job


@dataclass(frozen=True)
class Unit:
    """One process dflashops manages on one host."""

    name: str
    host: Host
    kind: Literal["service", "job"]
    engine: str  # sglang | vllm | stub | command | job
    playbook: Playbook
    spec: Spec  # the playbook entry, with {{ vars }} expanded for this host
    source: PathKey  # where the entry sits in the playbook, e.g. ("services", 0)
    service: str  # the service or job name in the playbook
    replica: int | None = None
    port: int | None = None
    gpus: tuple[int, ...] = ()
    needs: tuple[str, ...] = ()  # unit names that must be ready first
    servers: tuple[str, ...] = ()  # URLs given to a job with `servers:`
    env: EnvPlan | None = None  # the environment it runs in
    content: tuple[str, ...] = ()  # files entries (keys) whose content it runs on: its model
    waits: tuple[str, ...] = ()  # files entries (keys) that must be in place first
    # A part of a unit over several hosts: every host of ``nodes`` (rank order, head first) has
    # a part of that name; ``rank`` is this host's; the others dial ``head``:``dist_port``.
    nodes: tuple[str, ...] = ()
    rank: int | None = None
    head: str | None = None
    dist_port: int | None = None
    # The API server of a vLLM service over a Ray cluster: the Ray nodes' addresses, head
    # first (its Ray port is ``dist_port``); it serves once every one is in with its GPUs.
    cluster: tuple[str, ...] = ()
    # GPUs the process sees without holding them: the Ray API server sees its node's, which
    # that node's Ray part holds (None: it sees what it holds, ``gpus``).
    sees: tuple[int, ...] | None = None

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    @property
    def tp(self) -> int:
        return self.spec.tp if isinstance(self.spec, ModelService) else 1

    @property
    def dp(self) -> int:
        return self.spec.dp if isinstance(self.spec, ModelService) else 1

    def problem(self, message: str, *path: str | int) -> Problem:
        return self.playbook.doc.problem(
            (*self.source, *path), f"[{self.host.name}] {self.name}: {message}"
        )


@dataclass
class HostPlan:
    host: Host
    units: list[Unit] = field(default_factory=list)
    node: NodeState = field(default_factory=NodeState)


@dataclass
class Plan:
    hosts: dict[str, HostPlan]
    problems: list[Problem]

    @property
    def units(self) -> list[Unit]:
        return [u for hp in self.hosts.values() for u in hp.units]


Where = Callable[[str], Problem]  # turns a message into a located problem


def locator(book: Playbook, path: PathKey, prefix: str) -> Where:
    return lambda message: book.doc.problem(path, prefix + message)


def dial_host(bind: str | None) -> str:
    """The address a server bound to ``bind`` is dialled at from its own host (probes,
    liveness, the servers list): a wildcard bind is reached on loopback."""
    return "127.0.0.1" if bind in (None, "0.0.0.0", "::", "") else bind


def span_of(unit: Unit) -> str | None:
    """The unit over several hosts this part belongs to (playbook/service), if any."""
    if unit.multi_node or unit.cluster:
        return f"{unit.playbook.name}/{unit.service}"
    return None


def label(unit: Unit) -> str:
    """How the other hosts name this part: ``big-ray (rank 1 of 2) on h1``."""
    rank = f" (rank {unit.rank} of {len(unit.nodes)})" if unit.multi_node else ""
    return f"{unit.name}{rank} on {unit.host.name}"
