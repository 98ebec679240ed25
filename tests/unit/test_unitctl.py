"""Start, stop, probe and tail, for real: the unitctl payload on this machine (LocalConnection),
real processes in tmp workdirs, the stub engine as the server, fake nvidia-smi for GPU memory.

Every process a test starts is killed in a finalizer: unit groups by their recorded (pgid, start
time), the test's own bystanders by Popen. Only loopback is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflashops.errors import HostError
from dflashops.hosts.local import LocalConnection
from dflashops.hosts.unitctl import (
    ProbeSpec,
    StartResult,
    UnitctlError,
    UnitProbe,
    payload_source,
    probe_units,
    start_units,
    stop_units,
    tail_log,
)

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "dflashops" / "payloads" / "stub_engine.py"
FAKE_BIN = REPO / "tests" / "fakes" / "bin"
PYLIB = REPO / "tests" / "fakes" / "pylib"
SYSTEM_PYTHON = "/usr/bin/python3"
# The payload runs under the host's bare python; engines in launch scripts use it too.
HOST_PYTHON = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
HOST = "unit-host"
BANNER = (
    "[dflashops] unit={name} fingerprint={fp} engine=stub tp={tp} dp=1 port={port} "
    "gpus=0,1 started=2025-01-01T00:00:00Z"
)
FP = "ab" * 32


def _python39() -> str | None:
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for found in sorted(pyenv.glob("versions/3.9*/bin/python3.9")):
        if os.access(found, os.X_OK):
            return str(found)
    return None


PYTHON39 = _python39()


# ------------------------------------------------------------------------------ /proc helpers


def stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def start_time(pid: int) -> int:
    fields = stat_fields(pid)
    assert fields is not None
    return int(fields[19])


def group(pgid: int, since: int = 0) -> list[int]:
    """Live members of process group ``pgid`` in session ``pgid`` started at or after ``since``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = stat_fields(int(name))
        if f and f[0] not in ("Z", "X") and int(f[2]) == int(f[3]) == pgid and int(f[19]) >= since:
            out.append(int(name))
    return sorted(out)


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------ fixtures


