"""One host's session: its connection, its agent, its workdir, its facts and its peers.

What every command that talks to a host shares (status, top and logs use it alone; deploy's
HostRun builds on it). It changes nothing on the host: the deploy executor (deploy.py, stage.py,
transfer.py) is never imported from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dflashops.agent import Agent
from dflashops.agent.answers import HostFacts
from dflashops.agent.remote import layout
from dflashops.changes.orphans import Orphan, find
from dflashops.changes.verdicts import probe_spec
from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.errors import HostError
from dflashops.events import EventLog
from dflashops.hosts import connect
from dflashops.hosts.base import BaseConnection
from dflashops.lifecycle.secrets import Secrets, resolve
from dflashops.plan.nodestate import NodeState, local_scan


@dataclass
class HostSession:
    host: Host
    rendered: list[Rendered]
    events: EventLog
    # Unit names the project's playbooks define for this host; None: unknown (a project
    # playbook did not load), so nothing is called an orphan.
    known: set[str] | None = None
    node: NodeState = field(default_factory=NodeState)  # environments and files for this host
    peers: dict[str, Host] = field(default_factory=dict)  # the inventory: relay sources
    orphans: list[Orphan] = field(default_factory=list)
    warm: BaseConnection | None = None  # opened while pre-flight ran (prewarm.py)
    secrets: Secrets | None = None  # resolved here (secrets.py) unless given

    def __post_init__(self) -> None:
        # The one read of the controller's environment for this host's run, and the one
        # registration of what it holds for redaction.
        if self.secrets is None:
            self.secrets = resolve(self.host, self.rendered, self.node, os.environ)
        self.resolved: Secrets = self.secrets
        self.events.add_secrets(self.resolved.redacted())
        self.conn = self.warm if self.warm is not None else connect(self.host)
        # One agent kept for the run: facts, write, stop, start and wait are requests to it,
        # not a new interpreter each (round trips stay; processes and their start-up go).
        self.agent = Agent(self.conn, self.host.python, keep=True)
        self.workdir = self.host.workdir  # replaced by the host's absolute path at the first facts
        self.peer_agents: dict[str, Agent] = {}

    def peer(self, name: str) -> Agent:
        """The agent on another inventory host (a relay's source), connected once."""
        if name == self.host.name:
            return self.agent
        if name not in self.peer_agents:
            if name not in self.peers:
                raise HostError(self.host.name, f"{name} is not in the inventory")
            other = self.peers[name]
            self.peer_agents[name] = Agent(connect(other), other.python)
        return self.peer_agents[name]

    def peer_workdir(self, name: str) -> str:
        return self.workdir if name == self.host.name else self.peers[name].workdir

    def emit(
        self, unit: str | None, status: str, action: str, message: str, **data: object
    ) -> None:
        self.events.emit(self.host.name, unit, status, action, message, **data)  # type: ignore[arg-type]

    def unit_dir(self, name: str) -> str:
        return layout.unit_dir(self.workdir, name)

    def gather(self, probe: bool = False, rerun: bool = False) -> HostFacts:
        """Facts (with ``probe``: the services' probes too, for a deploy's first verdicts;
        ``rerun``: no unit is judged settled, jobs that finished run again)."""
        facts = self.agent.facts(
            self.host.workdir,
            files=files_request(self.node),
            envs=envs_request(self.node),
            ports=[r.unit.port for r in self.rendered if r.unit.port is not None],
            probes=[
                probe_spec(r, self.resolved.values)
                for r in self.rendered
                if r.unit.kind == "service"
            ]
            if probe
            else (),
            settled=None
            if rerun or not probe
            else {
                r.unit.name: {"fingerprint": r.fingerprint, "job": r.unit.kind == "job"}
                for r in self.rendered
            },
        )
        self.workdir = facts.workdir
        self.orphans = find(facts, self.known) if self.known is not None else []
        return facts

    def close(self) -> None:
        # For --json readers and benchmarks: how many round trips this host cost.
        self.agent.close()
        self.events.emit(
            self.host.name,
            None,
            "info",
            "stats",
            f"{self.agent.round_trips} round trips, {self.conn.commands} remote commands",
            show=False,
            commands=self.conn.commands,
            round_trips=self.agent.round_trips,
        )
        self.conn.close()
        for agent in self.peer_agents.values():
            agent.close()
            agent.conn.close()


def files_request(node: NodeState) -> list[dict[str, Any]]:
    """What facts should report about each entry (its dest; a same-host source too)."""
    out = []
    for f in node.files:
        item: dict[str, Any] = {
            "key": f.key,
            "dest": f.dest,
            "listing": f.kind in ("controller", "relay"),
        }
        if f.kind == "controller" and f.local is not None:
            item["expect"] = local_scan(f.local)["digest"]
        if f.kind == "host":
            item["src"] = f.src
        out.append(item)
    return out


def envs_request(node: NodeState) -> list[dict[str, Any]]:
    return [{"name": e.name, "path": e.path, "hash": e.hash} for e in node.envs.values()]
