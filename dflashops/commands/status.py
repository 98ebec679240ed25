"""status: what runs where, per unit, from the hosts themselves (facts, probes, log ends)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.agent.answers import HostFacts, UnitFacts, UnitProbe
from dflashops.changes.orphans import Orphan
from dflashops.changes.verdicts import health_text, probe_spec
from dflashops.commands.common import prepare
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host
from dflashops.engines import identity
from dflashops.engines.metrics import Memory, Reading, shown
from dflashops.engines.render import Rendered
from dflashops.events import EventLog
from dflashops.hosts.inert import inert
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.session import HostSession
from dflashops.output import duration, escape

# -- status -------------------------------------------------------------------------------------


def unit_state(r: Rendered, facts: HostFacts, probe: UnitProbe | None) -> tuple[str, str]:
    """(state, health) for the status table."""
    uf = facts.unit(r.unit.name)
    if uf is None or (uf.pid is None and uf.exit is None):
        return ("stopped" if uf is not None and uf.unit is not None else "absent"), "-"
    if not uf.running and uf.crashed is not None and uf.stopped is None:
        return "crashed", f"gave up after {restarts_of(uf)} restarts{last_exit(uf)}"
    if uf.running and uf.supervisor is not None and uf.supervisor.restarting:
        return "restarting", f"restart {uf.supervisor.restarts + 1}{last_exit(uf)}"
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


def restarts_of(uf: UnitFacts) -> int:
    return uf.supervisor.restarts if uf.supervisor is not None else 0


def last_exit(uf: UnitFacts) -> str:
    """`, last exit SIGKILL at 03:12:07Z` from the supervisor's record of crashes."""
    history = [h for h in (uf.supervisor.history if uf.supervisor else []) if "code" in h]
    if not history:
        return ""
    last = history[-1]
    how = last.get("signal") or f"code {last.get('code')}"
    why = " (liveness)" if last.get("reason") == "liveness" else ""
    return f", last exit {how}{why} at {str(last.get('at', ''))[11:]}"


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
    return duration((ended - began).total_seconds())


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
    target = prepare(out, inventory, hosts, playbooks, all_named_hosts=True)

    def look(host: Host) -> Look:
        return look_at(target.session(host, EventLog(out)))

    outcomes = on_hosts(list(target.hosts.values()), look, forks)
    memory = Memory()  # a vLLM counter's previous sample: tok/s since the last look
    table = Table(*COLUMNS, box=None)
    rows: list[dict[str, Any]] = []
    failures: list[tuple[str, str, str, str]] = []
    bad = False
    for name, outcome in outcomes.items():
        if outcome.value is None:
            add_row(
                table,
                name,
                "-",
                "[red]unreachable[/]",
                *[""] * (len(COLUMNS) - 4),
                escape((outcome.error or "")[:120]),
            )
            rows.append({"host": name, "state": "unreachable", "error": outcome.error})
            bad = True
            continue
        facts, probes, tails, orphans = outcome.value
        for o in orphans:
            rows.append(add_orphan(table, name, o, facts))
        for r in target.rendered.get(name, []):
            probe = probes.get(r.unit.name)
            reading = memory.read(
                f"{name}/{r.unit.name}", r.unit.engine, probe.metrics if probe else None, facts.time
            )
            row = status_row(r, facts, probe, reading)
            if r.unit.name in tails:
                row["log_tail"] = tails[r.unit.name]
                failures.append((name, r.unit.name, row["health"], tails[r.unit.name]))
            rows.append(row)
            color = STATE_COLORS.get(row["state"], "red")
            bad = bad or color == "red"
            rank = f" [rank {r.unit.rank}/{len(r.unit.nodes)}]" if r.unit.multi_node else ""
            add_row(
                table,
                name,
                escape(r.unit.name + rank),
                f"[{color}]{row['state']}[/]",
                str(row["pid"] or ""),
                row["uptime"],
                str(r.unit.port or "-"),
                escape(row["health"]),
                shown(reading.tok_s, "tok"),
                f"{shown(reading.running, 'n')}/{shown(reading.queued, 'n')}",
                shown(reading.kv, "pct"),
                row["gpu_util"],
                str(row["restarts"]),
                row["fingerprint"],
                row["gpus"],
                escape(row["progress"]),
            )
    memory.save()
    out.print(table)
    for host_name, unit, ended, text in failures:
        line = inert(f"[{host_name}] {unit} ({ended}), end of its log:")
        out.print(f"[red]==> {escape(line)}[/]")
        out.out(inert(text.rstrip("\n")), highlight=False)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            handle.write("\n".join(json.dumps(row, default=str) for row in rows) + "\n")
    return 2 if bad else 0


Look = tuple[HostFacts, dict[str, UnitProbe], dict[str, str], list[Orphan]]


