"""One clear line per expected failure, without a host to stand on (issue 21): what a port that
is not SSH does to a real paramiko client (plain sockets on 127.0.0.1 stand in for a wrong port:
a web server, a silent one, a full backlog, a closed one), a missing ``python:``, the ``-v``
trace of agent calls, who holds a port as the host agent sees it, and a command service's GPU
count.

The CLI over real sshd hosts is tests/integration/test_one_line.py.
"""

from __future__ import annotations

import logging
import os
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

from dflashops.agent.calling import PythonMissing
from dflashops.agent.client import Agent
from dflashops.agent.remote import layout, procfs
from dflashops.config.load import load_inventory
from dflashops.errors import HostError
from dflashops.hosts.local import LocalConnection
from dflashops.hosts.ssh import SshConnection
from dflashops.output import set_verbose
from tests.conftest import WriteTree
from tests.unit.test_plan import messages, plan_of

LIBRARY_NOISE = ("Traceback", "paramiko", "SSHException", "Exception (client)")


# ------------------------------------------------------------------------------ not SSH


class Port:
    """A TCP listener on 127.0.0.1 that does ``serve(connection)`` with each client."""

    def __init__(self, serve: Callable[[socket.socket], None] | None, backlog: int = 16) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(backlog)
        self.port: int = self.sock.getsockname()[1]
        self.clients: list[socket.socket] = []
        if serve is not None:
            threading.Thread(target=self._accept, args=(serve,), daemon=True).start()

    def _accept(self, serve: Callable[[socket.socket], None]) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.clients.append(client)
            serve(client)

    def close(self) -> None:
        self.sock.close()
        for c in self.clients:
            c.close()


def http(client: socket.socket) -> None:
    client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    client.close()


def chatty(client: socket.socket) -> None:
    client.sendall(b"220 mail.example ESMTP ready\r\n" * 120)


def silent(client: socket.socket) -> None:
    pass  # kept open, never a byte


@pytest.fixture
def ports() -> Iterator[list[Port]]:
    made: list[Port] = []
    yield made
    for p in made:
        p.close()


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(tmp_path / "known_hosts"))
    return tmp_path


def connect(tmp_path: Path, port: int, address: str = "127.0.0.1", timeout: float = 2.0) -> str:
    """Open an SSH connection to ``address:port`` as host ``pod``: its error's text."""
    inventory = tmp_path / "inventory.yaml"
    entry = {"address": address, "port": port, "user": "root", "workdir": "/w"}
    inventory.write_text(yaml.safe_dump({"hosts": {"pod": entry}}))
    conn = SshConnection(load_inventory(inventory).hosts["pod"], timeout=timeout)
    try:
        with pytest.raises(HostError) as info:
            conn.open()
    finally:
        conn.close()
    return str(info.value)


def one_clean_line(message: str, captured: str) -> None:
    assert "\n" not in message, message
    assert message.startswith("[pod] "), message
    assert not any(word in captured for word in LIBRARY_NOISE), captured


