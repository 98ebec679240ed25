"""The ``rendezvous`` action, run for real (LocalConnection): the head listens, workers dial;
every way it can fail is an answer, never a hang."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from dflashops.agent import Agent
from dflashops.hosts.local import LocalConnection
from tests.procs import free_port


def agent() -> Agent:
    return Agent(LocalConnection("testhost"), sys.executable)


def test_the_head_hears_each_worker_by_name(tmp_path: Path) -> None:
    port = free_port()
    head = agent()
    with head.listening(str(tmp_path), "127.0.0.1", port, 2, 10.0) as (first, finish):
        assert first.listening and first.error is None
        dialled = [agent().dial(str(tmp_path), "127.0.0.1", port, n, 5.0) for n in ("b", "c")]
        final = finish()
    assert all(d.ok for d in dialled)
    assert sorted(p["name"] for p in final.peers) == ["b", "c"]


def test_a_head_that_waits_in_vain_ends_at_its_timeout(tmp_path: Path) -> None:
    port = free_port()
    with agent().listening(str(tmp_path), "127.0.0.1", port, 1, 0.5) as (first, finish):
        assert first.listening
        assert finish().peers == []


def test_a_taken_port_and_a_foreign_address_are_said(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with agent().listening(str(tmp_path), "127.0.0.1", port, 1, 5.0) as (first, _):
            assert not first.listening and first.held and "in use" in (first.error or "")
    finally:
        taken.close()
    with agent().listening(str(tmp_path), "192.0.2.10", free_port(), 1, 5.0) as (first, _):
        assert not first.listening and not first.held and first.error


def test_dialling_nothing_is_refused(tmp_path: Path) -> None:
    got = agent().dial(str(tmp_path), "127.0.0.1", free_port(), "b", 2.0)
    assert not got.ok and got.error == "connection refused"
