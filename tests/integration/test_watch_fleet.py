"""`dflashops watch` against the sshd fleet (issue 22): a unit killed with its supervisor comes
back within three ticks; an sshd blip of 15 s restarts nothing; a host re-provisioned (new key,
processes gone, workdir empty) gets no action and key_changed once, and after `dflashops trust`
it is deployed again (reprovisioned, redeployed); `--once` prints one line per host and exits
non-zero only when a host could not be read.

The loop runs as a process of its own (`dflashops watch`, ended with SIGINT as Ctrl-C would),
its lines read as they come and its notices read from its --json events.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, job, pid_record, stub, unit_pid

from dflashops.cli import main
from tests.procs import alive, free_ports, start_time, wait_for

DFLASHOPS = Path(sys.executable).with_name("dflashops")  # the venv's console script
TICK = 1.0  # s: --interval of the loops here


class Watching:
    """`dflashops watch` as a process of its own: its lines as they come (with when), its
    --json events' notices."""

    def __init__(self, ctl: Ops, *extra: str) -> None:
        self.events = ctl.base / f"watch-{time.monotonic_ns()}.jsonl"
        argv = [str(DFLASHOPS), *ctl.argv("watch", None, "--json", str(self.events), *extra)]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def line(self, words: str, since: float = 0.0, timeout: float = 30.0) -> str:
        """The first line after ``since`` (time.monotonic()) holding ``words``."""

        def found() -> str | None:
            if self.proc.poll() is not None and not self.reader.is_alive():
                raise AssertionError(f"watch ended ({self.proc.returncode}):\n{self.text()}")
            return next((x for t, x in list(self.lines) if t >= since and words in x), None)

        try:
            return str(wait_for(f"a watch line with {words!r}", found, timeout))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.text()}") from None

    def notices(self) -> list[str]:
        if not self.events.exists():
            return []
        events = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        return [e["data"]["event"] for e in events if e["action"] == "notice"]

    def stop(self) -> int:
        """Ctrl-C, as a person ends it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(30)
        self.reader.join(5)
        return code


@contextmanager
def watching(ctl: Ops, *extra: str) -> Iterator[Watching]:
    w = Watching(ctl, *extra)
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()  # by pid, only if the test did not end it
            w.proc.wait()
        print(w.text())


def kill_with_supervisor(host: FleetHost, unit: str) -> int:
    """SIGKILL the unit's whole process group, its supervisor included (as an OOM killer or a
    careless `kill -9 -PGID` would): nothing on the host brings it back."""
    pid = unit_pid(host, unit)
    os.killpg(pid, signal.SIGKILL)
    wait_for(f"{unit}'s supervisor gone", lambda: not alive(pid), 10)
    return pid


def came_back(host: FleetHost, unit: str, old: int) -> Callable[[], bool]:
    def check() -> bool:
        rec = pid_record(host, unit)
        return rec is not None and rec["pid"] != old and alive(int(rec["pid"]))

    return check


KEPT = (
    'mkdir -p "$DFLASHOPS_WORKDIR/out" && echo line >> "$DFLASHOPS_WORKDIR/out/o.jsonl"; sleep 600'
)


def fleet_with_units(
    fleet_factory: FleetFactory, ops: Any, kept: bool = False
) -> tuple[Ops, FleetHost]:
    """Host w1 with a service and a job (``kept``: writing a line to WORKDIR/out/ at each start,
    kept every 5 s), deployed."""
    fleet = fleet_factory("w1")
    ctl = ops(fleet, hosts={"w1": {}})
    gen = (
        job("gen", KEPT, keep={"paths": ["out/"], "every": "5s"})
        if kept
        else job("gen", "sleep 600")
    )
    ctl.playbook("p", {"hosts": ["w1"], "services": [stub("web", free_ports(1))], "jobs": [gen]})
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    return ctl, fleet["w1"]


def test_once_one_line_per_host_and_its_exit_code(fleet_factory: FleetFactory, ops: Any) -> None:
    ctl, host = fleet_with_units(fleet_factory, ops)
    res = ctl.run("watch", "--once")
    lines = [x for x in res.out.splitlines() if "[w1]" in x]
    assert res.code == 0 and lines == ["ok: [w1] 2 running; nothing to do"], res.explain()

    old = kill_with_supervisor(host, "gen")
    res = ctl.run("watch", "--once")
    lines = [x for x in res.out.splitlines() if "[w1]" in x]
    assert res.code == 0, res.explain()
    assert lines == ["changed: [w1] 1 running, 1 gone with its supervisor (gen): started gen again"]
    assert came_back(host, "gen", old)()
    notices = [e["data"]["event"] for e in res.of(action="notice")]
    assert notices == ["redeployed"], res.explain()

    host.stop()  # sshd down: the host cannot be read, nothing is done
    try:
        res = ctl.run("watch", "--once")
    finally:
        host.start()
    lines = [x for x in res.out.splitlines() if "[w1]" in x]
    assert res.code == 2 and len(lines) == 1, res.explain()
    assert lines[0].startswith("unreachable: [w1] no answer (1 failed call(s); the last: ")
    assert "nothing done" in lines[0]

    res = ctl.run("watch", "--once", "--interval", "1m", "--lost-after", "30s")
    assert res.code == 1 and "--lost-after 30s is shorter than --interval 1m00s" in res.out


def test_watch_restarts_a_killed_unit_rides_out_a_blip_and_stops_at_a_changed_key(
    fleet_factory: FleetFactory, ops: Any
) -> None:
    ctl, host = fleet_with_units(fleet_factory, ops, kept=True)
    with watching(ctl, "--interval", f"{TICK:g}s", "--lost-after", "60s") as w:
        w.line("[w1] 2 running; nothing to do")

        # Killed with its supervisor: back within three ticks (and the deploy's start).
        old = kill_with_supervisor(host, "gen")
        killed = time.monotonic()
        wait_for("gen started again", came_back(host, "gen", old), 3 * TICK + 10)
        w.line("[w1] 1 running, 1 gone with its supervisor (gen): started gen again", killed)
        assert time.monotonic() - killed < 3 * TICK + 10
        w.line("[w1] 2 running; nothing to do", killed)

        # A 15 s sshd blip: failed calls, backoff, nothing restarted, no host_lost.
        running = {u: (unit_pid(host, u), start_time(unit_pid(host, u))) for u in ("web-0", "gen")}
        blip = time.monotonic()
        host.stop()
        w.line("unreachable: [w1] no answer", blip)
        time.sleep(15)
        host.start()
        back = w.line("[w1] 2 running; nothing to do", blip, timeout=30)
        for unit, (pid, started) in running.items():
            assert unit_pid(host, unit) == pid and alive(pid) and start_time(pid) == started, unit
        after_blip = [x for t, x in w.lines if t >= blip]
        assert not [x for x in after_blip if "start" in x], after_blip
        assert "host_lost" not in w.notices() and back

        # Re-provisioned: a new host key, its processes gone, its workdir empty. No action at
        # all while the key is not trusted, and key_changed once.
        rotated = time.monotonic()
        host.rotate_host_key()
        w.line("failed: [w1] host key of", rotated)
        pids = [kill_with_supervisor(host, unit) for unit in ("web-0", "gen")]
        shutil.rmtree(host.workdir)
        time.sleep(4 * TICK)
        assert not host.workdir.exists(), "watch acted on a host whose key changed"
        assert w.notices().count("key_changed") == 1, w.notices()

        # Trusted again: the next call sees it, and the host is deployed again, in order.
        trusted = time.monotonic()
        assert main(["trust", "-i", str(ctl.inventory), "--host", "w1", "--yes"]) == 0
        for unit, old in zip(("web-0", "gen"), pids, strict=True):
            wait_for(f"{unit} started again after trust", came_back(host, unit, old), 20)
        w.line(
            "changed: [w1] re-provisioned since watch last saw it; 2 not on the host (web-0, "
            "gen): started web-0, gen again",
            trusted,
        )
        w.line("[w1] 2 running; nothing to do", trusted)
        notices = w.notices()[-4:]
        assert notices == ["key_changed", "reprovisioned", "restored", "redeployed"], notices
        # The job's output came back before it started (lifecycle/keep.py), then it wrote on.
        lines = (host.workdir / "out" / "o.jsonl").read_text().splitlines()
        assert len(lines) >= 2, lines  # what was kept of the runs before, and this run's
        assert w.stop() == 0
    assert "watch stopped (Ctrl-C)" in w.text()
