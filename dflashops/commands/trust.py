"""trust: fetch, show and record a host's SSH key, on purpose (re-provisioned nodes change keys)."""

from __future__ import annotations

from rich.console import Console

from dflashops.commands.named import Confirm, OnNamed
from dflashops.config.inventory import Host
from dflashops.hosts.hostkeys import fingerprint, lookup, parse_key_line, record
from dflashops.hosts.ssh import SshConnection, user_known_hosts
from dflashops.output import confirm as ask_terminal


def _trust_one(out: Console, host: Host, yes: bool, confirm: Confirm | None) -> bool:
    """Fetch the host's SSH key, show its fingerprint, and record it in dflashops' known_hosts
    after confirmation (a terminal prompt, or --yes for scripts)."""
    if host.is_local:
        out.print(f"\\[{host.name}] local host: no SSH key to trust")
        return True
    conn = SshConnection(host)
    key = conn.host_key()
    name = conn.key_name()
    shown = f"{key.get_name()} {fingerprint(key)}"
    if host.host_key:
        pinned = parse_key_line(host.host_key)
        state = "matches" if pinned == key else "does NOT match"
        out.print(
            f"\\[{host.name}] {name} presents {shown}; the inventory's host_key pin {state} it."
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
            f"\\[{host.name}] {name} had {old.key.get_name()} {fingerprint(old.key)} in {old.source}"
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


trust = OnNamed("trust needs --host NAMES: say which hosts' keys to record", _trust_one)
