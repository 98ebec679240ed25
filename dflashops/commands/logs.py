"""logs: the end of a unit's current log, or follow it; a service's name shows each of its
units' logs, each headed by the unit's name."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from dflashops.commands.common import Target, prepare
from dflashops.errors import DflashopsError, HostError
from dflashops.events import EventLog
from dflashops.lifecycle.session import HostSession
from dflashops.output import escape, inert
from dflashops.plan.names import UnknownNames, of_host, of_units, partition, resolve


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
    """The unit (or service) is looked up in the playbooks; one they do not name (an orphan)
    is read from the one host given with --host. The log is shown inert (DESIGN.md "Trust
    boundary" 2) unless ``raw``."""
    target = prepare(out, inventory, hosts, playbooks, all_named_hosts=True)
    host_name, units = placed(target, unit)
    run = target.session(target.hosts[host_name], EventLog(out))
    try:
        facts = run.gather()
        if units is None:  # not in the playbooks: what the host records (orphans)
            kinds = {n: uf.unit.kind if uf.unit else None for n, uf in facts.units.items()}
            planned = of_units(r.unit for r in target.rendered.get(host_name, []))
            units = resolve([unit], {**of_host(kinds), **planned}, f"on {host_name}")
        Follower(out, run, facts.workdir, units, raw).show(lines, follow)
    except KeyboardInterrupt:
        return 0
    finally:
        run.close()
    return 0


def placed(target: Target, name: str) -> tuple[str, list[str] | None]:
    """The host and the units ``name`` means there, from the playbooks; (the one host, None)
    when they do not name it and one host is targeted: its records decide."""
    planned = {(h, r.unit.name): r.unit.service for h, rs in target.rendered.items() for r in rs}
    known = {u: s for (_, u), s in planned.items()}
    units, _ = partition([name], known)
    places = [h for h in target.hosts if any((h, u) in planned for u in units)]
    if len(places) > 1:
        raise DflashopsError(f"{name} runs on {', '.join(places)}: say which with --host")
    if places:
        return places[0], units
    if len(target.hosts) == 1:
        return next(iter(target.hosts)), None
    raise UnknownNames(
        [name],
        known,
        "in the playbooks for the selected hosts (for an orphan, name its host with --host)",
    )


class Follower:
    """The ends of some units' logs on one host, then (--follow) what they add: one header
    per unit, and again whenever the output switches to another unit (as ``tail -f`` does)."""

    def __init__(
        self, out: Console, run: HostSession, workdir: str, units: list[str], raw: bool
    ) -> None:
        self.out, self.run, self.workdir, self.units, self.raw = out, run, workdir, units, raw
        self.at: dict[str, tuple[int, str | None]] = {}  # unit -> (offset, log) to go on from
        self.last: str | None = None  # the unit whose output was printed last

    def header(self, text: str) -> None:
        self.out.print(f"[dim]==> {escape(inert(f'[{self.run.host.name}] {text}'))}[/]")

    def text(self, unit: str, text: str) -> None:
        if not text:
            return
        if unit != self.last and len(self.units) > 1:
            self.header(unit)
        self.last = unit
        self.out.out(text if self.raw else inert(text), end="", highlight=False)

    def show(self, lines: int, follow: bool) -> None:
        found = 0
        for unit in self.units:
            result = self.run.agent.tail(self.workdir, unit, lines=lines)
            self.at[unit] = (result.offset, result.log)
            if result.log is None:
                if len(self.units) > 1:
                    self.header(f"{unit}: no log yet (never started?)")
                continue
            found += 1
            self.header(f"{unit} {result.log}")
            self.last = unit
            self.out.out(result.text if self.raw else inert(result.text), end="", highlight=False)
        if not found:
            which = (
                f"{self.units[0]} has" if len(self.units) == 1 else f"{', '.join(self.units)} have"
            )
            raise HostError(self.run.host.name, f"{which} no log yet (never started?)")
        while follow:
            time.sleep(1.0)
            for unit in self.units:
                offset, log = self.at[unit]
                more = self.run.agent.tail(self.workdir, unit, offset=offset, log=log)
                if more.rotated:
                    self.header(f"{unit} now logs to {more.log}")
                    self.last = unit
                self.text(unit, more.text)
                self.at[unit] = (more.offset, more.log or log)
