"""deploy, restart-servers and stop: the commands that change what runs on hosts."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from dflashops.commands.common import each_host, prepare
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.errors import DflashopsError
from dflashops.events import EventLog
from dflashops.lifecycle import Options
from dflashops.output import some
from dflashops.project import split_names


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
    prune: bool = False,
    forks: int = DEFAULT_FORKS,
    json_path: str | None = None,
) -> int:
    target = prepare(out, inventory, hosts, playbooks)
    if prune and target.known is None:
        raise DflashopsError(
            "--prune needs every playbook in playbooks/ to load and plan (see the warning above): "
            "without them a running unit of theirs would look like an orphan; nothing was done"
        )
    events = EventLog(out, json_path)
    opts = Options(check=check, diff=diff, force=force, rerun=rerun, prune=prune)
    return each_host(out, target, events, forks, lambda run: run.deploy(), opts)


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
    return each_host(
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
    """Without --unit: every unit dflashops started on the targeted hosts, or with -p that
    playbook's units and the orphans. With --unit: those units wherever they run here, orphans
    too; a name found on no targeted host is an error."""
    target = prepare(out, inventory, hosts, playbooks, all_named_hosts=True)
    names = split_names(units) or None
    events = EventLog(out, json_path)
    everything = not target.explicit_playbooks
    code = each_host(out, target, events, forks, lambda run: run.stop(names, everything), Options())
    if names:
        seen = {e.unit for e in events.events if e.action == "stop"}
        unknown = [n for n in names if n not in seen]
        if unknown:
            raise DflashopsError(
                f"no unit named {', '.join(unknown)} on {some(list(target.hosts)) or 'the selected hosts'}"
            )
    return code
