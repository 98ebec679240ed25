"""Start, stop, probe and tail, for real: the host agent on this machine (``Agent`` over a
LocalConnection), real processes in tmp workdirs, the stub engine as the server, fake nvidia-smi
for GPU memory.

Every process a test starts is killed in a finalizer: unit groups by their recorded (pgid, start
time), the test's own bystanders by Popen. Only loopback is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent import Agent, AgentError
from dflashops.agent.answers import (
    HostFacts,
    ProbeSpec,
    StartResult,
    StopResult,
    TailResult,
    UnitProbe,
)
from dflashops.agent.bundle import bundle, command, digest
from dflashops.errors import HostError
from dflashops.hosts.local import LocalConnection
from tests.procs import (
    PGRP,
    PPID,
    SESSION,
    START_TIME,
    alive,
    boot_id,
    environ,
    free_port,
    group_members,
    pgid_of,
    start_time,
    stat,
    wait_for,
)

REPO = Path(__file__).resolve().parents[3]
STUB = REPO / "dflashops" / "builtins" / "stub_engine.py"
FAKE_BIN = REPO / "tests" / "fakes" / "bin"
PYLIB = REPO / "tests" / "fakes" / "pylib"
SYSTEM_PYTHON = "/usr/bin/python3"
# The agent runs under the host's bare python; engines in launch scripts use it too.
HOST_PYTHON = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
BOOT_ID = boot_id()
HOST = "unit-host"
BANNER = (
    "[dflashops] unit={name} fingerprint={fp} engine=stub tp={tp} dp=1 port={port} "
    "gpus=0,1 started=2025-01-01T00:00:00Z"
)
FP = "ab" * 32
PRUNED_RE = r"units/\.pruned/{name}-\d{{8}}T\d{{6}}Z(-\d+)?"


def _python39() -> str | None:
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for found in sorted(pyenv.glob("versions/3.9*/bin/python3.9")):
        if os.access(found, os.X_OK):
            return str(found)
    return None


PYTHON39 = _python39()


def group(pgid: int, since: int = 0) -> list[int]:
    """Live members of a unit's process group (in its session too) started at or after ``since``."""
    return group_members(pgid, since, session=True)


def cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


# ------------------------------------------------------------------------------ fixtures


class Host:
    """A tmp workdir on this machine plus everything the test started, for the finalizer."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.where = str(workdir)  # the workdir as the agent is told it ("~/..." allowed)
        # The fake nvidia-smi's state: a local host passes on nothing undeclared (trust 5).
        self.conn = LocalConnection(HOST, passes=("FAKE_GPU_STATE",))
        self.python = HOST_PYTHON
        self.groups: list[tuple[int, int]] = []  # (pgid, start_time) of every unit start
        self.popens: list[subprocess.Popen[bytes]] = []

    # -- units

    def unit_dir(self, name: str) -> Path:
        return self.workdir / "units" / name

    def write_unit(self, name: str, body: str, *, port: int | str = "-", tp: int = 1) -> Path:
        d = self.unit_dir(name)
        d.mkdir(parents=True, exist_ok=True)
        banner = BANNER.format(name=name, fp=FP, tp=tp, port=port)
        script = f"#!/usr/bin/env bash\nset -euo pipefail\necho {shlex.quote(banner)}\n{body}\n"
        (d / "launch.sh").write_text(script)
        return d

    def stub_unit(self, name: str, port: int, *, tp: int = 1, startup: float = 0.3) -> Path:
        argv = [HOST_PYTHON, str(STUB), "--model-path", "m", "--port", str(port)]
        argv += ["--tp-size", str(tp)]
        body = f"export DFLASHOPS_STUB_STARTUP_SECONDS={startup}\nexec {shlex.join(argv)}"
        return self.write_unit(name, body, port=port, tp=tp)

    def python_unit(self, name: str, code: str) -> Path:
        return self.write_unit(name, f"exec {shlex.join([HOST_PYTHON, '-c', code])}")

    # -- actions

    def agent(self, python: str | None = None) -> Agent:
        return Agent(self.conn, python or self.python)

    def start(
        self, *names: str, keep_logs: int = 20, python: str | None = None
    ) -> dict[str, StartResult]:
        got = self.agent(python).start(self.where, [(n, keep_logs) for n in names])
        for result in got.values():
            if result.ok:
                assert result.pgid is not None and result.start_time is not None
                self.groups.append((result.pgid, result.start_time))
        return got

    def stop(
        self, *units: tuple[str, float | None], python: str | None = None, **kw: Any
    ) -> dict[str, StopResult]:
        return self.agent(python).stop(self.where, list(units), **kw)

    def probe(
        self, *specs: ProbeSpec, python: str | None = None, **kw: Any
    ) -> dict[str, UnitProbe]:
        return self.agent(python).probe(self.where, list(specs), **kw)

    def tail(self, unit: str, python: str | None = None, **kw: Any) -> TailResult:
        return self.agent(python).tail(self.where, unit, **kw)

    def facts(self, python: str | None = None) -> HostFacts:
        return self.agent(python).facts(self.where, timeout=30)

    # -- looking

    def read(self, name: str, filename: str) -> Any:
        return json.loads((self.unit_dir(name) / filename).read_text())

    def wait_exit(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        path = self.unit_dir(name) / "exit"
        wait_for(f"{path}", path.exists, timeout)
        return dict(json.loads(path.read_text()))

    def wait_log(self, name: str, needle: str, timeout: float = 10.0) -> None:
        log = self.unit_dir(name) / "logs" / "current.log"
        wait_for(
            f"{needle!r} in {log}", lambda: log.exists() and needle in log.read_text(), timeout
        )

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, **kw)
        self.popens.append(proc)
        return proc

    def leader_with_child(self) -> tuple[subprocess.Popen[bytes], int]:
        """A session leader of our own with a sleeping child in its group; the leader exits
        when its stdin is closed (the child stays). Both are killed by the finalizer."""
        leader = self.popen(
            [
                HOST_PYTHON,
                "-c",
                "import subprocess, sys\n"
                "child = subprocess.Popen(['sleep', '300'])\n"
                "print(child.pid, flush=True)\n"
                "sys.stdin.readline()\n",
            ],
            start_new_session=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        self.groups.append((leader.pid, start_time(leader.pid)))  # for the finalizer
        return leader, child

    def cleanup(self) -> None:
        for pgid, since in self.groups:
            st = stat(pgid)
            if st is not None and int(st[START_TIME]) != since:
                continue  # the pid was reused: that group is not ours any more
            for pid in group(pgid, since):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def no_gpu_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    """PATH without any nvidia-smi (the fakes' or a real one)."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "nvidia-smi").exists()
    ]
    monkeypatch.setenv("PATH", os.pathsep.join(keep))