class Host:
    """A tmp workdir on this machine plus everything the test started, for the finalizer."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.conn = LocalConnection(HOST)
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

    def start(
        self, *names: str, keep_logs: int = 20, python: str | None = None
    ) -> dict[str, StartResult]:
        got = start_units(
            self.conn, python or self.python, str(self.workdir), [(n, keep_logs) for n in names]
        )
        for result in got.values():
            if result.ok:
                assert result.pgid is not None and result.start_time is not None
                self.groups.append((result.pgid, result.start_time))
        return got

    def stop(self, *units: tuple[str, float], **kw: Any) -> Any:
        return stop_units(
            self.conn, kw.pop("python", self.python), str(self.workdir), list(units), **kw
        )

    def probe(self, *specs: ProbeSpec, **kw: Any) -> dict[str, UnitProbe]:
        return probe_units(
            self.conn, kw.pop("python", self.python), str(self.workdir), list(specs), **kw
        )

    def tail(self, unit: str, **kw: Any) -> Any:
        return tail_log(self.conn, kw.pop("python", self.python), str(self.workdir), unit, **kw)

    def read(self, name: str, filename: str) -> Any:
        return json.loads((self.unit_dir(name) / filename).read_text())

    def wait_exit(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        path = self.unit_dir(name) / "exit"
        wait_for(path.exists, f"{path}", timeout)
        return dict(json.loads(path.read_text()))

    def wait_log(self, name: str, needle: str, timeout: float = 10.0) -> None:
        log = self.unit_dir(name) / "logs" / "current.log"
        wait_for(
            lambda: log.exists() and needle in log.read_text(), f"{needle!r} in {log}", timeout
        )

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, **kw)
        self.popens.append(proc)
        return proc

    def cleanup(self) -> None:
        for pgid, since in self.groups:
            fields = stat_fields(pgid)
            if fields is not None and int(fields[19]) != since:
                continue  # the pid was reused: that group is not ours any more
            for pid in group(pgid, since):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "wd")
    try:
        yield h
    finally:
        h.cleanup()


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

    # The payload and LocalConnection's bash (its own session) are gone; the supervisor lives on
    # as the leader of a session of its own, the engine as its child in the same group.
    fields = stat_fields(pid)
    assert fields is not None and fields[0] not in ("Z", "X")
    assert int(fields[2]) == pid and int(fields[3]) == pid  # pgid, sid
    host.wait_log("job", "sleeping")
    members = group(pid)
    assert len(members) == 2 and pid in members
    engine = next(p for p in members if p != pid)
    assert int(stat_fields(engine)[1]) == pid  # type: ignore[index]
    assert Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")[0] == HOST_PYTHON.encode()

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
    assert (
        f"DFLASHOPS_RUN_ID={record['run_id']}".encode()
        in Path(f"/proc/{engine}/environ").read_bytes()
    )


def test_second_start_is_refused_while_running(host: Host) -> None:
    host.python_unit("job", SLEEPER)
    first = host.start("job")["job"]
    assert first.ok
    logs_before = sorted((host.unit_dir("job") / "logs").iterdir())
    second = host.start("job")["job"]
    assert not second.ok and second.pid == first.pid
    assert second.error == f"already running (pid {first.pid})"
    assert sorted((host.unit_dir("job") / "logs").iterdir()) == logs_before  # no new log either
    assert group(first.pid or 0) and len(group(first.pid or 0)) == 2


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
    assert stopped.stale_pid is None
    assert stopped.gpu_freed is None  # no nvidia-smi here
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
    stopped = host.stop(("stubborn-a", 1.0), ("stubborn-b", 1.0), kill_wait=5.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.8  # one grace for both, not one after the other
    for name, result in stopped.items():
        assert result.ok and result.was_running and result.killed, result
        assert 1.0 <= result.seconds < 1.8
        assert result.pids == pids[name]
        assert not any(alive(p) for p in pids[name])
        assert host.read(name, "stopped")["killed"] is True


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
    wait_for(lambda: not alive(got.pid or 0), "the supervisor to die")
    assert alive(engine) and int(stat_fields(engine)[2]) == got.pid  # type: ignore[index]

    probe = host.probe(ProbeSpec(name="job"))["job"]
    assert not probe.alive and not probe.ours
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
    leader = host.popen(
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
    assert leader.stdout is not None and leader.stdin is not None
    child = int(leader.stdout.readline())
    host.groups.append((leader.pid, start_time(leader.pid)))  # for the finalizer
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

    got = host.stop(("job", 0.2), kill_wait=0.5)["job"]
    assert not got.ok and got.unproven_pids == [child] and got.pids == []
    assert "not provably ours" in (got.error or "")
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

    got = wait_for(ready, "the stub to be ready", timeout=15)
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
    assert host.start("sglang-0", python=PYTHON39)["sglang-0"].ok
    record = host.read("sglang-0", "pid")
    cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes().split(b"\0")
    assert cmdline[0] == PYTHON39.encode()  # the supervisor runs under the payload's python
    spec = ProbeSpec(name="sglang-0", port=port, identity_paths=["/get_server_info"])
    got = wait_for(
        lambda: (p := host.probe(spec, python=PYTHON39)["sglang-0"]).healthy and p,
        "ready",
    )
    assert got.identity is not None and got.identity.body["port"] == port
    assert host.tail("sglang-0", lines=1, python=PYTHON39).log == record["log"]
    assert host.stop(("sglang-0", 5.0), python=PYTHON39)["sglang-0"].ok


def test_python_not_found(host: Host) -> None:
    with pytest.raises(UnitctlError) as info:
        start_units(host.conn, "/nonexistent/python3", str(host.workdir), [("a", 3)])
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
    with pytest.raises(UnitctlError, match=match):
        probe_units(host.conn, python, str(host.workdir), [ProbeSpec(name="a")])


def test_answers_that_miss_units_or_mismatch(host: Host, tmp_path: Path) -> None:
    def fake(name: str, answer: dict[str, Any]) -> str:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\ncat >/dev/null\necho {shlex.quote(json.dumps(answer))}\n")
        path.chmod(0o755)
        return str(path)

    empty = fake("empty", {"schema": 1, "action": "stop", "units": {}})
    with pytest.raises(UnitctlError, match="without unit"):
        stop_units(host.conn, empty, str(host.workdir), [("a", 1.0)])
    other = fake("other", {"schema": 1, "action": "probe", "units": {}})
    with pytest.raises(UnitctlError, match="versions do not match"):
        stop_units(host.conn, other, str(host.workdir), [("a", 1.0)])
    bad = fake("bad", {"schema": 1, "action": "start", "units": {"a": {"name": "a", "ok": "yes"}}})
    with pytest.raises(UnitctlError, match="does not validate"):
        start_units(host.conn, bad, str(host.workdir), [("a", 3)])


def test_bad_request_is_refused_by_the_payload(host: Host) -> None:
    with pytest.raises(UnitctlError, match="bad request") as info:
        start_units(host.conn, host.python, str(host.workdir), [("../escape", 3)])
    assert "exit code 2" in str(info.value)
    result = host.conn.run([HOST_PYTHON, "-", "{}"], input=payload_source(), check=False)
    assert result.exit_code == 2 and result.out == ""


def test_empty_requests_need_no_round_trip(host: Host) -> None:
    assert start_units(host.conn, "/nonexistent", str(host.workdir), []) == {}
    assert stop_units(host.conn, "/nonexistent", str(host.workdir), []) == {}
    assert probe_units(host.conn, "/nonexistent", str(host.workdir), []) == {}
