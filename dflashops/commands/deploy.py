"""deploy, restart-servers and stop: the commands that change what runs on hosts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from dflashops.commands.common import Target, prepare
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError
from dflashops.events import EventLog, for_people
from dflashops.lifecycle.deploy import HostRun
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.keep import kept, state_dir
from dflashops.lifecycle.options import Options
from dflashops.output import escape, some
from dflashops.plan.names import UnknownNames, of_host, of_units, partition, resolve
from dflashops.plan.nodestate import NodeState
from dflashops.project import split_names


def deploy(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    check: bool = False,
    diff: bool = False,
    force: bool = False,
    rerun: bool = False,
    prune: bool = False,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
    lock_wait: str | None = None,
) -> int:
    """Every unit of the selected playbooks on their hosts; with ``units`` (--unit) those
    alone, with what they use (see ``narrowed``)."""
    wait = lock_seconds(lock_wait)
    names = split_names(units)
    if names and prune:
        raise DflashopsError(
            "--prune stops every orphan of a host: it does not go with --unit; nothing was done"
        )
    target = prepare(out, inventory, hosts, playbooks, warm_forks=forks)
    target = narrowed(target, names, needs=True)
    if prune and target.known is None:
        raise DflashopsError(
            "--prune needs every playbook in playbooks/ to load and plan (see the warning above): "
            "without them a running unit of theirs would look like an orphan; nothing was done"
        )
    if not check:
        rendezvous_first(out, target, force)
    events = EventLog(out, json_path)
    opts = Options(check=check, diff=diff, force=force, rerun=rerun, prune=prune, lock_wait=wait)
    return each_host(out, target, events, forks, lambda run: run.deploy(), opts)


def lock_seconds(value: str | None) -> float:
    """--lock-wait DURATION in seconds (0: refused at once when another actor holds a host)."""
    from dflashops.config.types import parse_duration

    if value is None:
        return 0.0
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise DflashopsError(f"--lock-wait {value!r}: {exc}") from None


def rendezvous_first(out: Console, target: Target, force: bool) -> None:
    """Before anything starts: every worker of a multi-node unit reaches its head's rendezvous
    (the head listens for the check). A rank that cannot would hang the head at NCCL init
    until its ready timeout; this says which hosts, address and port, in seconds."""
    from dflashops.errors import HostError
    from dflashops.output import escape
    from dflashops.preflight.live import rendezvous

    heads = [
        r.unit
        for rs in target.rendered.values()
        for r in rs
        if r.unit.multi_node and r.unit.rank == 0
    ]
    failed = []
    for head in heads:
        hosts = {n: target.peers[n] for n in head.nodes}
        try:
            found = rendezvous(head, hosts)
        except HostError as exc:  # deploy itself reports an unreachable host
            out.print(f"[yellow]WARN[/] rendezvous of {head.name} not checked: {escape(str(exc))}")
            continue
        if not found.ok:
            failed.append(found)
    if not failed:
        return
    label = "[yellow]WARN[/]" if force else "[red]FAIL[/]"
    for c in failed:
        out.print(f"{label} {c.check}: {escape(c.message)}")
    if not force:
        names = ", ".join(c.subject.split("@")[0] for c in failed)
        raise DflashopsError(
            f"the ranks of {names} cannot reach their head: nothing was started "
            "(`--force` deploys anyway)"
        )


def restart_servers(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    all_at_once: bool = False,
    force: bool = False,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
    lock_wait: str | None = None,
) -> int:
    wait = lock_seconds(lock_wait)
    target = narrowed(prepare(out, inventory, hosts, playbooks), split_names(units))
    jobs = sorted(
        {r.unit.name for rs in target.rendered.values() for r in rs if r.unit.kind == "job"}
    )
    if jobs and units:
        raise DflashopsError(
            f"--unit {', '.join(jobs)}: restart-servers restarts services, not jobs "
            "(`dflashops deploy --unit NAME --rerun` runs a job again); nothing was done"
        )
    events = EventLog(out, json_path)
    opts = Options(force=force, lock_wait=wait)
    return each_host(
        out, target, events, forks, lambda run: run.restart_services(rolling=not all_at_once), opts
    )


def stop(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
    lock_wait: str | None = None,
) -> int:
    """Without --unit: every unit dflashops started on the targeted hosts, or with -p that
    playbook's units and the orphans. With --unit: those units wherever they run here, orphans
    too; a name found on no targeted host is an error."""
    wait = lock_seconds(lock_wait)
    target = prepare(
        for_people(out, json_path),  # --json -: stdout is the events'
        inventory,
        hosts,
        playbooks,
        all_named_hosts=True,
        from_hosts="stopping what the hosts record",  # a broken playbook never blocks a stop
    )
    names = stop_names(out, target, split_names(units), forks) or None
    events = EventLog(out, json_path)
    everything = not target.explicit_playbooks
    opts = Options(lock_wait=wait)
    code = each_host(out, target, events, forks, lambda run: run.stop(names, everything), opts)
    if names:
        seen = {e.unit for e in events.events if e.action == "stop"}
        unknown = [n for n in names if n not in seen]
        if unknown:
            raise DflashopsError(
                f"no unit named {', '.join(unknown)} on {some(list(target.hosts)) or 'the selected hosts'}"
            )
    return code


def narrowed(target: Target, names: list[str], needs: bool = False) -> Target:
    """--unit: the target with those units alone (a service: all its units), on the hosts
    that have one, with the environments and files entries they use. Unknown names are an
    error with the known ones; with ``needs`` (deploy), so is a unit they need that they do
    not name: it is not added behind the user's back, and nothing is done."""
    if not names:
        return target
    planned = [r for rs in target.rendered.values() for r in rs]
    where = f"in the playbooks for {some(list(target.hosts)) or 'the selected hosts'}"
    chosen = set(resolve(names, of_units(r.unit for r in planned), where))
    lacking = sorted({n for r in planned if r.unit.name in chosen for n in r.unit.needs} - chosen)
    if needs and lacking:
        raise DflashopsError(
            f"--unit {','.join(names)} needs {', '.join(lacking)}, which --unit does not name: "
            f"add them (`--unit {','.join([*names, *lacking])}`; unchanged, they are left "
            "alone); nothing was done"
        )
    rendered = {
        h: kept
        for h, rs in target.rendered.items()
        if (kept := [r for r in rs if r.unit.name in chosen])
    }
    nodes = {h: node_used(target.nodes.get(h, NodeState()), rs) for h, rs in rendered.items()}
    hosts = {h: host for h, host in target.hosts.items() if h in rendered}
    return replace(target, hosts=hosts, rendered=rendered, nodes=nodes)