@pytest.fixture
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "gpu-state"
    (state / "procs").mkdir(parents=True)
    (state / "held").mkdir()
    (state / "config.json").write_text(json.dumps({"count": 2}))
    monkeypatch.setenv("PATH", f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPU_STATE", str(state))
    return state


IGNORE_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring TERM', flush=True)\n"
    "time.sleep(300)\n"
)
SLEEPER = "import time\nprint('sleeping', flush=True)\ntime.sleep(300)\n"


# ------------------------------------------------------------------------------ start


def test_start_returns_at_once_and_the_unit_is_detached(host: Host) -> None:
    host.python_unit("job", SLEEPER)
    t0 = time.monotonic()
    got = host.start("job")["job"]
    elapsed = time.monotonic() - t0
    assert got.ok and got.error is None, got
    assert elapsed < 1.0  # it never waits for the engine
    pid = got.pid
    assert pid is not None and got.pgid == pid

    # The agent and LocalConnection's bash (its own session) are gone; the supervisor lives on
    # as the leader of a session of its own, the engine as its child in the same group.
    st = stat(pid)
    assert st is not None and alive(pid)
    assert int(st[PGRP]) == pid and int(st[SESSION]) == pid
    host.wait_log("job", "sleeping")
    members = group(pid)
    assert len(members) == 2 and pid in members
    engine = next(p for p in members if p != pid)
    assert int((stat(engine) or [])[PPID]) == pid
    assert cmdline(engine)[0] == HOST_PYTHON.encode()

    # The supervisor is forked from the agent (no interpreter start): the agent's command line,
    # named dfo:<unit> for ps -o comm and top, holding nothing of the agent's but its code: its
    # stdin is /dev/null, stdout and stderr the log, no other descriptor (not the agent's pipes
    # to the controller, not the start lock).
    assert cmdline(pid)[:3] == [HOST_PYTHON.encode(), b"-S", b"-c"]
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "dfo:job"
    fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert fds[0] == os.devnull
    assert fds[1] == fds[2] and fds[1].startswith(str(host.unit_dir("job") / "logs"))
    # Besides: the read end of the pipe the unit writes into, copied into the log (logpump).
    assert set(fds) == {0, 1, 2, 3} and fds[3].startswith("pipe:"), fds

    record = host.read("job", "pid")
    assert set(record) == {"pid", "pgid", "start_time", "boot_id", "started_at", "log", "run_id"}
    assert record["pid"] == pid and record["pgid"] == pid
    assert record["start_time"] == start_time(pid) == got.start_time
    assert isinstance(record["start_time"], int)
    assert record["boot_id"] == BOOT_ID
    assert record["started_at"].endswith("Z") and "T" in record["started_at"]
    assert record["log"] == got.log and record["log"].startswith("logs/")
    assert (host.unit_dir("job") / record["log"]).is_file()
    # every process of this start carries its run id (membership proof once the leader is gone)
    assert environ(engine).get("DFLASHOPS_RUN_ID") == record["run_id"]
    assert re.fullmatch(r"[0-9a-f]{16}", record["run_id"])


