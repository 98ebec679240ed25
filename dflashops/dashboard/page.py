"""The page's document: what ``/api/state`` answers, from the last look and the store.

Numbers come shown (``1,234``, ``42%``, ``3m05s``) so the page's script only places text;
host text goes out as JSON strings that the script sets as text, never as markup. Plots come
drawn (plots.py, escaped there). ``WINDOWS`` are the spans a person can pick; long ones read
the store's coarse copies, so 7 days of samples draw as fast as an hour.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from dflashops.commands.states import STYLE
from dflashops.dashboard.plots import MAX_SERIES, Series, number, plot
from dflashops.dashboard.sample import Sample, UnitSample
from dflashops.dashboard.sampler import Sampler
from dflashops.dashboard.store import Point
from dflashops.engines.metrics import shown
from dflashops.output import duration

WINDOWS = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0, "24h": 86400.0, "7d": 7 * 86400.0}
DEFAULT_WINDOW = "1h"
EVENTS = 40
MIN_SPAN = 60.0  # s: the shortest time axis
STATIC = ("index.html", "app.js", "style.css")
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
MAX_JOB_PLOTS = 16  # of jobs' own metrics (a plot per job and metric); the rest are counted
Curves = dict[tuple[str, str], dict[str, list[tuple[float, float]]]]  # Store.job_metrics


def static(name: str) -> tuple[bytes, str] | None:
    """A shipped page asset (dashboard/static/, package data) and its content type."""
    if name not in STATIC:
        return None
    data = (resources.files("dflashops.dashboard") / "static" / name).read_bytes()
    return data, TYPES[name[name.rindex(".") :]] + "; charset=utf-8"


def document(sampler: Sampler, window: str, now: float | None = None) -> dict[str, Any]:
    """The page's state: hosts, servers, jobs, events, plots over ``window``, and (asked for
    with ``log``) a unit's log end."""
    clock = time.time() if now is None else now
    span = WINDOWS.get(window, WINDOWS[DEFAULT_WINDOW])
    sample = sampler.latest
    drawn = Drawn.of(sample)
    points: list[Point] = []
    total: list[tuple[float, float]] = []
    curves: Curves = {}
    size, since = sampler.interval, clock - MIN_SPAN
    if sampler.store is not None:
        try:
            since = start(sampler.store.first(), clock - span, clock)
            _, size = sampler.store.level(since, clock, sampler.interval)
            points = sampler.store.points(since, clock, size, drawn.keys())
            total = sampler.store.fleet(since, clock, size)
            curves = sampler.store.job_metrics(since, clock, size, drawn.measured)
        except Exception as exc:  # sqlite3.Error and a file gone: the tables still show
            sampler.say(f"plots not read from {sampler.store.path}: {exc}")
    gap = 3 * max(size, sampler.interval)
    return {
        "time": clock,
        "interval": sampler.interval,
        "window": window if window in WINDOWS else DEFAULT_WINDOW,
        "windows": list(WINDOWS),
        "samples": sampler.samples,
        "hosts": hosts(sample),
        "servers": [server_row(u) for u in units(sample, "service")],
        "jobs": [job_row(u) for u in units(sample, "job")],
        "fleet": fleet(sample),
        "events": [
            {"time": e.time, "host": e.host, "unit": e.unit, "what": e.what, "text": e.text}
            for e in sampler.events(EVENTS)
        ],
        "plots": {
            **plots(points, total, drawn, sample, since, clock, gap),
            "job-metrics": job_plots(curves, sample, since, clock, gap),
        },
    }


def start(first: float | None, since: float, until: float) -> float:
    """Where the plots' time axis begins: the window's start, or (the samples began later: the
    dashboard is new) the first sample, so that a young dashboard's plots are neither a sliver
    at the right nor coarse; at least ``MIN_SPAN`` before ``until``."""
    return max(since, min(first if first is not None else until, until - MIN_SPAN))


def units(sample: Sample | None, kind: str) -> list[UnitSample]:
    if sample is None:
        return []
    return [u for u in sample.units if (u.kind or "service") == kind]


