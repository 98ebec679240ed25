"""Helpers for the lifecycle tests (test_lifecycle.py): drive `dflashops` through its CLI
against the sshd test fleet and look at what really happened on the hosts.

- `free_ports(n)`: n consecutive ports free on every local address (all fleet hosts share one
  network namespace, and facts report a listener on any address as taking the port).
- `Ops`: an inventory for a fleet, playbooks written into tmp_path, `run(...)` calling
  `dflashops.cli.main` with `-i/-p/--json`, returning the exit code, the JSON events and the
  console output. `cleanup()` stops every unit of every playbook it wrote.
- `/proc` helpers: a process's liveness, start time, environment and process group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from fleet import Fleet, FleetHost

from dflashops.cli import main

# Below the kernel's ephemeral range (32768+), where sshd and client sockets take their ports,
# and below the engines' default ports (30000+) that other tests may use as they are.
_PORT_LOW, _PORT_HIGH = 20000, 29900
_PORT_LOCK = threading.Lock()
_PORTS_TAKEN: set[int] = set()

READY = {"timeout": "30s", "interval": "0.2s"}
MODEL = "/dev/shm/Qwen3.6-27B"


def _port_free(port: int) -> bool:
    """Nothing listens on `port` on any address (a wildcard bind fails if any address has it)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((address, port))
        except OSError:
            if family == socket.AF_INET6:
                continue  # no IPv6 here: the IPv4 check stands
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive free ports (unique within this process)."""
    with _PORT_LOCK:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(500):
            base = rng.randrange(_PORT_LOW, _PORT_HIGH - count)
            ports = range(base, base + count)
            if any(p in _PORTS_TAKEN for p in ports):
                continue
            if all(_port_free(p) for p in ports):
                _PORTS_TAKEN.update(ports)
                return base
    raise RuntimeError("no free port range found")


# ------------------------------------------------------------------------------ /proc


def proc_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def start_time(pid: int) -> int:
    st = proc_stat(pid)
    assert st is not None, f"pid {pid} is gone"
    return int(st[19])


def pgid_of(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else int(st[2])


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and st[0] not in ("Z", "X") and int(st[2]) == pgid:
                out.append(int(entry.name))
    return sorted(out)


def unit_processes(host: FleetHost) -> list[int]:
    """Live processes started by dflashops on `host` (they carry DFLASHOPS_RUN_ID and the
    host's FAKE_GPU_STATE in their environment)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = environ(pid)
        if (
            env.get("FAKE_GPU_STATE") == str(host.gpu_dir)
            and "DFLASHOPS_RUN_ID" in env
            and alive(pid)
        ):
            found.append(pid)
    return sorted(found)


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 20.0, every: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def http_json(port: int, path: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


def http_status(port: int, path: str, timeout: float = 5.0) -> int:
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# ------------------------------------------------------------------------------ host files


def unit_dir(host: FleetHost, unit: str) -> Path:
    return host.workdir / "units" / unit


def pid_record(host: FleetHost, unit: str) -> dict[str, Any] | None:
    try:
        return json.loads((unit_dir(host, unit) / "pid").read_text())
    except FileNotFoundError:
        return None


def unit_pid(host: FleetHost, unit: str) -> int:
    rec = pid_record(host, unit)
    assert rec is not None, f"{unit} on {host.name} has no pid record"
    return int(rec["pid"])


def engine_pid(host: FleetHost, unit: str) -> int:
    """The pid of the unit's engine (the supervisor's child that exec'd the engine)."""
    sup = unit_pid(host, unit)
    members = [p for p in group_members(sup) if p != sup]
    assert members, f"{unit} on {host.name}: no engine under supervisor {sup}"
    return min(members)


def gpu_procs(host: FleetHost) -> list[dict[str, Any]]:
    out = []
    for path in sorted((host.gpu_dir / "procs").glob("*.json")):
        with contextlib.suppress(FileNotFoundError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


def dflashops_tmp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if ".dflashops-tmp." in p.name)


def ssh_sessions(host: FleetHost) -> int:
    """Commands run over SSH on `host` so far (sshd at LogLevel VERBOSE logs each exec)."""
    return host.log_text().count("Starting session: command")


# ------------------------------------------------------------------------------ the CLI


@dataclass
class Result:
    code: int
    events: list[dict[str, Any]]
    out: str
    seconds: float

    def of(
        self,
        unit: str | None = None,
        *,
        host: str | None = None,
        action: str | None = None,
        status: str | None = None,
    ) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if (unit is None or e["unit"] == unit)
            and (host is None or e["host"] == host)
            and (action is None or e["action"] == action)
            and (status is None or e["status"] == status)
        ]

    def statuses(self, host: str | None = None) -> dict[tuple[str, str | None], set[str]]:
        out: dict[tuple[str, str | None], set[str]] = {}
        for e in self.events:
            if host is None or e["host"] == host:
                out.setdefault((e["host"], e["unit"]), set()).add(e["status"])
        return out

    def explain(self) -> str:
        return f"exit {self.code}\n{self.out}"


@dataclass
class Ops:
    """One controller: HOME, known_hosts, inventory and playbooks under `base`."""

    base: Path
    fleet: Fleet
    hosts: dict[str, dict[str, Any]] | None = None
    playbooks: dict[str, Path] = field(default_factory=dict)
    runs: int = 0
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.base / "home" / ".ssh").mkdir(parents=True, exist_ok=True)
        shutil.copy(self.fleet.known_hosts_path, self.base / "home" / ".ssh" / "known_hosts")
        (self.base / "playbooks").mkdir(exist_ok=True)
        self.inventory = self.fleet.write_inventory(self.base / "inventory.yaml", hosts=self.hosts)

    def host(self, name: str) -> FleetHost:
        return self.fleet[name]

    def playbook(self, name: str, data: dict[str, Any]) -> Path:
        """Write (or rewrite) playbooks/<name>.yaml; `data` gets name: <name> unless given."""
        path = self.base / "playbooks" / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, **data}, sort_keys=False))
        self.playbooks[name] = path
        return path

    def argv(self, command: str, playbooks: Iterable[str] | None, *extra: str) -> list[str]:
        names = list(playbooks) if playbooks is not None else list(self.playbooks)
        argv = [command, "-i", str(self.inventory)]
        for n in names:
            argv += ["-p", str(self.playbooks[n])]
        return [*argv, *extra]

    def events_path(self, command: str, ahead: int = 1) -> Path:
        """Where the `ahead`-th next run of `command` writes its JSON events."""
        return self.base / f"events-{self.runs + ahead:02d}-{command}.jsonl"

    def run(
        self,
        command: str,
        *extra: str,
        playbooks: Iterable[str] | None = None,
        json_events: bool = True,
    ) -> Result:
        events_path = self.events_path(command)
        self.runs += 1
        argv = self.argv(command, playbooks, *extra)
        if json_events and command not in ("logs",):
            argv += ["--json", str(events_path)]
        buf = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = main(argv)
        seconds = time.monotonic() - t0
        out = buf.getvalue()
        events = []
        if events_path.exists():
            events = [json.loads(x) for x in events_path.read_text().splitlines() if x.strip()]
        self.log.append(f"$ dflashops {' '.join(argv)}  -> {code} in {seconds:.1f}s\n{out}")
        print(self.log[-1])
        return Result(code, events, out, seconds)

    def cleanup(self) -> list[str]:
        """Stop every unit of every playbook written; returns what could not be cleaned."""
        problems = []
        if self.playbooks:
            res = self.run("stop")
            if res.code != 0:
                problems.append(f"dflashops stop at teardown: {res.explain()}")
        for host in self.fleet:
            left = unit_processes(host)
            if left:
                problems.append(f"{host.name}: unit processes left after stop: {left}")
        return problems


@contextlib.contextmanager
def foreign_process(argv: list[str], env: dict[str, str] | None = None) -> Iterator[int]:
    """A process dflashops did not start (own session, like anything started by hand)."""
    import subprocess

    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    try:
        yield proc.pid
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
