"""One clear line per expected failure, on real sshd hosts and the real CLI (issue 21,
DESIGN.md "Operating under pressure" 2): every way a host cannot be reached is one line that
names the host, its address and port, and what to do, with no traceback and no paramiko log
line anywhere in the output; a missing ``python:`` says which and what a stock pod has; ``-v``
traces each remote call with its time; a taken port names its holder, its command line and the
dflashops unit (and workdir) it is.

Plain sockets on 127.0.0.1 stand in for the ports that are not SSH (a web server, a silent
one, a full backlog that drops SYNs, a closed one).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet import FleetFactory
from lifecycle_helpers import Ops, engine_pid, foreign_process, stub

from tests.procs import free_ports

DFLASHOPS = str(Path(sys.executable).parent / "dflashops")
ROOT_VENV_PYTHON = "/root/venv/bin/python3"  # the example inventory's; not on a stock pod
LIBRARY_NOISE = ("Traceback", "paramiko", "SSHException", "Exception (client)", "EOFError")


class Sockets:
    """Listeners on 127.0.0.1 that are not SSH; closed at the end of the test."""

    def __init__(self) -> None:
        self.open: list[socket.socket] = []

    def listen(self, backlog: int = 16) -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(backlog)
        self.open.append(s)
        return s

    def web(self) -> int:
        """A web server where SSH was expected (a RunPod pod's HTTP port)."""
        s = self.listen()

        def serve() -> None:
            while True:
                try:
                    client, _ = s.accept()
                except OSError:
                    return
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                client.close()

        threading.Thread(target=serve, daemon=True).start()
        return int(s.getsockname()[1])

    def silent(self) -> int:
        """Accepts (the kernel does, from the backlog) and never says a word."""
        return int(self.listen().getsockname()[1])

    def dropping(self) -> int:
        """A full accept queue: the kernel drops new SYNs, as a firewall does."""
        s = self.listen(backlog=0)
        port = int(s.getsockname()[1])
        for _ in range(8):  # until a connect is dropped: then the queue is known to be full
            queued = socket.socket()
            queued.settimeout(0.3)
            self.open.append(queued)
            try:
                queued.connect(("127.0.0.1", port))
            except TimeoutError:
                return port
        raise AssertionError("a full accept queue still takes connections here")

    def closed(self) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
        s.close()
        return port


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    made = Sockets()
    yield made
    for s in made.open:
        s.close()


def cli(base: Path, *argv: str) -> tuple[int, str]:
    """``dflashops ARGV`` in its own process (whatever paramiko's threads print after the
    command is done is in its output too), stdout and stderr together."""
    env = dict(
        os.environ,
        HOME=str(base / "home"),
        DFLASHOPS_KNOWN_HOSTS=str(base / "own_known_hosts"),
        COLUMNS="400",
    )
    done = subprocess.run(
        [DFLASHOPS, *argv],
        cwd=base,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
        check=False,
    )
    print(f"$ dflashops {' '.join(argv)} -> {done.returncode}\n{done.stdout}")
    return done.returncode, done.stdout


def line_of(out: str, host: str) -> str:
    """The one line that reports ``host``'s failure."""
    found = [line for line in out.splitlines() if f"[{host}] " in line]
    assert len(found) == 1, (host, out)
    return found[0]


def test_each_way_a_host_cannot_be_reached_is_one_line(
    fleet_factory: FleetFactory, sockets: Sockets, tmp_path: Path
) -> None:
    fleet = fleet_factory("a", "b")
    a, b = fleet["a"], fleet["b"]
    assert not os.path.exists(ROOT_VENV_PYTHON)
    other_key = tmp_path / "other_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True
    )
    ports = {
        "web": sockets.web(),
        "silent": sockets.silent(),
        "dropping": sockets.dropping(),
        "closed": sockets.closed(),
    }
    local = {"address": "127.0.0.1"}
    hosts: dict[str, dict[str, Any]] = {
        # name: inventory entry, and what its line must say (where, what to do)
        "web-port": a.inventory_entry(**local, port=ports["web"]),
        "silent-port": a.inventory_entry(**local, port=ports["silent"]),
        "dropped": a.inventory_entry(**local, port=ports["dropping"]),
        "refused": a.inventory_entry(**local, port=ports["closed"]),
        "wrong-key": a.inventory_entry(key_file=str(other_key)),
        "new-key": b.inventory_entry(),
        "changed-key": a.inventory_entry(host_key=b.host_key_line()),
        "no-dns": a.inventory_entry(address="no-such-host.invalid"),
        "no-python": a.inventory_entry(python=ROOT_VENV_PYTHON),
    }
    expected = {
        "web-port": (
            f"no SSH server at 127.0.0.1:{ports['web']}: it closed the connection without "
            "sending an SSH banner",
            "Check `port:` for this host in the inventory (a RunPod pod: the public port of "
            "its direct TCP mapping for 22)",
        ),
        "silent-port": (
            f"timed out after 15s waiting for an SSH banner from 127.0.0.1:{ports['silent']}",
            "Check `port:` for this host in the inventory",
        ),
        "dropped": (
            f"timed out after 15s connecting to 127.0.0.1:{ports['dropping']}",
            "check `address:` and `port:` for this host in the inventory",
        ),
        "refused": (
            f"connection refused at 127.0.0.1:{ports['closed']}",
            "Check `port:` for this host in the inventory",
        ),
        "wrong-key": (
            f"authentication failed for root@{a.address}:{a.port} with key(s) {other_key}",
            "Check `user` and `key_file` in the inventory",
        ),
        "new-key": (
            f"host key of [{b.address}]:{b.port} is unknown: it presents ssh-ed25519 "
            f"{b.fingerprint()}",
            "run `dflashops trust --host new-key`",
        ),
        "changed-key": (
            f"host key of [{a.address}]:{a.port} CHANGED: it presents ssh-ed25519 "
            f"{a.fingerprint()}, but the inventory's host_key has ssh-ed25519 {b.fingerprint()}",
            "run `dflashops trust --host changed-key`",
        ),
        "no-dns": (
            "cannot resolve 'no-such-host.invalid' (DNS: ",
            f"to reach no-such-host.invalid:{a.port}. Check `address:` for this host in the "
            "inventory",
        ),
        "no-python": (
            f"python '{ROOT_VENV_PYTHON}' not found on the host no-python",
            "set `python:` for this host in the inventory (a stock RunPod pod has "
            "/usr/bin/python3)",
        ),
    }
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    # The user knows a's key only: b is met for the first time.
    (tmp_path / "home" / ".ssh" / "known_hosts").write_text(a.known_hosts_line() + "\n")
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    (tmp_path / "playbooks").mkdir()
    book = {
        "name": "p",
        "hosts": sorted(hosts),
        "services": [{"name": "echo", "engine": "command", "command": ["sleep", "300"]}],
    }
    (tmp_path / "playbooks" / "p.yaml").write_text(yaml.safe_dump(book))

    started = time.monotonic()
    code, out = cli(tmp_path, "deploy", "-i", "inventory.yaml")
    assert code != 0, out
    assert time.monotonic() - started < 60, "the hosts are tried at once, each within 15 s"
    assert not [w for w in LIBRARY_NOISE if w in out], out
    for name, (what, todo) in expected.items():
        line = line_of(out, name)
        assert what in line and todo in line, (name, line)
        # It answered, without the python it needs: failed (the fix is on the host).
        word = "failed" if name == "no-python" else "unreachable"
        assert re.match(rf"^{word}: \[{name}\] ", line), line

    # status says the same without the noise (its table holds each host's row).
    code, out = cli(tmp_path, "status", "-i", "inventory.yaml")
    assert code != 0, out
    assert not [w for w in LIBRARY_NOISE if w in out], out
    assert all(f"[{name}]" in out or f" {name} " in out for name in hosts), out
    assert re.search(r"^failed: \[no-python\] python '.*' not found", out, re.M), out
    assert re.search(r"^unreachable: \[refused\] ", out, re.M), out


