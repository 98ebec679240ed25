"""Facts in one round trip: the host agent run for real (LocalConnection, several pythons) on a
fake workdir, through ``Agent.facts``; the agent's pure helpers tested on their own."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent import Agent, AgentError
from dflashops.agent.answers import HostFacts
from dflashops.agent.bundle import bundle, command
from dflashops.agent.remote import gpu, procfs
from dflashops.agent.remote.ownership import RUN_ID_VAR
from dflashops.errors import HostError
from dflashops.hosts.local import LocalConnection
from tests.conftest import SYSTEM_PYTHON, interpreters
from tests.procs import STATE, alive, boot_id, group_members, start_time, stat, wait_for

REPO = Path(__file__).resolve().parents[3]
FAKE_BIN = REPO / "tests" / "fakes" / "bin"
PYTHONS = interpreters()


def _python39() -> str | None:
    """A Python 3.9 (the oldest the agent supports), if this machine has one that runs."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [
        shutil.which("python3.9"),
        *map(str, sorted(pyenv.glob("versions/3.9*/bin/python3.9"))),
    ]
    for found in filter(None, candidates):
        try:
            out = subprocess.run(
                [found, "-c", "import sys; print(sys.executable)"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            continue  # e.g. a pyenv shim for a version that is not selected
        if out.stdout.strip():
            return out.stdout.strip()
    return None


def _python_older_than_39() -> str | None:
    """A Python 3.6 (too old for the agent), to see the hint the controller gives for it."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for found in sorted(pyenv.glob("versions/3.6*/bin/python3.6")):
        if os.access(found, os.X_OK):
            return str(found)
    return None


PYTHON39 = _python39()
if PYTHON39 is not None:
    PYTHONS.append(pytest.param(PYTHON39, id="python3.9"))
PYTHON36 = _python_older_than_39()
ANY_PYTHON = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
BOOT_ID = boot_id()
HOST = "testhost"


def conn() -> LocalConnection:
    return LocalConnection(HOST)


def gather(python: str, workdir: str | Path, **kw: Any) -> HostFacts:
    kw.setdefault("timeout", 30)
    return Agent(conn(), python).facts(str(workdir), **kw)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def wrapper(path: Path, body: str) -> str:
    """An executable sh script standing in for the host's python."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def unit_json(name: str, port: int | None = 30000) -> dict[str, Any]:
    return {
        "unit": name,
        "fingerprint": "f" * 64,
        "engine": "sglang",
        "kind": "service",
        "port": port,
        "gpus": [0],
        "tp": 1,
        "dp": 1,
        "playbook": "serve-sglang",
        "deployed_at": "2025-01-01T00:00:00Z",
    }


LEADER_CODE = (
    "import subprocess, sys\n"
    "child = subprocess.Popen(['sleep', '300'])\n"
    "print(child.pid, flush=True)\n"
    "sys.stdin.readline()\n"
)


def leaderless_group(run_id: str | None) -> tuple[int, int, int]:
    """A session leader that started a child and exited, the child left in its group (as a
    killed supervisor leaves an engine): (leader pid, leader start time, child pid). The child
    has ``DFLASHOPS_RUN_ID=run_id`` in its environment, or none at all."""
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_VAR}
    if run_id is not None:
        env[RUN_ID_VAR] = run_id
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER_CODE],
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert leader.stdin is not None and leader.stdout is not None
    child = int(leader.stdout.readline())
    since = start_time(leader.pid)
    leader.stdin.close()
    leader.wait(10)
    leader.stdout.close()
    return leader.pid, since, child