def node_used(node: NodeState, rendered: list[Rendered]) -> NodeState:
    """The environments and files entries of ``node`` that these units run in or on."""
    envs = {r.unit.env.name for r in rendered if r.unit.env is not None}
    keys = {k for r in rendered for k in (*r.unit.content, *r.unit.waits)}
    return NodeState(
        envs={n: e for n, e in node.envs.items() if n in envs},
        files=[f for f in node.files if f.key in keys],
    )


def stop_names(out: Console, target: Target, names: list[str], forks: int) -> list[str]:
    """--unit for stop: the units the names mean, from the playbooks and else from what the
    hosts record (orphans). A name no host has is an error before anything stops; if a host
    could not be read, such a name is passed on as typed (it may be there)."""
    if not names:
        return []
    planned = of_units(r.unit for rs in target.rendered.values() for r in rs)
    units, unknown = partition(names, planned)
    if not unknown:
        return units
    recorded, unread = recorded_units(out, target, forks)
    known = {**recorded, **planned}
    units, unknown = partition(names, known)
    if unknown and not unread:
        raise UnknownNames(unknown, known, f"on {some(list(target.hosts)) or 'the selected hosts'}")
    return units + unknown


def recorded_units(out: Console, target: Target, forks: int) -> tuple[dict[str, str], list[str]]:
    """Every unit the targeted hosts record (unit -> service), and the hosts not read."""

    def look(host: Host) -> dict[str, str | None]:
        session = target.session(host, EventLog(out))
        try:
            facts = session.gather()
        finally:
            session.close()
        return {n: uf.unit.kind if uf.unit else None for n, uf in facts.units.items()}

    outcomes = on_hosts(list(target.hosts.values()), look, forks)
    known: dict[str, str] = {}
    for outcome in outcomes.values():
        known.update(of_host(outcome.value or {}))
    return known, [h for h, o in outcomes.items() if o.value is None]


class ProgressBoard:
    """One live line per host while waiting for readiness, on a terminal only."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.lines: dict[str, str] = {}
        self.lock = threading.Lock()
        self.live: Live | None = None

    def update(self, host: str, text: str) -> None:
        with self.lock:
            if text:
                self.lines[host] = text
            else:
                self.lines.pop(host, None)
            if self.live is not None:
                self.live.update(self._render())

    def _render(self) -> Text:
        return Text("\n".join(f"[{h}] {t}" for h, t in sorted(self.lines.items())), style="dim")

    @contextmanager
    def running(self) -> Iterator[ProgressBoard]:
        if not self.console.is_terminal:
            yield self
            return
        with Live(
            self._render(), console=self.console, refresh_per_second=4, transient=True
        ) as live:
            self.live = live
            try:
                yield self
            finally:
                self.live = None


def each_host(
    out: Console,
    target: Target,
    events: EventLog,
    forks: int,
    work: Callable[[HostRun], None],
    opts: Options,
) -> int:
    """``work`` on every host of the target, a recap, and the exit status (0, or 2)."""
    board = ProgressBoard(out)
    # The project's state folder: what the controller remembers of each host (node and boot
    # id), and where kept outputs are mirrored (deploy restores and mirrors them, stop too).
    state = None
    if target.selection:
        try:
            state = state_dir(target.selection.inventory.path)
        except OSError as exc:
            units = (r.unit for rs in target.rendered.values() for r in rs)
            lost = "; kept outputs are not mirrored this run" if kept(units) else ""
            out.print(
                f"[yellow]WARN[/] state folder: {escape(str(exc))}: hosts are not remembered{lost}"
            )

    def one(host: Host) -> None:
        run = HostRun(
            host,
            target.rendered.get(host.name, []),
            events,
            opts=opts,
            board=board.update,
            state_dir=state,
            **target.parts(host),
        )
        try:
            work(run)
        finally:
            run.close()

    try:
        with board.running():
            outcomes = on_hosts(list(target.hosts.values()), one, forks, opts.abort)
    finally:
        if target.warm is not None:
            target.warm.close()  # what no host's run took
    for name, outcome in outcomes.items():
        if not outcome.ok:
            status = "failed" if outcome.unexpected or outcome.reached else "unreachable"
            message = outcome.reason or "failed"  # the line names the host
            events.emit(name, None, status, "host", message)  # type: ignore[arg-type]
    ok = events.print_recap(target.hosts)
    events.close()
    return 0 if ok else 2
