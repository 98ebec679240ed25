"""status: what runs where, per unit, from the hosts themselves (facts, probes, log ends).

One ``Row`` per unit, made once: the table shows it for people (states explained in
states.LEGEND), ``--json`` gives it as data with raw values (``document``: seconds, booleans,
bytes, ISO-8601 UTC times), on stdout for ``--json`` alone or ``--json -``, else in FILE.
When a playbook does not load (common.prepare warns), the units a host records that no
playbook renders are shown from those records alone, their health not probed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.agent import history_actions
from dflashops.agent.answers import HostFacts, UnitFacts, UnitProbe
from dflashops.agent.history_actions import RolledUnit
from dflashops.changes.history import rolled_back
from dflashops.changes.identity import iso
from dflashops.changes.orphans import Orphan
from dflashops.changes.verdicts import health_text, probe_spec
from dflashops.commands.common import Target, prepare
from dflashops.commands.states import STYLE
from dflashops.commands.status_rows import LastExit as LastExit
from dflashops.commands.status_rows import last_exit as last_exit
from dflashops.commands.status_rows import restarts_of as restarts_of
from dflashops.commands.status_rows import run_since as run_since
from dflashops.commands.status_rows import run_time as run_time
from dflashops.commands.status_rows import seconds_since as seconds_since
from dflashops.commands.status_rows import text_or_none
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host
from dflashops.engines import identity
from dflashops.engines.metrics import Memory, Reading, shown
from dflashops.engines.render import Rendered
from dflashops.events import STDOUT, EventLog, for_people
from dflashops.lifecycle.fleet import Outcome, on_hosts
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.session import HostSession
from dflashops.output import duration, escape, inert, some

DOCUMENT_SCHEMA = 1  # of the --json document: raised when a field changes meaning or goes away
UNREACHABLE = "unreachable"  # a host's row when it did not answer

# -- one unit, as a row sees it ------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """A row's unit: as a playbook renders it, or (no playbook that loads renders it) as its
    host records it in unit.json."""

    name: str
    kind: str | None  # service | job; None: the host records nothing of it
    port: int | None
    gpus: tuple[int, ...]
    engine: str | None
    rendered: Rendered | None = None

    @classmethod
    def of(cls, r: Rendered) -> Seen:
        u = r.unit
        return cls(u.name, u.kind, u.port, u.gpus, u.engine, r)

    @classmethod
    def recorded(cls, name: str, uf: UnitFacts) -> Seen:
        rec = uf.unit
        if rec is None:
            return cls(name, None, None, (), None)
        return cls(name, rec.kind, rec.port, tuple(rec.gpus), rec.engine)


# -- states ----------------------------------------------------------------------------------------


def unit_state(r: Rendered, facts: HostFacts, probe: UnitProbe | None) -> tuple[str, str]:
    """(state, health) of a rendered unit for the status table."""
    return state_of(Seen.of(r), facts.unit(r.unit.name), probe, facts.time)


def state_of(
    seen: Seen, uf: UnitFacts | None, probe: UnitProbe | None, now: float
) -> tuple[str, str]:
    """(state, health): every state here is explained in states.LEGEND."""
    ended = process_state(seen.kind, uf, now)
    if ended is not None or uf is None:
        return ended or ("absent", "-")
    r = seen.rendered
    if r is None:
        return "running", "not probed"  # its playbook does not load: no probe to ask
    if r.unit.port is None or r.launch.health_path is None or probe is None:
        return ("running" if uf.fingerprint == r.fingerprint else "outdated"), "-"
    health = health_text(probe)
    if probe.health is None or probe.health.status != 200:
        return "starting", health
    if uf.fingerprint != r.fingerprint:
        return "outdated", health  # runs an older rendering: `deploy` restarts it
    refused = probe.identity is not None and probe.identity.status in (401, 403)
    if refused and (wanted := r.unit.spec.secret_args):
        # It wants the key this controller does not have: its settings are unknown, not wrong.
        names = ", ".join(sorted(set(wanted.values())))
        return "ready", f"{health}; settings not checked (HTTP 401): export {names} to check them"
    if identity.check(r, probe):
        return "drifted", health
    return "ready", health


def rolled_state(
    got: tuple[str, str], rolled: dict[str, RolledUnit], name: str, uf: UnitFacts | None
) -> tuple[str, str]:
    """`outdated` is `rolled back` while the unit runs the kept revision a rollback put back."""
    revision = rolled_back(rolled, name, uf.fingerprint if uf is not None else None)
    if got[0] != "outdated" or revision is None:
        return got
    health = "" if got[1] == "-" else f"; {got[1]}"
    return "rolled back", f"revision {revision}, playbooks differ{health}"


def process_state(kind: str | None, uf: UnitFacts | None, now: float) -> tuple[str, str] | None:
    """(state, health) from the unit's records and process alone; None when it runs and no
    restart is under way (then its probe and its rendering say more)."""
    if uf is None or (uf.pid is None and uf.exit is None):
        return ("stopped" if uf is not None and uf.unit is not None else "absent"), "-"
    restarts = restarts_of(uf.supervisor, uf.running)
    ended = last_exit(uf)
    since = f", last exit {ended.text(now)}" if ended is not None else ""
    if not uf.running and uf.crashed is not None and uf.stopped is None:
        return "crashed", f"gave up after {restarts} restarts{since}"
    if uf.running and uf.supervisor is not None and uf.supervisor.restarting:
        return "restarting", f"restart {restarts}{since}"
    if uf.running:
        return None
    if uf.stopped is not None and uf.pid is None:
        return "stopped", "-"
    if uf.exit is not None and uf.exit.code is not None:
        ran = run_time(uf)
        outcome = f"exit {uf.exit.code}" + (f" after {ran}" if ran else "")
        if kind == "job":
            return ("done" if uf.exit.code == 0 else "failed"), outcome
        return "dead", outcome
    return ("stopped" if uf.pid is None else "dead"), "-"


def failed_units(names: list[str], facts: HostFacts) -> list[str]:
    """Units that ended on their own with a non-zero exit: their log ends are worth showing."""
    out = []
    for name in names:
        uf = facts.unit(name)
        if (
            uf
            and not uf.running
            and uf.stopped is None
            and uf.exit is not None
            and uf.exit.code not in (0, None)
        ):
            out.append(name)
    return out


def recorded(facts: HostFacts, rendered: list[Rendered]) -> list[str]:
    """Units the host records that none of ``rendered`` is (what orphans.find looks at)."""
    mine = {r.unit.name for r in rendered}
    return [
        name
        for name, uf in sorted(facts.units.items())
        if name not in mine and (uf.unit is not None or uf.pid is not None or uf.group_pids)
    ]


# -- rows ------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One unit on one host: what the table shows and what --json gives, from the same facts."""

    host: str
    seen: Seen
    uf: UnitFacts | None
    facts: HostFacts
    state: str
    health: str
    source: str  # playbook | host record (a playbook does not load) | orphan
    probe: UnitProbe | None = None
    reading: Reading | None = None
    log_tail: str | None = None

    @property
    def running(self) -> bool:
        return self.uf is not None and (self.uf.running or bool(self.uf.group_pids))

    @property
    def pid(self) -> int | None:
        return self.uf.process.pid if self.uf is not None and self.uf.running else None

    @property
    def started_at(self) -> str | None:
        uf = self.uf
        if uf is None or not uf.running or uf.pid is None:
            return None
        return run_since(uf.pid.started_at, uf.supervisor)

    @property
    def restarts(self) -> int:
        return restarts_of(self.uf.supervisor, self.uf.running) if self.uf else 0

    @property
    def rank_label(self) -> str:
        r = self.seen.rendered
        return f" [rank {r.unit.rank}/{len(r.unit.nodes)}]" if r and r.unit.multi_node else ""

    def fingerprint(self) -> dict[str, Any]:
        r, running = self.seen.rendered, self.uf.fingerprint if self.uf else None
        rendered = r.fingerprint if r is not None else None
        match = None if rendered is None or self.uf is None else running == rendered
        return {"rendered": rendered, "running": running, "match": match}

    def fingerprint_cell(self) -> str:
        fp = self.fingerprint()
        running = (fp["running"] or "none")[:12]
        if self.seen.rendered is None:
            return f"{running} (host)"
        return f"{self.seen.rendered.short} {'=' if fp['match'] else '!= ' + running}"

    def gpus(self) -> list[dict[str, Any]]:
        devices = [(g, self.facts.gpus.device(g)) for g in self.seen.gpus]
        return [
            {
                "index": g,
                "used_bytes": self.facts.gpu_used_mib(g) * 2**20,
                "util_pct": d.utilization_pct if d is not None else None,
            }
            for g, d in devices
        ]

    def cells(self) -> list[str]:
        """The table's cells, in COLUMNS' order (host text made inert by add_row)."""
        m = self.reading or Reading()
        last = last_exit(self.uf)
        style = STYLE.get(self.state, "red")
        utils = [g["util_pct"] for g in self.gpus() if g["util_pct"] is not None]
        orphan = self.source == "orphan"
        up = seconds_since(self.started_at, self.facts.time)
        return [
            self.host,
            escape(self.seen.name + self.rank_label),
            f"[{style}]{self.state}[/]",
            str(self.pid or ""),
            duration(up) if up is not None else "",
            str(self.seen.port or "-"),
            escape(self.health),
            "-" if orphan else shown(m.tok_s, "tok"),
            "-" if orphan else f"{shown(m.running, 'n')}/{shown(m.queued, 'n')}",
            "-" if orphan else shown(m.kv, "pct"),
            f"{sum(utils) / len(utils):.0f}%" if utils else "-",
            str(self.restarts),
            escape(last.text(self.facts.time)) if last is not None else "",
            self.fingerprint_cell(),
            " ".join(f"{g['index']}:{g['used_bytes'] // 2**30}G" for g in self.gpus()) or "-",
            escape(progress_text(self.uf)),
        ]

    def as_json(self) -> dict[str, Any]:
        """The row as data (docs/operations.md, "status --json", lists every field)."""
        uf, r, last = self.uf, self.seen.rendered, last_exit(self.uf)
        health = self.probe.health if self.probe is not None else None
        return {
            "host": self.host,
            "unit": self.seen.name,
            "service": r.unit.service if r is not None else None,
            "rank": r.unit.rank if r is not None else None,
            "kind": self.seen.kind,
            "engine": self.seen.engine,
            "source": self.source,
            "playbook": recorded_playbook(uf) if r is None else r.unit.playbook.name,
            "state": self.state,
            "health": self.health,
            "http_status": health.status if health is not None else None,
            "running": self.running,
            "pid": self.pid,
            "pids": list(uf.group_pids) if uf is not None else [],
            "started_at": self.started_at,
            "uptime_s": seconds_since(self.started_at, self.facts.time),
            "port": self.seen.port,
            "restarts": self.restarts,
            "last_exit": last.as_json() if last is not None else None,
            "fingerprint": self.fingerprint(),
            "gpus": self.gpus(),
            "metrics": (self.reading or Reading()).as_json(),
            "progress": progress_json(uf),
            "log_tail": self.log_tail,
        }


