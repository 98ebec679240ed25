"""What the commands that touch hosts share: select, pre-flight and render (nothing is shipped
that pre-flight rejects), the orphan rule's names, and each host's session (lifecycle/session.py).
The changing commands' pool of HostRuns is in deploy.py: a read-only command never loads it.

Looking and stopping never depend on a playbook being valid (DESIGN.md "Operating under
pressure" 1): when pre-flight fails, status, top, logs and stop go on from what the hosts record
(one warning names the file and line); deploy-like commands refuse. Only an inventory that does
not load stops them all: there is nothing to connect to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, TypedDict

from rich.console import Console

from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.prewarm import Prewarm
from dflashops.lifecycle.session import HostSession
from dflashops.output import escape, inert, shorten
from dflashops.plan import build_plan, targets, topo_order
from dflashops.plan.expand import reportable
from dflashops.plan.nodestate import NodeState
from dflashops.preflight import Check, Report, run_preflight
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
    # Pre-flight failed and the command goes on from what the hosts record: the warning it
    # printed (None: the playbooks loaded). Then ``rendered`` holds what did render, every
    # unit a host records is its business, and nothing is called an orphan.
    degraded: str | None = None

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


LOOK = "showing what the hosts record"  # what a read-only command does when pre-flight fails


def prepare(
    out: Console,
    inventory: str | None,
    hosts: Any,
    playbooks: list[str] | None,
    *,
    all_named_hosts: bool = False,
    warm_forks: int | None = None,
    from_hosts: str | None = None,
) -> Target:
    """Select, pre-flight and render; if pre-flight finds any error, refuse to go on, or with
    ``from_hosts`` (what the command does then: LOOK, "stopping what the hosts record") warn
    once and go on from what the hosts record (``Target.degraded``). ``all_named_hosts``:
    keep hosts given with --host even when no selected playbook puts a unit there (stop and
    status still have orphans to look at); the commands that pass it (status, logs, stop) act
    on what hosts hold, so they get LOOK unless they say otherwise. ``warm_forks``: connect to
    the targeted hosts (that many at a time) while pre-flight runs."""
    if from_hosts is None and all_named_hosts:
        from_hosts = LOOK
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
    if not report.ok and from_hosts is not None:
        if warm is not None:
            warm.close()
        return from_records(out, selection, report, from_hosts)
    if not report.ok:
        if warm is not None:
            warm.close()
        for c in report.errors:
            out.print(f"[red]FAIL[/] {c.check}: {escape(inert(c.message))}")
        raise DflashopsError(
            f"pre-flight failed ({len(report.errors)} error(s)): nothing was sent to any host"
        )
    rendered = by_unit(report, list(selection.inventory.hosts))
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


def by_unit(report: Report, names: list[str]) -> dict[str, list[Rendered]]:
    """The rendered units per host (of ``names``), in start order."""
    order = {u.name: i for i, u in enumerate(topo_order(report.plan.units if report.plan else []))}
    rendered: dict[str, list[Rendered]] = {}
    for r in sorted(report.rendered, key=lambda r: order.get(r.unit.name, 0)):
        if r.unit.host.name in names:
            rendered.setdefault(r.unit.host.name, []).append(r)
    return rendered


def from_records(out: Console, selection: Selection, report: Report, doing: str) -> Target:
    """Pre-flight failed: the target of a command that looks or stops all the same. Its hosts
    are those --host names, else every inventory host (a playbook that does not load cannot say
    which it targets); its units what rendered, and whatever else the hosts record."""
    inv = selection.inventory.hosts
    names = list(selection.hosts) if selection.hosts is not None else list(inv)
    where = "" if selection.hosts is not None else ", on every inventory host"
    warning = f"{fault(report.errors)}: {doing}{where}"
    out.print(f"[yellow]WARN[/] {escape(inert(warning))}")
    return Target(
        {h: inv[h] for h in names},
        by_unit(report, names),
        None,  # what the project defines is not known: nothing is an orphan
        selection=selection,
        peers=dict(inv),
        degraded=warning,
    )


def fault(errors: list[Check]) -> str:
    """``playbooks/wip.yaml:12: does not load (mapping values are not allowed here)``: the
    first error by file and line, and how many more there are."""
    first = min(errors, key=lambda c: (c.file or "~", c.line or 0))
    where = (first.file or first.subject) + (f":{first.line}" if first.line else "")
    message = first.message
    if first.file and message.startswith(first.file):
        # Problem text repeats the place (file:line:column: field: message): keep the rest.
        message = re.sub(r"^(:\d+)*:\s*", "", message[len(first.file) :])
    more = f"; {len(errors) - 1} more: `dflashops preflight` lists them" if len(errors) > 1 else ""
    return f"{where}: does not load ({shorten(message, 100)}{more})"


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
            why = f"a playbook does not plan: {reportable(plan.problems)[0]}"
        else:
            return {h: {u.name for u in hp.units} for h, hp in plan.hosts.items()}
    out.print(f"[yellow]WARN[/] orphans: not looked for, {escape(why)}")
    return None