def hosts(sample: Sample | None) -> list[dict[str, Any]]:
    if sample is None:
        return []
    out = []
    for h in sample.hosts:
        mine = [u for u in sample.units if u.host == h.host]
        out.append(
            {
                "host": h.host,
                "state": h.state,
                "style": "green" if h.reachable else "red",
                "error": h.error,
                "identity": h.identity,
                "units": len(mine),
                "up": sum(u.up for u in mine),
            }
        )
    return out


def server_row(u: UnitSample) -> dict[str, Any]:
    return {
        "host": u.host,
        "unit": u.unit,
        "state": u.state,
        "style": STYLE.get(u.state, "red"),
        "tok_s": shown(u.tok_s, "tok"),
        "requests": f"{shown(u.running, 'n')}/{shown(u.queued, 'n')}",
        "kv": shown(u.kv, "pct"),
        "gpu": "-" if u.gpu is None else f"{u.gpu:.0f}%",
        "gpu_mem": "-" if u.gpu_mem is None else f"{u.gpu_mem / 1024:.1f} GiB",
        "restarts": u.restarts,
        "last_exit": u.last_exit or "",
    }


def job_row(u: UnitSample) -> dict[str, Any]:
    ratio = u.ratio
    running = u.state == "running"
    return {
        "host": u.host,
        "unit": u.unit,
        "state": u.state,
        "style": STYLE.get(u.state, "red"),
        "ratio": ratio,
        "progress": f"{ratio * 100:.0f}%" if ratio is not None else "-",
        "done": f"{u.done:,.0f}/{u.total:,.0f}" if u.total else "-",
        "rate": f"{u.rate:.1f}/s" if u.rate else "-",
        "eta": duration(u.eta) if running and u.eta else "-",
        "failed": "-" if u.failed is None else f"{u.failed:.0f}",
        "restarts": u.restarts,
        "last_exit": u.last_exit or "",
    }


def fleet(sample: Sample | None) -> dict[str, Any]:
    servers = units(sample, "service")
    reached = [h for h in sample.hosts if h.reachable] if sample is not None else []
    return {
        "tok_s": shown(sum(u.tok_s or 0.0 for u in servers), "tok"),
        "ready": sum(u.up for u in servers),
        "servers": len(servers),
        "hosts": len(sample.hosts) if sample is not None else 0,
        "reached": len(reached),
    }


@dataclass(frozen=True)
class Drawn:
    """The units each plot draws, from the last look: the busiest servers, the units with GPUs
    and the jobs, MAX_SERIES each (the legend counts the rest); only their points are read
    (a fleet of 64 hosts is 192 series a window)."""

    servers: list[tuple[str, str]]
    gpus: list[tuple[str, str]]
    jobs: list[tuple[str, str]]
    more: tuple[int, int, int]
    measured: list[tuple[str, str]] = field(default_factory=list)  # jobs with their own metrics

    @classmethod
    def of(cls, sample: Sample | None) -> Drawn:
        found = sample.units if sample is not None else []
        busy = sorted(units(sample, "service"), key=lambda u: -(u.tok_s or 0.0))
        servers = [(u.host, u.unit) for u in busy]
        gpus = sorted((u.host, u.unit) for u in found if u.gpu is not None)
        jobs = sorted((u.host, u.unit) for u in units(sample, "job"))

        def left(items: list[tuple[str, str]]) -> int:
            return max(0, len(items) - MAX_SERIES)

        return cls(
            servers[:MAX_SERIES],
            gpus[:MAX_SERIES],
            jobs[:MAX_SERIES],
            (left(servers), left(gpus), left(jobs)),
            sorted((u.host, u.unit) for u in units(sample, "job") if u.metrics),
        )

    def keys(self) -> set[tuple[str, str]]:
        return {*self.servers, *self.gpus, *self.jobs}


