"""A RunPod host against the sshd test fleet (issue 22): the inventory names the pod, the
address and port come from a RunPod-shaped API on 127.0.0.1 (tests/unit/test_providers.py's
FakeApi), and deploy, status and stop reach the real sshd through it. When the API moves the
pod's SSH to another public port (a TCP relay to the same sshd here, as RunPod's port mapping
is), the next run follows it once the cached answer expires, and at once when the cached port
stops answering."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from fleet import FleetFactory
from lifecycle_helpers import Ops, job

from dflashops.config import providers
from tests.unit.test_providers import ENV, KEY, FakeApi, pod


class Relay:
    """A TCP port that forwards every connection to ``target``: the pod's public port."""

    def __init__(self, address: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((address, 0))
        self.server.settimeout(0.1)
        self.address = address
        self.port: int = self.server.getsockname()[1]
        self.accepted = 0
        self.open: list[socket.socket] = []
        self.closed = threading.Event()
        self.serving = threading.Thread(target=self._serve, daemon=True)
        self.serving.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """The port goes away, with the connections through it."""
        self.closed.set()
        self.serving.join()  # then nothing is in accept(): the port is closed for real
        self.server.close()
        for s in self.open:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApi]:
    monkeypatch.setenv(ENV, KEY)
    fake = FakeApi()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def relays() -> Iterator[Callable[[str, tuple[str, int]], Relay]]:
    made: list[Relay] = []

    def make(address: str, target: tuple[str, int]) -> Relay:
        made.append(Relay(address, target))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def provider_inventory(ctl: Ops, api: FakeApi, name: str, **entry: Any) -> None:
    """Rewrite the controller's inventory: ``name`` is the RunPod pod gen-b200."""
    host = ctl.fleet[name].inventory_entry(**entry)
    del host["address"], host["port"]
    host["runpod"] = {"pod": "gen-b200"}
    ctl.inventory.write_text(
        yaml.safe_dump(
            {
                "providers": {"runpod": {"api_key": f"env:{ENV}", "api_url": api.url}},
                "hosts": {name: host},
            },
            sort_keys=False,
        )
    )


def expire(ctl: Ops) -> None:
    """The cached answer is older than MAX_AGE (as if a minute went by)."""
    cache = ctl.base / ".dflashops" / "providers" / "runpod.json"
    data = json.loads(cache.read_text())
    data["fetched"] -= providers.MAX_AGE + 1
    cache.write_text(json.dumps(data))


def test_a_runpod_host_is_deployed_and_looked_at_through_the_api_and_its_port_followed(
    api: FakeApi,
    relays: Callable[[str, tuple[str, int]], Relay],
    fleet_factory: FleetFactory,
    ops: Callable[..., Ops],
) -> None:
    fleet = fleet_factory("pod")
    sshd = fleet["pod"]
    ctl = ops(fleet)
    # The key pinned: a port change then needs no `trust` (the pin beats known_hosts).
    provider_inventory(ctl, api, "pod", host_key=sshd.host_key_line())
    ctl.playbook("gen", {"hosts": "pod", "jobs": [job("idle", "sleep 300")]})
    api.pods = [pod("gen-b200", "pod-1", ip=sshd.address, port=sshd.port)]

    assert ctl.run("deploy").code == 0
    res = ctl.run("status")
    assert res.code == 0, res.explain()
    assert res.rows()["idle"]["state"] == "running"
    assert api.calls == 1  # status used deploy's answer, kept in .dflashops/

    first = relays(sshd.address, (sshd.address, sshd.port))
    api.pods = [pod("gen-b200", "pod-1", ip=sshd.address, port=first.port)]
    assert ctl.run("status").code == 0
    assert (api.calls, first.accepted) == (1, 0)  # within 60 s: the cached port, still fine

    expire(ctl)
    res = ctl.run("status")
    assert res.code == 0 and res.rows()["idle"]["state"] == "running", res.explain()
    assert api.calls == 2 and first.accepted >= 1  # the new port, from the API

    second = relays(sshd.address, (sshd.address, sshd.port))
    api.pods = [pod("gen-b200", "pod-1", ip=sshd.address, port=second.port)]
    first.close()  # the cached port stops answering: asked again at once, not in 60 s
    res = ctl.run("status")
    assert res.code == 0 and res.rows()["idle"]["state"] == "running", res.explain()
    assert api.calls == 3 and second.accepted >= 1


def test_a_starting_pod_is_unreachable_with_its_reason_and_the_other_host_is_fine(
    api: FakeApi, fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("pod", "fixed")
    ctl = ops(fleet)
    host = fleet["pod"].inventory_entry()
    del host["address"], host["port"]
    host["runpod"] = {"pod": "gen-b200"}
    ctl.inventory.write_text(
        yaml.safe_dump(
            {
                "providers": {"runpod": {"api_key": f"env:{ENV}", "api_url": api.url}},
                "hosts": {"pod": host, "fixed": fleet["fixed"].inventory_entry()},
            }
        )
    )
    ctl.playbook("gen", {"hosts": ["pod", "fixed"], "jobs": [job("idle", "true")]})
    api.pods = [pod("gen-b200", "pod-1", ip="", port=None)]
    res = ctl.run("status")
    assert res.code == 2
    assert res.document is not None
    hosts = {h["host"]: h for h in res.document["hosts"]}
    assert hosts["fixed"]["state"] == "ok" and hosts["pod"]["state"] == "unreachable"
    assert hosts["pod"]["error"].startswith(
        "[pod] runpod: pod 'gen-b200' (id pod-1) is starting (no public IP/port yet)."
    )
    # The pod is up: the next run asks again (another run's answer that names a problem is
    # not trusted), and deploy and stop (at teardown) reach it.
    api.pods = [pod("gen-b200", "pod-1", ip=fleet["pod"].address, port=fleet["pod"].port)]
    res = ctl.run("status")
    assert res.code == 0, res.explain()
