"""Connections opened while pre-flight runs (dflashops/hosts/prewarm.py): a host that cannot be
reached is reported as before, the others deploy; a pre-flight that fails sends nothing and
leaves no connection open."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fleet import FleetFactory
from lifecycle_helpers import MODEL, READY, Ops

from tests.procs import free_ports, wait_for


def stub_book(port: int, **extra: object) -> dict[str, object]:
    service = {"name": "s", "engine": "stub", "model": MODEL, "port": port, "ready": READY}
    return {"hosts": ["a", "b"], "services": [{**service, **extra}]}


def established_to(port: int) -> int:
    """TCP connections to ``port`` on loopback in state ESTABLISHED (either end)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "01" and port in (
                int(local.split(":")[1], 16),
                int(remote.split(":")[1], 16),
            ):
                count += 1
    return count


def test_a_host_that_is_down_is_reported_unreachable_and_the_others_deploy(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a", "b")
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("p", stub_book(port))
    fleet["b"].stop()
    up = ctl.run("deploy")
    assert up.code == 2, up.explain()
    assert up.of("s-0", host="a", action="ready", status="changed"), up.explain()
    (down,) = up.of(host="b", status="unreachable")
    assert f"{fleet['b'].address}:{fleet['b'].port}" in down["message"], up.explain()
    fleet["b"].start()


def test_a_failed_preflight_sends_nothing_and_leaves_no_connection(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a", "b")
    ctl = ops(fleet)
    ctl.playbook("p", stub_book(free_ports(1), args={"no-such-flag": True}))
    failed = ctl.run("deploy")
    assert failed.code == 1 and "nothing was sent to any host" in failed.out, failed.explain()
    for host in fleet:
        # No command ran: no workdir, and no agent (it caches its code under HOME on first run).
        assert not host.workdir.exists() or not any(host.workdir.iterdir()), host.name
        assert not (host.home_dir / ".cache" / "dflashops-agent").exists(), host.name
        wait_for(f"no connection left to {host.name}", lambda h=host: established_to(h.port) == 0)
    ctl.playbook("p", stub_book(free_ports(1)))  # a playbook the teardown's stop can use