def job_plots(curves: Curves, sample: Sample | None, since: float, until: float, gap: float) -> str:
    """A plot per job and metric it reports (``job gen: loss``), a series per host running
    it, named in text with its newest value; at most ``MAX_JOB_PLOTS`` (a line counts the
    rest). The metrics are those of the last look (a job that stopped reporting one drops it)."""
    newest: dict[tuple[str, str], dict[str, float]] = {}  # (job, metric) -> host -> value
    for u in units(sample, "job"):
        for name, value in u.metrics.items():
            newest.setdefault((u.unit, name), {})[u.host] = value
    figures = []
    for job, name in sorted(newest)[:MAX_JOB_PLOTS]:
        series = [
            Series(f"{host}/{job}", curves.get((host, job), {}).get(name, []), number(value))
            for host, value in sorted(newest[(job, name)].items())
        ]
        title = f"job {job}: {name}"
        figures.append(plot(f"job-{job}-{name}", title, series, since, until, gap=gap))
    left = len(newest) - MAX_JOB_PLOTS
    if left > 0:
        figures.append(f'<p class="dim">and {left} more job metrics, not drawn</p>')
    return "".join(figures)


def plots(
    points: list[Point],
    total: list[tuple[float, float]],
    drawn: Drawn,
    sample: Sample | None,
    since: float,
    until: float,
    gap: float,
) -> dict[str, str]:
    """Fleet and per-server throughput, job progress with ETA, GPU utilisation."""
    by_key: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in points:
        by_key[(p.host, p.unit)].append(p)
    latest = {(u.host, u.unit): u for u in sample.units} if sample is not None else {}
    fleet_line = Series("fleet", total, f"{fleet(sample)['tok_s']} tok/s")
    servers = [
        Series(f"{h}/{u}", values(by_key[(h, u)], "tok_s"), f"{tok_of(latest.get((h, u)))} tok/s")
        for h, u in drawn.servers
    ]
    gpus = [
        Series(f"{h}/{u}", values(by_key[(h, u)], "gpu"), gpu_of(latest.get((h, u))))
        for h, u in drawn.gpus
    ]
    jobs, job_until = job_series(by_key, drawn.jobs, latest, since, until)
    more_servers, more_gpus, more_jobs = drawn.more
    return {
        "fleet": plot("fleet", "fleet throughput (tok/s)", [fleet_line], since, until, gap=gap),
        "servers": plot(
            "servers",
            "throughput per server (tok/s)",
            servers,
            since,
            until,
            gap=gap,
            more=more_servers,
        ),
        "jobs": plot(
            "jobs",
            "job progress (%), dashed: to the ETA",
            jobs,
            since,
            job_until,
            top=100.0,
            unit="%",
            gap=gap,
            more=more_jobs,
        ),
        "gpu": plot(
            "gpu",
            "GPU utilisation (%)",
            gpus,
            since,
            until,
            top=100.0,
            unit="%",
            gap=gap,
            more=more_gpus,
        ),
    }


def tok_of(u: UnitSample | None) -> str:
    return shown(u.tok_s if u is not None else None, "tok")


def gpu_of(u: UnitSample | None) -> str:
    return "-" if u is None or u.gpu is None else f"{u.gpu:.0f}%"


def values(points: list[Point], name: str) -> list[tuple[float, float]]:
    return [(p.t, v) for p in points if (v := getattr(p, name)) is not None]


def job_series(
    by_key: dict[tuple[str, str], list[Point]],
    keys: list[tuple[str, str]],
    latest: dict[tuple[str, str], UnitSample],
    since: float,
    until: float,
) -> tuple[list[Series], float]:
    """Each job's progress in %, with a dashed line from now to 100% at its ETA; the x axis
    reaches past now to show the nearest ETAs (at most half the window again)."""
    out: list[Series] = []
    etas = [u.eta for u in latest.values() if u.kind == "job" and u.state == "running" and u.eta]
    end = until + min(max(etas, default=0.0), (until - since) / 2)
    for host, unit in keys:
        progress = [
            (p.t, 100 * min(1.0, p.done / p.total))
            for p in by_key[(host, unit)]
            if p.done is not None and p.total
        ]
        last = latest.get((host, unit))
        note, projection = "", []
        if last is not None and last.ratio is not None:
            eta = last.eta if last.state == "running" and last.eta else None
            note = f"{last.ratio * 100:.0f}%" + (
                f" ETA {duration(eta)}" if eta else f" {last.state}"
            )
            if eta:
                at = 100 * last.ratio
                reach = at + (100 - at) * min(1.0, (end - until) / eta)
                projection = [(until, at), (min(until + eta, end), reach)]
        out.append(Series(f"{host}/{unit}", progress, note, projection))
    return out, end
