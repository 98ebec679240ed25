"""First contacts in parallel under `accept-new` (prewarm, `--forks 64`) record every host."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from fleet import FleetFactory

from dflashops.config.load import load_inventory
from dflashops.hosts.ssh import SshConnection

HOSTS = 16


def test_parallel_first_contacts_are_all_recorded(
    fleet_factory: FleetFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    known = tmp_path / "dflashops_known_hosts"
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(known))
    names = [f"n{i}" for i in range(HOSTS)]
    fleet = fleet_factory(*names)
    inventory = tmp_path / "inventory.yaml"
    entries = {n: fleet[n].inventory_entry(host_key_policy="accept-new") for n in names}
    inventory.write_text(yaml.safe_dump({"hosts": entries}))
    hosts = load_inventory(inventory).hosts
    start = threading.Barrier(HOSTS)
    answers: dict[str, str] = {}

    def contact(name: str) -> None:
        conn = SshConnection(hosts[name])
        try:
            start.wait()
            answers[name] = conn.run("echo hello").out
        finally:
            conn.close()

    threads = [threading.Thread(target=contact, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == dict.fromkeys(names, "hello\n")
    recorded = known.read_text()
    for n in names:
        h = fleet[n]
        assert f"[{h.address}]:{h.port} ssh-ed25519" in recorded, f"{n} was not recorded"
    # Recorded means trusted: the same hosts under `strict` connect without a prompt.
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"hosts": {n: fleet[n].inventory_entry() for n in names}}))
    for host in load_inventory(strict).hosts.values():
        conn = SshConnection(host)
        try:
            assert conn.run("true").exit_code == 0
        finally:
            conn.close()
