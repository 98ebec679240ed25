"""top: a live view of the fleet's servers and jobs, from the hosts and the engines themselves.

Each refresh is one agent call per host (``probe`` with nvidia-smi: processes, health, the
engines' /metrics, jobs' progress, supervisors' restarts) over SSH connections kept open between
refreshes; a host that drops out shows as unreachable and is reconnected on the next refresh.
Servers: state, tok/s, running/queued requests, KV-cache use, GPU utilisation and memory,
restarts, uptime. Jobs: a progress bar, done/total, rate, ETA, failures. Totals per host and
for the fleet, and a sparkline of the fleet's throughput over the session. ``--once`` prints
one frame (for scripts and tests): exit 0 whatever the units' states, 2 when no host answered.
When a playbook does not load (common.prepare warns), the units each host records are shown
from its records: the first call on a host is a facts call that lists them.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dflashops.agent.answers import ProbeResult, ProbeSpec, UnitProbe
from dflashops.changes.verdicts import probe_spec
from dflashops.commands.common import LOOK, Target, prepare
from dflashops.commands.states import STYLE
from dflashops.commands.status import Seen, recorded, restarts_of, run_since, seconds_since
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host
from dflashops.config.types import parse_duration
from dflashops.engines.metrics import Memory, Reading, shown
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.session import HostSession
from dflashops.output import duration, escape, inert, shorten

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 60


@dataclass
class HostView:
    result: ProbeResult | None = None
    error: str | None = None
    readings: dict[str, Reading] = field(default_factory=dict)


class Watch:
    """The fleet, refreshed: one probe per host per refresh. With ``keep`` (what `top` does)
    each host has one SSH connection and one agent session (``serve``) for the whole watch, so
    a refresh is a request line and an answer line; without it, each refresh connects and runs
    a fresh agent (what the benchmark compares it with)."""

    def __init__(self, target: Target, forks: int, keep: bool = True) -> None:
        self.target = target
        self.forks = forks
        self.keep = keep
        self.runs: dict[str, HostSession] = {}
        self.memory = Memory(persist=False)
        self.views: dict[str, HostView] = {h: HostView() for h in target.hosts}
        self.totals: list[float] = []  # the fleet's tok/s, refresh by refresh
        self.lock = threading.Lock()
        # A playbook does not load: the units each host records and no playbook renders.
        self.recorded: dict[str, list[Seen]] = {}

    def seen(self, host: str) -> list[Seen]:
        """The units shown for ``host``: rendered ones, then those only the host records."""
        return [Seen.of(r) for r in self.target.rendered.get(host, [])] + self.recorded.get(
            host, []
        )

    def _run(self, host: Host) -> HostSession:
        run = self.runs.get(host.name)
        if run is None or not self.keep:
            run = self.target.session(host, EventLog(Console(quiet=True)))
            self.runs[host.name] = run
            if self.target.degraded is not None:
                facts = run.gather()
                self.recorded[host.name] = [
                    Seen.recorded(n, facts.units[n]) for n in recorded(facts, run.rendered)
                ]
        return run

    def _look(self, host: Host) -> ProbeResult:
        try:
            run = self._run(host)
            specs = [probe_spec(r, run.resolved.values, metrics=True) for r in run.rendered]
            # Known from its records alone: its process state and log, no HTTP probe.
            specs += [
                ProbeSpec(name=s.name, port=None, health_path=None)
                for s in self.recorded.get(host.name, [])
            ]
            run.agent.keep = self.keep
            return run.agent.observe(host.workdir, specs)
        except DflashopsError:
            self.drop(host.name)  # reconnect next time: the host may come back
            raise
        finally:
            if not self.keep:
                self.drop(host.name)

    def drop(self, name: str) -> None:
        run = self.runs.pop(name, None)
        if run is not None:
            run.agent.close()
            run.conn.close()

    def refresh(self) -> None:
        outcomes = on_hosts(list(self.target.hosts.values()), self._look, self.forks)
        total = 0.0
        for name, outcome in outcomes.items():
            view = HostView(error=outcome.reason)  # the row names the host
            if outcome.value is not None:
                view.result = outcome.value
                at = outcome.value.time or time.time()
                for s in self.seen(name):
                    probe = outcome.value.units.get(s.name)
                    reading = self.memory.read(
                        f"{name}/{s.name}", s.engine or "", probe.metrics if probe else None, at
                    )
                    view.readings[s.name] = reading
                    total += reading.tok_s or 0.0
            self.views[name] = view
        self.totals = [*self.totals, total][-HISTORY:]

    def close(self) -> None:
        for name in list(self.runs):
            self.drop(name)

    @property
    def reached(self) -> int:
        return sum(1 for v in self.views.values() if v.result is not None)


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


def unit_state(s: Seen, p: UnitProbe | None) -> str:
    """The unit's state by the words of states.LEGEND, from one probe."""
    if p is None:
        return "?"
    sup = p.supervisor
    if p.running:
        if sup is not None and sup.restarting:
            return "restarting"
        r = s.rendered
        if s.kind == "job" or r is None or r.unit.port is None or r.launch.health_path is None:
            return "running"
        return "ready" if p.healthy else "starting"
    if p.crashed is not None and p.stopped is None:
        return "crashed"
    if p.stopped is not None:
        return "stopped"
    if p.exit is not None and p.exit.code is not None:
        if s.kind == "job":
            return "done" if p.exit.code == 0 else "failed"
        return "dead"
    return "absent" if p.pid is None else "dead"


def uptime(p: UnitProbe | None, now: float) -> str:
    """Of the current run: a restart starts it again (status.run_since)."""
    since = run_since(p.started_at, p.supervisor) if p is not None and p.running else None
    up = seconds_since(since, now)
    return "-" if up is None else duration(up)


