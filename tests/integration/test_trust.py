"""`dflashops trust` against real sshd hosts: fetch, show, record; re-trust after re-provisioning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from fleet import FleetFactory

from dflashops.cli import main
from dflashops.config.load import load_inventory
from dflashops.hosts.ssh import SshConnection


def test_trust_records_and_reprovisioned_node_needs_it_again(
    fleet_factory: FleetFactory, controller: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = fleet_factory("pro6000")
    node = fleet["pro6000"]
    inventory = controller / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"pro6000": node.inventory_entry()}}))
    name = f"[{node.address}]:{node.port}"

    assert main(["trust", "-i", str(inventory), "--host", "pro6000"]) == 1  # no terminal, no --yes
    out = capsys.readouterr().out
    assert f"{name} presents ssh-ed25519 {node.fingerprint()}" in out and "pass --yes" in out
    assert not (controller / "known_hosts").exists()

    assert main(["trust", "-i", str(inventory), "--host", "pro6000", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"recorded ssh-ed25519 {node.fingerprint()} for {name}" in out
    host = load_inventory(inventory).hosts["pro6000"]
    assert SshConnection(host).run("echo trusted").out == "trusted\n"

    assert main(["trust", "-i", str(inventory), "--host", "pro6000", "--yes"]) == 0
    assert "already trusted" in capsys.readouterr().out

    old = node.fingerprint()
    node.rotate_host_key()
    assert main(["trust", "-i", str(inventory), "--host", "pro6000", "--yes"]) == 0
    out = capsys.readouterr().out
    # The host's name heads the line, not eaten as rich markup.
    assert re.search(rf"^\[pro6000\] \S+ had ssh-ed25519 {re.escape(old)}", out, re.M), out
    assert f"had ssh-ed25519 {old}" in out and f"presents ssh-ed25519 {node.fingerprint()}" in out
    assert SshConnection(host).run("echo re-trusted").out == "re-trusted\n"
    assert len((controller / "known_hosts").read_text().splitlines()) == 1


def test_trust_reports_a_pin_mismatch(
    fleet_factory: FleetFactory, controller: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = fleet_factory("a", "b")
    inventory = controller / "inventory.yaml"
    entry = fleet["a"].inventory_entry(host_key=fleet["b"].host_key_line())
    inventory.write_text(yaml.safe_dump({"hosts": {"a": entry}}))
    assert main(["trust", "-i", str(inventory), "--host", "a", "--yes"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[a\] \S+ presents .*host_key pin does NOT match", out, re.M), out
    assert fleet["a"].host_key_line().split()[1] in out