def test_verbose_traces_the_connection_and_each_agent_call(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("v")
    v = fleet["v"]
    ctl = ops(fleet)
    ctl.playbook("quiet", {"hosts": "v", "services": [stub("web", free_ports(1))]})
    quiet = ctl.run("status", json_events=False)
    assert " 0." not in quiet.out and "facts" not in quiet.out, quiet.out
    traced = ctl.run("status", "-v", json_events=False)
    assert re.search(rf"^\[v\] connect root@{v.address}:{v.port} \d+\.\d{{3}}s$", traced.out, re.M)
    assert re.search(r"^\[v\] facts \d+\.\d{3}s$", traced.out, re.M), traced.out


def test_a_taken_port_names_its_holder_and_whose_unit_it_is(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("node")
    node = fleet["node"]
    port = free_ports(1)
    first = ops(fleet)
    first.playbook("serve", {"hosts": "node", "services": [stub("web", port)]})
    up = first.run("deploy")
    assert up.code == 0, up.explain()
    holder = engine_pid(node, "web-0")

    # Another project on the same host (its own workdir) wants the same port.
    other_workdir = node.dir / "other-workdir"
    second = ops(fleet, hosts={"node": {"workdir": str(other_workdir)}})
    second.playbook("serve", {"hosts": "node", "services": [stub("web", port)]})
    res = second.run("deploy")
    assert res.code != 0, res.explain()
    (failed,) = res.of("web-0", status="failed")
    assert failed["action"] == "start", res.explain()
    message = failed["message"]
    assert message.startswith(f"port {port} is already taken by pid {holder} ("), message
    assert f"pid {holder} (/usr/bin/python3 …/stub_engine.py --model-path /dev/shm/" in message
    assert f"dflashops unit web-0 of workdir {node.workdir} (another project)" in message
    assert "not a dflashops unit" not in message, message
    assert "`dflashops stop --unit web-0 -i <that project's inventory>`" in message, message
    assert "\n" not in message, message

    # A process dflashops did not start: its command line, and kill.
    free = free_ports(1)
    second.playbook("serve", {"hosts": "node", "services": [stub("web", free)]})
    listener = [
        "/usr/bin/python3",
        "-c",
        f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {free})); s.listen(); "
        "time.sleep(300)",
    ]
    with foreign_process(listener) as stranger:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not holds(free):
            time.sleep(0.05)
        res = second.run("deploy")
    assert res.code != 0, res.explain()
    (failed,) = res.of("web-0", status="failed")
    message = failed["message"]
    assert message.startswith(
        f'port {free} is already taken by pid {stranger} (/usr/bin/python3 -c "import socket, '
        "time; s = socket.socket(); s.bind(('127.0.0.1',"
    ), message
    assert "…), not a dflashops unit; not started: stop it (`kill " in message, message
    assert f"`kill {stranger}`" in message, message


def holds(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