def recorded_playbook(uf: UnitFacts | None) -> str | None:
    return uf.unit.playbook if uf is not None and uf.unit is not None else None


PROGRESS_NUMBERS = ("done", "total", "failed", "requests_per_s", "eta_s")


def number(value: Any) -> float | int | None:
    """A progress file's number (the job writes it): anything else is None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value if ok and value == value and abs(value) != float("inf") else None


def progress_json(uf: UnitFacts | None) -> dict[str, Any] | None:
    p = uf.progress if uf is not None else None
    if not p:
        return None
    out: dict[str, Any] = {k: number(p.get(k)) for k in PROGRESS_NUMBERS}
    out["state"] = text_or_none(p.get("state"))
    return out


def progress_text(uf: UnitFacts | None) -> str:
    """`40/100 eta 3m05s` for the table."""
    p = progress_json(uf)
    if p is None or uf is None:
        return ""
    done, total, eta = p["done"], p["total"], p["eta_s"]
    text = f"{done}/{total}" if done is not None and total else ""
    if eta and p["state"] == "running" and uf.running:
        text += f" eta {duration(float(eta))}"
    return text


# -- the command -------------------------------------------------------------------------------

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
    "last exit",
    "fingerprint",
    "gpus",
    "progress",
)


def status(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    """The table (on stderr when the JSON takes stdout: ``json_path`` "-"), the log ends of
    failed units, and with ``json_path`` the document. ``units``: these units alone (a name
    matching none is an error, after the hosts were asked)."""
    people = for_people(out, json_path)
    target = prepare(people, inventory, hosts, playbooks, all_named_hosts=True)
    seen = HostMemory(target.selection.inventory.path if target.selection else None)

    def look(host: Host) -> Look:
        return look_at(target.session(host, EventLog(people)), seen, target.degraded is not None)

    outcomes = on_hosts(list(target.hosts.values()), look, forks)
    memory = Memory()  # a vLLM counter's previous sample: tok/s since the last look
    rows = collect(target, outcomes, memory)
    memory.save()
    if units:
        rows = only(rows, units, list(target.hosts))
    table = Table(*COLUMNS, box=None)
    bad = False
    for name, outcome in outcomes.items():
        if outcome.value is None:
            # Its reason whole, on a line of its own below: a table cell would wrap it.
            cells = [name, "-", f"[red]{host_state(outcome)}[/]", "", "", "", "see below"]
            add_row(table, *cells, *[""] * (len(COLUMNS) - len(cells)))
            bad = True
        for row in (r for r in rows if r.host == name):
            add_row(table, *row.cells())
            bad = bad or STYLE.get(row.state, "red") == "red"
    people.print(table)
    for outcome in outcomes.values():
        if outcome.value is None:  # the error names the host
            why = escape(inert(outcome.error or "no answer"))
            people.print(f"[red]{host_state(outcome)}:[/] {why}")
    for label, line in seen.warnings(outcomes):  # rebooted, re-provisioned since last seen
        people.print(f"[yellow]{label}:[/] {escape(inert(line))}")
    for row in rows:
        if row.log_tail is not None:
            line = inert(f"[{row.host}] {row.seen.name} ({row.health}), end of its log:")
            people.print(f"[red]==> {escape(line)}[/]")
            people.out(inert(row.log_tail.rstrip("\n")), highlight=False)
    if json_path:
        # One line: a reader of JSON lines (an events file, a log) takes it whole too.
        text = json.dumps(document(target, outcomes, rows, not bad, seen)) + "\n"
        if json_path == STDOUT:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            with open(json_path, "w", encoding="utf-8") as handle:
                handle.write(text)
    return 2 if bad else 0


# facts, probes, failed units' log ends, orphans, units a rollback put on a kept revision
Look = tuple[HostFacts, dict[str, UnitProbe], dict[str, str], list[Orphan], dict[str, RolledUnit]]


def look_at(session: HostSession, seen: HostMemory, from_records: bool = False) -> Look:
    """One host's facts (then compared with ``seen``, and kept there), its services' probes, its
    failed units' log ends; ``from_records``: of the units no playbook renders too (not probed)."""
    rolled: dict[str, RolledUnit] = {}
    try:
        history_actions.rolled_ahead(session.agent, session.workdir, rolled.update)
        facts = session.gather()
        seen.look(session, facts)
        probed = [
            r
            for r in session.rendered
            if r.unit.port is not None and (uf := facts.unit(r.unit.name)) and uf.running
        ]
        specs = [probe_spec(r, session.resolved.values, metrics=True) for r in probed]
        probes = session.agent.probe(facts.workdir, specs)
        names = [r.unit.name for r in session.rendered]
        if from_records:
            names += recorded(facts, session.rendered)
        # Only failed units cost an extra call each: the end of the log says why.
        tails = {
            name: session.agent.tail(facts.workdir, name, lines=10).text
            for name in failed_units(names, facts)
        }
        return facts, probes, tails, session.orphans, rolled
    finally:
        session.close()


