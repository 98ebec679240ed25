"""`watch`'s hands: one facts call per host over a session kept open across calls, the pure
decisions of changes/watch.py on each answer, and the work they ask for, in the background:
a deploy under the host's deploy lock, through the very code `deploy` runs (``HostRun.deploy``:
environments, files, kept outputs restored, units, in deploy order) narrowed to the units to
start; or the mirror of kept jobs' outputs (lifecycle/keep.py) over the kept session.

A host's call and its work never overlap: while work runs on a host, watch does not call it.
A call that fails drops the host's session; the next call connects again, so watch outlives
its own connections. Nothing grows with the ticks: a host's memory is ``History`` (bounded),
and the events of a tick are dropped once printed (commands/watch.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console

from dflashops.agent.answers import HostFacts
from dflashops.agent.transfer import human
from dflashops.changes.watch import (
    Acted,
    History,
    Kept,
    Looked,
    Notice,
    Settings,
    Step,
    acted,
    kept,
    looked_at,
    step,
)
from dflashops.config import providers
from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError, HostBusy
from dflashops.events import Event, EventLog
from dflashops.hosts.hostkeys import ChangedHostKey, UnknownHostKey
from dflashops.lifecycle import keep
from dflashops.lifecycle.deploy import HostRun
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.notices import Notices
from dflashops.lifecycle.options import Options
from dflashops.lifecycle.secrets import resolve
from dflashops.lifecycle.session import HostSession
from dflashops.output import escape
from dflashops.plan.nodestate import NodeState

FACTS_TIMEOUT = 30.0  # s a call may take at least (nvidia-smi included); the interval if longer
SLOP = 0.05  # s: hosts due this close together are called in the same tick
RETRY_WITHIN = 5.0  # s: a kept session that failed sooner is tried again on a new connection

Done = tuple[Step, list[Event]]  # a host's work: its step, and the events it emitted


def quiet() -> EventLog:
    return EventLog(Console(quiet=True))


@dataclass
class Declared:
    """What the inventory and playbooks declare, as loaded (commands/watch.py loads it again
    when they change on disk)."""

    hosts: dict[str, Host]
    rendered: dict[str, list[Rendered]]  # per host, in start order
    known: dict[str, set[str]] | None = None  # unit names the project defines (orphans)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    peers: dict[str, Host] = field(default_factory=dict)
    # Why units are not started (a playbook does not load: watch only looks); None: they are.
    converge: str | None = None
    # The environments and files entries some units use (commands/deploy.py's node_used).
    node_used: Callable[[NodeState, list[Rendered]], NodeState] = lambda node, _: node
    state: Path | None = None  # the project's state folder: kept outputs (lifecycle/keep.py)


def outcome(events: list[Event], result: Acted) -> Acted:
    """What a deploy's events say it did: the units it started, those that failed, the kept
    outputs it put back."""
    started = []
    failed = dict(result.failed)
    restored = dict(result.restored)
    warned: dict[str, tuple[str, ...]] = dict(result.warnings)
    for e in events:
        if e.unit is not None and e.status == "changed" and e.action in ("start", "restart"):
            started.append(e.unit)
        elif e.status == "failed":
            failed[e.unit or str(e.data.get("entry") or "host")] = e.message
        elif e.action == "restore" and e.status == "changed" and e.unit is not None:
            restored[e.unit] = int(e.data.get("restored_bytes") or 0)
        elif e.action == "keep" and e.unit is not None and e.message.startswith("warning: "):
            warned[e.unit] = (*warned.get(e.unit, ()), e.message.removeprefix("warning: "))
    return Acted(tuple(started), failed, result.busy, result.error, restored, warned)


class WatchRun(HostRun):
    """A deploy of one host in watch's name: its deploy lock names `dflashops watch`."""

    def take_lock(self, command: str) -> None:
        super().take_lock("watch")


