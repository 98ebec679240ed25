"""fetch: a path on a host to the controller, verified (sha256 of every file, as the host
computed it) and resumable (a partial file is kept and completed by the next run)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from dflashops.agent import Agent
from dflashops.agent.transfer import human, listing, pull
from dflashops.config.load import load_inventory
from dflashops.errors import DflashopsError
from dflashops.hosts import connect
from dflashops.output import escape, inert
from dflashops.project import expand_hosts, find_inventory, split_names


def fetch(
    out: Console,
    *,
    remote: str,
    local: str,
    inventory: str | None = None,
    hosts: list[str] | None = None,
) -> int:
    inv = load_inventory(find_inventory(inventory))
    names = split_names(hosts)
    targets = expand_hosts(inv, names)
    if len(targets) != 1:
        raise DflashopsError("fetch takes one host: --host NAME")
    host = inv.hosts[targets[0]]
    if not remote.startswith(("/", "~/")):
        raise DflashopsError(f"{remote!r}: give the path on {host.name} as an absolute path")
    conn = connect(host)
    try:
        agent = Agent(conn, host.python)
        started = time.monotonic()
        found = agent.scan(host.workdir, remote).tree
        if found is None or not found.exists:
            raise DflashopsError(f"[{host.name}] {remote} does not exist")
        dest = Path(local)
        if found.kind == "file" and dest.is_dir():
            dest = dest / Path(remote.rstrip("/")).name
        src = listing(found.files)
        fetched, failed = pull(agent, host.workdir, remote, src, dest, timeout=24 * 3600)
    finally:
        conn.close()
    size = sum(src[rel][0] for rel in fetched)
    for rel, why in failed.items():
        # The host names its files: shown inert (an escape sequence in a name is data).
        out.print(f"[red]failed:[/] {escape(inert(f'[{host.name}] {remote}/{rel}: {why}'))}")
    kept = len(src) - len(fetched) - len(failed)
    line = (
        f"[{host.name}] {remote} -> {dest}: {len(fetched)} file(s), {human(size)} in "
        f"{time.monotonic() - started:.1f}s; {kept} already there and verified"
        + (f"; {len(failed)} failed (run again to resume)" if failed else "")
    )
    out.print(f"{'[red]incomplete' if failed else '[green]fetched'}[/] {escape(line)}")
    return 2 if failed else 0