def collect(target: Target, outcomes: dict[str, Outcome[Look]], memory: Memory) -> list[Row]:
    """The rows of every host that answered: its orphans, its rendered units in start order,
    then (a playbook does not load) what else it records."""
    rows: list[Row] = []
    for name, outcome in outcomes.items():
        if outcome.value is None:
            continue
        # A look of four parts (no history asked) is taken as one with nothing rolled back.
        facts, probes, tails, orphans, *more = outcome.value
        rolled = more[0] if more else {}
        for o in orphans:
            rows.append(
                Row(
                    name,
                    Seen.recorded(o.name, o.facts),
                    o.facts,
                    facts,
                    "orphan",
                    "no playbook defines it",
                    "orphan",
                )
            )
        rendered = target.rendered.get(name, [])
        seen = [Seen.of(r) for r in rendered]
        if target.degraded is not None:
            seen += [Seen.recorded(n, facts.units[n]) for n in recorded(facts, rendered)]
        for s in seen:
            probe = probes.get(s.name)
            uf = facts.unit(s.name)
            metrics = probe.metrics if probe else None
            reading = memory.read(f"{name}/{s.name}", s.engine or "", metrics, facts.time)
            state, health = rolled_state(state_of(s, uf, probe, facts.time), rolled, s.name, uf)
            source = "playbook" if s.rendered is not None else "host record"
            rows.append(
                Row(name, s, uf, facts, state, health, source, probe, reading, tails.get(s.name))
            )
    return rows