class Watcher:
    """The fleet's hosts, called when due (``History.due``), judged, and worked on."""

    def __init__(
        self,
        declared: Declared,
        settings: Settings,
        forks: int,
        events: EventLog,
        memory: HostMemory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.forks = forks
        self.events = events
        self.memory = memory
        self.clock = clock
        self.abort = threading.Event()  # Ctrl-C: deploys under way stop between steps
        self.sessions: dict[str, HostSession] = {}
        self.histories: dict[str, History] = {}
        self.acting: dict[str, Future[Done]] = {}
        self.stale: set[str] = set()  # hosts whose session goes once their work ends
        self.pool = ThreadPoolExecutor(max_workers=max(1, forks), thread_name_prefix="act")
        self.notices: dict[str, Notices] = {}
        # Each host's last answer (its rendered units, its facts): the samples the dashboard
        # plots are made from it (commands/watch.py); a failed call forgets it.
        self.seen: dict[str, tuple[list[Rendered], HostFacts]] = {}
        self.declared = declared
        self.retarget(declared)

    # -- what is declared ----------------------------------------------------------------

    def retarget(self, declared: Declared) -> None:
        """Work from ``declared`` on: sessions open again (their units may have changed), each
        host keeps its memory (a lost host's clock goes on), a host no longer named is
        forgotten."""
        for name in list(self.sessions):
            if name in self.acting:
                self.stale.add(name)  # its work uses it: dropped when it ends
            else:
                self.drop(name)
        self.declared = declared
        self.histories = {h: self.histories.get(h) or self.recall(h) for h in declared.hosts}
        self.notices = {}
        for name, host in declared.hosts.items():
            node = declared.nodes.get(name, NodeState())
            found = resolve(host, declared.rendered.get(name, []), node, os.environ)
            self.events.add_secrets(found.redacted())
            self.notices[name] = Notices.of(host, self.warn)

    def recall(self, name: str) -> History:
        """A host new to this watch: what the controller remembers of it (its node and boot
        ids when last seen, by any command), so a host re-provisioned while no watch ran is
        told as such."""
        known = self.memory.recall(name) if self.memory is not None else None
        if known is None:
            return History()
        return History(node_id=known.node_id, boot_id=known.boot_id)

    def warn(self, line: str) -> None:
        self.events.console.print(f"[yellow]WARN[/] {escape(self.events.redact(line))}")

    @property
    def converge(self) -> str | None:
        return self.declared.converge

    # -- calls ---------------------------------------------------------------------------

    def due(self) -> float:
        """When the next host is due (the clock's time)."""
        waiting = [h.due for n, h in self.histories.items() if n not in self.acting]
        return min(waiting, default=self.clock() + self.settings.interval)

    def look(self, everyone: bool = False) -> dict[str, Step]:
        """Call every host that is due (``everyone``: every host not being worked on), in
        parallel, and judge each answer; the host's memory becomes the step's."""
        now = self.clock()
        names = [
            n
            for n, h in self.histories.items()
            if n not in self.acting and (everyone or h.due <= now + SLOP)
        ]
        hosts = [self.declared.hosts[n] for n in names]
        outcomes = on_hosts(hosts, self._call, self.forks, self.abort)
        steps = {}
        for name, found in outcomes.items():
            seen = found.value or Looked(failure=found.reason or "no answer")
            got = step(self.histories[name], seen, self.clock(), self.settings, self.converge)
            self.histories[name] = got.history
            steps[name] = got
        return steps

    def _call(self, host: Host) -> Looked:
        """One facts call, judged; a failure is a ``Looked`` saying why, never an exception.
        A kept session that fails at once is tried again on a new connection: a session that
        died while idle (sshd restarted, a NAT forgot it) is not the host failing, and the
        new connection's failure says why the host cannot be reached. (One that timed out is
        not: a host that does not answer costs one timeout per call, not two.)"""
        kept = host.name in self.sessions
        started = time.monotonic()
        seen = self._facts(host)
        quick = time.monotonic() - started < RETRY_WITHIN
        if kept and quick and seen.failure is not None and not seen.untrusted:
            seen = self._facts(host)
        if seen.failure is not None and not seen.untrusted:
            # A pod may be back elsewhere: its provider is asked again before the next call.
            with contextlib.suppress(DflashopsError):
                providers.refresh(host)
        return seen

    def _facts(self, host: Host) -> Looked:
        try:
            session = self._session(host)
            facts = session.agent.facts(
                session.host.workdir,
                ports=[],
                settled={
                    r.unit.name: {"fingerprint": r.fingerprint, "job": r.unit.kind == "job"}
                    for r in session.rendered
                },
                timeout=max(FACTS_TIMEOUT, self.settings.interval),
            )
            session.workdir = facts.workdir
        except (ChangedHostKey, UnknownHostKey) as exc:
            self.drop(host.name)
            return Looked(failure=exc.message_for(host.name), untrusted=True)
        except DflashopsError as exc:
            self.drop(host.name)  # connect again next time: the host may come back
            return Looked(failure=exc.message_for(host.name))
        except Exception as exc:  # a bug must not end a watch of days: said, and called again
            self.drop(host.name)
            return Looked(failure=f"internal error ({type(exc).__name__}: {exc})")
        self._remember(session, facts)
        self.seen[host.name] = (session.rendered, facts)
        return looked_at(session.rendered, facts, recorded=self.converge is not None)

    def _remember(self, session: HostSession, facts: HostFacts) -> None:
        """The controller's memory of the host (lifecycle/memory.py, what status compares
        with), written when its node or boot id is news to this watch: not at every call."""
        h = self.histories.get(session.host.name)
        if self.memory is None or h is None:
            return
        if h.state == "new" or (h.node_id, h.boot_id) != (facts.node_id, facts.boot_id):
            self.memory.look(session, facts)
            for line in self.memory.problems:
                self.warn(line)
            self.memory.problems.clear()

    def _session(self, host: Host) -> HostSession:
        session = self.sessions.get(host.name)
        if session is None:
            d = self.declared
            session = HostSession(
                host,
                d.rendered.get(host.name, []),
                quiet(),
                node=d.nodes.get(host.name, NodeState()),
                peers=d.peers,
            )
            self.sessions[host.name] = session
        return session

    def drop(self, name: str) -> None:
        self.seen.pop(name, None)
        session = self.sessions.pop(name, None)
        if session is not None:
            session.agent.close()
            session.conn.close()

    def said(self, name: str, got: Step) -> None:
        """What the host's line said (the next one is printed when it says something else)."""
        h = self.histories.get(name)
        if h is not None:
            self.histories[name] = replace(h, said=got.key)

    # -- work ----------------------------------------------------------------------------

    def act(self, name: str, done: Step, wait: bool = False) -> Step | None:
        """The work ``done`` asks for (a deploy of ``done.deploy``, else the mirror of
        ``done.mirror``), in the background (``wait``: now, and the step it ends with). The
        host is not called while it runs."""
        future = self.pool.submit(self._work, name, done)
        if wait:
            return self.finish(name, future.result())
        self.acting[name] = future
        return None

    def finished(self) -> dict[str, Step]:
        """The work that ended since the last look: its steps."""
        out = {}
        for name, future in list(self.acting.items()):
            if future.done():
                del self.acting[name]
                out[name] = self.finish(name, future.result())
        return out

    def finish(self, name: str, got: Done) -> Step:
        """Work's end: its events go to --json readers; after a deploy the host is called at
        once (its next call sees what the deploy left)."""
        done, events = got
        for e in events:
            self.events.emit(e.host, e.unit, e.status, e.action, e.message, show=False, **e.data)
        if name in self.stale:
            self.stale.discard(name)
            self.drop(name)
        if name in self.histories:
            due = self.clock() if done.start else done.history.due
            self.histories[name] = replace(done.history, due=due)
        return done

    def _work(self, name: str, done: Step) -> Done:
        try:
            return self._deploy(name, done) if done.start else self._mirror(name, done)
        except Exception as exc:  # a bug: said on the host's line, the watch goes on
            return acted(done, Acted(error=f"internal error ({type(exc).__name__}: {exc})")), []

    def _deploy(self, name: str, done: Step) -> Done:
        d = self.declared
        rendered = [r for r in d.rendered.get(name, []) if r.unit.name in done.deploy]
        log = quiet()
        try:
            run = WatchRun(
                d.hosts[name],
                rendered,
                log,
                opts=Options(abort=self.abort),
                known=None if d.known is None else d.known.get(name, set()),
                node=d.node_used(d.nodes.get(name, NodeState()), rendered),
                peers=d.peers,
                state_dir=d.state,
            )
        except DflashopsError as exc:
            return acted(done, Acted(error=exc.message_for(name))), []
        result = Acted()
        try:
            run.deploy()
        except HostBusy as exc:
            result = Acted(busy=exc.message_for(name))
        except DflashopsError as exc:
            result = Acted(error=exc.message_for(name))
        finally:
            run.close()
        return acted(done, outcome(log.events, result)), log.events

    def _mirror(self, name: str, done: Step) -> Done:
        """The kept jobs' outputs, over the host's kept session (lifecycle/keep.py)."""
        d = self.declared
        units = [r.unit for r in d.rendered.get(name, []) if r.unit.name in done.mirror]
        if d.state is None or not units:
            return done, []
        log = quiet()
        results = []
        for r in keep.mirror(self._session(d.hosts[name]), units, d.state):
            took = f"{r.files} file(s), {human(r.bytes_sent)}" if r.files else ""
            said = f"kept {r.job}: {took} (copy {human(r.kept_bytes)})" if took else ""
            results.append(Kept(r.job, r.ok, said if r.ok else r.error or "", tuple(r.warnings)))
            what = said or r.error or "nothing new"
            log.emit(name, r.job, "ok" if r.ok else "failed", "keep", what, show=False)
        if not all(r.ok for r in results):
            self.stale.add(name)  # its session may be broken: a new one next time
        return kept(done, results), log.events

    # -- notices -------------------------------------------------------------------------

    def notify(self, name: str, notices: tuple[Notice, ...]) -> None:
        """Each notice to the host's webhook (its notify:), and as a JSON event (``notice``)."""
        sender = self.notices.get(name)
        for n in notices:
            details = {k: v for k, v in n.details.items() if k != "unit"}
            unit = n.details.get("unit")
            self.events.emit(
                name,
                unit if isinstance(unit, str) else None,
                "info",
                "notice",
                n.event,
                show=False,
                event=n.event,
                **details,
            )
            if sender is not None:
                sender.send(name, n.event, **n.details)

    def close(self) -> None:
        self.abort.set()
        self.pool.shutdown(wait=True)
        for name in list(self.sessions):
            self.drop(name)
