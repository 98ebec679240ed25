"""One look at the fleet as data, and what changed between two looks.

A ``Sample`` holds raw values (seconds, ratios, MiB, None for "not known"), the same whether
the dashboard's probes made it (``of_watch``) or another loop did: `watch` may build one from
its own looks and give it to ``Store.add``. ``changes`` turns two samples into events: a unit
going down or coming up, a restart (with its last exit), a new rendering running, a host lost
or back. Host text in them is kept as the host said it; the page shows it as text.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dflashops.commands.status_rows import restarts_of
from dflashops.dashboard.fleet import Watch, gpu_use, number, probe_last_exit, since, unit_state

AGO = re.compile(r" [0-9a-z]+ ago$")  # the end of a last exit's text: `... 3m05s ago`
UP = ("ready", "running")  # serving (or, with no health check, running): dflashops_unit_up 1


@dataclass(frozen=True)
class UnitSample:
    host: str
    unit: str
    kind: str | None  # service | job | None (its host records nothing of it)
    engine: str | None
    state: str  # a word of states.LEGEND
    restarts: int = 0
    last_exit: str | None = None  # `code 137 (SIGKILL) 4s ago`
    since: str | None = None  # ISO-8601 UTC: the current run began
    fingerprint: str | None = None  # of the rendering running (its launch banner)
    port: int | None = None
    tok_s: float | None = None
    running: float | None = None  # requests
    queued: float | None = None
    kv: float | None = None  # 0..1
    gpu: float | None = None  # utilisation %, mean over its GPUs
    gpu_mem: float | None = None  # MiB, sum over its GPUs
    done: float | None = None  # jobs: their progress file
    total: float | None = None
    rate: float | None = None  # per second
    eta: float | None = None  # seconds
    failed: float | None = None
    # A job's own metrics (`metrics:` in its playbook), newest values: {"loss": 0.42}.
    metrics: dict[str, float] = field(default_factory=dict, hash=False)

    @property
    def up(self) -> bool:
        return self.state in UP

    @property
    def ratio(self) -> float | None:
        """A job's progress, 0..1 (None: it says no total)."""
        if self.done is None or not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def key(self) -> str:
        return f"{self.host}/{self.unit}"


@dataclass(frozen=True)
class HostSample:
    host: str
    state: str  # ok | failed | unreachable
    error: str | None = None  # without the host's name (the row names it)
    identity: str | None = None  # same, rebooted, re-provisioned, ... (None: not read)

    @property
    def reachable(self) -> bool:
        return self.state == "ok"


@dataclass(frozen=True)
class Event:
    time: float
    host: str
    unit: str | None
    what: str  # restart | down | up | deploy | lost | back | identity
    text: str


@dataclass(frozen=True)
class Sample:
    time: float  # the controller's clock when the look began
    hosts: list[HostSample] = field(default_factory=list)
    units: list[UnitSample] = field(default_factory=list)

    def unit(self, host: str, name: str) -> UnitSample | None:
        return next((u for u in self.units if u.host == host and u.unit == name), None)


def of_watch(watch: Watch, at: float | None = None) -> Sample:
    """The sample of ``watch``'s last refresh (its views), stamped ``at`` (default: now)."""
    now = time.time() if at is None else at
    hosts, units = [], []
    for name, view in watch.views.items():
        identity = watch.memory.identity(name) if watch.memory is not None else None
        hosts.append(HostSample(name, view.state, view.error, identity))
        if view.result is None:
            continue
        result = view.result
        clock = result.time or now
        for s in watch.seen(name):
            p = result.units.get(s.name)
            m = view.readings.get(s.name)
            util, mem = gpu_use(result.gpus, s.gpus)
            ended = probe_last_exit(p)
            banner = p.banner if p is not None else None
            prog = (p.progress if p is not None else None) or {}
            units.append(
                UnitSample(
                    name,
                    s.name,
                    s.kind,
                    s.engine,
                    unit_state(s, p),
                    restarts=restarts_of(p.supervisor, p.running) if p is not None else 0,
                    last_exit=ended.text(clock) if ended is not None else None,
                    since=since(p),
                    fingerprint=str(banner.get("fingerprint") or "") or None if banner else None,
                    port=s.port,
                    tok_s=m.tok_s if m else None,
                    running=m.running if m else None,
                    queued=m.queued if m else None,
                    kv=m.kv if m else None,
                    gpu=util if s.gpus else None,
                    gpu_mem=mem if s.gpus else None,
                    metrics=view.metrics.get(s.name, {}),
                    **progress(prog),
                )
            )
    return Sample(now, hosts, units)


def progress(prog: dict[str, object]) -> dict[str, float | None]:
    """A job's progress file as numbers (what it writes: anything else is None)."""
    if not prog:
        return {}
    names = {"done": "done", "total": "total", "rate": "requests_per_s", "eta": "eta_s"}
    out: dict[str, float | None] = {k: number(prog.get(v)) for k, v in names.items()}
    out["failed"] = number(prog.get("failed")) if "failed" in prog else None
    return out


def changes(before: Sample | None, after: Sample) -> list[Event]:
    """What happened between two looks, as the page's recent events say it (the first look:
    a host found rebooted or re-provisioned since the controller last saw it)."""
    t = after.time
    out: list[Event] = []
    was = {h.host: h for h in before.hosts} if before is not None else {}
    for h in after.hosts:
        old = was.get(h.host)
        if old is not None and old.reachable and not h.reachable:
            out.append(Event(t, h.host, None, "lost", f"{h.state}: {h.error or 'no answer'}"))
        elif old is not None and not old.reachable and h.reachable:
            out.append(Event(t, h.host, None, "back", "answers again"))
        new_word = h.identity not in (None, "same", "first-seen")
        if new_word and (old is None or old.identity != h.identity):
            out.append(Event(t, h.host, None, "identity", f"{h.identity} since last seen"))
    # By key, not Sample.unit: a fleet of 64 hosts is 128 units a look, compared each with each.
    olds = {(u.host, u.unit): u for u in before.units} if before is not None else {}
    for u in after.units:
        old_u = olds.get((u.host, u.unit))
        if old_u is not None:
            out += unit_changes(old_u, u, t)
    return out


def unit_changes(old: UnitSample, new: UnitSample, t: float) -> list[Event]:
    out = []
    if new.restarts > old.restarts:
        # The event has its own time: "4s ago" would be wrong an hour later.
        ended = AGO.sub("", new.last_exit or "")
        why = f" (last exit {ended})" if ended else ""
        out.append(Event(t, new.host, new.unit, "restart", f"restarted{why}"))
    elif new.since and old.since and new.since != old.since and new.state in UP:
        out.append(Event(t, new.host, new.unit, "restart", "started again"))
    if new.state != old.state:
        what = "up" if new.up else ("down" if old.up else "state")
        out.append(Event(t, new.host, new.unit, what, f"{old.state} -> {new.state}"))
    if new.fingerprint and old.fingerprint and new.fingerprint != old.fingerprint:
        text = f"runs a new rendering ({old.fingerprint[:12]} -> {new.fingerprint[:12]})"
        out.append(Event(t, new.host, new.unit, "deploy", text))
    return out
