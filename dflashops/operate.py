"""The commands that change or inspect hosts: deploy, restart-servers, stop, status, logs.

Each one: select and pre-flight (nothing is shipped that pre-flight rejects), then one HostRun
per host in a bounded pool, every host's outcome reported, a recap, and a non-zero exit status
when any host failed or could not be reached.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dflashops.config.inventory import Host
from dflashops.engines import identity
from dflashops.errors import DflashopsError, HostError
from dflashops.events import EventLog
from dflashops.hosts.facts import HostFacts, UnitFacts
from dflashops.hosts.unitctl import UnitProbe, probe_units, tail_log
from dflashops.lifecycle import HostRun, Options, health_text, probe_spec
from dflashops.output import escape
from dflashops.plan import topo_order
from dflashops.preflight import Report, run_preflight
from dflashops.project import find_inventory, select, split_names
from dflashops.render import Rendered
from dflashops.run import DEFAULT_FORKS, on_hosts


@dataclass
class Target:
    hosts: dict[str, Host]
    rendered: dict[str, list[Rendered]]  # per host, in start order


def prepare(out: Console, inventory: str | None, hosts: Any, playbooks: list[str] | None) -> Target:
    """Select, pre-flight and render; refuse to go on if pre-flight finds any error."""
    selection = select(find_inventory(inventory), playbooks or [], split_names(hosts))
    report: Report = run_preflight(selection)
    if not report.ok:
        for c in report.errors:
            out.print(f"[red]FAIL[/] {c.check}: {escape(c.message)}")
        raise DflashopsError(
            f"pre-flight failed ({len(report.errors)} error(s)): nothing was sent to any host"
        )
    order = {u.name: i for i, u in enumerate(topo_order(report.plan.units if report.plan else []))}
    rendered: dict[str, list[Rendered]] = {}
    for r in sorted(report.rendered, key=lambda r: order.get(r.unit.name, 0)):
        rendered.setdefault(r.unit.host.name, []).append(r)
    inventory_hosts = selection.inventory.hosts
    return Target({h: inventory_hosts[h] for h in rendered}, rendered)


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
    def running(self) -> Any:
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


def _each_host(
    out: Console,
    target: Target,
    events: EventLog,
    forks: int,
    work: Callable[[HostRun], None],
    opts: Options,
) -> int:
    board = ProgressBoard(out)

    def one(host: Host) -> None:
        run = HostRun(host, target.rendered[host.name], events, opts, board.update)
        try:
            work(run)
        finally:
            run.close()

    with board.running():
        outcomes = on_hosts(list(target.hosts.values()), one, forks, opts.abort)
    for name, outcome in outcomes.items():
        if not outcome.ok:
            status = "failed" if outcome.unexpected else "unreachable"
            message = (outcome.error or "failed").removeprefix(
                f"[{name}] "
            )  # the line names the host
            events.emit(name, None, status, "host", message)  # type: ignore[arg-type]
    ok = events.print_recap(target.hosts)
    events.close()
    return 0 if ok else 2


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
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    target = prepare(out, inventory, hosts, playbooks)
    events = EventLog(out, json_path)
    opts = Options(check=check, diff=diff, force=force, rerun=rerun)
    return _each_host(out, target, events, forks, lambda run: run.deploy(), opts)


def restart_servers(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    all_at_once: bool = False,
    force: bool = False,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    target = prepare(out, inventory, hosts, playbooks)
    events = EventLog(out, json_path)
    opts = Options(force=force)
    return _each_host(
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
) -> int:
    target = prepare(out, inventory, hosts, playbooks)
    wanted = set(units or [])
    known = {r.unit.name for rs in target.rendered.values() for r in rs}
    unknown = sorted(wanted - known)
    if unknown:
        raise DflashopsError(
            f"no unit named {', '.join(unknown)} on the selected hosts (they have: {', '.join(sorted(known))})"
        )
    if wanted:
        target.rendered = {
            h: [r for r in rs if r.unit.name in wanted] for h, rs in target.rendered.items()
        }
        target.rendered = {h: rs for h, rs in target.rendered.items() if rs}
        target.hosts = {h: target.hosts[h] for h in target.rendered}
    events = EventLog(out, json_path)
    return _each_host(out, target, events, forks, lambda run: run.stop_all(), Options())


# -- status -------------------------------------------------------------------------------------


def unit_state(r: Rendered, facts: HostFacts, probe: UnitProbe | None) -> tuple[str, str]:
    """(state, health) for the status table."""
    uf = facts.unit(r.unit.name)
    if uf is None or (uf.pid is None and uf.exit is None):
        return ("stopped" if uf is not None and uf.unit is not None else "absent"), "-"
    if not uf.running:
        if uf.stopped is not None and uf.pid is None:
            return "stopped", "-"
        if uf.exit is not None and uf.exit.code is not None:
            ran = run_time(uf)
            outcome = f"exit {uf.exit.code}" + (f" after {ran}" if ran else "")
            if r.unit.kind == "job":
                return ("done" if uf.exit.code == 0 else "failed"), outcome
            return "dead", outcome
        return ("stopped" if uf.pid is None else "dead"), "-"
    if r.unit.port is None or r.launch.health_path is None or probe is None:
        return ("running" if uf.fingerprint == r.fingerprint else "outdated"), "-"
    health = health_text(probe)
    if probe.health is None or probe.health.status != 200:
        return "starting", health
    if uf.fingerprint != r.fingerprint:
        return "outdated", health  # runs an older rendering: `deploy` restarts it
    if identity.check(r, probe):
        return "drifted", health
    return "ready", health


def run_time(uf: UnitFacts) -> str:
    if uf.pid is None or not uf.pid.started_at or uf.exit is None or not uf.exit.finished_at:
        return ""
    try:
        began, ended = (
            datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ")
            for t in (uf.pid.started_at, uf.exit.finished_at)
        )
    except ValueError:
        return ""
    return _duration((ended - began).total_seconds())


def failed_units(rendered: list[Rendered], facts: HostFacts) -> list[str]:
    """Units that ended on their own with a non-zero exit: their log ends are worth showing."""
    names = []
    for r in rendered:
        uf = facts.unit(r.unit.name)
        if (
            uf
            and not uf.running
            and uf.stopped is None
            and uf.exit is not None
            and uf.exit.code not in (0, None)
        ):
            names.append(r.unit.name)
    return names


def status(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    target = prepare(out, inventory, hosts, playbooks)

    def look(host: Host) -> tuple[HostFacts, dict[str, UnitProbe], dict[str, str]]:
        run = HostRun(host, target.rendered[host.name], EventLog(out), Options())
        try:
            facts = run.gather()
            probed = [
                r
                for r in run.rendered
                if r.unit.port is not None and (uf := facts.unit(r.unit.name)) and uf.running
            ]
            probes = (
                probe_units(run.conn, host.python, facts.workdir, [probe_spec(r) for r in probed])
                if probed
                else {}
            )
            # Only failed units cost an extra call each: the end of the log says why.
            tails = {
                name: tail_log(run.conn, host.python, facts.workdir, name, lines=10).text
                for name in failed_units(run.rendered, facts)
            }
            return facts, probes, tails
        finally:
            run.close()

    outcomes = on_hosts(list(target.hosts.values()), look, forks)
    table = Table(
        "host",
        "unit",
        "state",
        "pid",
        "uptime",
        "port",
        "health",
        "fingerprint",
        "gpus",
        "progress",
        box=None,
    )
    rows: list[dict[str, Any]] = []
    failures: list[tuple[str, str, str, str]] = []
    bad = False
    for name, outcome in outcomes.items():
        if outcome.value is None:
            table.add_row(
                name,
                "-",
                "[red]unreachable[/]",
                "",
                "",
                "",
                "",
                "",
                "",
                escape((outcome.error or "")[:120]),
            )
            rows.append({"host": name, "state": "unreachable", "error": outcome.error})
            bad = True
            continue
        facts, probes, tails = outcome.value
        for r in target.rendered[name]:
            row = status_row(r, facts, probes.get(r.unit.name))
            if r.unit.name in tails:
                row["log_tail"] = tails[r.unit.name]
                failures.append((name, r.unit.name, row["health"], tails[r.unit.name]))
            rows.append(row)
            color = {
                "ready": "green",
                "running": "green",
                "done": "green",
                "starting": "yellow",
                "outdated": "yellow",
                "stopped": "dim",
                "absent": "dim",
            }.get(row["state"], "red")
            bad = bad or color == "red"
            table.add_row(
                name,
                r.unit.name,
                f"[{color}]{row['state']}[/]",
                str(row["pid"] or ""),
                row["uptime"],
                str(r.unit.port or "-"),
                escape(row["health"]),
                row["fingerprint"],
                row["gpus"],
                escape(row["progress"]),
            )
    out.print(table)
    for host_name, unit, ended, text in failures:
        out.print(f"[red]==> {escape(f'[{host_name}] {unit} ({ended}), end of its log:')}[/]")
        out.out(text.rstrip("\n"), highlight=False)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            handle.write("\n".join(json.dumps(row, default=str) for row in rows) + "\n")
    return 2 if bad else 0


def status_row(r: Rendered, facts: HostFacts, probe: UnitProbe | None) -> dict[str, Any]:
    uf = facts.unit(r.unit.name)
    state, health = unit_state(r, facts, probe)
    pid = uf.process.pid if uf is not None and uf.running else None
    uptime = ""
    if uf is not None and uf.running and uf.pid is not None and uf.pid.started_at:
        started = datetime.strptime(uf.pid.started_at, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=timezone.utc
        )
        uptime = _duration(facts.time - started.timestamp())
    match = uf is not None and uf.fingerprint == r.fingerprint
    fp = f"{r.short} {'=' if match else '!= ' + (uf.fingerprint or 'none')[:12] if uf else 'none'}"
    gpus = " ".join(f"{g}:{facts.gpu_used_mib(g) // 1024}G" for g in r.unit.gpus) or "-"
    progress = ""
    if uf is not None and uf.progress:
        p = uf.progress
        done, total = p.get("done"), p.get("total")
        progress = f"{done}/{total}" if done is not None and total else ""
        if p.get("eta_s") and p.get("state") == "running" and uf.running:
            progress += f" eta {_duration(float(p['eta_s']))}"
    return {
        "host": r.unit.host.name,
        "unit": r.unit.name,
        "state": state,
        "pid": pid,
        "uptime": uptime,
        "port": r.unit.port,
        "health": health,
        "fingerprint": fp,
        "gpus": gpus,
        "progress": progress,
    }


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# -- logs ---------------------------------------------------------------------------------------


def logs(
    out: Console,
    *,
    unit: str,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    lines: int = 100,
    follow: bool = False,
) -> int:
    target = prepare(out, inventory, hosts, playbooks)
    places = [(h, r) for h, rs in target.rendered.items() for r in rs if r.unit.name == unit]
    if not places:
        raise DflashopsError(f"no unit named {unit!r} on the selected hosts")
    if len(places) > 1:
        raise DflashopsError(
            f"{unit} runs on {', '.join(h for h, _ in places)}: say which with --host"
        )
    host_name, _ = places[0]
    host = target.hosts[host_name]
    run = HostRun(host, target.rendered[host_name], EventLog(out), Options())
    try:
        facts = run.gather()
        result = tail_log(run.conn, host.python, facts.workdir, unit, lines=lines)
        if result.log is None:
            raise HostError(host_name, f"{unit} has no log yet (never started?)")
        out.print(f"[dim]==> {escape(f'[{host_name}] {unit} {result.log}')}[/]")
        out.out(result.text, end="", highlight=False)
        offset, log = result.offset, result.log
        while follow:
            time.sleep(1.0)
            more = tail_log(run.conn, host.python, facts.workdir, unit, offset=offset, log=log)
            if more.rotated:
                out.print(f"[dim]==> {escape(f'[{host_name}] {unit} now logs to {more.log}')}[/]")
            out.out(more.text, end="", highlight=False)
            offset, log = more.offset, more.log or log
    except KeyboardInterrupt:
        return 0
    finally:
        run.close()
    return 0
