"""The fleet, looked at again and again: what `top` refreshes and `dashboard` samples.

Each look is one agent call per host (``probe`` with nvidia-smi: processes, health, the
engines' /metrics, jobs' progress, supervisors' restarts; the ``job_metrics`` of jobs that
declare ``metrics:`` ride with it) over an SSH connection and an agent session kept open
between looks; a host that drops out is reconnected on the next look. The
metric math (a vLLM counter's rate between two looks) is engines/metrics.Memory's; the state
words are states.LEGEND's, read from one probe.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from dflashops.agent import job_metrics
from dflashops.agent.answers import GpuFacts, ProbeResult, ProbeSpec, UnitProbe
from dflashops.agent.calling import AgentError
from dflashops.changes.verdicts import probe_spec
from dflashops.commands.common import Target
from dflashops.commands.status import Seen, recorded
from dflashops.commands.status_rows import LastExit, ended, run_since
from dflashops.config.inventory import Host
from dflashops.engines.metrics import Memory, Reading
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.session import HostSession

HISTORY = 60
TAIL_LINES = 40  # of a unit's log, when the dashboard shows it


@dataclass
class HostView:
    result: ProbeResult | None = None
    error: str | None = None
    readings: dict[str, Reading] = field(default_factory=dict)
    state: str = "ok"  # ok | failed (it answered, the work could not be done) | unreachable
    tails: dict[str, str] = field(default_factory=dict)  # unit -> its log's end (asked for)
    # job -> its own metrics' newest values (the jobs that declare `metrics:`)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Look:
    """What one host's look brought back."""

    result: ProbeResult
    tails: dict[str, str]
    metrics: dict[str, dict[str, float]]


class Watch:
    """The fleet, refreshed: one probe per host per refresh. With ``keep`` (what `top` does)
    each host has one SSH connection and one agent session (``serve``) for the whole watch, so
    a refresh is a request line and an answer line; without it, each refresh connects and runs
    a fresh agent (what the benchmark compares it with). With ``memory`` (the dashboard) each
    new session begins with a facts call, compared with what the controller remembers of the
    host (rebooted, re-provisioned: lifecycle/memory.py); ``tails`` says, per host, which
    units' log ends to fetch on the same session after each probe."""

    def __init__(
        self,
        target: Target,
        forks: int,
        keep: bool = True,
        memory: HostMemory | None = None,
        tails: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.target = target
        self.forks = forks
        self.keep = keep
        self.memory = memory
        self.tails = tails
        self.runs: dict[str, HostSession] = {}
        self.metrics = Memory(persist=False)
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
            if self.target.degraded is not None or self.memory is not None:
                facts = run.gather()
                if self.memory is not None:
                    self.memory.look(run, facts)
                if self.target.degraded is not None:
                    self.recorded[host.name] = [
                        Seen.recorded(n, facts.units[n]) for n in recorded(facts, run.rendered)
                    ]
        return run

    def _look(self, host: Host) -> Look:
        try:
            run = self._run(host)
            specs = [probe_spec(r, run.resolved.values, metrics=True) for r in run.rendered]
            # Known from its records alone: its process state and log, no HTTP probe.
            specs += [
                ProbeSpec(name=s.name, port=None, health_path=None)
                for s in self.recorded.get(host.name, [])
            ]
            run.agent.keep = self.keep
            declared = job_metrics.specs(run.rendered)
            answers: list[job_metrics.MetricsAnswer] = []
            if self.keep:  # rides with the probe: no round trip of its own
                job_metrics.read_ahead(run.agent, host.workdir, declared, answers.append)
            result = run.agent.observe(host.workdir, specs)
            if declared and not self.keep:
                with contextlib.suppress(AgentError):  # a plot misses a point; the look goes on
                    answers.append(job_metrics.read(run.agent, host.workdir, declared))
            wanted = self.tails(host.name) if self.tails is not None else []
            tails = {
                unit: run.agent.tail(host.workdir, unit, lines=TAIL_LINES).text for unit in wanted
            }
            got = answers[0] if answers else None
            values = {d["name"]: job_metrics.job_metrics(got, d["name"]) for d in declared}
            return Look(result, tails, {k: v for k, v in values.items() if v})
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
            # The row names the host: its reason alone. Answered but failed (its python is
            # missing, a bug of ours) is `failed`, as status says it.
            state = "failed" if outcome.reached or outcome.unexpected else "unreachable"
            view = HostView(error=outcome.reason, state=state)
            if outcome.value is not None:
                look = outcome.value
                view.result, view.tails, view.metrics = look.result, look.tails, look.metrics
                view.state = "ok"
                at = view.result.time or time.time()
                for s in self.seen(name):
                    probe = view.result.units.get(s.name)
                    reading = self.metrics.read(
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


def probe_last_exit(p: UnitProbe | None) -> LastExit | None:
    """status' last exit of a probe, which carries the exit, stopped and supervisor records as
    facts do: one rule for the row and the page."""
    return None if p is None else ended(p.exit, p.stopped, p.supervisor)


def since(p: UnitProbe | None) -> str | None:
    """When the current run began (status.run_since): a restart starts it again."""
    return run_since(p.started_at, p.supervisor) if p is not None and p.running else None


def number(value: Any) -> float:
    """A progress file's number (the job writes it: anything else counts as 0)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else 0.0


def gpu_use(gpus: GpuFacts | None, unit_gpus: tuple[int, ...]) -> tuple[float | None, float | None]:
    """(GPU utilisation %, the mean over the unit's GPUs; memory in use, MiB, their sum);
    None where nvidia-smi does not say."""
    if gpus is None or not gpus.devices:
        return None, None
    devices = [d for d in gpus.devices if d.index in unit_gpus]
    utils = [d.utilization_pct for d in devices if d.utilization_pct is not None]
    util = sum(utils) / len(utils) if utils else None
    mem = float(sum(d.memory_used_mib or 0 for d in devices)) if devices else None
    return util, mem
