"""prometheus-targets: every engine's own /metrics, as a Prometheus ``file_sd_configs`` file.

``[{"targets": ["ADDRESS:PORT"], "labels": {"host": ..., "unit": ..., "engine": ...}}]``, one
entry per service with a port (a multi-node unit's head: its worker ranks serve no HTTP), so an
existing Prometheus and the engines' own Grafana dashboards (vLLM and SGLang ship them) work
unchanged. Where Prometheus dials it: a server bound to a wildcard (``bind: 0.0.0.0``) at its
host's address as other hosts dial it (``internal_address``, else ``address``); bound to one
address, at that address (plan.model.dial_host). A server bound to loopback is reachable only
from its own machine: it is listed only when its host is this machine, and otherwise named in
one line on stderr. Written with --out as a whole file at once (Prometheus re-reads the file
when it changes: a half-written one would drop every target), else printed on stdout. Nothing
is asked of any host.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from dflashops.commands.common import prepare
from dflashops.config.inventory import Host
from dflashops.config.playbook import Job
from dflashops.engines.render import Rendered
from dflashops.errors import DflashopsError
from dflashops.output import console, escape, inert, some
from dflashops.plan.model import dial_host


def prometheus_targets(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: Any = None,
    playbooks: list[str] | None = None,
    out_path: str | None = None,
) -> int:
    people = console(stderr=True) if out_path is None or out_path == "-" else out
    target = prepare(people, inventory, hosts, playbooks)
    entries, unreachable = targets([r for rs in target.rendered.values() for r in rs])
    if unreachable:
        people.print(
            f"[yellow]WARN[/] not listed, bound to loopback on another machine: "
            f"{escape(inert(some(unreachable)))}: a Prometheus elsewhere cannot scrape them "
            "(give them `bind: 0.0.0.0`, or scrape on their host)"
        )
    text = json.dumps(entries, indent=2) + "\n"
    if out_path is None or out_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return 0
    write_whole(Path(out_path), text)
    people.print(f"prometheus-targets: {len(entries)} target(s) written to {escape(out_path)}")
    return 0


def targets(rendered: list[Rendered]) -> tuple[list[dict[str, Any]], list[str]]:
    """The file_sd entries, sorted by host and unit; and the `host/unit` of servers bound to
    loopback on a host that is not this machine."""
    entries, skipped = [], []
    for r in sorted(rendered, key=lambda r: (r.unit.host.name, r.unit.name)):
        u = r.unit
        if u.kind != "service" or u.port is None or isinstance(u.spec, Job):
            continue
        address = address_of(u.host, getattr(u.spec, "bind", "127.0.0.1"))
        if address is None:
            skipped.append(f"{u.host.name}/{u.name}")
            continue
        shown = f"[{address}]" if ":" in address else address
        labels = {"host": u.host.name, "unit": u.name, "engine": u.engine}
        entries.append({"targets": [f"{shown}:{u.port}"], "labels": labels})
    return entries, skipped


def address_of(host: Host, bind: str | None) -> str | None:
    """Where a server bound to ``bind`` on ``host`` is dialled from another machine (None:
    from nowhere else: bound to loopback on a host that is not this machine)."""
    near = dial_host(bind)  # how its own host dials it
    if near != bind:  # a wildcard bind: any address of the host, so the one others dial
        return host.dial_address
    if not is_loopback(near):
        return near
    return near if host.is_local or is_loopback(host.dial_address) else None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def write_whole(path: Path, text: str) -> None:
    """``text`` as ``path``: a temporary file beside it, then one rename."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
    except OSError as exc:
        raise DflashopsError(
            f"--out {path}: {exc.strerror or exc}: pick a writable folder"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # Prometheus, often another user, reads it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
