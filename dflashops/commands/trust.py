"""trust: fetch, show and record a host's SSH key, on purpose (re-provisioned nodes change keys)."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console

from dflashops.config.inventory import Host
from dflashops.config.load import load_inventory
from dflashops.errors import DflashopsError
from dflashops.hosts.hostkeys import fingerprint, lookup, parse_key_line, record
from dflashops.hosts.ssh import SshConnection, user_known_hosts
from dflashops.output import confirm as ask_terminal
from dflashops.output import escape
from dflashops.project import find_inventory, split_names


def trust(
    out: Console,
    *,
    inventory: str | None = None,
    hosts: list[str] | str | None = None,
    yes: bool = False,
    confirm: Callable[[str], bool] | None = None,
) -> int:
    """Fetch each host's SSH key, show its fingerprint, and record it in dflashops' known_hosts
    after confirmation (a terminal prompt, or --yes for scripts)."""
    inv = load_inventory(find_inventory(inventory))
    names = split_names(hosts)
    if not names:
        raise DflashopsError("trust needs --host NAMES: say which hosts' keys to record")
    try:
        targets = inv.expand(names)
    except KeyError as exc:
        raise DflashopsError(f"--host {exc.args[0]!r} is not in {inv.path}") from None
    failed = 0
    for name in targets:
        host = inv.hosts[name]
        if host.is_local:
            out.print(f"\\[{name}] local host: no SSH key to trust")
            continue
        try:
            failed += not _trust_one(out, host, yes, confirm)
        except DflashopsError as exc:
            out.print(f"[red]failed:[/] {escape(str(exc))}")
            failed += 1
    return 1 if failed else 0


def _trust_one(out: Console, host: Host, yes: bool, confirm: Callable[[str], bool] | None) -> bool:
    conn = SshConnection(host)
    key = conn.host_key()
    name = conn.key_name()
    shown = f"{key.get_name()} {fingerprint(key)}"
    if host.host_key:
        pinned = parse_key_line(host.host_key)
        state = "matches" if pinned == key else "does NOT match"
        out.print(
            f"[{host.name}] {name} presents {shown}; the inventory's host_key pin {state} it."
        )
        if pinned != key:
            out.print(
                f"  the pin wins over known_hosts: update `host_key` for {host.name} to: {key.get_name()} {key.get_base64()}"
            )
            return False
        return True
    previous = lookup(name, None, user_known_hosts(conn.fabric))
    same = [k for k in previous if k.key == key]
    if same:
        out.print(f"\\[{host.name}] {name} presents {shown}: already trusted ({same[0].source})")
        return True
    for old in previous:
        out.print(
            f"[{host.name}] {name} had {old.key.get_name()} {fingerprint(old.key)} in {old.source}"
        )
    out.print(f"\\[{host.name}] {name} presents {shown}")
    if not yes:
        ask = confirm or (lambda q: ask_terminal(q, "pass --yes to record the key"))
        if not ask(f"Trust this key for {host.name}? [y/N] "):
            out.print(f"\\[{host.name}] not recorded")
            return False
    path = record(name, key)
    out.print(f"\\[{host.name}] recorded {shown} for {name} in {path}")
    return True
