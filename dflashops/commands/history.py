"""history and rollback: what was deployed where, when and by whom; back to a kept revision.

`history` reads what each host records (agent/remote/history.py), so it works when a playbook
does not load (DESIGN 3 a.m. 1). `rollback` is deploy-like: it needs the playbooks (readiness
comes from them), takes the deploy lock, and is carried out by lifecycle/history.py.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.agent import history_actions
from dflashops.agent.client import Agent
from dflashops.agent.history_actions import Revision
from dflashops.changes.history import changed_text, touching
from dflashops.commands.common import prepare
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host
from dflashops.errors import DflashopsError
from dflashops.events import STDOUT, EventLog, for_people
from dflashops.hosts import connect
from dflashops.lifecycle.fleet import on_hosts
from dflashops.output import escape, inert
from dflashops.project import split_names

COLUMNS = ("host", "rev", "time (UTC)", "who", "command", "units changed")


def history(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    """Per host, newest first: revision, time, who, command, the units it changed; with
    ``units`` the revisions that changed those alone (a service: its replicas too)."""
    people = for_people(out, json_path)
    target = prepare(people, inventory, hosts, playbooks, all_named_hosts=True)
    names = split_names(units) or None

    def look(host: Host) -> list[Revision]:
        conn = connect(host)
        try:
            return history_actions.listing(Agent(conn, host.python), host.workdir).revisions
        finally:
            conn.close()

    outcomes = on_hosts(list(target.hosts.values()), look, forks)
    table = Table(*COLUMNS, box=None)
    doc: list[dict[str, Any]] = []
    for name, outcome in outcomes.items():
        if outcome.value is None:
            table.add_row(
                name, "-", "[red]unreachable[/]" if not outcome.reached else "[red]failed[/]"
            )
            doc.append({"host": name, "error": outcome.error, "revisions": []})
            continue
        shown = touching(outcome.value, expand(names, outcome.value))
        for r in shown:
            cells = (r.time or "-", r.who or "-", r.command or "-", changed_text(r))
            table.add_row(name, str(r.revision), *(escape(inert(c)) for c in cells))
        doc.append({"host": name, "error": None, "revisions": [r.model_dump() for r in shown]})
    people.print(table)
    bad = False
    for name, outcome in outcomes.items():
        if outcome.value is None:
            bad = True
            people.print(f"[red]{escape(name)}:[/] {escape(inert(outcome.error or 'no answer'))}")
        elif not outcome.value:
            people.print(
                f"\\[{escape(name)}] no revisions on record yet (the first deploy makes one)"
            )
    if json_path:
        write_json({"schema": 1, "ok": not bad, "hosts": doc}, json_path)
    return 2 if bad else 0


def expand(names: list[str] | None, revisions: list[Revision]) -> list[str] | None:
    """The unit names ``names`` mean on this host: a name, or a service's replicas NAME-i."""
    if names is None:
        return None
    seen = {u for r in revisions for u in r.units}
    out = set(names)
    for n in names:
        out.update(u for u in seen if re.fullmatch(re.escape(n) + r"-\d+", u))
    return sorted(out)


def write_json(doc: dict[str, Any], path: str) -> None:
    text = json.dumps(doc) + "\n"
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def rollback(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    to: int | None = None,
    units: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
    lock_wait: str | None = None,
) -> int:
    """The host's units back on revision ``to`` (default: the one before the newest): those
    whose kept script differs from what they have, restarted and verified like a deploy."""
    from dflashops.commands.deploy import each_host, lock_seconds, narrowed
    from dflashops.lifecycle.history import rollback as roll
    from dflashops.lifecycle.options import Options

    if not hosts:
        raise DflashopsError("rollback needs --host NAMES: say which hosts go back")
    wait = lock_seconds(lock_wait)
    names = split_names(units)
    target = narrowed(prepare(out, inventory, hosts, playbooks), names)
    chosen = None
    if names:
        chosen = sorted({r.unit.name for rs in target.rendered.values() for r in rs})
    events = EventLog(out, json_path)
    opts = Options(lock_wait=wait)
    return each_host(out, target, events, forks, lambda run: roll(run, to, chosen), opts)
