"""`dflashops preflight --live` and facts against the sshd fleet."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fleet import Fleet, FleetFactory

from dflashops.agent import Agent
from dflashops.cli import main
from dflashops.config.load import load_inventory
from dflashops.hosts.ssh import SshConnection
from dflashops.lifecycle.fleet import on_hosts


def test_live_preflight_reports_every_host(
    fleet4: Fleet, controller: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(fleet4.known_hosts_path, controller / "home" / ".ssh" / "known_hosts")
    model = fleet4["h1"].workdir.parent / "models" / "Qwen3.6-27B"
    model.mkdir(parents=True, exist_ok=True)
    hosts = {
        "h1": fleet4["h1"].inventory_entry(),
        "h2": fleet4["h2"].inventory_entry(),
        "h3": fleet4["h3"].inventory_entry(),
        "h4": fleet4["h4"].inventory_entry(gpus=4),  # the fake node has only 2
    }
    (controller / "inventory.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    (controller / "playbooks").mkdir()
    (controller / "playbooks" / "p.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "p",
                "hosts": ["h1", "h2", "h3", "h4"],
                "services": [
                    {
                        "name": "sglang",
                        "engine": "sglang",
                        "model": str(model),
                        "replicas": 2,
                        "port": 30000,
                    },
                    {"name": "vllm", "engine": "vllm", "model": "/nowhere/model", "port": 8000},
                ],
            }
        )
    )
    # h3 (a separate workdir, same loopback) has a foreign listener on the vLLM port: all fleet
    # hosts share this machine's network namespace, so it shows on every host.
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", 8000))
    blocker.listen()
    try:
        code = main(
            [
                "preflight",
                "--live",
                "-i",
                str(controller / "inventory.yaml"),
                "--json",
                str(controller / "r.json"),
            ]
        )
    finally:
        blocker.close()
    out = capsys.readouterr().out
    assert code == 1, out
    assert "live: 4 of 4 host(s) reached (h1, h2, h3, h4)" in out
    assert "[h4] inventory says 4 GPUs, nvidia-smi lists 2" in out
    assert "[h1] /nowhere/model does not exist on the host" in out
    assert f"{model} does not exist" not in out
    # Deploy's words for a port holder: pid, command line, whose unit it is, what to do.
    held = f"vllm-0: port 8000 is already taken by pid {os.getpid()} ("
    assert held in out and "not a dflashops unit: stop it (`kill" in out, out
    assert "import sglang" not in out and "import vllm" not in out  # the fakes import on the hosts


def test_live_preflight_unreachable_host_does_not_hide_others(
    fleet_factory: FleetFactory, controller: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = fleet_factory("up", "down", "stranger")
    shutil.copy(fleet.known_hosts_path, controller / "home" / ".ssh" / "known_hosts")
    fleet["down"].stop()
    fleet["stranger"].rotate_host_key()
    hosts = {name: fleet[name].inventory_entry(gpus=0) for name in ("up", "down", "stranger")}
    (controller / "inventory.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    (controller / "playbooks").mkdir()
    (controller / "playbooks" / "p.yaml").write_text(
        "name: p\nhosts: [up, down, stranger]\njobs:\n  - {name: j, command: [sleep, '1']}\n"
    )
    assert main(["preflight", "--live", "-i", str(controller / "inventory.yaml")]) == 1
    out = capsys.readouterr().out
    assert "live: 1 of 3 host(s) reached" in out
    assert "[down] connection refused" in out
    assert "[stranger] host key of" in out and "CHANGED" in out


def test_facts_from_16_hosts_take_one_ssh_command_each(
    fleet_factory: FleetFactory, controller: Path
) -> None:
    fleet = fleet_factory(*[f"n{i:02d}" for i in range(16)])
    shutil.copy(fleet.known_hosts_path, controller / "home" / ".ssh" / "known_hosts")
    path = controller / "inventory.yaml"
    path.write_text(yaml.safe_dump(fleet.inventory()))
    inventory = load_inventory(path)
    connections: dict[str, SshConnection] = {}

    def facts(host):  # type: ignore[no-untyped-def]
        conn = connections[host.name] = SshConnection(host)
        return Agent(conn, host.python).facts(host.workdir)

    outcomes = on_hosts(list(inventory.hosts.values()), facts, forks=16)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values() if not o.ok]
    assert {name: c.commands for name, c in connections.items()} == {
        name: 1 for name in inventory.hosts
    }
    for name, outcome in outcomes.items():
        assert outcome.value is not None and outcome.value.workdir == str(fleet[name].workdir)
        assert len(outcome.value.gpus.devices) == 8
    for conn in connections.values():
        conn.close()


def test_bench_facts_runs(fleet_factory: FleetFactory, controller: Path) -> None:
    """The benchmark script itself works (its numbers are read by people, not asserted)."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_facts.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--hosts", "1,2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hosts=2" in proc.stdout and "ssh_commands_per_host=1" in proc.stdout
