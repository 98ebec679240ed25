"""Listening TCP sockets as the host agent finds them (``remote/procfs.py``).

``facts`` reports which ports are taken, and by whom, before anything is started: a port that
is missed gets a unit started on a busy port, a port reported by mistake blocks a deploy. The
agent asks the kernel over netlink (sock_diag, ``_diag_listeners``) and reads
/proc/net/tcp{,6} when it cannot (``_proc_listeners``); both must say the same. The sockets
looked at are ones the test opens itself, and only their ports are compared: the machine (and
other tests running meanwhile) listen on ports of their own.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dflashops.agent.remote import procfs
from tests.conftest import IPV6, needs_ipv6, unless
from tests.procs import start_time

Finder = Callable[[], list[dict[str, Any]]]


def _netlink_works() -> bool:
    try:
        procfs._diag_listeners()
    except (OSError, ValueError):
        return False
    return True


NETLINK = _netlink_works()
needs_netlink = unless(NETLINK, "no sock_diag netlink here")
FINDERS = [
    pytest.param(procfs._diag_listeners, id="netlink", marks=needs_netlink),
    pytest.param(procfs._proc_listeners, id="proc"),
    pytest.param(procfs.listeners, id="listeners"),
]


def listen(host: str = "127.0.0.1", port: int = 0, *, reuseport: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6 and host == "::":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack
    s.bind((host, port))
    s.listen()
    return s


def entry(s: socket.socket) -> dict[str, Any]:
    """What every finder must report for the listening socket ``s``."""
    host, port = s.getsockname()[:2]
    return {"address": host, "port": port, "inode": os.fstat(s.fileno()).st_ino, "pids": []}


def on_ports(found: list[dict[str, Any]], ports: set[int]) -> list[dict[str, Any]]:
    return sorted(
        (e for e in found if e["port"] in ports),
        key=lambda e: (e["port"], e["address"], e["inode"]),
    )


def expected(socks: list[socket.socket]) -> list[dict[str, Any]]:
    return on_ports([entry(s) for s in socks], {s.getsockname()[1] for s in socks})


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """Every socket a test opens, closed at its end."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


# ------------------------------------------------------------------------------ what is found


@pytest.mark.parametrize("find", FINDERS)
def test_loopback_listeners_found(find: Finder, opened: list[socket.socket]) -> None:
    opened += [listen() for _ in range(3)]
    ports = {s.getsockname()[1] for s in opened}
    assert len(ports) == 3
    assert on_ports(find(), ports) == expected(opened)


@pytest.mark.parametrize("find", FINDERS)
@needs_ipv6
def test_ipv6_and_wildcard_listeners_found(find: Finder, opened: list[socket.socket]) -> None:
    """::1, 0.0.0.0 and a dual-stack :: (an IPv6 socket: in tcp6 only, reported once)."""
    opened += [listen("::1"), listen("0.0.0.0"), listen("::")]
    found = on_ports(find(), {s.getsockname()[1] for s in opened})
    assert found == expected(opened)
    assert {e["address"] for e in found} == {"::1", "0.0.0.0", "::"}


@pytest.mark.parametrize("find", FINDERS)
@needs_ipv6
def test_same_port_in_both_families(find: Finder, opened: list[socket.socket]) -> None:
    for _ in range(20):  # a port free on 127.0.0.1 may be taken on ::1: try another
        v4 = listen()
        try:
            v6 = listen("::1", v4.getsockname()[1])
            break
        except OSError:
            v4.close()
    else:
        pytest.fail("no port free on both 127.0.0.1 and ::1 in 20 tries")
    opened.extend([v4, v6])
    found = on_ports(find(), {v4.getsockname()[1]})
    assert found == expected(opened) and len(found) == 2


@pytest.mark.parametrize("find", FINDERS)
def test_reuseport_listeners_each_found(find: Finder, opened: list[socket.socket]) -> None:
    """Two sockets on one port (SO_REUSEPORT, as multi-process servers do): two entries."""
    first = listen(reuseport=True)
    opened += [first, listen(port=first.getsockname()[1], reuseport=True)]
    found = on_ports(find(), {first.getsockname()[1]})
    assert found == expected(opened)
    assert len({e["inode"] for e in found}) == 2


@pytest.mark.parametrize("find", FINDERS)
def test_many_listeners_found(find: Finder, opened: list[socket.socket]) -> None:
    """600 listeners: the netlink dump comes in several datagrams (about 260 per 32 KiB)."""
    opened += [listen() for _ in range(600)]
    assert on_ports(find(), {s.getsockname()[1] for s in opened}) == expected(opened)