def test_with_another_thread_alive_the_supervisor_runs_from_the_agents_copy(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork copies only the calling thread: with another one alive, start execs the
    content-addressed copy of the agent instead (`python -S COPY supervise UNIT_DIR`)."""
    import threading

    import dflashops.agent.remote as remote
    from dflashops.agent.remote import start

    host.python_unit("job", SLEEPER)
    monkeypatch.setattr(remote, "BUNDLE", bundle().decode(), raising=False)
    monkeypatch.setattr(sys, "executable", HOST_PYTHON)
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    try:
        assert not start.may_fork()
        agent = start.agent_file(str(host.workdir))
        record = start.spawn(str(host.unit_dir("job")), agent, 20, BOOT_ID)
    finally:
        release.set()
        other.join()
    pid = record["pid"]
    host.groups.append((pid, record["start_time"]))
    copy = host.workdir / "agent" / f"{digest()[:16]}.py"
    assert agent == str(copy) and copy.read_bytes() == bundle()
    assert cmdline(pid)[:5] == [
        HOST_PYTHON.encode(),
        b"-S",
        str(copy).encode(),
        b"supervise",
        str(host.unit_dir("job")).encode(),
    ]
    host.wait_log("job", "sleeping")
    # The thread is gone: forking is back, unless a thread of another test in this worker runs.
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    assert start.may_fork() == (not others), others


def test_second_start_is_refused_while_running(host: Host) -> None:
    host.python_unit("job", SLEEPER)
    first = host.start("job")["job"]
    assert first.ok
    logs_before = sorted((host.unit_dir("job") / "logs").iterdir())
    second = host.start("job")["job"]
    assert not second.ok and second.pid == first.pid
    assert second.error == f"already running (pid {first.pid})"
    assert sorted((host.unit_dir("job") / "logs").iterdir()) == logs_before  # no new log either
    host.wait_log("job", "sleeping")
    assert len(group(first.pid or 0)) == 2


def test_concurrent_starts_make_one_copy(host: Host) -> None:
    from concurrent.futures import ThreadPoolExecutor

    host.python_unit("job", SLEEPER)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: host.start("job")["job"], range(4)))
    winners = [r for r in results if r.ok]
    assert len(winners) == 1, results
    assert all("already running" in (r.error or "") for r in results if not r.ok)
    host.wait_log("job", "sleeping")
    assert len(group(winners[0].pid or 0)) == 2


def test_start_errors_per_unit(host: Host) -> None:
    host.write_unit("good", "echo fine")
    (host.unit_dir("nolaunch")).mkdir(parents=True)
    got = host.start("good", "nolaunch", "absent")
    assert got["good"].ok
    assert not got["nolaunch"].ok and "launch.sh missing" in (got["nolaunch"].error or "")
    assert not got["absent"].ok and "launch.sh missing" in (got["absent"].error or "")
    host.wait_exit("good")


def test_logs_are_kept_and_rotated(host: Host) -> None:
    d = host.write_unit("job", 'echo "run $$"')
    logs = d / "logs"
    logs.mkdir()
    (logs / "20200101T000000Z.log").write_text("the oldest evidence\n")
    (logs / "20200101T000000Z-1.log").write_text("older\n")
    (logs / "notes.txt").write_text("not a log of ours\n")
    names = []
    for _ in range(4):
        got = host.start("job", keep_logs=3)["job"]
        assert got.ok and got.log is not None
        host.wait_exit("job")
        names.append(got.log.removeprefix("logs/"))
        current = os.readlink(logs / "current.log")
        assert current == names[-1]  # a relative link to the newest
        kept = sorted(
            p.name for p in logs.iterdir() if p.name.endswith(".log") and p.name != "current.log"
        )
        assert names[-1] in kept and len(kept) <= 3
        assert (logs / names[-1]).read_text().startswith("[dflashops] unit=job ")
    assert len(set(names)) == 4  # a new log each time, never a truncated old one
    kept = sorted(
        p.name for p in logs.iterdir() if p.name.endswith(".log") and p.name != "current.log"
    )
    assert kept == sorted(names[-3:])  # the newest three, by time (suffix -N counts)
    assert (logs / "notes.txt").exists()
    # each log holds exactly one run, ended by the supervisor's line
    text = (logs / names[-1]).read_text()
    assert text.count("run ") == 1
    assert "[dflashops] launch.sh ended (exit code 0)" in text


# ------------------------------------------------------------------------------ stop


def test_stop_terminates_the_stub(host: Host, no_gpu_tool: None) -> None:
    port = free_port()
    host.stub_unit("sglang-0", port)
    got = host.start("sglang-0")["sglang-0"]
    assert got.ok and got.pid
    host.wait_log("sglang-0", "fired up")
    members = group(got.pid)
    assert len(members) == 2
    stopped = host.stop(("sglang-0", 10.0))["sglang-0"]
    assert stopped.ok and stopped.error is None, stopped
    assert stopped.was_running and not stopped.killed
    assert stopped.pids == members
    assert stopped.stale_pid is None and stopped.unproven_pids == []
    assert stopped.gpu_freed is None  # no nvidia-smi here
    assert stopped.pruned_to is None
    assert stopped.seconds < 5
    assert not any(alive(p) for p in members)
    exit_record = host.read("sglang-0", "exit")
    # the stub handles TERM and exits 0; an engine that dies of it shows SIGTERM / 143
    assert (exit_record["code"], exit_record["signal"]) in ((0, None), (143, "SIGTERM"))
    assert not (host.unit_dir("sglang-0") / "pid").exists()
    record = host.read("sglang-0", "stopped")
    assert record["pids"] == members and record["killed"] is False
    assert record["stopped_at"].endswith("Z")
    # stopping again: nothing to do, the first record of the stop is kept
    again = host.stop(("sglang-0", 10.0))["sglang-0"]
    assert again.ok and not again.was_running and again.pids == []
    assert host.read("sglang-0", "stopped") == record


def test_kill_after_grace_for_all_units_together(host: Host) -> None:
    for name in ("stubborn-a", "stubborn-b"):
        host.python_unit(name, IGNORE_TERM)
    got = host.start("stubborn-a", "stubborn-b")
    for name in got:
        host.wait_log(name, "ignoring TERM")
    pids = {name: group(r.pid or 0) for name, r in got.items()}
    t0 = time.monotonic()
    grace = 2.0
    stopped = host.stop(("stubborn-a", grace), ("stubborn-b", grace), kill_wait=5.0)
    elapsed = time.monotonic() - t0
    # One grace for both, not one after the other (that would take 2 x grace at least); the
    # margin is a whole grace, so a loaded machine cannot fail it.
    assert elapsed < 2 * grace - 0.1
    for name, result in stopped.items():
        assert result.ok and result.was_running and result.killed, result
        assert grace <= result.seconds < 2 * grace - 0.1
        assert result.pids == pids[name]
        assert not any(alive(p) for p in pids[name])
        assert host.read(name, "stopped")["killed"] is True


def test_stop_grace_none_is_the_one_recorded_at_deploy(host: Host) -> None:
    """grace None: the unit's unit.json says how long it gets (an orphan stops as meant to)."""
    d = host.python_unit("recorded", IGNORE_TERM)
    (d / "unit.json").write_text(json.dumps({"unit": "recorded", "stop_grace": 0.5}))
    d = host.python_unit("overridden", IGNORE_TERM)
    (d / "unit.json").write_text(json.dumps({"unit": "overridden", "stop_grace": 600}))
    host.python_unit("polite", SLEEPER)  # no unit.json: the default grace; TERM ends it at once
    host.start("recorded", "overridden", "polite")
    host.wait_log("recorded", "ignoring TERM")
    host.wait_log("overridden", "ignoring TERM")
    host.wait_log("polite", "sleeping")
    t0 = time.monotonic()
    got = host.stop(("recorded", None), ("overridden", 0.2), ("polite", None), kill_wait=5.0)
    assert time.monotonic() - t0 < 3.0  # neither 600 s nor the default 30 s
    recorded = got["recorded"]
    assert recorded.ok and recorded.was_running and recorded.killed, recorded
    assert 0.5 <= recorded.seconds < 1.3
    overridden = got["overridden"]
    assert overridden.ok and overridden.killed and 0.2 <= overridden.seconds < 1.0, overridden
    polite = got["polite"]
    assert polite.ok and polite.was_running and not polite.killed, polite
    assert polite.seconds < 1.0


def test_prune_moves_cleanly_stopped_units_aside(host: Host) -> None:
    host.python_unit("job", SLEEPER)
    host.write_unit("idle", "exit 0")  # deployed, never started
    wedged = host.write_unit("wedged", "exec sleep 300")
    (wedged / "pid").write_text("{half a rec")  # cannot be stopped cleanly
    assert host.start("job")["job"].ok
    host.wait_log("job", "sleeping")

    got = host.stop(("job", 5.0), ("idle", 1.0), ("wedged", 1.0), ("absent", 1.0), prune=True)
    job = got["job"]
    assert job.ok and job.was_running and job.pruned_to is not None, job
    assert re.fullmatch(PRUNED_RE.format(name="job"), job.pruned_to)
    moved = host.workdir / job.pruned_to
    assert not host.unit_dir("job").exists()
    # the whole folder, logs and records included: nothing of it is deleted
    assert (moved / "launch.sh").is_file() and not (moved / "pid").exists()
    assert json.loads((moved / "stopped").read_text())["pids"] == job.pids
    assert (moved / "exit").is_file()
    assert "sleeping" in (moved / "logs" / "current.log").read_text()

    idle = got["idle"]
    assert idle.ok and not idle.was_running and idle.pruned_to is not None
    assert re.fullmatch(PRUNED_RE.format(name="idle"), idle.pruned_to)
    assert (host.workdir / idle.pruned_to / "launch.sh").is_file()

    bad = got["wedged"]
    assert not bad.ok and bad.pruned_to is None and "nothing signalled" in (bad.error or "")
    assert (wedged / "launch.sh").is_file() and (wedged / "pid.unusable").is_file()  # stays

    absent = got["absent"]
    assert absent.ok and absent.pruned_to is None
    assert not host.unit_dir("absent").exists()

    assert sorted(host.facts().units) == ["wedged"]  # pruned units are not units any more

    # the same unit deployed, started and pruned again: a second folder beside the first
    host.python_unit("job", SLEEPER)
    assert host.start("job")["job"].ok
    again = host.stop(("job", 5.0), prune=True)["job"]
    assert again.ok and again.pruned_to is not None and again.pruned_to != job.pruned_to
    assert re.fullmatch(PRUNED_RE.format(name="job"), again.pruned_to)
    assert moved.is_dir() and (host.workdir / again.pruned_to).is_dir()


def test_stale_pid_is_never_signalled(host: Host) -> None:
    """A pid record whose pid is now another process (ours to check, not to kill)."""
    bystander = host.popen(["sleep", "300"], start_new_session=True)
    d = host.write_unit("job", "exec sleep 300")
    record = {
        "pid": bystander.pid,
        "pgid": bystander.pid,
        "start_time": start_time(bystander.pid) - 5,  # the record is from another process
        "boot_id": BOOT_ID,
        "started_at": "2025-01-01T00:00:00Z",
        "log": "logs/20250101T000000Z.log",
    }
    (d / "pid").write_text(json.dumps(record))
    probe = host.probe(ProbeSpec(name="job"))["job"]
    assert probe.alive and not probe.ours and "reused" in (probe.reason or "")
    got = host.stop(("job", 1.0))["job"]
    assert got.ok and not got.was_running and got.pids == []
    assert got.stale_pid == bystander.pid
    time.sleep(0.1)
    assert bystander.poll() is None and alive(bystander.pid)
    assert not (d / "pid").exists()  # the stale record is gone, the stop recorded
    assert host.read("job", "stopped")["pids"] == []
    # A record from another boot is stale too.
    record["start_time"] = start_time(bystander.pid)
    record["boot_id"] = "00000000-0000-0000-0000-000000000000"
    (d / "pid").write_text(json.dumps(record))
    got = host.stop(("job", 1.0))["job"]
    assert got.ok and got.stale_pid == bystander.pid and got.pids == []
    assert bystander.poll() is None


def test_record_whose_pgid_is_not_its_pid_is_never_ours(host: Host) -> None:
    """start records pid == pgid. A record naming a live process (right start time, this boot)
    of some other group was not written by start: nothing treats it as the unit. (The old
    facts payload called it ours and running.)"""
    leader, child = host.leader_with_child()
    assert pgid_of(child) == leader.pid != child
    d = host.write_unit("job", "exec sleep 300")
    record = {
        "pid": child,
        "pgid": leader.pid,
        "start_time": start_time(child),
        "boot_id": BOOT_ID,
        "started_at": "2025-01-01T00:00:00Z",
        "log": "logs/20250101T000000Z.log",
        "run_id": "0123456789abcdef",
    }
    (d / "pid").write_text(json.dumps(record))

    unit = host.facts().unit("job")
    assert unit is not None
    assert not unit.running and not unit.process.ours and not unit.process.alive
    reason = unit.process.reason or ""
    assert "pid record unusable" in reason and "not written by dflashops start" in reason
    assert f"pgid {leader.pid} is not the pid {child}" in reason
    assert unit.pid is not None and unit.pid.pid == child  # the record itself is still shown
    assert unit.group_pids == [] and unit.unproven_pids == []

    probe = host.probe(ProbeSpec(name="job"))["job"]
    assert not probe.ours and not probe.running
    assert "not written by dflashops start" in (probe.reason or "")

    refused = host.start("job")["job"]
    assert not refused.ok and "pid record unusable" in (refused.error or "")
    assert "run stop for this unit first" in (refused.error or "")

    got = host.stop(("job", 0.2), kill_wait=0.5)["job"]
    assert not got.ok and not got.was_running and got.pids == [] and not got.killed
    assert "nothing signalled" in (got.error or "")
    time.sleep(0.2)
    assert alive(child) and alive(leader.pid) and leader.poll() is None
    assert group(leader.pid) == sorted([leader.pid, child])
    assert json.loads((d / "pid.unusable").read_text()) == record  # kept as evidence


def test_foreign_python_is_never_touched(host: Host) -> None:
    """Unlike `pkill -f python`: a python we did not start survives every stop."""
    foreign = host.popen([HOST_PYTHON, "-c", "import time; time.sleep(300)"])
    foreign_group = host.popen(
        [HOST_PYTHON, "-c", "import time; time.sleep(300)"], start_new_session=True
    )
    host.python_unit("py-a", SLEEPER)
    host.python_unit("py-b", IGNORE_TERM)
    host.write_unit("never-started", "exec sleep 1")
    host.start("py-a", "py-b")
    host.wait_log("py-a", "sleeping")
    host.wait_log("py-b", "ignoring TERM")
    got = host.stop(("py-a", 5.0), ("py-b", 0.3), ("never-started", 1.0), ("no-such-unit", 1.0))
    assert all(r.ok for r in got.values()), got
    assert not got["never-started"].was_running and not got["no-such-unit"].was_running
    assert not (host.workdir / "units" / "no-such-unit").exists()
    assert foreign.poll() is None and alive(foreign.pid)
    assert foreign_group.poll() is None and alive(foreign_group.pid)


def test_orphans_of_a_killed_supervisor_are_found_and_stopped(host: Host) -> None:
    host.python_unit("job", SLEEPER)
    got = host.start("job")["job"]
    assert got.ok and got.pid
    host.wait_log("job", "sleeping")
    engine = next(p for p in group(got.pid) if p != got.pid)
    os.kill(got.pid, signal.SIGKILL)  # the leader dies, the engine stays in its group
    wait_for("the supervisor to die", lambda: not alive(got.pid or 0), 10)
    assert alive(engine) and pgid_of(engine) == got.pid

    probe = host.probe(ProbeSpec(name="job"))["job"]
    assert not probe.alive and not probe.ours
    unit = host.facts().unit("job")
    assert unit is not None and not unit.running
    assert unit.group_pids == [engine] and unit.unproven_pids == []  # its run id proves it
    refused = host.start("job")["job"]
    assert not refused.ok and f"pids {engine}" in (refused.error or "")
    assert "stop the unit first" in (refused.error or "")

    stopped = host.stop(("job", 5.0))["job"]
    assert stopped.ok and stopped.was_running and stopped.pids == [engine], stopped
    assert not alive(engine)
    assert host.start("job")["job"].ok  # and now it can start again


def test_leaderless_group_without_run_id_is_not_signalled(host: Host) -> None:
    """A group whose leader is gone and whose members lack the start's run id may be a stranger
    (the pid reused by a daemon's double fork): it is never signalled, and loudly reported."""
    leader, child = host.leader_with_child()
    assert leader.stdin is not None
    d = host.write_unit("job", "exec sleep 300")
    record = {
        "pid": leader.pid,
        "pgid": leader.pid,
        "start_time": start_time(leader.pid),
        "boot_id": BOOT_ID,
        "started_at": "2025-01-01T00:00:00Z",
        "log": "logs/20250101T000000Z.log",
        "run_id": "0123456789abcdef",
    }
    (d / "pid").write_text(json.dumps(record))
    leader.stdin.close()
    leader.wait(10)  # the leader is gone; its child stays in the group
    assert alive(child) and group(leader.pid) == [child]

    unit = host.facts().unit("job")
    assert unit is not None and not unit.running
    assert unit.group_pids == [] and unit.unproven_pids == [child]

    got = host.stop(("job", 0.2), kill_wait=0.5, prune=True)["job"]
    assert not got.ok and got.unproven_pids == [child] and got.pids == []
    assert "not provably ours" in (got.error or "")
    assert got.pruned_to is None and d.is_dir()  # not stopped cleanly: not moved aside
    refused = host.start("job")["job"]
    assert not refused.ok and "not provably ours" in (refused.error or "")
    time.sleep(0.1)
    assert alive(child)
    assert (d / "pid").exists()  # kept: nothing may start beside them


def test_unusable_pid_record(host: Host) -> None:
    d = host.write_unit("job", "exec sleep 300")
    (d / "pid").write_text("{half a rec")
    refused = host.start("job")["job"]
    assert not refused.ok and "pid record unreadable" in (refused.error or "")
    got = host.stop(("job", 1.0))["job"]
    assert not got.ok and "nothing signalled" in (got.error or "")
    assert (d / "pid.unusable").read_text() == "{half a rec"  # kept as evidence
    assert host.start("job")["job"].ok
    assert host.stop(("job", 1.0))["job"].ok  # nothing of the test is left running


# ------------------------------------------------------------------------------ GPU memory


GPU_ENGINE = (
    "import sys, time\n"
    f"sys.path.insert(0, {str(PYLIB)!r})\n"
    "import _fakegpu\n"
    "_fakegpu.register(used_mib=1234, gpus=[1])\n"
    "print('gpu taken', flush=True)\n"
    "time.sleep(300)\n"
)


def test_gpu_memory_freed(host: Host, fake_gpus: Path) -> None:
    host.python_unit("gpu", GPU_ENGINE)
    got = host.start("gpu")["gpu"]
    host.wait_log("gpu", "gpu taken")
    engine = next(p for p in group(got.pid or 0) if p != got.pid)
    assert (fake_gpus / "procs" / f"{engine}.json").exists()
    stopped = host.stop(("gpu", 5.0), gpu_timeout=5.0)["gpu"]
    assert stopped.ok and stopped.gpu_freed is True and stopped.gpu_held == [], stopped


def test_gpu_memory_held(host: Host, fake_gpus: Path) -> None:
    host.python_unit("gpu", GPU_ENGINE)
    got = host.start("gpu")["gpu"]
    host.wait_log("gpu", "gpu taken")
    engine = next(p for p in group(got.pid or 0) if p != got.pid)
    # a wedged context: the memory stays after the process is gone
    (fake_gpus / "held" / "wedged.json").write_text(
        json.dumps({"pid": engine, "gpus": [1], "used_mib": 4321})
    )
    t0 = time.monotonic()
    stopped = host.stop(("gpu", 5.0), gpu_timeout=1.0)["gpu"]
    assert time.monotonic() - t0 < 5
    assert not stopped.ok and stopped.gpu_freed is False
    assert [h.model_dump() for h in stopped.gpu_held] == [
        {"pid": engine, "gpu_index": 1, "used_mib": 4321}
    ]
    assert "GPU memory still held" in (stopped.error or "") and str(engine) in (stopped.error or "")
    assert not alive(engine)  # the processes are gone: the record of the stop is written
    assert not (host.unit_dir("gpu") / "pid").exists()
    assert (host.unit_dir("gpu") / "stopped").exists()


# ------------------------------------------------------------------------------ probe


def test_probe_health_identity_banner(host: Host) -> None:
    port = free_port()
    host.stub_unit("sglang-0", port, tp=2, startup=1.0)
    host.start("sglang-0")
    spec = ProbeSpec(name="sglang-0", port=port, identity_paths=["/nope", "/server_info"])
    seen: list[int | None] = []

    def ready() -> UnitProbe | None:
        got = host.probe(spec, http_timeout=2.0)["sglang-0"]
        assert got.alive and got.ours and got.exit is None and got.log_tail is None
        assert got.health is not None
        seen.append(got.health.status)
        return got if got.health.status == 200 else None

    got = wait_for("the stub to be ready", ready, 15)
    assert 503 in seen  # it warmed up under our eyes
    assert got.identity is not None and got.identity.path == "/server_info"
    assert got.identity.status == 200 and got.identity.error is None
    assert got.identity.body["tp_size"] == 2 and got.identity.body["port"] == port
    assert got.identity.body["model_path"] == "m"
    banner = got.banner_info
    assert banner is not None and got.banner is not None
    assert banner.unit == "sglang-0" and banner.fingerprint == FP
    assert (banner.engine, banner.tp, banner.dp, banner.port) == ("stub", 2, 1, port)
    assert banner.gpus == [0, 1] and banner.started == "2025-01-01T00:00:00Z"
    assert got.banner["unit"] == "sglang-0" and got.banner["tp"] == 2  # the dict, by key
    assert banner.line.startswith("[dflashops] unit=sglang-0 ")
    assert got.running and got.healthy


def test_probe_dead_unit_reports_exit_and_log_tail(host: Host) -> None:
    port = free_port()
    host.write_unit("crashy", "echo boom\nexit 3", port=port)
    host.write_unit("job", "for i in $(seq 1 100); do echo line $i; done")
    host.start("crashy", "job")
    host.wait_exit("crashy")
    host.wait_exit("job")
    got = host.probe(ProbeSpec(name="crashy", port=port), ProbeSpec(name="job"), log_lines=5)
    crashy = got["crashy"]
    assert not crashy.alive and not crashy.ours
    assert crashy.exit is not None and crashy.exit.code == 3 and crashy.exit.signal is None
    assert crashy.log_tail is not None and "boom" in crashy.log_tail
    assert crashy.health is not None and crashy.health.status is None
    assert crashy.health.error == "connection refused"
    assert crashy.identity is None
    assert crashy.banner is not None and crashy.banner["port"] == port
    job = got["job"]
    assert job.health is None and job.exit is not None and job.exit.code == 0
    assert job.log_tail is not None and len(job.log_tail) == 5
    assert job.log_tail[-2] == "line 100" and job.log_tail[-1].startswith(
        "[dflashops] launch.sh ended"
    )
    assert job.banner is not None and job.banner["port"] is None and job.banner["unit"] == "job"
    # a port without a health path: process state and log only
    no_health = host.probe(ProbeSpec(name="crashy", port=port, health_path=None))["crashy"]
    assert no_health.health is None and no_health.exit is not None


def test_probe_of_hanging_servers_takes_one_timeout(host: Host) -> None:
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)  # connections complete in the backlog and are never answered
    try:
        port = hang.getsockname()[1]
        specs = [ProbeSpec(name=f"u-{i}", port=port) for i in range(16)]
        t0 = time.monotonic()
        got = host.probe(*specs, http_timeout=1.0)
        elapsed = time.monotonic() - t0
    finally:
        hang.close()
    assert elapsed < 2.5, elapsed  # ~1 s for all 16, not 16 s
    for unit in got.values():
        assert unit.health is not None and unit.health.status is None
        assert unit.health.error == "timed out"
        assert unit.pid is None and unit.reason == "no pid record"