@pytest.mark.parametrize(
    ("serve", "said"),
    [
        (http, "it closed the connection without sending an SSH banner"),
        (chatty, "it answered '220 mail.example ESMTP ready', not an SSH banner"),
        (silent, "timed out after 2s waiting for an SSH banner from"),
    ],
    ids=["web-server", "another-protocol", "silent"],
)
def test_a_port_that_is_not_ssh_is_one_line_naming_the_port_to_fix(
    serve: Callable[[socket.socket], None],
    said: str,
    ports: list[Port],
    controller: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    ports.append(listener := Port(serve))
    message = connect(controller, listener.port)
    time.sleep(0.2)  # paramiko's own thread would log its traceback about now
    out, err = capfd.readouterr()
    one_clean_line(message, out + err)
    assert f"127.0.0.1:{listener.port}" in message and said in message, message
    assert "Check `port:` for this host in the inventory" in message, message
    assert "direct TCP mapping for 22" in message, message


def test_a_refused_and_a_timed_out_connection_are_one_line_each(
    ports: list[Port], controller: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    closed = Port(None)
    closed.close()  # nothing listens there now: refused
    refused = connect(controller, closed.port)
    assert f"connection refused at 127.0.0.1:{closed.port}" in refused, refused
    assert "Check `port:` for this host in the inventory" in refused, refused
    # A full accept queue drops new SYNs: the connect itself times out, as behind a firewall.
    ports.append(full := Port(None, backlog=0))
    for _ in range(8):  # until a connect is dropped: then the queue is known to be full
        queued = socket.socket()
        queued.settimeout(0.3)
        full.clients.append(queued)
        try:
            queued.connect(("127.0.0.1", full.port))
        except TimeoutError:
            break
    else:
        pytest.fail("a full accept queue still takes connections here")
    started = time.monotonic()
    timed_out = connect(controller, full.port, timeout=1.0)
    assert time.monotonic() - started < 5
    assert f"timed out after 1s connecting to 127.0.0.1:{full.port}" in timed_out, timed_out
    assert "check `address:` and `port:`" in timed_out, timed_out
    out, err = capfd.readouterr()
    for message in (refused, timed_out):
        one_clean_line(message, out + err)


def test_a_name_that_does_not_resolve_is_one_line(
    controller: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    message = connect(controller, 2222, address="no-such-host.invalid")
    out, err = capfd.readouterr()
    one_clean_line(message, out + err)
    assert "cannot resolve 'no-such-host.invalid'" in message, message
    assert "no-such-host.invalid:2222" in message and "Check `address:`" in message, message


LOG_AN_ERROR = (
    "import logging, sys\n"
    "if sys.argv[1] == 'dflashops': import dflashops.hosts.ssh\n"
    "logging.getLogger('paramiko.transport').error('Exception (client): Error reading SSH protocol banner')\n"
)


def test_library_records_show_only_with_verbose(capfd: pytest.CaptureFixture[str]) -> None:
    """What paramiko logs (its thread's tracebacks) never reaches the terminal, but with -v.
    In a fresh interpreter: pytest's own log handlers would hide Python's last-resort one."""
    for who, printed in (("plain", True), ("dflashops", False)):
        done = subprocess.run(
            [sys.executable, "-c", LOG_AN_ERROR, who], capture_output=True, text=True, check=True
        )
        assert ("Error reading SSH protocol banner" in done.stderr) is printed, (who, done)
    set_verbose(True)
    try:
        logging.getLogger("paramiko.transport").error("Traceback\x1b[2J (most recent call last):")
    finally:
        set_verbose(False)
    err = capfd.readouterr().err
    assert "paramiko.transport: Traceback (most recent call last):" in err, err
    assert "\x1b" not in err


# ------------------------------------------------------------------------------ the agent


def test_a_missing_python_is_a_failed_host_with_the_fix(tmp_path: Path) -> None:
    agent = Agent(LocalConnection("pod"), "/root/venv/bin/python3-not-here")
    with pytest.raises(PythonMissing) as info:
        agent.facts(str(tmp_path))
    assert str(info.value) == (
        "[pod] python '/root/venv/bin/python3-not-here' not found on the host pod: set "
        "`python:` for this host in the inventory (a stock RunPod pod has /usr/bin/python3)"
    )
    assert info.value.reached  # failed, not unreachable: the host answered
    script = tmp_path / "python3"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(PythonMissing, match=r"cannot be executed on the host pod \(.*denied\)"):
        Agent(LocalConnection("pod"), str(script)).facts(str(tmp_path))


def test_verbose_traces_each_agent_call_with_its_time(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    agent = Agent(LocalConnection("pod"), sys.executable)
    agent.facts(str(tmp_path))
    assert capfd.readouterr().err == ""  # quiet without -v
    set_verbose(True)
    try:
        agent.facts(str(tmp_path))
        with pytest.raises(PythonMissing):
            Agent(LocalConnection("pod"), "/nonexistent/python3").facts(str(tmp_path))
    finally:
        set_verbose(False)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("[pod] facts 0.") and lines[0].endswith("s"), lines
    assert lines[1].startswith("[pod] facts (failed) "), lines


# ------------------------------------------------------------------------------ port holders


@pytest.fixture
def spawned() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kw)
        procs.append(proc)
        return proc

    yield spawn
    for p in procs:
        p.kill()
        p.wait()


SERVE = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(300)"


def holders(workdir: Path, port: int) -> list[dict[str, object]]:
    listening = [e for e in procfs.listeners() if e["port"] == port]
    found = procfs.scan(set(), {e["inode"] for e in listening})[1]
    for e in listening:
        e["pids"] = sorted(found.get(e["inode"], []))
    procfs.describe_holders(listening, {port}, set(), str(workdir))
    return [h for e in listening for h in e.get("holders", [])]


def serving(spawn: Callable[..., subprocess.Popen[bytes]], **kw: Any) -> tuple[int, int]:
    proc = spawn([sys.executable, "-c", SERVE, "--tag", "x"], stdout=subprocess.PIPE, **kw)
    assert proc.stdout is not None
    return proc.pid, int(proc.stdout.readline())


def test_the_host_names_a_port_holder_and_the_dflashops_unit_it_is(
    tmp_path: Path, spawned: Callable[..., subprocess.Popen[bytes]]
) -> None:
    here, other = tmp_path / "here", tmp_path / "other"
    folder = other / layout.UNITS / "web-0"
    folder.mkdir(parents=True)
    (folder / layout.UNIT_RECORD).write_text("{}")
    (here / layout.UNITS).mkdir(parents=True)
    # A stranger: its command line, no unit.
    pid, port = serving(spawned)
    assert holders(here, port) == [
        {
            "pid": pid,
            "cmdline": [sys.executable, "-c", SERVE, "--tag", "x"],
            "unit": None,
            "workdir": None,
            "this_workdir": False,
        }
    ]
    # Another project's unit, by the environment its launch script gives the engine ...
    env = dict(os.environ, DFLASHOPS_WORKDIR=str(other), DFLASHOPS_UNIT="web-0")
    pid, port = serving(spawned, env=env)
    (found,) = holders(here, port)
    assert (found["pid"], found["unit"], found["workdir"]) == (pid, "web-0", str(other))
    assert found["this_workdir"] is False
    # ... or, with its environment cleared, by the unit folder it runs in.
    pid, port = serving(spawned, env={}, cwd=folder)
    (found,) = holders(here, port)
    assert (found["unit"], found["workdir"], found["this_workdir"]) == ("web-0", str(other), False)
    assert holders(other, port)[0]["this_workdir"] is True


def test_a_port_held_by_this_workdirs_units_costs_nothing_to_describe(
    tmp_path: Path, spawned: Callable[..., subprocess.Popen[bytes]]
) -> None:
    pid, port = serving(spawned)
    listening = [dict(e, pids=[pid]) for e in procfs.listeners() if e["port"] == port]
    procfs.describe_holders(listening, {port}, {pid}, str(tmp_path))
    assert listening and all("holders" not in e and "user" not in e for e in listening)
    procfs.describe_holders(listening, {port}, set(), str(tmp_path))
    assert [h["pid"] for e in listening for h in e["holders"]] == [pid]


# ------------------------------------------------------------------------------ words


def test_gpus_listed_for_a_command_service_talk_about_gpus_per_replica(
    write_tree: WriteTree,
) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: small
            services:
              - {name: a, engine: command, command: [serve], gpus: [3], port: 1000}
              - {name: b, engine: command, command: [serve], gpus: [0, 1, 2], replicas: 2, port: 2000}
            """
        },
    )
    assert messages(plan) == [
        "service a: lists 1 GPU(s) but 1 replica(s) x gpus_per_replica 0 need 0: set "
        "`gpus_per_replica: 1` (GPUs each replica uses)",
        "service b: lists 3 GPU(s) but 2 replica(s) x gpus_per_replica 0 need 0: list 2 x "
        "gpus_per_replica GPUs, or change `replicas`",
    ]


def test_a_missing_python_is_said_the_same_by_a_kept_session(tmp_path: Path) -> None:
    """status, deploy and stop open a kept session (`serve`): the shell exits 127 before it
    takes the bundle, and that must read as the missing python, not "Broken pipe"."""
    agent = Agent(LocalConnection("pod"), "/root/venv/bin/python3-not-here")
    for _ in range(3):  # the pipe breaks at a different moment each time: the answer does not
        with pytest.raises(PythonMissing, match=r"python '/root/venv/bin/python3-not-here' not"):
            agent.kept().call("facts", {"workdir": str(tmp_path)}, timeout=10)
