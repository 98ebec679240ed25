"""Pre-flight spread over the cores (preflight/spread.py): forked children render and check
slices of the plan, and the report is exactly a serial run's, in the same order; a child that
fails in any way is redone by the parent; deploy's pre-flight keeps every Rendered unit."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflashops.config import reads
from dflashops.preflight import offline, spread
from dflashops.preflight.report import to_json, to_junit
from dflashops.project import select

Work = Callable[[int, int], list[int]]


@dataclass
class Forks:
    pids: list[int]
    possible: bool  # no other thread was running when the test began

    def expect(self, n: int) -> int:
        return n if self.possible else 0


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> Forks:
    """The pid of every child spread forks (counted in the parent). A thread another test left
    behind (in the same pytest worker) is given a moment to end: with one running, spread
    rightly does not fork, and ``expect`` says how many forks there are then."""
    deadline = time.monotonic() + 2
    for thread in threading.enumerate():
        if thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    pids: list[int] = []
    real = os.fork

    def counted() -> int:
        pid = real()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted)
    return Forks(pids, spread.can_fork())


def squares(lo: int, hi: int) -> list[int]:
    return [i * i for i in range(lo, hi)]


def test_slices_come_back_in_order_from_the_children(forks: Forks) -> None:
    parts = spread.spread(squares, 10, 3)
    assert parts == [squares(0, 3), squares(3, 6), squares(6, 10)]
    assert len(forks.pids) == forks.expect(2), "the parent computes the first slice itself"


def test_one_slice_or_another_thread_means_no_fork(forks: Forks) -> None:
    assert spread.spread(squares, 5, 1) == [squares(0, 5)]
    assert spread.spread(squares, 2, 8) == [squares(0, 1), squares(1, 2)]  # one per item
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert spread.spread(squares, 10, 2) == [squares(0, 5), squares(5, 10)]
    finally:
        stop.set()
        other.join()
    assert len(forks.pids) == forks.expect(1)  # only the two-item call forked


@pytest.mark.parametrize("how", ["raise", "signal", "garbage"])
def test_a_failing_child_is_redone_by_the_parent(
    how: str, forks: Forks, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = os.getpid()

    def flaky(lo: int, hi: int) -> list[int]:
        if os.getpid() != parent:
            if how == "raise":
                raise RuntimeError("a child's bug")
            if how == "signal":
                os.kill(os.getpid(), signal.SIGKILL)
        return squares(lo, hi)

    if how == "garbage":
        monkeypatch.setattr(pickle, "dumps", lambda *a: b"not a pickle")
    assert spread.spread(flaky, 9, 3) == [squares(0, 3), squares(3, 6), squares(6, 9)]
    assert len(forks.pids) == forks.expect(2)
    for pid in forks.pids:  # every child was reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_an_error_is_the_one_a_serial_run_raises(forks: Forks) -> None:
    def broken(lo: int, hi: int) -> list[int]:
        if lo > 0:
            raise ValueError(f"slice {lo}")
        return []

    with pytest.raises(ValueError, match="slice 5"):
        spread.spread(broken, 10, 2)


def fleet(base: Path, hosts: int = 7) -> Path:
    """Units that pass and fail in every way a slice can see: bash syntax (a broken override
    for vLLM), SGLang flags, a shipped script that does not compile, a render problem (a
    missing script), warnings."""
    (base / "playbooks").mkdir(parents=True)
    (base / "templates").mkdir()
    (base / "scripts").mkdir()
    names = [f"n{i:02d}" for i in range(hosts)]
    (base / "inventory.yaml").write_text(
        "hosts:\n"
        + "".join(f"  {n}: {{address: 127.0.2.{i + 10}, gpus: 4}}\n" for i, n in enumerate(names))
        + f"groups:\n  odd: [{', '.join(names[1::2])}]\n  all: [{', '.join(names)}]\n"
    )
    (base / "playbooks" / "a.yaml").write_text(
        "name: a\nhosts: all\nservices:\n"
        "  - {name: s, engine: stub, model: m, replicas: 2, port: 31000, args: {bogus: 1}}\n"
        "  - {name: g, engine: sglang, model: /m, port: 32000, args: {mem-fraction-static: 0.8}}\n"
        "jobs:\n  - {name: j, script: ../scripts/bad.py, needs: [s]}\n"
    )
    (base / "playbooks" / "b.yaml").write_text(
        "name: b\nhosts: odd\nservices:\n"
        "  - {name: v, engine: vllm, model: /m, port: 33000, args: {not-a-flag: 1}}\n"
        "jobs:\n  - {name: k, script: ../scripts/missing.py}\n"
    )
    (base / "playbooks" / "c.yaml").write_text(  # only on the last host: a child's slice
        f"name: c\nhosts: {names[-1]}\nservices:\n"
        "  - {name: c, engine: command, command: [/bin/true, '{port}'], port: 34000}\n"
    )
    (base / "scripts" / "bad.py").write_text("def f(:\n")
    (base / "templates" / "vllm.sh.j2").write_text(
        '{% extends "_unit.sh.j2" %}\n{% block prelude %}\nif [[ x ]; then\n{% endblock %}\n'
    )
    return base


@pytest.mark.parametrize("workers", [2, 3])
def test_a_spread_run_is_exactly_a_serial_run(
    tmp_path: Path, workers: int, forks: Forks, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = fleet(tmp_path / "f")
    selection = select(base / "inventory.yaml", [], [])
    serial = offline.run_preflight(selection, keep_rendered=False)  # below SPREAD_FROM
    assert forks.pids == []
    monkeypatch.setattr(offline, "SPREAD_FROM", 1)
    monkeypatch.setattr(offline, "cores", lambda: workers)
    spread_run = offline.run_preflight(selection, keep_rendered=False)
    assert len(forks.pids) == forks.expect(workers - 1)
    assert not serial.ok and serial.warnings
    assert {c.check for c in serial.errors} == {
        "bash-syntax",
        "sglang-flags",
        "py-compile",
        "render",
    }
    assert to_json(spread_run) == to_json(serial) and to_junit(spread_run) == to_junit(serial)
    assert (spread_run.units, spread_run.hosts) == (serial.units, serial.hosts)
    assert serial.units == 7 * 4 + 3 * 2 + 1 and serial.hosts == [f"n{i:02d}" for i in range(7)]
    assert spread_run.rendered == []
    # The order a serial run has always had: layout, every render problem, then per unit in
    # plan order its bash-syntax and flag checks, then each shipped script's compile.
    names = [c.check for c in serial.checks]
    first_bash = names.index("bash-syntax")
    assert names[:first_bash] == sorted(names[:first_bash], key=["layout", "render"].index)
    assert "render" in names[:first_bash] and "py-compile" not in names[:first_bash]
    assert set(names[names.index("py-compile") :]) == {"py-compile"}
    assert serial.plan is not None
    assert [c.subject for c in serial.checks if c.check == "bash-syntax"] == [
        f"{u.host.name}/{u.name}" for u in serial.plan.units
    ]


def test_what_children_read_is_recorded_as_a_serial_run_records_it(
    tmp_path: Path, forks: Forks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template only a child's slice uses (command.sh.j2, last host) is an input all the
    same: the children send back what they looked at."""
    base = fleet(tmp_path / "f")
    (base / "scripts" / "bad.py").write_text("print('fine')\n")
    selection = select(base / "inventory.yaml", [], [])
    with reads.recording() as serial:
        offline.run_preflight(selection, keep_rendered=False)
    monkeypatch.setattr(offline, "SPREAD_FROM", 1)
    monkeypatch.setattr(offline, "cores", lambda: 2)
    with reads.recording() as spread_run:
        offline.run_preflight(selection, keep_rendered=False)
    assert len(forks.pids) == forks.expect(1)
    assert spread_run.facts == serial.facts and spread_run.unstable is None
    assert any(path.endswith("/command.sh.j2") for _, path in serial.facts)


def test_deploys_pre_flight_keeps_every_rendered_unit_and_does_not_fork(
    tmp_path: Path, forks: Forks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(offline, "SPREAD_FROM", 1)
    base = fleet(tmp_path / "f")
    report = offline.run_preflight(select(base / "inventory.yaml", [], []))
    assert forks.pids == []
    assert len(report.rendered) == report.units == 35
    assert {r.unit.host.name for r in report.rendered} == set(report.hosts)
