"""inventory: the inventory as dflashops sees it, provider-resolved addresses included.

``--list`` prints JSON in the shape of ``ansible-inventory --list``: every host with defaults
and group vars applied, and for a provider host its pod and where the provider says it is now
(one API call for all of them, the same cached answer a deploy would connect with). Without
``--list``: a table. Secrets are never shown: not the API key, nor a host's env or webhook.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.inventory import Host, Inventory
from dflashops.config.load import load_inventory
from dflashops.config.providers import Endpoint
from dflashops.errors import HostError
from dflashops.lifecycle.fleet import on_hosts
from dflashops.output import console, escape, inert
from dflashops.project import expand_hosts, find_inventory, split_names


@dataclass(frozen=True)
class Seen:
    """One host as listed: where it is reached, or why a provider cannot say."""

    host: Host
    endpoint: Endpoint | None = None
    problem: HostError | None = None

    @property
    def address(self) -> str | None:
        if self.host.provider is None:
            return self.host.given_address
        return self.endpoint.address if self.endpoint else None

    @property
    def port(self) -> int | None:
        if self.host.provider is None:
            return self.host.given_port
        return self.endpoint.port if self.endpoint else None


def inventory(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: list[str] | str | None = None,
    as_json: bool = False,
) -> int:
    """The inventory (``hosts``: these hosts and groups alone), as JSON with ``as_json``.
    Exit 2 when a provider could not say where one of its hosts is (each said on stderr)."""
    inv = load_inventory(find_inventory(inventory))
    names = split_names(hosts)
    chosen = expand_hosts(inv, names) if names else list(inv.hosts)
    seen = look(inv, chosen)
    if as_json:
        sys.stdout.write(json.dumps(listing(inv, seen), indent=2, default=str) + "\n")
        sys.stdout.flush()
    else:
        out.print(table(inv, seen))
    people = console(stderr=True) if as_json else out
    for s in seen.values():
        if s.problem is not None:
            people.print(f"[red]unreachable:[/] {escape(inert(str(s.problem)))}")
    return 2 if any(s.problem is not None for s in seen.values()) else 0


def look(inv: Inventory, names: list[str]) -> dict[str, Seen]:
    """Every host of ``names``; a provider host with its endpoint or its problem. The provider
    hosts ask in parallel: the first asks the API, the others wait for that one answer (a
    cached one is checked by a TCP connection per host)."""

    def endpoint(host: Host) -> Endpoint:
        assert host.provider is not None
        return host.provider.endpoint(host.name)

    pods = [inv.hosts[n] for n in names if inv.hosts[n].provider is not None]
    outcomes = on_hosts(pods, endpoint, DEFAULT_FORKS)
    seen = {}
    for name in names:
        host = inv.hosts[name]
        outcome = outcomes.get(name)
        if outcome is None:
            seen[name] = Seen(host)
        elif isinstance(outcome.exception, HostError):
            seen[name] = Seen(host, problem=outcome.exception)
        elif outcome.exception is not None:
            raise outcome.exception  # a bug: shown as one
        else:
            seen[name] = Seen(host, endpoint=outcome.value)
    return seen


def listing(inv: Inventory, seen: dict[str, Seen]) -> dict[str, Any]:
    """``{"hosts": {name: {...}}, "groups": {name: {"hosts": [...], "vars": {...}}}}``: the
    groups that hold any of the hosts listed, with those of their hosts alone."""
    groups = {}
    for group, members in inv.groups.items():
        kept = [m for m in members if m in seen]
        if kept:
            groups[group] = {"hosts": kept, "vars": inv.group_vars.get(group, {})}
    return {"hosts": {name: host_entry(s) for name, s in seen.items()}, "groups": groups}


def host_entry(s: Seen) -> dict[str, Any]:
    h = s.host
    provider = None
    if h.provider is not None:
        provider = {
            "name": h.provider.name,
            "pod": h.provider.key,
            "pod_id": s.endpoint.id if s.endpoint else None,
            "status": s.endpoint.status if s.endpoint else None,
            "problem": s.problem.reason if s.problem else None,
        }
    return {
        "connection": h.connection,
        "address": s.address,
        "port": s.port,
        "user": h.user,
        "workdir": h.workdir,
        "gpus": h.gpus,
        "python": h.python,
        "provider": provider,
        "vars": h.vars,
    }


def table(inv: Inventory, seen: dict[str, Seen]) -> Table:
    groups: dict[str, list[str]] = {}
    for group, members in inv.groups.items():
        for m in members:
            groups.setdefault(m, []).append(group)
    grid = Table("HOST", "ADDRESS", "USER", "GPUS", "PROVIDER", "GROUPS", box=None)
    for name, s in seen.items():
        h = s.host
        where = "local" if h.is_local else s.address or "-"
        if s.address is not None and s.port is not None:
            where += f":{s.port}"
        pod = "-"
        if h.provider is not None:
            pod = f"{h.provider.name} {h.provider.key!r}"
            pod += f" (id {s.endpoint.id})" if s.endpoint else " (see below)"
        cells = [name, where, h.user or "-", str(h.gpus), pod, ", ".join(groups.get(name, []))]
        grid.add_row(*(escape(inert(c)) for c in cells))
    return grid
