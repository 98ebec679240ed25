"""What the commands that touch hosts share: select, pre-flight and render (nothing is shipped
that pre-flight rejects), the orphan rule's names, and each host's session (lifecycle/session.py).
The changing commands' pool of HostRuns is in deploy.py: a read-only command never loads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from rich.console import Console

from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.inert import inert
from dflashops.hosts.prewarm import Prewarm
from dflashops.lifecycle.session import HostSession
from dflashops.output import escape
from dflashops.plan import build_plan, targets, topo_order
from dflashops.plan.nodestate import NodeState
from dflashops.preflight import Report, run_preflight
from dflashops.project import Selection, find_inventory, select, split_names


@dataclass
class Target:
    hosts: dict[str, Host]
    rendered: dict[str, list[Rendered]]  # per host, in start order
    known: dict[str, set[str]] | None  # unit names the project defines per host (None: unknown)
    explicit_playbooks: bool = False  # -p narrowed the playbooks
    selection: Selection | None = field(default=None, repr=False)
    nodes: dict[str, NodeState] = field(default_factory=dict)  # environments, files per host
    peers: dict[str, Host] = field(default_factory=dict)  # every inventory host (relays)
    warm: Prewarm | None = None  # connections opened while pre-flight ran

    def session(self, host: Host, events: EventLog) -> HostSession:
        """A session on ``host`` for a command that only reads (status, top, logs)."""
        return HostSession(host, self.rendered.get(host.name, []), events, **self.parts(host))

    def parts(self, host: Host) -> SessionParts:
        """What a session on ``host`` is made of besides its units and events."""
        return {
            "known": None if self.known is None else self.known.get(host.name, set()),
            "node": self.nodes.get(host.name, NodeState()),
            "peers": self.peers,
            "warm": self.warm.take(host) if self.warm is not None else None,
        }


class SessionParts(TypedDict):
    known: set[str] | None
    node: NodeState
    peers: dict[str, Host]
    warm: BaseConnection | None


def prepare(
    out: Console,
    inventory: str | None,
    hosts: Any,
    playbooks: list[str] | None,
    *,
    all_named_hosts: bool = False,
    warm_forks: int | None = None,
) -> Target:
    """Select, pre-flight and render; refuse to go on if pre-flight finds any error.
    ``all_named_hosts``: keep hosts given with --host even when no selected playbook puts a
    unit there (stop and status still have orphans to look at). ``warm_forks``: connect to
    the targeted hosts (that many at a time) while pre-flight runs."""
    selection = select(find_inventory(inventory), playbooks or [], split_names(hosts))
    warm = None
    if warm_forks is not None:
        warm = Prewarm([selection.inventory.hosts[h] for h in targeted(selection)], warm_forks)
    try:
        report: Report = run_preflight(selection)
    except BaseException:
        if warm is not None:
            warm.close()
        raise
    if not report.ok:
        if warm is not None:
            warm.close()
        for c in report.errors:
            out.print(f"[red]FAIL[/] {c.check}: {escape(inert(c.message))}")
        raise DflashopsError(
            f"pre-flight failed ({len(report.errors)} error(s)): nothing was sent to any host"
        )
    order = {u.name: i for i, u in enumerate(topo_order(report.plan.units if report.plan else []))}
    rendered: dict[str, list[Rendered]] = {}
    for r in sorted(report.rendered, key=lambda r: order.get(r.unit.name, 0)):
        rendered.setdefault(r.unit.host.name, []).append(r)
    # Every host a selected playbook targets, even with no unit left there: its orphans count.
    names = list(report.plan.hosts) if report.plan else list(rendered)
    if all_named_hosts and selection.hosts:
        names += [h for h in selection.hosts if h not in names]
    inv = selection.inventory.hosts
    return Target(
        {h: inv[h] for h in names},
        rendered,
        project_units(out, selection, names),
        explicit_playbooks=bool(playbooks),
        selection=selection,
        nodes={h: hp.node for h, hp in report.plan.hosts.items()} if report.plan else {},
        peers=dict(inv),
        warm=warm,
    )


def targeted(selection: Selection) -> list[str]:
    """The hosts the selected playbooks target (within --host), known before any plan."""
    names: list[str] = []
    for book in selection.playbooks:
        found, _ = targets(selection.inventory, book)
        names += [n for n in found if n not in names]
    if selection.hosts is not None:
        names = [n for n in names if n in selection.hosts]
    return names


def project_units(
    out: Console, selection: Selection, hosts: list[str]
) -> dict[str, set[str]] | None:
    """Unit names every project playbook defines on each host, or None (with a warning) when
    the project cannot be read whole: then no unit is called an orphan."""
    why = None
    if selection.project is None:
        why = "a playbook in playbooks/ does not load"
    else:
        plan = build_plan(selection.inventory, selection.project, hosts)
        if plan.problems:
            why = f"a playbook does not plan: {plan.problems[0]}"
        else:
            return {h: {u.name for u in hp.units} for h, hp in plan.hosts.items()}
    out.print(f"[yellow]WARN[/] orphans: not looked for, {escape(why)}")
    return None