# ------------------------------------------------------------------------------ what is not


@pytest.mark.parametrize("find", FINDERS)
def test_bound_but_not_listening_is_not_reported(find: Finder, opened: list[socket.socket]) -> None:
    bound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    opened.append(bound)
    bound.bind(("127.0.0.1", 0))
    assert on_ports(find(), {bound.getsockname()[1]}) == []


@pytest.mark.parametrize("find", FINDERS)
def test_connections_are_not_listeners(find: Finder, opened: list[socket.socket]) -> None:
    """An established connection: the client's port is not reported, and the server's port
    only as its listener (not the accepted socket on the same port)."""
    server = listen()
    client = socket.create_connection(server.getsockname(), timeout=5)
    accepted, _ = server.accept()
    opened += [server, client, accepted]
    ports = {server.getsockname()[1], client.getsockname()[1]}
    assert on_ports(find(), ports) == [entry(server)]


@pytest.mark.parametrize("find", FINDERS)
def test_closed_listener_disappears(find: Finder, opened: list[socket.socket]) -> None:
    kept, gone = listen(), listen()
    opened += [kept, gone]  # closing twice is harmless
    was = entry(gone)
    assert was in find()
    gone.close()
    found = find()
    assert entry(kept) in found
    assert not [e for e in found if (e["port"], e["inode"]) == (was["port"], was["inode"])]


# ------------------------------------------------------------------------------ combined


@needs_netlink
def test_netlink_and_proc_agree(opened: list[socket.socket]) -> None:
    opened += [listen() for _ in range(5)]
    if IPV6:
        opened += [listen("::1") for _ in range(2)]
    ports = {s.getsockname()[1] for s in opened}
    assert on_ports(procfs._diag_listeners(), ports) == on_ports(procfs._proc_listeners(), ports)
    assert on_ports(procfs._proc_listeners(), ports) == expected(opened)


def test_listeners_sorted_by_port_then_address(opened: list[socket.socket]) -> None:
    opened += [listen() for _ in range(4)]
    if IPV6:
        opened.append(listen("::1"))
    found = procfs.listeners()
    keys = [(e["port"], e["address"]) for e in found]
    assert keys == sorted(keys)
    assert on_ports(found, {s.getsockname()[1] for s in opened}) == expected(opened)


def test_listeners_falls_back_to_proc(
    opened: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where sock_diag is missing or refuses (an old kernel, a sandbox), /proc answers."""
    opened += [listen() for _ in range(3)]
    ports = {s.getsockname()[1] for s in opened}
    for failure in (
        PermissionError(1, "Operation not permitted"),
        ValueError("sock_diag refused the dump"),
    ):

        def broken(failure: Exception = failure) -> list[dict[str, Any]]:
            raise failure

        monkeypatch.setattr(procfs, "_diag_listeners", broken)
        found = procfs.listeners()
        assert on_ports(found, ports) == expected(opened)
        keys = [(e["port"], e["address"]) for e in found]
        assert keys == sorted(keys)


# ------------------------------------------------------------------------------ holders


@pytest.fixture
def holder(opened: list[socket.socket]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A child in a session of its own holding a listener it inherited: (child, inode)."""
    s = listen()
    opened.append(s)
    child = subprocess.Popen(
        ["sleep", "60"], pass_fds=[s.fileno()], start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        yield child, os.fstat(s.fileno()).st_ino
    finally:
        child.kill()
        child.wait()


def test_scan_finds_a_listeners_holders(holder: tuple[subprocess.Popen[bytes], int]) -> None:
    """The inode a listener is reported with leads to the processes holding it; the agent's
    own process is skipped (it holds nothing of a unit's), so only the child is named."""
    child, inode = holder
    listed = [e for e in procfs.listeners() if e["inode"] == inode]
    assert len(listed) == 1
    groups, holders = procfs.scan(set(), {inode})
    assert groups == {} and holders == {inode: [child.pid]}


def test_scan_groups_and_holders_in_one_pass(holder: tuple[subprocess.Popen[bytes], int]) -> None:
    child, inode = holder
    groups, holders = procfs.scan({child.pid}, {inode})
    assert groups == {child.pid: [(child.pid, child.pid, start_time(child.pid))]}
    assert holders == {inode: [child.pid]}


def test_scan_of_nothing_and_of_an_unheld_inode(opened: list[socket.socket]) -> None:
    assert procfs.scan(set(), set()) == ({}, {})
    mine = listen()  # held by this process only, which scan skips
    opened.append(mine)
    assert procfs.scan(set(), {os.fstat(mine.fileno()).st_ino}) == ({}, {})
