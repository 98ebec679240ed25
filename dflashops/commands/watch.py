"""watch: the fleet's control loop (DESIGN.md "Nothing lost when a node is lost" 3, 5, 7).

Each tick calls every host that is due once (one facts call over a session kept open), judges
the answers (changes/watch.py) and starts what is down through deploy's own code, in the
background and under each host's deploy lock (lifecycle/watch.py). A line per host when what
it says changes (``--once``: one line per host, always), a heartbeat every ``HEARTBEAT`` ticks,
and the inventory and playbooks loaded again when they change on disk: one that does not load
stops the starting, not the looking.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from dflashops.agent.answers import HostFacts
from dflashops.changes.watch import HEALS, Settings, Step, refusal
from dflashops.commands.common import prepare
from dflashops.commands.deploy import node_used
from dflashops.commands.status import Seen, state_of
from dflashops.commands.status_rows import restarts_of
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.types import parse_duration
from dflashops.dashboard.sample import HostSample, Sample, UnitSample, changes, progress
from dflashops.dashboard.store import FILE as STORE_FILE
from dflashops.dashboard.store import Store
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.lifecycle.keep import state_dir
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.watch import Declared, Watcher
from dflashops.output import duration, escape, inert, some
from dflashops.project import find_inventory

HEARTBEAT = 20  # ticks between heartbeat lines (10 minutes at the default interval)
NAP = 0.5  # s at most between looks at the deploys under way while waiting for a tick
ONLY_LOOKING = "watching only: nothing is started until it loads"


def watch(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    interval: str = "30s",
    lost_after: str = "2m",
    heal: str | None = None,
    once: bool = False,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    settings = settings_of(interval, lost_after, heal)
    path = find_inventory(inventory)
    sources = Sources(path, playbooks or [])
    loader = Loader(out, path, hosts, playbooks)
    events = EventLog(out, json_path)
    watcher = Watcher(loader.load(), settings, forks, events, HostMemory(path))
    loop = Loop(events, watcher, sources, loader, Samples(path, events))
    # Under nohup or a service manager SIGINT may be ignored: SIGTERM ends it as Ctrl-C does.
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    before = signal.signal(signal.SIGTERM, interrupted) if main else None
    try:
        return loop.once() if once else loop.forever()
    except KeyboardInterrupt:
        events.console.print("watch stopped (Ctrl-C); a deploy under way stops between steps")
        return 0
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
        watcher.close()
        if loop.samples is not None:
            loop.samples.close()
        events.close()


def settings_of(interval: str, lost_after: str, heal: str | None) -> Settings:
    every, lost = seconds("--interval", interval), seconds("--lost-after", lost_after)
    why = refusal(every, lost)
    if why is not None:
        raise DflashopsError(f"{why}; nothing was done")
    if heal is not None and heal not in HEALS:
        raise DflashopsError(f"--heal {heal!r}: only {', '.join(HEALS)}; nothing was done")
    return Settings(every, lost, frozenset([heal]) if heal else frozenset())


def seconds(flag: str, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise DflashopsError(f"{flag} {value!r}: {exc}") from None


class Loader:
    """The inventory and playbooks as `deploy` loads them (select, pre-flight, render); one
    that fails pre-flight gives a target to look at, not to start anything on."""

    def __init__(self, out: Console, inventory: Path, hosts: Any, playbooks: list[str] | None):
        self.out = out
        self.state = state_dir(inventory)
        self.args = (str(inventory), hosts, playbooks)

    def load(self) -> Declared:
        target = prepare(self.out, *self.args, from_hosts=ONLY_LOOKING)
        return Declared(
            hosts=target.hosts,
            rendered=target.rendered,
            known=target.known,
            nodes=target.nodes,
            peers=target.peers,
            # The warning said it whole; the hosts' lines say the fault alone.
            converge=target.degraded and target.degraded.split(f": {ONLY_LOOKING}")[0],
            node_used=node_used,
            state=self.state,
        )


class Sources:
    """The files a watch was loaded from (the inventory, the playbooks, template overrides):
    their sizes and mtimes, to load them again when one changes, appears or goes."""

    def __init__(self, inventory: Path, playbooks: list[str]) -> None:
        self.inventory = inventory
        self.explicit = [Path(p) for p in playbooks]
        self.seen = self.stamp()

    def files(self) -> list[Path]:
        base = self.inventory.parent
        found = [self.inventory, *self.explicit]
        for folder in (base / "playbooks", base / "templates"):
            if folder.is_dir():
                found += sorted(p for p in folder.rglob("*") if p.is_file())
        return found

    def stamp(self) -> dict[str, tuple[int, int]]:
        out = {}
        for p in self.files():
            try:
                st = p.stat()
            except OSError:
                continue
            out[str(p)] = (st.st_mtime_ns, st.st_size)
        return out

    def changed(self) -> list[str]:
        """The files changed, added or gone since the last call (their names)."""
        now = self.stamp()
        names = sorted(n for n in {*now, *self.seen} if now.get(n) != self.seen.get(n))
        self.seen = now
        return names


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Samples:
    """What watch sees, kept for the dashboard's plots in the same file (DESIGN: samples are
    written by `dashboard` and by `watch`): after each tick, one sample of every host from its
    last facts call. Watch probes nothing, so servers are `running` (not `ready`) and have no
    tok/s; states, restarts and job progress are what the page plots from it."""

    def __init__(self, inventory: Path, events: EventLog) -> None:
        self.events = events
        self.store: Store | None = None
        try:
            self.store = Store(state_dir(inventory) / STORE_FILE)
        except OSError as exc:
            events.console.print(f"[yellow]WARN[/] samples not kept: {escape(str(exc))}")
        self.last: Sample | None = None

    def add(self, watcher: Watcher) -> None:
        if self.store is None:
            return
        hosts, units = [], []
        for name in watcher.histories:
            seen = watcher.seen.get(name)
            if seen is None:
                hosts.append(HostSample(name, "unreachable"))
                continue
            hosts.append(HostSample(name, "ok"))
            rendered, facts = seen
            units += [unit_sample(name, r, facts) for r in rendered]
        sample = Sample(time.time(), hosts, units)
        self.store.add(sample, changes(self.last, sample))
        self.last = sample
        for note in self.store.notes:
            self.events.console.print(f"[yellow]WARN[/] {escape(note)}")
        self.store.notes.clear()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def unit_sample(host: str, r: Rendered, facts: HostFacts) -> UnitSample:
    uf = facts.unit(r.unit.name)
    state, _ = state_of(Seen.of(r), uf, None, facts.time)
    restarts = restarts_of(uf.supervisor, uf.running) if uf is not None else 0
    prog = uf.progress if uf is not None and uf.progress else {}
    done = progress(prog)
    return UnitSample(
        host,
        r.unit.name,
        r.unit.kind,
        r.unit.engine,
        state,
        restarts=restarts,
        done=done.get("done"),
        total=done.get("total"),
        rate=done.get("rate"),
        eta=done.get("eta"),
        failed=done.get("failed"),
    )


class Loop:
    def __init__(
        self,
        events: EventLog,
        watcher: Watcher,
        sources: Sources,
        loader: Loader,
        samples: Samples | None = None,
    ):
        self.samples = samples
        self.events = events
        self.console = events.console
        self.watcher = watcher
        self.sources = sources
        self.loader = loader
        self.ticks = 0
        self.warned: dict[str, tuple[str, ...]] = {}  # a host's last mirror warnings (said once)

    def once(self) -> int:
        """One call to every host, its deploy waited for: a line per host; 2 when a host
        could not be read or a deploy failed."""
        bad = False
        for name, got in self.watcher.look(everyone=True).items():
            if got.start or got.mirror:
                self.watcher.notify(name, got.notices)  # the look's; the work's come with it
                got = self.watcher.act(name, got, wait=True) or got
            self.report(name, got, show=True)
            bad = bad or got.status in ("failed", "unreachable")
        if self.samples is not None:
            self.samples.add(self.watcher)
        return 2 if bad else 0

    def forever(self) -> int:
        settings = self.watcher.settings
        hosts = len(self.watcher.histories)
        self.console.print(
            f"watch: {hosts} host(s), a call every {duration(settings.interval)}, lost after "
            f"{duration(settings.lost_after)} of failed calls; a line when a host's state "
            "changes; Ctrl-C ends it"
        )
        while True:
            self.tick()
            self.wait()

    def tick(self) -> None:
        """The files again if they changed, a call to each host that is due, its work started."""
        self.reload()
        for name, got in self.watcher.look().items():
            if got.start or got.mirror:
                self.watcher.act(name, got)
            self.report(name, got)
        if self.samples is not None:
            self.samples.add(self.watcher)
        self.ticks += 1
        if self.ticks % HEARTBEAT == 0:
            self.heartbeat()
        self.events.events.clear()  # printed and written: a watch of days keeps none

    def wait(self) -> None:
        """Until the next host is due, reporting deploys as they end (their hosts are due
        at once: the next call sees what they left)."""
        while True:
            for name, got in self.watcher.finished().items():
                # A deploy's end is news; a mirror's only when it failed or warns anew.
                news = bool(got.warnings) and got.warnings != self.warned.get(name)
                self.report(name, got, show=bool(got.start) or got.status == "failed" or news)
                self.warned[name] = got.warnings
            left = self.watcher.due() - self.watcher.clock()
            if left <= 0:
                return
            time.sleep(min(NAP, left))

    def report(self, name: str, got: Step, show: bool | None = None) -> None:
        """The host's line when ``show`` (None: when it says something new), its notices, and
        what it said remembered."""
        if got.changed if show is None else show:
            self.events.emit(
                name, None, got.status, "watch", got.text, state=got.history.state, start=got.start
            )
        self.watcher.notify(name, got.notices)
        self.watcher.said(name, got)

    def heartbeat(self) -> None:
        states: dict[str, int] = {}
        for h in self.watcher.histories.values():
            states[h.state] = states.get(h.state, 0) + 1
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
        acting = len(self.watcher.acting)
        busy = f"; deploying on {acting}" if acting else ""
        self.console.print(f"watch: tick {self.ticks}: {counts}{busy}")

    def reload(self) -> None:
        """The inventory and playbooks again when one of their files changed on disk."""
        changed = self.sources.changed()
        if not changed:
            return
        names = some([Path(n).name for n in changed])
        self.console.print(f"watch: {escape(names)} changed on disk: loading again")
        try:
            declared = self.loader.load()
        except DflashopsError as exc:
            self.console.print(
                f"[yellow]WARN[/] watch: {escape(inert(str(exc)))}: going on with what was "
                "loaded before; fix it and save again"
            )
            return
        self.watcher.retarget(declared)
        units = sum(len(rs) for rs in declared.rendered.values())
        only = "; looking only, until the playbooks load" if declared.converge else ""
        self.console.print(f"watch: loaded: {len(declared.hosts)} host(s), {units} unit(s){only}")