def only(rows: list[Row], names: list[str], hosts: list[str]) -> list[Row]:
    """The rows of the units ``names`` mean (a service: all its units); a name that matches
    none of the units seen is an error that says which names there are."""
    from dflashops.plan.names import of_host, of_units, resolve

    rendered = [row.seen.rendered.unit for row in rows if row.seen.rendered is not None]
    kinds = {row.seen.name: row.seen.kind for row in rows if row.seen.rendered is None}
    known = {**of_host(kinds), **of_units(rendered)}
    wanted = set(resolve(names, known, f"on {some(hosts) or 'the selected hosts'}"))
    return [row for row in rows if row.seen.name in wanted]


def document(
    target: Target, outcomes: dict[str, Outcome[Look]], rows: list[Row], ok: bool, seen: HostMemory
) -> dict[str, Any]:
    """`status --json`: one document (its schema: docs/operations.md, "status --json")."""
    hosts = []
    for name, outcome in outcomes.items():
        facts = outcome.value[0] if outcome.value is not None else None
        hosts.append(
            {
                "host": name,
                # Answered, even when the work failed there (a missing python, a held lock).
                "reachable": facts is not None or outcome.reached,
                "state": "ok" if facts is not None else host_state(outcome),
                "error": outcome.error,
                "time": iso(facts.time) if facts is not None else None,
                "identity": seen.identity(name),  # same, rebooted, ... (None: not read)
            }
        )
    return {
        "schema": DOCUMENT_SCHEMA,
        "time": iso(datetime.now(timezone.utc).timestamp()),
        "ok": ok,
        "warnings": [target.degraded] if target.degraded else [],
        "hosts": hosts,
        "units": [row.as_json() for row in rows],
    }


def host_state(outcome: Outcome[Look]) -> str:
    """A host without facts: ``failed`` when it answered (its python is missing, another
    actor holds its lock) or on a bug of ours, else ``unreachable`` (the network, sshd, keys)."""
    return "failed" if outcome.reached or outcome.unexpected else UNREACHABLE


def add_row(table: Table, *cells: str) -> None:
    """A row of host text (health, progress, fingerprints, errors): shown inert."""
    table.add_row(*(inert(cell) for cell in cells))