def test_probe_identity_that_hangs_after_health(host: Host) -> None:
    """Health answers but the identity path hangs: still bounded by one timeout."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/big":
                body = b'"' + b"x" * (300 * 1024) + b'"'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                time.sleep(3)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        port = server.server_address[1]
        t0 = time.monotonic()
        got = host.probe(
            ProbeSpec(name="slow", port=port, identity_paths=["/server_info"]),
            ProbeSpec(name="big", port=port, identity_paths=["/big"]),
            http_timeout=1.0,
        )
        elapsed = time.monotonic() - t0
    finally:
        server.shutdown()
        server.server_close()
    assert elapsed < 2.5
    slow = got["slow"]
    assert slow.health is not None and slow.health.status == 200
    assert slow.identity is not None and slow.identity.body is None
    assert "timed out" in (slow.identity.error or "")
    big = got["big"]
    assert big.identity is not None and big.identity.body is None
    assert "larger than 256 KiB" in (big.identity.error or "")


# ------------------------------------------------------------------------------ tail


def test_tail_lines_follow_and_rotation(host: Host) -> None:
    assert host.tail("job").log is None  # no unit yet: nothing, not an error
    host.write_unit("job", "for i in $(seq 1 50); do echo line $i; done")
    first = host.start("job")["job"]
    host.wait_exit("job")
    got = host.tail("job", lines=3)
    assert got.log == first.log and not got.rotated
    lines = got.text.splitlines()
    assert lines[:2] == ["line 49", "line 50"] and lines[2].startswith(
        "[dflashops] launch.sh ended"
    )
    assert got.offset == got.size == (host.unit_dir("job") / (first.log or "")).stat().st_size

    # follow: what is appended after the offset, exactly once; a split UTF-8 character waits
    path = host.unit_dir("job") / (first.log or "")
    with path.open("ab") as f:
        f.write("more é".encode()[:-1])
    nxt = host.tail("job", offset=got.offset, log=got.log)
    assert nxt.text == "more " and nxt.offset == got.offset + 5
    with path.open("ab") as f:
        f.write(b"\xa9\n" + b"y" * (1024 * 1024 + 10))
    nxt = host.tail("job", offset=nxt.offset, log=nxt.log)
    assert nxt.text.startswith("é\nyyy") and len(nxt.text.encode()) == 1024 * 1024  # capped
    nxt = host.tail("job", offset=nxt.offset, log=nxt.log)
    assert nxt.text == "y" * 13 and nxt.offset == nxt.size
    assert host.tail("job", offset=nxt.offset, log=nxt.log).text == ""

    # a new start rotates current.log: the follower is told and reads the new log from 0
    second = host.start("job")["job"]
    host.wait_exit("job")
    rotated = host.tail("job", offset=nxt.offset, log=nxt.log)
    assert rotated.rotated and rotated.log == second.log != first.log
    assert rotated.text.startswith("[dflashops] unit=job ") and "line 50" in rotated.text
    # an offset past the end of the same log (not ours to truncate, but say so)
    odd = host.tail("job", offset=rotated.size + 100, log=rotated.log)
    assert odd.truncated and odd.text == rotated.text


# ------------------------------------------------------------------------------ pythons, faults


@pytest.mark.skipif(PYTHON39 is None, reason="no Python 3.9 under pyenv")
def test_whole_cycle_on_python39(host: Host) -> None:
    assert PYTHON39 is not None
    port = free_port()
    host.stub_unit("sglang-0", port, startup=0.1)
    assert host.facts(python=PYTHON39).python.startswith("3.9.")
    assert host.start("sglang-0", python=PYTHON39)["sglang-0"].ok
    record = host.read("sglang-0", "pid")
    assert cmdline(record["pid"])[0] == PYTHON39.encode()  # the supervisor runs under it too
    spec = ProbeSpec(name="sglang-0", port=port, identity_paths=["/get_server_info"])
    got = wait_for(
        "ready",
        lambda: (p := host.probe(spec, python=PYTHON39)["sglang-0"]).healthy and p,
    )
    assert got.identity is not None and got.identity.body["port"] == port
    assert host.tail("sglang-0", lines=1, python=PYTHON39).log == record["log"]
    assert host.stop(("sglang-0", 5.0), python=PYTHON39)["sglang-0"].ok


@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no /usr/bin/python3")
def test_python_under_home(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_gpu_tool: None
) -> None:
    """``python: ~/venv/bin/python3`` (and a ``~/`` workdir) resolve on the host, in its HOME."""
    home = tmp_path  # the workdir is ~/wd
    venv_python = home / "venv" / "bin" / "python3"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(SYSTEM_PYTHON)
    monkeypatch.setenv("HOME", str(home))
    python = "~/venv/bin/python3"
    host.where = "~/wd"
    port = free_port()
    host.stub_unit("sglang-0", port, startup=0.1)

    facts = host.facts(python=python)
    assert facts.python_executable == str(venv_python)
    assert facts.workdir == str(host.workdir) and facts.unit("sglang-0") is not None

    started = host.start("sglang-0", python=python)["sglang-0"]
    assert started.ok and started.pid, started
    assert cmdline(started.pid)[0] == str(venv_python).encode()  # the supervisor's python
    assert (host.workdir / "agent" / f"{digest()[:16]}.py").is_file()

    spec = ProbeSpec(name="sglang-0", port=port, identity_paths=["/server_info"])
    got = wait_for(
        "ready", lambda: (p := host.probe(spec, python=python)["sglang-0"]).healthy and p
    )
    assert got.running and got.identity is not None and got.identity.body["port"] == port
    assert host.tail("sglang-0", lines=5, python=python).log == started.log

    members = group(started.pid)
    stopped = host.stop(("sglang-0", 5.0), python=python)["sglang-0"]
    assert stopped.ok and stopped.was_running and stopped.pids == members, stopped
    assert not any(alive(p) for p in members)


def test_python_not_found(host: Host) -> None:
    with pytest.raises(AgentError) as info:
        host.agent("/nonexistent/python3").start(host.where, [("a", 3)])
    assert str(info.value).startswith(f"[{HOST}] ")
    assert "'/nonexistent/python3' not found on the host" in str(info.value)
    assert isinstance(info.value, HostError)


@pytest.mark.parametrize(
    ("python", "match"),
    [
        ("true", "printed nothing"),
        ("echo", "not a JSON answer"),
        ("false", "exit code 1"),
    ],
)
def test_unusable_answers(host: Host, python: str, match: str) -> None:
    with pytest.raises(AgentError, match=match):
        host.agent(python).probe(host.where, [ProbeSpec(name="a")])


def test_answers_that_miss_units_or_mismatch(host: Host, tmp_path: Path) -> None:
    def fake(name: str, answer: dict[str, Any]) -> Agent:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\ncat >/dev/null\necho {shlex.quote(json.dumps(answer))}\n")
        path.chmod(0o755)
        return host.agent(str(path))

    empty = fake("empty", {"schema": 2, "action": "stop", "units": {}})
    with pytest.raises(AgentError, match="without unit"):
        empty.stop(host.where, [("a", 1.0)])
    nounits = fake("nounits", {"schema": 2, "action": "stop", "units": []})
    with pytest.raises(AgentError, match="has no units"):
        nounits.stop(host.where, [("a", 1.0)])
    other = fake("other", {"schema": 2, "action": "probe", "units": {}})
    with pytest.raises(AgentError, match="versions do not match"):
        other.stop(host.where, [("a", 1.0)])
    old = fake("old", {"schema": 1, "action": "stop", "units": {}})
    with pytest.raises(AgentError, match="schema 1"):
        old.stop(host.where, [("a", 1.0)])
    bad = fake("bad", {"schema": 2, "action": "start", "units": {"a": {"name": "a", "ok": "yes"}}})
    with pytest.raises(AgentError, match="does not validate"):
        bad.start(host.where, [("a", 3)])


def test_bad_request_is_refused_by_the_agent(host: Host) -> None:
    with pytest.raises(AgentError, match="refused the request") as info:
        host.agent().start(host.where, [("../escape", 3)])
    assert "bad request" in str(info.value)
    assert "units[0].name must be a unit name" in str(info.value)
    assert not (host.workdir / "agent").exists()  # refused before anything was done
    result = host.conn.run(command(HOST_PYTHON), input=bundle() + b"{}\n", check=False)
    assert result.exit_code == 2 and result.out == ""
    assert "dflashops agent: bad request: action must be one of" in result.err


def test_empty_requests_need_no_round_trip(host: Host) -> None:
    agent = host.agent("/nonexistent")
    assert agent.start(host.where, []) == {}
    assert agent.stop(host.where, []) == {}
    assert agent.probe(host.where, []) == {}
    assert host.conn.commands == 0


# ------------------------------------------------------------------------------ wait


def test_wait_sends_heartbeats_without_probes_then_the_full_probe_when_the_unit_is_done(
    host: Host,
) -> None:
    """While nothing happens the host sends a heartbeat every report_every seconds (so the
    controller shows progress and hears a dead link) without probing every unit for it; the
    line that ends a unit's wait carries its full probe."""
    import threading

    port = free_port()
    host.stub_unit("slow", port, startup=1.5)
    host.start("slow")
    spec = ProbeSpec(name="slow", port=port, identity_paths=["/server_info"])
    lines = list(
        host.agent().wait(
            host.where, [(spec, 20.0)], poll=0.1, report_every=0.3, abort=threading.Event()
        )
    )
    beats = [r for r in lines if not r.final]
    assert len(beats) >= 3, lines  # 1.5 s of starting, a line every 0.3 s
    assert all(r.units == {} and r.done == [] for r in beats[1:]), beats  # the first probes
    last = lines[-1]
    assert last.final and last.done == ["slow"]
    assert last.units["slow"].health is not None and last.units["slow"].health.status == 200
    assert last.units["slow"].identity is not None