def look_at(session: HostSession) -> Look:
    """One host's facts, its running services' probes, the log ends of its failed units (the
    session is closed after)."""
    try:
        facts = session.gather()
        probed = [
            r
            for r in session.rendered
            if r.unit.port is not None and (uf := facts.unit(r.unit.name)) and uf.running
        ]
        specs = [probe_spec(r, session.resolved.values, metrics=True) for r in probed]
        probes = session.agent.probe(facts.workdir, specs)
        # Only failed units cost an extra call each: the end of the log says why.
        tails = {
            name: session.agent.tail(facts.workdir, name, lines=10).text
            for name in failed_units(session.rendered, facts)
        }
        return facts, probes, tails, session.orphans
    finally:
        session.close()


def add_orphan(table: Table, host: str, o: Orphan, facts: HostFacts) -> dict[str, Any]:
    """An orphan's row in the table; its --json row returned."""
    row = orphan_row(host, o, facts)
    add_row(
        table,
        host,
        o.name,
        "[magenta]orphan[/]",
        str(row["pid"] or ""),
        row["uptime"],
        str(o.port or "-"),
        *["-"] * 6,
        "no playbook defines it",
        row["gpus"],
        "",
    )
    return row


def add_row(table: Table, *cells: str) -> None:
    """A row of host text (health, progress, fingerprints, errors): shown inert."""
    table.add_row(*(inert(cell) for cell in cells))


COLUMNS = (
    "host",
    "unit",
    "state",
    "pid",
    "uptime",
    "port",
    "health",
    "tok/s",
    "run/q",
    "KV",
    "GPU%",
    "restarts",
    "fingerprint",
    "gpus",
    "progress",
)
STATE_COLORS = {
    "ready": "green",
    "running": "green",
    "done": "green",
    "starting": "yellow",
    "outdated": "yellow",
    "restarting": "yellow",
    "stopped": "dim",
    "absent": "dim",
}


def gpu_util(facts_gpus: Any, gpus: tuple[int, ...]) -> str:
    """`87%` (the mean over the unit's GPUs), `-` when nvidia-smi does not say."""
    values = [
        d.utilization_pct
        for g in gpus
        if (d := facts_gpus.device(g)) is not None and d.utilization_pct is not None
    ]
    return f"{sum(values) / len(values):.0f}%" if values else "-"


def status_row(
    r: Rendered, facts: HostFacts, probe: UnitProbe | None, reading: Reading | None = None
) -> dict[str, Any]:
    uf = facts.unit(r.unit.name)
    state, health = unit_state(r, facts, probe)
    pid = uf.process.pid if uf is not None and uf.running else None
    up = uptime(uf, facts) if uf is not None else ""
    match = uf is not None and uf.fingerprint == r.fingerprint
    fp = f"{r.short} {'=' if match else '!= ' + (uf.fingerprint or 'none')[:12] if uf else 'none'}"
    gpus = " ".join(f"{g}:{facts.gpu_used_mib(g) // 1024}G" for g in r.unit.gpus) or "-"
    progress = ""
    if uf is not None and uf.progress:
        p = uf.progress
        done, total = p.get("done"), p.get("total")
        progress = f"{done}/{total}" if done is not None and total else ""
        if p.get("eta_s") and p.get("state") == "running" and uf.running:
            progress += f" eta {duration(float(p['eta_s']))}"
    return {
        "host": r.unit.host.name,
        "unit": r.unit.name,
        "rank": r.unit.rank,  # a part of a unit over several nodes: one row per rank
        "state": state,
        "pid": pid,
        "uptime": up,
        "port": r.unit.port,
        "health": health,
        "fingerprint": fp,
        "gpus": gpus,
        "gpu_util": gpu_util(facts.gpus, r.unit.gpus),
        "restarts": restarts_of(uf) if uf is not None else 0,
        "progress": progress,
        "metrics": (reading or Reading()).as_json(),
    }


def uptime(uf: UnitFacts, facts: HostFacts) -> str:
    if not uf.running or uf.pid is None or not uf.pid.started_at:
        return ""
    started = datetime.strptime(uf.pid.started_at, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=timezone.utc
    )
    return duration(facts.time - started.timestamp())


def orphan_row(host: str, o: Orphan, facts: HostFacts) -> dict[str, Any]:
    return {
        "host": host,
        "unit": o.name,
        "state": "orphan",
        "running": o.running,
        "pid": o.facts.process.pid if o.running else None,
        "pids": o.pids,
        "uptime": uptime(o.facts, facts),
        "port": o.port,
        "gpus": " ".join(f"{g}:{facts.gpu_used_mib(g) // 1024}G" for g in o.gpus) or "-",
        "playbook": o.facts.unit.playbook if o.facts.unit else None,
    }
