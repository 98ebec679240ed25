"""logs: the end of a unit's current log, or follow it."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from dflashops.commands.common import prepare
from dflashops.errors import DflashopsError, HostError
from dflashops.events import EventLog
from dflashops.hosts.inert import inert
from dflashops.output import escape


def logs(
    out: Console,
    *,
    unit: str,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    lines: int = 100,
    follow: bool = False,
    raw: bool = False,
) -> int:
    """The unit is looked up in the playbooks; a unit they do not name (an orphan) is read
    from the one host given with --host. The log is shown inert (DESIGN.md "Trust boundary"
    2) unless ``raw``."""
    shown = (lambda text: text) if raw else inert
    target = prepare(out, inventory, hosts, playbooks, all_named_hosts=True)
    places = [h for h, rs in target.rendered.items() for r in rs if r.unit.name == unit]
    if not places and len(target.hosts) == 1:
        places = list(target.hosts)
    if not places:
        raise DflashopsError(
            f"no unit named {unit!r} in the playbooks for the selected hosts "
            "(for an orphan, name its host with --host)"
        )
    if len(places) > 1:
        raise DflashopsError(f"{unit} runs on {', '.join(places)}: say which with --host")
    host_name = places[0]
    host = target.hosts[host_name]
    run = target.session(host, EventLog(out))
    try:
        facts = run.gather()
        result = run.agent.tail(facts.workdir, unit, lines=lines)
        if result.log is None:
            raise HostError(host_name, f"{unit} has no log yet (never started?)")
        out.print(f"[dim]==> {escape(inert(f'[{host_name}] {unit} {result.log}'))}[/]")
        out.out(shown(result.text), end="", highlight=False)
        offset, log = result.offset, result.log
        while follow:
            time.sleep(1.0)
            more = run.agent.tail(facts.workdir, unit, offset=offset, log=log)
            if more.rotated:
                line = inert(f"[{host_name}] {unit} now logs to {more.log}")
                out.print(f"[dim]==> {escape(line)}[/]")
            out.out(shown(more.text), end="", highlight=False)
            offset, log = more.offset, more.log or log
    except KeyboardInterrupt:
        return 0
    finally:
        run.close()
    return 0