def bar(done: float, total: float, width: int = 20) -> str:
    filled = int(width * min(1.0, done / total)) if total else 0
    return "█" * filled + "░" * (width - filled)


def add_row(table: Table, *cells: str) -> None:
    """A row of host text (a progress file's fields, an error): shown inert."""
    table.add_row(*(inert(cell) for cell in cells))


def number(value: Any) -> float:
    """A progress file's number (the job writes it: anything else counts as 0)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else 0.0


def gpu_cells(gpus: Any, unit_gpus: tuple[int, ...]) -> tuple[str, str]:
    """GPU% (the mean over the unit's GPUs) and GPU memory, `-` when nvidia-smi does not say."""
    util, mem = "-", "-"
    if gpus is not None and gpus.devices:
        devices = [d for d in gpus.devices if d.index in unit_gpus]
        utils = [d.utilization_pct for d in devices if d.utilization_pct is not None]
        util = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
        used = sum(d.memory_used_mib or 0 for d in devices)
        mem = f"{used / 1024:.0f}G" if devices else "-"
    return util, mem


def frame_tables() -> tuple[Table, Table, Table]:
    """The servers, jobs and totals tables of a frame, empty."""
    servers = Table(
        "host",
        "unit",
        "state",
        "tok/s",
        "run",
        "queue",
        "KV",
        "GPU%",
        "GPU mem",
        "restarts",
        "uptime",
        title="servers",
        box=None,
        title_justify="left",
    )
    jobs = Table(
        "host",
        "unit",
        "state",
        "progress",
        "done/total",
        "rate",
        "ETA",
        "failed",
        title="jobs",
        box=None,
        title_justify="left",
    )
    totals = Table(
        "host",
        "servers ready",
        "tok/s",
        "running",
        "queued",
        title="totals",
        box=None,
        title_justify="left",
    )
    return servers, jobs, totals


def frame(watch: Watch) -> Group:
    now = time.time()
    servers, jobs, totals = frame_tables()
    fleet = [0.0, 0, 0, 0.0, 0.0]
    for name, view in watch.views.items():
        if view.result is None:
            reason = escape(shorten(view.error or "no answer yet", 80))
            add_row(servers, name, "-", "[red]unreachable[/]", reason)
            continue
        result = view.result
        gpus = result.gpus
        host_tok, host_ready, host_servers, host_run, host_queue = 0.0, 0, 0, 0.0, 0.0
        for s in watch.seen(name):
            p = result.units.get(s.name)
            state = unit_state(s, p)
            style = STYLE.get(state, "red")
            restarts = str(restarts_of(p.supervisor, p.running) if p else 0)
            if s.kind != "job":
                m = view.readings.get(s.name) or Reading()
                util, mem = gpu_cells(gpus, s.gpus)
                add_row(
                    servers,
                    name,
                    s.name,
                    f"[{style}]{state}[/]",
                    shown(m.tok_s, "tok"),
                    shown(m.running, "n"),
                    shown(m.queued, "n"),
                    shown(m.kv, "pct"),
                    util,
                    mem,
                    restarts,
                    uptime(p, result.time or now),
                )
                host_servers += 1
                host_ready += state == "ready"
                host_tok += m.tok_s or 0.0
                host_run += m.running or 0.0
                host_queue += m.queued or 0.0
            else:
                prog = (p.progress if p else None) or {}
                done, total = number(prog.get("done")), number(prog.get("total"))
                rate, eta = number(prog.get("requests_per_s")), number(prog.get("eta_s"))
                add_row(
                    jobs,
                    name,
                    s.name,
                    f"[{style}]{state}[/]",
                    bar(done, total) if total else "-",
                    f"{done:,.0f}/{total:,.0f}" if total else "-",
                    f"{rate:.1f}/s" if rate else "-",
                    duration(eta) if state == "running" and eta else "-",
                    str(prog.get("failed", "-")),
                )
        totals.add_row(
            name,
            f"{host_ready}/{host_servers}",
            shown(host_tok, "tok"),
            shown(host_run, "n"),
            shown(host_queue, "n"),
        )
        fleet[0] += host_tok
        fleet[1] += host_ready
        fleet[2] += host_servers
        fleet[3] += host_run
        fleet[4] += host_queue
    totals.add_row(
        "[bold]fleet[/]",
        f"{fleet[1]}/{fleet[2]}",
        shown(fleet[0], "tok"),
        shown(fleet[3], "n"),
        shown(fleet[4], "n"),
    )
    stamp = datetime.now(timezone.utc).strftime("%H:%M:%SZ")
    head = Text(
        f"dflashops top  {stamp}  {watch.reached}/{len(watch.views)} host(s)  fleet {fleet[0]:,.0f} tok/s  {sparkline(watch.totals)}"
    )
    return Group(head, servers, jobs, totals)


def top(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    interval: str = "2s",
    once: bool = False,
    forks: int = DEFAULT_FORKS,
) -> int:
    try:
        every = parse_duration(interval)
    except ValueError as exc:
        raise DflashopsError(f"--interval {interval!r}: {exc}") from None
    target = prepare(out, inventory, hosts, playbooks, from_hosts=LOOK)
    watch = Watch(target, forks)
    try:
        watch.refresh()
        if once:
            if any(s.engine == "vllm" for h in target.hosts for s in watch.seen(h)):
                time.sleep(1.0)  # vLLM counts tokens: a rate needs a second sample
                watch.refresh()
            out.print(frame(watch))
            return 0 if watch.reached else 2
        with Live(frame(watch), console=out, screen=out.is_terminal, auto_refresh=False) as live:
            while True:
                time.sleep(every)
                watch.refresh()
                live.update(frame(watch), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        watch.close()