@dataclass
class FactsHost:
    """The fake host facts are gathered on: a workdir full of units, and the processes behind."""

    workdir: Path
    leader: int  # a live `sh` we started, with two sleeping children in its process group
    dead_pid: int
    zombie_pid: int
    port: int
    port6: int | None
    orphan: int  # child of a gone leader, with the run id of the record: provably ours
    stranger: int  # child of a gone leader, without the run id: not provably ours
    payload_hashes: dict[str, str] = field(default_factory=dict)
    script_hash: str = ""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FactsHost]:
    workdir = tmp_path_factory.mktemp("facts") / "wd"
    units = workdir / "units"
    strays: list[tuple[int, int]] = []  # (pid, start time) of processes no Popen holds

    group = subprocess.Popen(
        ["sh", "-c", "sleep 300 & sleep 300 & wait"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    zombie = subprocess.Popen(["true"])  # not waited for until the end: a zombie meanwhile
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener6: socket.socket | None = None
    try:
        wait_for("the zombie", lambda: (stat(zombie.pid) or ["?"])[STATE] == "Z", 5)
        wait_for(
            "the process group to fill",
            lambda: len(group_members(group.pid, session=True)) == 3,
            5,
        )
        orphan_leader, orphan_since, orphan = leaderless_group("0123456789abcdef")
        strays.append((orphan, start_time(orphan)))
        stranger_leader, stranger_since, stranger = leaderless_group(None)
        strays.append((stranger, start_time(stranger)))

        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:
            listener6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            listener6.bind(("::1", 0))
            listener6.listen()
        except OSError:
            if listener6 is not None:
                listener6.close()
            listener6 = None

        script = b"#!/bin/bash\nexec sleep 60\n"
        pid_ok: dict[str, Any] = {
            "pid": group.pid,
            "pgid": group.pid,
            "start_time": start_time(group.pid),
            "boot_id": BOOT_ID,
            "started_at": "2025-01-01T00:00:00Z",
            "log": "logs/20250102T000000Z.log",
        }

        # (a) ours and alive, with logs, a secrets.env that must never be opened
        d = units / "sglang-0"
        d.mkdir(parents=True)
        (d / "launch.sh").write_bytes(script)
        write_json(d / "unit.json", unit_json("sglang-0"))
        write_json(d / "pid", pid_ok)
        (d / "logs").mkdir()
        (d / "logs" / "20250101T000000Z.log").write_text("old\n")
        (d / "logs" / "20250102T000000Z.log").write_text("hello world\n")
        (d / "logs" / "current.log").symlink_to("20250102T000000Z.log")
        os.mkfifo(d / "secrets.env", 0o600)  # opening it would block the agent: a hang = a read

        # (b) the pid is alive but it is a different process (start time differs): reused
        d = units / "reused"
        d.mkdir()
        (d / "launch.sh").write_bytes(script)
        write_json(d / "unit.json", unit_json("reused", 30001))
        write_json(d / "pid", dict(pid_ok, start_time=pid_ok["start_time"] - 7))

        # (b') right start time, but recorded on another boot
        d = units / "otherboot"
        d.mkdir()
        write_json(d / "pid", dict(pid_ok, boot_id="00000000-0000-0000-0000-000000000000"))

        # (c) a dead pid, an exit file
        d = units / "dead"
        d.mkdir()
        (d / "launch.sh").write_bytes(script)
        write_json(d / "unit.json", unit_json("dead", 30002))
        write_json(d / "pid", dict(pid_ok, pid=dead.pid, pgid=dead.pid, start_time=1))
        write_json(d / "exit", {"code": 137, "finished_at": "2025-01-01T01:00:00Z"})

        # a zombie with its true start time: exited, so not alive and not ours
        d = units / "zombie"
        d.mkdir()
        write_json(
            d / "pid",
            dict(pid_ok, pid=zombie.pid, pgid=zombie.pid, start_time=start_time(zombie.pid)),
        )

        # the leader is gone; what is left of its group carries the record's run id: ours
        d = units / "orphaned"
        d.mkdir()
        write_json(
            d / "pid",
            dict(
                pid_ok,
                pid=orphan_leader,
                pgid=orphan_leader,
                start_time=orphan_since,
                run_id="0123456789abcdef",
            ),
        )

        # the leader is gone; what is left of its group lacks the run id: not provably ours
        d = units / "stranger"
        d.mkdir()
        write_json(
            d / "pid",
            dict(
                pid_ok,
                pid=stranger_leader,
                pgid=stranger_leader,
                start_time=stranger_since,
                run_id="feedfacefeedface",
            ),
        )

        # (d) a broken unit.json: the rest of the unit is still reported
        d = units / "broken"
        d.mkdir()
        (d / "launch.sh").write_bytes(script)
        (d / "unit.json").write_text("{not json")
        write_json(d / "pid", dict(pid_ok, pid=dead.pid, pgid=dead.pid))
        (d / "exit").write_text("[1, 2]")

        # record files of the wrong shape: demoted to that unit's errors by the controller
        d = units / "badtypes"
        d.mkdir()
        write_json(d / "unit.json", dict(unit_json("badtypes"), port="30000"))
        write_json(d / "pid", {"pid": "1234"})

        # a job with progress; one whose progress.json is too big
        d = units / "generate"
        d.mkdir()
        (d / "launch.sh").write_bytes(script)
        write_json(d / "unit.json", unit_json("generate", None))
        write_json(d / "progress.json", {"done": 5, "total": 10, "rate": 1.5})
        write_json(d / "exit", {"code": 0, "finished_at": "2025-01-01T02:00:00Z"})
        d = units / "bigprogress"
        d.mkdir()
        write_json(d / "progress.json", {"pad": "x" * (70 * 1024)})

        # an empty unit dir; things under units/ that are not units (pruned ones included)
        (units / "empty").mkdir()
        (units / ".staging").mkdir()
        write_json(units / ".pruned" / "old-20250101T000000Z" / "unit.json", unit_json("old"))
        (units / "stray-file").write_text("x")

        # shipped payloads, plus an interrupted upload's leftover
        hashes = {}
        for rel, content in {
            "0123456789abcdef/generate_completions.py": b"print('hi')\n",
            "fedcba9876543210/train.sh": b"#!/bin/sh\necho train\n",
        }.items():
            path = workdir / "payloads" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            hashes[rel] = hashlib.sha256(content).hexdigest()
        (workdir / "payloads" / "0123456789abcdef" / ".x.py.dflashops-tmp.AbC123").write_text("p")

        yield FactsHost(
            workdir=workdir,
            leader=group.pid,
            dead_pid=dead.pid,
            zombie_pid=zombie.pid,
            port=listener.getsockname()[1],
            port6=listener6.getsockname()[1] if listener6 else None,
            orphan=orphan,
            stranger=stranger,
            payload_hashes=hashes,
            script_hash=hashlib.sha256(script).hexdigest(),
        )
    finally:
        listener.close()
        if listener6 is not None:
            listener6.close()
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()
        zombie.wait()
        for pid, since in strays:
            if alive(pid) and start_time(pid) == since:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module", params=PYTHONS)
def facts(request: pytest.FixtureRequest, fleet: FactsHost) -> HostFacts:
    return gather(
        request.param,
        fleet.workdir,
        imports=["json", "no_such_module_xyz"],
        paths=[str(fleet.workdir / "units"), str(fleet.workdir / "nope"), "/dev/null"],
    )


# ------------------------------------------------------------------------------ the host itself


def test_host_basics(facts: HostFacts, fleet: FactsHost) -> None:
    assert facts.host == HOST
    assert facts.hostname == socket.gethostname()
    assert facts.boot_id == BOOT_ID
    assert facts.clock_ticks == os.sysconf("SC_CLK_TCK")
    assert facts.uptime_s is not None and facts.uptime_s > 0
    assert abs(facts.time - time.time()) < 60
    assert facts.workdir == str(fleet.workdir)
    assert facts.workdir_exists
    assert facts.disk is not None and facts.disk.path == str(fleet.workdir)
    assert 0 < facts.disk.free_bytes <= facts.disk.total_bytes
    assert facts.errors == {}
    assert facts.python.count(".") == 2


def test_answer_carries_schema_and_action(tmp_path: Path) -> None:
    data = Agent(conn(), ANY_PYTHON).call("facts", {"workdir": str(tmp_path / "wd")}, timeout=30)
    assert data["schema"] == 2 and data["action"] == "facts"
    assert data["imports"] == {} and data["paths"] == {}  # defaults of the request


def test_both_pythons_are_really_used(fleet: FactsHost) -> None:
    for python in (sys.executable, SYSTEM_PYTHON):
        if not os.path.exists(python):
            continue
        got = gather(python, fleet.workdir)
        assert got.python_executable == python
        assert (
            got.python
            == subprocess.check_output(
                [python, "-c", "import platform; print(platform.python_version())"], text=True
            ).strip()
        )


# ------------------------------------------------------------------------------ units


def test_units_listed(facts: HostFacts) -> None:
    assert sorted(facts.units) == sorted(
        [
            "sglang-0",
            "reused",
            "otherboot",
            "dead",
            "zombie",
            "orphaned",
            "stranger",
            "broken",
            "badtypes",
            "generate",
            "bigprogress",
            "empty",
        ]
    )
    assert facts.unit("nope") is None


def test_live_unit_is_ours(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("sglang-0")
    assert u is not None
    assert u.running
    assert u.process.alive and u.process.ours and u.process.reason is None
    assert u.process.pid == fleet.leader and u.process.pgid == fleet.leader
    assert u.process.state in ("S", "R")
    assert u.process.start_time == start_time(fleet.leader)
    assert u.process.cmdline[:2] == ["sh", "-c"]
    assert u.group_pids == group_members(fleet.leader, session=True)
    assert fleet.leader in u.group_pids and len(u.group_pids) == 3
    assert u.unproven_pids == []
    assert u.script_sha256 == fleet.script_hash
    assert u.unit is not None and u.unit.port == 30000 and u.unit.gpus == [0]
    assert u.fingerprint == "f" * 64
    assert u.pid is not None and u.pid.boot_id == BOOT_ID
    assert u.exit is None and u.progress is None
    assert u.logs.count == 2
    assert u.logs.current == "20250102T000000Z.log"
    assert u.logs.current_size == len("hello world\n")


def test_reused_pid_is_alive_but_not_ours(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("reused")
    assert u is not None
    assert u.process.alive and not u.process.ours and not u.running
    assert u.process.pid == fleet.leader
    assert "reused" in (u.process.reason or "")
    assert u.group_pids == [] and u.unproven_pids == []


def test_other_boot_is_not_ours(facts: HostFacts) -> None:
    u = facts.unit("otherboot")
    assert u is not None
    assert u.process.alive and not u.process.ours
    assert "another boot" in (u.process.reason or "")
    assert u.group_pids == [] and u.unproven_pids == []
    assert u.script_sha256 is None and u.unit is None and u.unit_error is None


def test_dead_pid(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("dead")
    assert u is not None
    assert not u.process.alive and not u.process.ours and not u.running
    assert u.process.pid == fleet.dead_pid and u.process.state is None
    assert "gone" in (u.process.reason or "")
    assert u.exit is not None and u.exit.code == 137
    assert u.logs.count == 0 and u.logs.current is None
    assert u.group_pids == [] and u.unproven_pids == []


def test_zombie_is_not_alive(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("zombie")
    assert u is not None
    assert u.process.pid == fleet.zombie_pid
    assert u.process.state == "Z"
    assert not u.process.alive and not u.process.ours
    assert "zombie" in (u.process.reason or "")


def test_leader_gone_members_with_run_id_are_ours(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("orphaned")
    assert u is not None
    assert not u.running and not u.process.alive and "gone" in (u.process.reason or "")
    assert u.group_pids == [fleet.orphan]
    assert u.unproven_pids == []


def test_leader_gone_members_without_run_id_are_unproven(
    facts: HostFacts, fleet: FactsHost
) -> None:
    u = facts.unit("stranger")
    assert u is not None
    assert not u.running and not u.process.alive
    assert u.group_pids == []
    assert u.unproven_pids == [fleet.stranger]


def test_broken_files_reported_rest_kept(facts: HostFacts, fleet: FactsHost) -> None:
    u = facts.unit("broken")
    assert u is not None
    assert u.unit is None and u.unit_error is not None and "unit.json" in u.unit_error
    assert u.exit is None and u.exit_error is not None and "not a JSON object" in u.exit_error
    assert u.script_sha256 == fleet.script_hash
    assert u.pid is not None and u.pid.pid == fleet.dead_pid
    assert not u.process.alive


def test_badly_typed_records_become_unit_errors(facts: HostFacts) -> None:
    u = facts.unit("badtypes")
    assert u is not None
    assert u.unit is None and u.unit_error is not None and "port" in u.unit_error
    assert u.pid is None and u.pid_error is not None and "pid" in u.pid_error
    assert not u.process.ours and not u.process.alive
    assert "no valid pid" in (u.process.reason or "")


def test_progress_and_exit(facts: HostFacts) -> None:
    u = facts.unit("generate")
    assert u is not None
    assert u.progress == {"done": 5, "total": 10, "rate": 1.5}
    assert u.exit is not None and u.exit.code == 0
    assert u.unit is not None and u.unit.port is None
    big = facts.unit("bigprogress")
    assert big is not None
    assert big.progress is None and "64 KiB" in (big.progress_error or "")


def test_empty_unit(facts: HostFacts) -> None:
    u = facts.unit("empty")
    assert u is not None
    assert u.script_sha256 is None and u.unit is None and u.pid is None and u.exit is None
    assert u.unit_error is None and u.pid_error is None
    assert not u.running and u.process.pid is None and u.process.reason == "no pid record"
    assert u.logs.count == 0
    assert u.group_pids == [] and u.unproven_pids == []


# ------------------------------------------------------------------------------ the rest


def test_listeners(facts: HostFacts, fleet: FactsHost) -> None:
    entry = facts.listener(fleet.port)
    assert entry is not None
    assert entry.address == "127.0.0.1"
    assert os.getpid() in entry.pids
    assert entry.inode > 0
    if fleet.port6 is not None:
        entry6 = facts.listener(fleet.port6)
        assert entry6 is not None and entry6.address == "::1"
        assert os.getpid() in entry6.pids


def test_payload_hashes(facts: HostFacts, fleet: FactsHost) -> None:
    assert facts.payloads == fleet.payload_hashes
    key, sha = next(iter(fleet.payload_hashes.items()))
    assert facts.has_payload(key, sha)
    assert not facts.has_payload(key, "0" * 64)


def test_imports(facts: HostFacts) -> None:
    ok = facts.imports["json"]
    assert ok.ok and ok.error is None and ok.version and ok.seconds >= 0
    bad = facts.imports["no_such_module_xyz"]
    assert not bad.ok and bad.version is None
    assert "No module named 'no_such_module_xyz'" in (bad.error or "")
    assert len((bad.error or "").splitlines()) <= 5


def test_paths(facts: HostFacts, fleet: FactsHost) -> None:
    assert facts.paths[str(fleet.workdir / "units")].exists
    assert facts.paths[str(fleet.workdir / "units")].is_dir
    assert not facts.paths[str(fleet.workdir / "nope")].exists
    assert facts.paths["/dev/null"].exists and not facts.paths["/dev/null"].is_dir


def test_no_nvidia_smi(facts: HostFacts) -> None:
    if facts.gpus.available:
        pytest.skip("this machine has a real nvidia-smi")
    assert facts.gpus.error == "nvidia-smi not found"
    assert facts.gpus.devices == [] and facts.gpus.processes == []
    assert facts.gpu_used_mib(0) == 0 and facts.gpu_pids(0) == []


# ------------------------------------------------------------------------------ GPUs


@pytest.mark.parametrize("python", PYTHONS)
def test_fake_gpus(tmp_path: Path, python: str) -> None:
    state = tmp_path / "gpu"
    write_json(state / "config.json", {"count": 4, "name": "NVIDIA B200"})
    holder = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        write_json(
            state / "procs" / f"{holder.pid}.json",
            {
                "pid": holder.pid,
                "gpus": [1, 3],
                "used_mib": 5000,
                "name": "sglang::scheduler, tp0",
                "start_time": str(start_time(holder.pid)),
            },
        )
        py = wrapper(
            tmp_path / "py",
            f"PATH={shlex.quote(str(FAKE_BIN))}:/usr/bin:/bin "
            f'FAKE_GPU_STATE={shlex.quote(str(state))} exec {shlex.quote(python)} "$@"',
        )
        got = gather(py, tmp_path / "wd")
    finally:
        holder.kill()
        holder.wait()
    gpus = got.gpus
    assert gpus.available and gpus.error is None
    assert [d.index for d in gpus.devices] == [0, 1, 2, 3]
    assert all(d.name == "NVIDIA B200" and d.uuid.startswith("GPU-") for d in gpus.devices)
    assert gpus.devices[1].memory_used_mib == 5000 and gpus.devices[0].memory_used_mib == 0
    assert gpus.devices[0].memory_total_mib == 183359
    # the fake reports 87 % on a GPU with a compute process on it, 0 % on an idle one
    assert [d.utilization_pct for d in gpus.devices] == [0, 87, 0, 87]
    assert {(p.pid, p.gpu_index) for p in gpus.processes} == {(holder.pid, 1), (holder.pid, 3)}
    assert all(p.process_name == "sglang::scheduler, tp0" for p in gpus.processes)
    assert all(p.used_mib == 5000 for p in gpus.processes)
    assert got.gpu_used_mib(1) == 5000 and got.gpu_used_mib(0) == 0
    assert got.gpu_pids(3) == [holder.pid] and got.gpu_pids(2) == []
    assert got.workdir_exists is False
    assert got.units == {} and got.payloads == {}
    assert got.disk is not None and got.disk.path == str(tmp_path)


def test_gpu_na_values_and_failures(tmp_path: Path) -> None:
    na_bin = tmp_path / "na"
    na_bin.mkdir()
    wrapper(
        na_bin / "nvidia-smi",
        'case "$1" in\n'
        '  --query-gpu=*) echo "0, GPU-aaa, NVIDIA GB200, [N/A], [N/A], [N/A]";'
        ' echo "1, GPU-bbb, NVIDIA GB200, rev 2, 12, 97887, 40";;\n'
        '  --query-compute-apps=*) echo "4242, GPU-aaa, [N/A], python3";'
        ' echo "4343, GPU-zzz, 7, [Not Found]";;\n'
        "esac",
    )
    bad_bin = tmp_path / "bad"
    bad_bin.mkdir()
    wrapper(
        bad_bin / "nvidia-smi",
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.' >&2\n"
        "exit 9",
    )
    none_bin = tmp_path / "none"
    none_bin.mkdir()

    def run(bin_dir: Path) -> HostFacts:
        py = wrapper(
            tmp_path / f"py-{bin_dir.name}",
            f'PATH={shlex.quote(str(bin_dir))} exec {shlex.quote(ANY_PYTHON)} "$@"',
        )
        return gather(py, tmp_path / "wd")

    na = run(na_bin)
    assert na.gpus.available and na.gpus.error is None
    assert (
        na.gpus.devices[0].memory_used_mib is None and na.gpus.devices[0].memory_total_mib is None
    )
    assert na.gpus.devices[0].utilization_pct is None
    assert na.gpus.devices[1].memory_used_mib == 12
    assert na.gpus.devices[1].utilization_pct == 40
    assert na.gpus.devices[1].name == "NVIDIA GB200, rev 2"  # a comma in the name stays
    assert na.gpus.processes[0].used_mib is None and na.gpus.processes[0].gpu_index == 0
    assert na.gpus.processes[1].gpu_index is None  # uuid of no listed GPU
    assert na.gpu_used_mib(0) == 0 and na.gpu_pids(0) == [4242]

    bad = run(bad_bin)
    assert not bad.gpus.available
    assert "could not communicate with the NVIDIA driver" in (bad.gpus.error or "")
    assert "9" in (bad.gpus.error or "")

    none = run(none_bin)
    assert not none.gpus.available and none.gpus.error == "nvidia-smi not found"


def test_idle_gpus_cost_one_nvidia_smi_and_busy_ones_two(tmp_path: Path) -> None:
    """With every device at 0 MiB no process can hold one (a CUDA context alone takes
    hundreds of MiB): the compute-apps query is not run. Memory in use, or unknown, is."""
    calls = tmp_path / "calls"

    def smi(name: str, used: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        wrapper(
            folder / "nvidia-smi",
            f'echo "$1" >> {shlex.quote(str(calls))}\n'
            'case "$1" in\n'
            f'  --query-gpu=*) echo "0, GPU-aaa, NVIDIA B200, 0, 183359, 0";'
            f' echo "1, GPU-bbb, NVIDIA B200, {used}, 183359, 0";;\n'
            '  --query-compute-apps=*) echo "4242, GPU-bbb, 900, python3";;\n'
            "esac",
        )
        return folder

    for name, used, queries, pids in (
        ("idle", "0", 1, []),
        ("busy", "900", 2, [4242]),
        ("unknown", "[N/A]", 2, [4242]),
    ):
        calls.unlink(missing_ok=True)
        py = wrapper(
            tmp_path / f"py-{name}",
            f'PATH={shlex.quote(str(smi(name, used)))}:/usr/bin:/bin exec {shlex.quote(ANY_PYTHON)} "$@"',
        )
        got = gather(py, tmp_path / "wd")
        assert got.gpus.available and got.gpus.error is None, name
        assert len(calls.read_text().splitlines()) == queries, name
        assert got.gpu_pids(1) == pids, name


# ------------------------------------------------------------------------------ faults


def test_python_not_found(tmp_path: Path) -> None:
    for python in ("/nonexistent/python3", "python3-no-such-interpreter"):
        with pytest.raises(AgentError) as info:
            gather(python, tmp_path)
        msg = str(info.value)
        assert msg.startswith(f"[{HOST}] ")
        assert f"python {python!r} not found on the host" in msg
        assert "set `python:` for this host in the inventory" in msg
        assert isinstance(info.value, HostError)


def test_python_not_executable(tmp_path: Path) -> None:
    py = tmp_path / "python3"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o644)
    with pytest.raises(AgentError, match="cannot be executed on the host"):
        gather(str(py), tmp_path)


def test_agent_printing_nothing(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="printed nothing") as info:
        gather("true", tmp_path)
    assert "no answer is not success" in str(info.value)


def test_agent_printing_garbage(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="not a JSON answer") as info:
        gather("echo", tmp_path)
    # the start of what it printed is shown (echo repeats the loader's command line)
    assert ': "-S -c import sys;exec(compile(sys.stdin.buffer.read(' in str(info.value)


def test_agent_failing(tmp_path: Path) -> None:
    py = wrapper(tmp_path / "py", "echo 'Traceback: boom' >&2\nexit 3")
    with pytest.raises(AgentError, match="exit code 3") as info:
        gather(py, tmp_path)
    assert f"using python {py!r}" in str(info.value)
    assert "Traceback: boom" in str(info.value)
    assert "3.9" not in str(info.value)  # no SyntaxError: no hint about old pythons


def test_python_too_old_hint(tmp_path: Path) -> None:
    py = wrapper(tmp_path / "py", "echo '    SyntaxError: invalid syntax' >&2\nexit 1")
    with pytest.raises(AgentError, match=r"needs Python 3\.9"):
        gather(py, tmp_path)


@pytest.mark.skipif(PYTHON36 is None, reason="no Python 3.6 under pyenv")
def test_a_real_old_python_gets_the_hint(tmp_path: Path) -> None:
    assert PYTHON36 is not None
    with pytest.raises(AgentError, match=r"exit code 1 .*needs Python 3\.9") as info:
        gather(PYTHON36, tmp_path)
    assert "SyntaxError" in str(info.value)


def test_wrong_schema(tmp_path: Path) -> None:
    py = wrapper(tmp_path / "py", 'cat >/dev/null; echo \'{"schema": 1, "action": "facts"}\'')
    with pytest.raises(AgentError, match="schema 1") as info:
        gather(py, tmp_path)
    assert "versions do not match" in str(info.value)
    py = wrapper(tmp_path / "py-noaction", "cat >/dev/null; echo '{\"schema\": 2}'")
    with pytest.raises(AgentError, match="for action None"):
        gather(py, tmp_path)
    py = wrapper(tmp_path / "py-other", 'cat >/dev/null; echo \'{"schema": 2, "action": "stop"}\'')
    with pytest.raises(AgentError, match="for action 'stop'"):
        gather(py, tmp_path)
    py = wrapper(tmp_path / "py2", "cat >/dev/null; echo '[1, 2]'")
    with pytest.raises(AgentError, match="not a JSON answer"):
        gather(py, tmp_path)


def test_invalid_report(tmp_path: Path) -> None:
    answer = '{"schema": 2, "action": "facts", "hostname": 5}'
    py = wrapper(tmp_path / "py", f"cat >/dev/null; echo '{answer}'")
    with pytest.raises(AgentError, match="does not validate") as info:
        gather(py, tmp_path)
    assert "hostname" in str(info.value)


def test_banner_before_report_is_tolerated(tmp_path: Path) -> None:
    py = wrapper(tmp_path / "py", f'echo "Welcome to the GPU box"\nexec {sys.executable} "$@"')
    got = gather(py, tmp_path / "wd")
    assert got.units == {}


def test_agent_never_reads_secrets(tmp_path: Path) -> None:
    """secrets.env is a FIFO nobody writes: opening it would hang the agent until the timeout."""
    unit = tmp_path / "wd" / "units" / "u"
    unit.mkdir(parents=True)
    os.mkfifo(unit / "secrets.env", 0o600)
    got = gather(sys.executable, tmp_path / "wd", timeout=15)
    assert got.unit("u") is not None


# ------------------------------------------------------------------------------ the agent itself


def test_bundle_runs_as_a_file_and_with_tilde(tmp_path: Path) -> None:
    path = tmp_path / "agent.py"
    path.write_bytes(bundle())
    request = json.dumps({"action": "facts", "workdir": "~/no-such-dflashops-dir"})
    result = conn().run([ANY_PYTHON, str(path)], input=request.encode() + b"\n")
    data = json.loads(result.out)
    assert data["schema"] == 2 and data["action"] == "facts"
    assert data["workdir"] == os.path.expanduser("~/no-such-dflashops-dir")
    assert not data["workdir_exists"]
    assert len(result.out.strip().splitlines()) == 1


def test_bad_request_exits_2() -> None:
    for line, why in (
        (b"not json", "not JSON"),
        (b"[1]", "the request must be a JSON object"),
        (b'{"action": "facts"}', "workdir must be a non-empty string"),
        (b'{"action": "nope", "workdir": "/tmp"}', "action must be one of"),
        (b'{"action": "facts", "workdir": "/tmp", "imports": "json"}', "imports must be a list"),
        (b"", "no request given"),
    ):
        result = conn().run(
            command(sys.executable), input=bundle() + line + b"\n", check=False, timeout=30
        )
        assert result.exit_code == 2 and result.out == "", line
        assert f"dflashops agent: bad request: {why}" in result.err, line


def test_refused_request_is_an_agent_error(tmp_path: Path) -> None:
    agent = Agent(conn(), sys.executable)
    with pytest.raises(AgentError, match="refused the request") as info:
        agent.call("facts", {"workdir": str(tmp_path), "paths": [1]}, timeout=30)
    assert "paths must be a list of strings" in str(info.value)


def test_decode_address() -> None:
    if sys.byteorder != "little":
        pytest.skip("hex strings below are little-endian /proc output")
    assert procfs.decode_address("0100007F") == "127.0.0.1"
    assert procfs.decode_address("00000000") == "0.0.0.0"
    assert procfs.decode_address("00000000000000000000000001000000") == "::1"
    assert procfs.decode_address("0000000000000000FFFF00000100007F") == "::ffff:127.0.0.1"


def test_parse_int() -> None:
    assert gpu.parse_int(" 12 ") == 12
    assert gpu.parse_int("[N/A]") is None
    assert gpu.parse_int("[Not Supported]") is None
    assert gpu.parse_int("3.0") == 3
    assert gpu.parse_int("garbage") is None


def test_agent_is_fast_on_an_empty_workdir(tmp_path: Path) -> None:
    got = gather(sys.executable, tmp_path / "wd")
    assert got.elapsed_s is not None and got.elapsed_s < 1.0  # typically ~10 ms


def test_a_unit_that_ends_between_reading_its_records_and_the_proc_pass_shows_its_exit(
    tmp_path: Path,
) -> None:
    """The supervisor writes the exit record, then exits. Facts read the records first and
    look at processes later: a job ending in between was read with no exit and then found
    gone, and `status` called a finished job `dead` for one look. The ends are read again."""
    from dflashops.agent.remote import facts as remote_facts
    from dflashops.agent.remote import ownership

    ended = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    record = {
        "pid": ended.pid,
        "pgid": ended.pid,
        "start_time": int(start_time(ended.pid)),
        "boot_id": boot_id(),
    }
    ended.wait()
    unit = tmp_path / "units" / "gen"
    write_json(unit / "pid", record)
    write_json(unit / "unit.json", unit_json("gen", port=None))
    units, records = remote_facts.read_units(str(tmp_path), {})
    assert units["gen"]["exit"] is None  # read while it still ran
    write_json(unit / "exit", {"code": 0, "signal": None, "finished_at": "2026-12-02T12:00:00Z"})
    groups: ownership.Groups = {ended.pid: []}
    remote_facts.attach_processes(units, records, boot_id(), groups, str(tmp_path))
    assert units["gen"]["process"]["alive"] is False
    assert units["gen"]["exit"] == {
        "code": 0,
        "signal": None,
        "finished_at": "2026-12-02T12:00:00Z",
    }
