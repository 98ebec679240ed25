"""Helpers for the lifecycle tests (test_lifecycle.py): drive `dflashops` through its CLI
against the sshd test fleet and look at what really happened on the hosts.

- `Ops`: an inventory for a fleet, playbooks written into tmp_path, `run(...)` calling
  `dflashops.cli.main` with `-i/-p/--json`, returning the exit code, the JSON events (for
  `status`: its --json document instead, `Result.document`, `Result.rows()`) and the console
  output. `cleanup()` stops every unit of every playbook it wrote.
- host-side views: a unit's folder, pid record, engine pid, fake GPU processes, SSH sessions
  (generic /proc helpers and free ports are in tests/procs.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from fleet import Fleet, FleetHost

from dflashops.cli import main
from tests.procs import alive, environ, group_members

READY = {"timeout": "30s", "interval": "0.2s"}
MODEL = "/dev/shm/Qwen3.6-27B"


# ------------------------------------------------------------------------------ /proc


def unit_processes(host: FleetHost) -> list[int]:
    """Live processes started by dflashops on `host`: they have the host's FAKE_GPU_STATE in
    their environment, and DFLASHOPS_RUN_ID too, but for the supervisors: forked from the
    agent, they start from its environment (their children get the run id) and are named
    dfo:<unit>."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = environ(pid)
        if env.get("FAKE_GPU_STATE") != str(host.gpu_dir) or not alive(pid):
            continue
        if "DFLASHOPS_RUN_ID" in env or _comm(pid).startswith("dfo:"):
            found.append(pid)
    return sorted(found)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def http_json(port: int, path: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


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
    document: dict[str, Any] | None = None  # `status --json FILE`: one document, no events

    def rows(self) -> dict[str, dict[str, Any]]:
        """The status document's units by name; a name on two hosts fails (key those by
        (host, unit) from ``document["units"]``)."""
        assert self.document is not None, f"status wrote no --json document\n{self.explain()}"
        units = self.document["units"]
        rows = {row["unit"]: row for row in units}
        assert len(rows) == len(units), f"a unit name on two hosts: {units}"
        return rows

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
        self.log.append(f"$ dflashops {' '.join(argv)}  -> {code} in {seconds:.1f}s\n{out}")
        print(self.log[-1])
        if not events_path.exists():
            return Result(code, [], out, seconds)
        text = events_path.read_text()
        if command == "status":  # its --json FILE is one document, not events
            return Result(code, [], out, seconds, json.loads(text))
        events = [json.loads(x) for x in text.splitlines() if x.strip()]
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


# ------------------------------------------------------------------------------ playbook entries


def sglang(port: int | str, replicas: int = 2, **kw: Any) -> dict[str, Any]:
    return {
        "name": "sglang",
        "engine": "sglang",
        "model": MODEL,
        "replicas": replicas,
        "port": port,
        "ready": READY,
        "stop_grace": "2s",
        **kw,
    }


def stub(
    name: str, port: int | str, env: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "stub",
        "model": MODEL,
        "port": port,
        "ready": READY,
        "stop_grace": "2s",
        "env": env or {},
        **kw,
    }


def job(name: str, script: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": ["bash", "-c", script], "stop_grace": "2s", **kw}
