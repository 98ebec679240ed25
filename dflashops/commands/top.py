"""top: a live view of the fleet's servers and jobs, from the hosts and the engines themselves.

Each refresh is one agent call per host (``probe`` with nvidia-smi: processes, health, the
engines' /metrics, jobs' progress, supervisors' restarts) over SSH connections kept open between
refreshes; a host that drops out shows as unreachable and is reconnected on the next refresh.
Servers: state, tok/s, running/queued requests, KV-cache use, GPU utilisation and memory,
restarts, uptime. Jobs: a progress bar, done/total, rate, ETA, failures. Totals per host and
for the fleet, and a sparkline of the fleet's throughput over the session. ``--once`` prints
one frame (for scripts and tests): exit 0 whatever the units' states, 2 when no host answered.
When a playbook does not load (common.prepare warns), the units each host records are shown
from its records: the first call on a host is a facts call that lists them. The looking itself
(``Watch``) is dashboard/fleet.py's, shared with `dashboard`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dflashops.agent.answers import UnitProbe
from dflashops.commands.common import LOOK, prepare
from dflashops.commands.states import STYLE
from dflashops.commands.status_rows import restarts_of, seconds_since
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.types import parse_duration
from dflashops.dashboard.fleet import HostView, Watch, gpu_use, number, since, unit_state
from dflashops.engines.metrics import Reading, shown
from dflashops.errors import DflashopsError
from dflashops.output import duration, escape, inert, shorten

__all__ = ["HostView", "Watch", "frame", "top"]  # Watch: bench/bench_top.py measures it here
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


def uptime(p: UnitProbe | None, now: float) -> str:
    """Of the current run: a restart starts it again (status.run_since)."""
    up = seconds_since(since(p), now)
    return "-" if up is None else duration(up)


def bar(done: float, total: float, width: int = 20) -> str:
    filled = int(width * min(1.0, done / total)) if total else 0
    return "█" * filled + "░" * (width - filled)


def add_row(table: Table, *cells: str) -> None:
    """A row of host text (a progress file's fields, an error): shown inert."""
    table.add_row(*(inert(cell) for cell in cells))


def gpu_cells(gpus: Any, unit_gpus: tuple[int, ...]) -> tuple[str, str]:
    """GPU% (the mean over the unit's GPUs) and GPU memory, `-` when nvidia-smi does not say."""
    util, mem = gpu_use(gpus, unit_gpus)
    return (
        "-" if util is None else f"{util:.0f}%",
        "-" if mem is None else f"{mem / 1024:.0f}G",
    )


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
