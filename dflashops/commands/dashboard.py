"""dashboard: the fleet on one web page, served from the controller (DESIGN "The fleet on one
page" 1 and 3).

Every --interval one look at the fleet over kept sessions (what `top` refreshes), kept in
``.dflashops/samples.sqlite`` beside the inventory for --keep; the page (dashboard/static/)
polls its document at the same pace and draws nothing itself: tables and server-drawn plots.
Bound beyond loopback it refuses to start without --token; see dashboard/server.py for who may
ask and what is logged. Looking never depends on a playbook (common.prepare's LOOK).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from rich.console import Console

from dflashops.commands.common import LOOK, prepare
from dflashops.commands.table import DEFAULT_FORKS
from dflashops.config.types import parse_duration
from dflashops.dashboard.fleet import Watch
from dflashops.dashboard.sampler import Sampler
from dflashops.dashboard.server import Dashboard, loopback, parse_listen
from dflashops.dashboard.store import FILE, Store
from dflashops.errors import DflashopsError
from dflashops.lifecycle.memory import HostMemory
from dflashops.output import escape, inert, verbose
from dflashops.project import state_dir

DAYS = re.compile(r"\s*(\d+(?:\.\d+)?)\s*d\s*")


def dashboard(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    listen: str = "127.0.0.1:8765",
    token: str | None = None,
    interval: str = "2s",
    keep: str = "7d",
    forks: int = DEFAULT_FORKS,
) -> int:
    every = seconds("--interval", interval)
    kept = seconds("--keep", keep, days=True)
    address = parse_listen(listen)
    secret = token_from(token)
    if secret is None and not loopback(address[0]):
        raise DflashopsError(
            f"dashboard: --listen {listen} is reachable from other machines: give --token "
            "env:NAME (NAME: an environment variable holding a secret), or listen on 127.0.0.1"
        )
    target = prepare(out, inventory, hosts, playbooks, from_hosts=LOOK)
    assert target.selection is not None  # prepare always selects
    where = target.selection.inventory.path

    def say(line: str) -> None:
        out.print(f"[yellow]WARN[/] {escape(inert(line))}")

    def log(line: str) -> None:  # -v: the requests, any token in them redacted (server.py)
        out.print(escape(inert(line)), highlight=False)

    store = Store(state_dir(where) / FILE, kept)
    for note in store.notes:
        say(note)
    watch = Watch(target, forks, memory=HostMemory(where))
    sampler = Sampler(watch, store, every, say)
    try:
        server = Dashboard(address, sampler, secret, log=log if verbose() else None)
    except OSError as exc:
        watch.close()
        store.close()
        raise DflashopsError(
            f"dashboard: cannot listen on {listen}: {exc.strerror or exc}: pick another "
            "--listen ADDRESS:PORT (another dashboard may be running there)"
        ) from None
    stop = threading.Event()
    looker = threading.Thread(target=sampler.run, args=(stop,), name="sampler", daemon=True)
    looker.start()
    out.print(
        f"dashboard: {escape(server.url)}  ({len(target.hosts)} host(s), a look every {interval}, "
        f"samples kept {keep} in {escape(str(store.path))}"
        + ("; token required" if secret else "")
        + "); Ctrl-C stops it",
        highlight=False,
    )
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        stop.set()
        looker.join(timeout=every + 30)
        watch.close()
        store.close()
    return 0


def seconds(flag: str, value: str, days: bool = False) -> float:
    """A duration option; ``days``: ``7d`` too (and more than a week)."""
    match = DAYS.fullmatch(value) if days else None
    if match is not None and float(match.group(1)) > 0:
        return float(match.group(1)) * 86400
    try:
        return parse_duration(value)
    except ValueError as exc:
        forms = "'7d', '12h', '30m'" if days else "'2s', '1m'"
        raise DflashopsError(f"{flag} {value!r}: {exc} (forms: {forms})") from None


def token_from(spec: str | None) -> str | None:
    """``env:NAME`` -> the value of NAME (a token on the command line would show in ps)."""
    if spec is None:
        return None
    if not spec.startswith("env:") or not spec[4:]:
        raise DflashopsError(
            f"--token {spec!r}: give env:NAME, the name of an environment variable holding "
            "the token (a token on the command line would show in `ps`)"
        )
    name = spec[4:]
    value = os.environ.get(name, "")
    if not value.strip():
        raise DflashopsError(
            f"--token env:{name}: {name} is not set (or empty) in this environment: export "
            f"{name}=SECRET first (e.g. {name}=$(openssl rand -hex 16))"
        )
    return value.strip()