def test_a_held_unit_is_done_only_when_it_dies_not_at_its_banner(host: Host) -> None:
    """A rank with no readiness of its own is held while its unit gets ready: its banner does
    not end its wait, its death does, at once (the race it closes: a rank that dies right
    after its banner was judged ready)."""
    import threading

    host.python_unit("rank", "import time\ntime.sleep(1.0)\nraise SystemExit(3)\n")
    host.python_unit("plain", "import time\ntime.sleep(300)\n")
    host.start("rank", "plain")
    t0 = time.monotonic()
    lines = list(
        host.agent().wait(
            host.where,
            [(ProbeSpec(name="rank", health_path=None), 20.0)],
            poll=0.05,
            report_every=5.0,
            abort=threading.Event(),
            hold={"rank"},
        )
    )
    took = time.monotonic() - t0
    assert lines[-1].final and lines[-1].done == ["rank"]
    assert 0.8 < took < 5.0, took  # not at the banner (at once), not at the 20 s timeout
    assert lines[-1].units["rank"].alive is False
    assert lines[-1].units["rank"].exit is not None and lines[-1].units["rank"].exit.code == 3
    # Not held, the same kind of unit is done at its banner.
    plain = list(
        host.agent().wait(
            host.where,
            [(ProbeSpec(name="plain", health_path=None), 20.0)],
            poll=0.05,
            report_every=5.0,
            abort=threading.Event(),
        )
    )
    assert plain[-1].done == ["plain"] and plain[-1].units["plain"].alive
