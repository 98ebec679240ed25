"""The unit lifecycle against the sshd test fleet (issue 4): deploy, restart-servers, stop,
status and logs, and every fault the issue lists, driven through `dflashops.cli.main` with
`-i INVENTORY -p PLAYBOOK --json EVENTS`, and checked on the hosts themselves (/proc, the unit
directories under the host's workdir, the fake GPU state).

Every fleet here comes from `fleet_factory` (fresh per test); every unit a test starts is stopped
by `dflashops stop` at teardown (the `ops` fixture), which also fails the test if any process
started by dflashops is left on a host.

Counting SSH commands: sshd runs at LogLevel VERBOSE and logs one "Starting session: command"
line per exec request, so the difference in that count across one `dflashops` call is the number
of remote commands it ran, seen from the host and independent of dflashops' own bookkeeping.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet import FleetFactory, FleetHost
from lifecycle_helpers import (
    READY,
    Ops,
    Result,
    dflashops_tmp_files,
    engine_pid,
    foreign_process,
    gpu_procs,
    http_json,
    job,
    pid_record,
    sglang,
    ssh_sessions,
    stub,
    unit_dir,
    unit_pid,
)

import dflashops.commands.deploy
from dflashops.lifecycle.options import Options
from tests.procs import (
    alive,
    all_pids,
    boot_id,
    free_ports,
    group_members,
    http_status,
    start_time,
    wait_for,
)
from tests.procs import stat as proc_stat

AUX_SERVER = ["/usr/bin/python3", "-m", "http.server", "--bind", "127.0.0.1", "{port}"]
FOREIGN_PYTHON = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]
IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


# ------------------------------------------------------------------------------ fixtures


def only_statuses(res: Result, host: str, units: list[str], wanted: set[str]) -> None:
    got = {u: {e["status"] for e in res.of(u, host=host)} for u in units}
    assert got == dict.fromkeys(units, wanted), res.explain()


def event_time(res: Result, unit: str, action: str, host: str | None = None) -> float:
    found = res.of(unit, host=host, action=action)
    assert len(found) == 1, (unit, action, found, res.explain())
    return float(found[0]["time"])


def the_event(res: Result, unit: str, status: str, host: str | None = None) -> dict[str, Any]:
    found = res.of(unit, host=host, status=status)
    assert len(found) == 1, (unit, status, res.explain())
    return found[0]


def pids(host: FleetHost, units: list[str]) -> dict[str, tuple[int, int]]:
    """unit -> (supervisor pid, its start time), checked alive."""
    out = {}
    for u in units:
        pid = unit_pid(host, u)
        assert alive(pid), f"{u} on {host.name}: pid {pid} is not alive"
        out[u] = (pid, start_time(pid))
    return out


def still_running(host: FleetHost, before: dict[str, tuple[int, int]]) -> None:
    for u, (pid, started) in before.items():
        assert unit_pid(host, u) == pid, f"{u} on {host.name} has a new pid"
        assert alive(pid) and start_time(pid) == started, f"{u} on {host.name} was restarted"


class GoneWatch:
    """Polls pids from a thread and records when each one disappears (time.time())."""

    def __init__(self, pids: list[int]) -> None:
        self.started = {p: start_time(p) for p in pids}
        self.gone: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, started in self.started.items():
                if pid in self.gone:
                    continue
                if not alive(pid) or start_time_or_none(pid) != started:
                    self.gone[pid] = time.time()
            time.sleep(0.01)

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        now = time.time()  # a last look: what went in the final poll interval
        for pid, started in self.started.items():
            if pid not in self.gone and (not alive(pid) or start_time_or_none(pid) != started):
                self.gone[pid] = now
        return self.gone


def logs_of(host: FleetHost, unit: str) -> list[Path]:
    return sorted((unit_dir(host, unit) / "logs").glob("2*.log"))


def started_like_a_unit(host: FleetHost, unit: str) -> None:
    """Guarantee 5: the supervisor leads its own session, reads /dev/null, and writes to a new
    timestamped log that current.log points at, which starts with the unit's banner."""
    pid = unit_pid(host, unit)
    st = proc_stat(pid)
    assert st is not None and int(st[2]) == pid and int(st[3]) == pid, (unit, st)
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    logs = unit_dir(host, unit) / "logs"
    newest = logs_of(host, unit)[-1]
    assert os.readlink(logs / "current.log") == newest.name
    assert os.readlink(f"/proc/{pid}/fd/1") == str(newest)
    record = pid_record(host, unit)
    assert record is not None and record["log"] == f"logs/{newest.name}"
    banner = f"[dflashops] unit={unit} fingerprint="
    wait_for(f"{unit}'s banner", lambda: newest.read_text().startswith(banner), timeout=10)


def start_time_or_none(pid: int) -> int | None:
    try:
        return start_time(pid)
    except AssertionError:
        return None


# ------------------------------------------------------------------------------ 1. deploy


def test_deploy_from_nothing_redeploy_ok_and_dp_change_restarts_only_that_service(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a", "b")
    ports = {"a": free_ports(3), "b": free_ports(3)}  # sglang-0, sglang-1, aux-0 per host
    ctl = ops(fleet, hosts={h: {"vars": {"base": p}} for h, p in ports.items()})
    hosts = ["a", "b"]
    services = ["sglang-0", "sglang-1", "aux-0"]
    units = [*services, "client"]

    def book(dp: int, restart_with: list[str] | None = None) -> None:
        client = job("client", "sleep 300", needs=["sglang"])
        if restart_with:
            client["restart_with"] = restart_with
        ctl.playbook(
            "serve",
            {
                "hosts": hosts,
                "services": [
                    sglang("{{ base }}", dp=dp),
                    {
                        "name": "aux",
                        "engine": "command",
                        "command": AUX_SERVER,
                        "port": "{{ base + 2 }}",
                        "ready": {**READY, "path": "/"},
                        "stop_grace": "2s",
                    },
                ],
                "jobs": [client],
            },
        )

    # From nothing: every unit started and verified, the job only after both replicas are ready.
    book(dp=1)
    first = ctl.run("deploy")
    assert first.code == 0, first.explain()
    assert not first.of(status="failed"), first.explain()
    for h in hosts:
        for u in services:
            assert first.of(u, host=h, action="start", status="changed"), (h, u, first.explain())
            assert first.of(u, host=h, action="ready", status="changed"), (h, u, first.explain())
        started = event_time(first, "client", "start", h)
        assert started > max(event_time(first, f"sglang-{i}", "ready", h) for i in (0, 1))
        for i in (0, 1):
            info = http_json(ports[h] + i, "/server_info")
            assert (info["tp_size"], info["dp_size"], info["port"]) == (1, 1, ports[h] + i)
        for u in units:
            started_like_a_unit(fleet[h], u)
    before = {h: pids(fleet[h], units) for h in hosts}

    # Nothing changed: every unit ok, nothing restarted, one remote command per host (the facts
    # answer carries the probe of every unit).
    sessions = {h: ssh_sessions(fleet[h]) for h in hosts}
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    for h in hosts:
        only_statuses(again, h, units, {"ok"})
        still_running(fleet[h], before[h])
        assert ssh_sessions(fleet[h]) - sessions[h] == 1, (
            f"{h}: a no-op deploy should run 1 remote command (facts with the probe)"
        )

    # --check with dp changed: the plan names the replicas, and nothing changes.
    book(dp=2)
    plan = ctl.run("deploy", "--check")
    assert plan.code == 0, plan.explain()
    for h in hosts:
        for i in (0, 1):
            (e,) = plan.of(f"sglang-{i}", host=h, action="plan")
            assert e["status"] == "changed" and "would restart" in e["message"], e
        for u in ("aux-0", "client"):
            assert plan.of(u, host=h, action="plan", status="ok"), (h, u, plan.explain())
        still_running(fleet[h], before[h])

    # dp changed: only the sglang replicas restart; aux and the job keep their processes.
    changed = ctl.run("deploy")
    assert changed.code == 0, changed.explain()
    for h in hosts:
        for i in (0, 1):
            u = f"sglang-{i}"
            (e,) = changed.of(u, host=h, action="restart")
            assert e["status"] == "changed" and "fingerprint" in e["message"], e
            assert changed.of(u, host=h, action="ready", status="changed"), changed.explain()
            assert unit_pid(fleet[h], u) != before[h][u][0]
            assert not alive(before[h][u][0])
            info = http_json(ports[h] + i, "/server_info")
            assert (info["tp_size"], info["dp_size"]) == (1, 2), info
        only_statuses(changed, h, ["aux-0", "client"], {"ok"})
        still_running(fleet[h], {u: before[h][u] for u in ("aux-0", "client")})
        # Each replica now holds two fake GPUs.
        engines = {engine_pid(fleet[h], f"sglang-{i}") for i in (0, 1)}
        held = {p["pid"]: p["gpus"] for p in gpu_procs(fleet[h]) if p["pid"] in engines}
        assert sorted(held.values()) == [[0, 1], [2, 3]], held
        # The relaunch opened a new log and kept the old one (guarantee 8).
        assert len(logs_of(fleet[h], "sglang-0")) == 2
        started_like_a_unit(fleet[h], "sglang-0")
    middle = {h: pids(fleet[h], units) for h in hosts}

    # With restart_with, a restart of sglang restarts the job too (after the replicas are ready).
    book(dp=1, restart_with=["sglang"])
    coupled = ctl.run("deploy")
    assert coupled.code == 0, coupled.explain()
    for h in hosts:
        (e,) = coupled.of("client", host=h, action="restart")
        assert e["status"] == "changed", e
        assert event_time(coupled, "client", "restart", h) > max(
            event_time(coupled, f"sglang-{i}", "ready", h) for i in (0, 1)
        )
        assert unit_pid(fleet[h], "client") != middle[h]["client"][0]
        assert not alive(middle[h]["client"][0])
        only_statuses(coupled, h, ["aux-0"], {"ok"})
        still_running(fleet[h], {"aux-0": middle[h]["aux-0"]})
        for i in (0, 1):
            assert http_json(ports[h] + i, "/server_info")["dp_size"] == 1
    # The restart says why: restart_with (the job's own fingerprint did not change).
    for h in hosts:
        (e,) = coupled.of("client", host=h, action="restart")
        assert "restart_with" in e["message"], e


# ------------------------------------------------------------------------------ 2. restart-servers


def test_restart_servers_rolls_one_replica_at_a_time_and_aborts_on_failure(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("r")
    host = fleet["r"]
    ctl = ops(fleet)
    port = free_ports(3)
    replicas = [f"sglang-{i}" for i in range(3)]
    ctl.playbook(
        "roll",
        {
            "hosts": "r",
            "services": [sglang(port, replicas=3)],
            "jobs": [job("client", "sleep 300", needs=["sglang"])],
        },
    )
    with foreign_process(FOREIGN_PYTHON, env=host.env()) as foreign:
        first = ctl.run("deploy")
        assert first.code == 0, first.explain()
        job_before = pids(host, ["client"])

        # Rolling: replica i+1 goes down only after replica i is ready again.
        old = pids(host, replicas)
        watch = GoneWatch([pid for pid, _ in old.values()])
        roll = ctl.run("restart-servers")
        gone = watch.stop()
        assert roll.code == 0, roll.explain()
        order = [
            (e["unit"], e["action"])
            for e in roll.events
            if e["unit"] in replicas and e["action"] in ("restart", "ready")
        ]
        assert order == [(u, a) for u in replicas for a in ("restart", "ready")], order
        for i, u in enumerate(replicas):
            old_pid = old[u][0]
            assert old_pid in gone, f"{u}: old pid {old_pid} still alive after the roll"
            if i > 0:
                ready_before = event_time(roll, replicas[i - 1], "ready")
                assert gone[old_pid] > ready_before, (
                    f"{u} was stopped {ready_before - gone[old_pid]:.3f}s before "
                    f"{replicas[i - 1]} was ready again"
                )
            assert unit_pid(host, u) != old_pid
        assert not roll.of("client"), "restart-servers restarts services, not jobs"
        still_running(host, job_before)

        # --all-at-once: every replica down before any comes back.
        old = pids(host, replicas)
        watch = GoneWatch([pid for pid, _ in old.values()])
        together = ctl.run("restart-servers", "--all-at-once")
        gone = watch.stop()
        assert together.code == 0, together.explain()
        actions = [e["action"] for e in together.events if e["action"] in ("restart", "ready")]
        assert actions == ["restart"] * 3 + ["ready"] * 3, together.explain()
        for u in replicas:
            assert together.of(u, action="restart", status="changed"), together.explain()
            assert old[u][0] in gone and unit_pid(host, u) != old[u][0]
        still_running(host, job_before)

        # A replica that does not come back aborts the roll: the rest keep their old processes.
        # GPU 1 vanishes from the node (the fake driver lists only GPU 0), so sglang-1, which
        # runs on CUDA_VISIBLE_DEVICES=1, dies at start with "invalid device ordinal".
        old = pids(host, replicas)
        config = host.gpu_dir / "config.json"
        saved = config.read_text()
        config.write_text(json.dumps({**json.loads(saved), "count": 1}))
        try:
            broken = ctl.run("restart-servers")
        finally:
            config.write_text(saved)
        assert broken.code != 0, broken.explain()
        assert broken.of("sglang-0", action="ready", status="changed"), broken.explain()
        failed = the_event(broken, "sglang-1", "failed")
        assert "died while starting" in failed["message"], failed
        assert "invalid device ordinal" in failed["message"], failed
        skipped = the_event(broken, "sglang-2", "skipped")
        assert "sglang-1" in skipped["message"], skipped
        assert broken.of("sglang-2", status="skipped") == broken.of("sglang-2"), broken.explain()
        assert unit_pid(host, "sglang-0") != old["sglang-0"][0]
        still_running(host, {"sglang-2": old["sglang-2"]})
        assert http_status(port + 2, "/health") == 200, "sglang-2 should still serve"
        assert "sglang-1" in broken.out and "failed" in broken.out  # the recap says which

        # A rerun converges.
        fixed = ctl.run("deploy")
        assert fixed.code == 0, fixed.explain()
        # Its supervisor was waiting out a backoff: deploy restarts it now instead.
        assert fixed.of("sglang-1", action="restart", status="changed"), fixed.explain()
        only_statuses(fixed, "r", ["sglang-0", "sglang-2"], {"ok"})
        assert alive(foreign), "a foreign python process on the host was touched"
        stopped = ctl.run("stop")
        assert stopped.code == 0, stopped.explain()
        assert alive(foreign), "stop touched a foreign python process"


# ------------------------------------------------------------------------------ 3. stop


def test_stop_ends_processes_frees_gpus_keeps_logs_and_is_idempotent(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("s")
    host = fleet["s"]
    ctl = ops(fleet)
    port = free_ports(2)
    ctl.playbook(
        "stopme",
        {
            "hosts": "s",
            "services": [
                sglang(port, replicas=2),
                {
                    "name": "stubborn",
                    "engine": "command",
                    "command": ["/usr/bin/python3", "-c", IGNORES_TERM],
                    "stop_grace": "1s",
                },
            ],
            "jobs": [job("client", "echo working; sleep 300", needs=["sglang"])],
        },
    )
    units = ["sglang-0", "sglang-1", "stubborn-0", "client"]
    with foreign_process(FOREIGN_PYTHON, env=host.env()) as foreign:
        up = ctl.run("deploy")
        assert up.code == 0, up.explain()
        group = {u: group_members(unit_pid(host, u)) for u in units}
        everything = sorted(p for members in group.values() for p in members)
        engines = [engine_pid(host, f"sglang-{i}") for i in (0, 1)]
        on_gpu = {p["pid"]: p["gpus"] for p in gpu_procs(host)}
        assert sorted(on_gpu) == sorted(engines) and sorted(on_gpu.values()) == [[0], [1]]

        down = ctl.run("stop")
        assert down.code == 0, down.explain()
        for u in units:
            (e,) = down.of(u, action="stop")
            assert e["status"] == "changed", e
        assert "SIGKILL" in the_event(down, "stubborn-0", "changed")["message"]
        assert down.seconds >= 1.0, "KILL came before the 1 s grace period was over"
        for u in ("sglang-0", "sglang-1", "client"):
            assert "SIGKILL" not in the_event(down, u, "changed")["message"]
        assert [p for p in everything if alive(p)] == []
        assert alive(foreign), "stop touched a foreign python process"

        # The fake GPUs are free, as nvidia-smi on the host reports them.
        code, out, err = host.run(
            "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits; "
            "nvidia-smi --query-compute-apps=pid --format=csv,noheader"
        )
        assert code == 0, err
        used = {int(i): int(m) for i, m in (x.split(", ") for x in out.splitlines() if "," in x)}
        assert used == dict.fromkeys(range(8), 0), out
        assert [x for x in out.splitlines() if "," not in x and x.strip()] == [], out  # no apps

        # Logs are kept: every unit's log with its banner and its output.
        for u in units:
            logs = sorted((unit_dir(host, u) / "logs").glob("2*.log"))
            assert logs, f"{u}: no logs left after stop"
            text = logs[-1].read_text()
            assert f"[dflashops] unit={u} " in text, text
        assert (
            "working" in sorted((unit_dir(host, "client") / "logs").glob("2*.log"))[-1].read_text()
        )
        assert pid_record(host, "sglang-0") is None

        # Stopping again changes nothing.
        again = ctl.run("stop")
        assert again.code == 0, again.explain()
        only_statuses(again, "s", units, {"ok"})
        assert alive(foreign)


# ------------------------------------------------------------------------------ 4. faults


def test_engine_that_dies_while_starting_fails_at_once_and_one_never_ready_times_out(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("f")
    host = fleet["f"]
    ctl = ops(fleet)
    port = free_ports(2)
    ctl.playbook(
        "faulty",
        {
            "hosts": "f",
            "services": [
                # Dies 2 s after start, long before its 30 s readiness timeout.
                stub(
                    "crash",
                    port,
                    {"DFLASHOPS_STUB_EXIT_AFTER": "2", "DFLASHOPS_STUB_STARTUP_SECONDS": "60"},
                ),
                # Never becomes ready.
                stub(
                    "slow",
                    port + 1,
                    {"DFLASHOPS_STUB_STARTUP_SECONDS": "3600"},
                    ready={"timeout": "3s", "interval": "0.2s"},
                ),
            ],
            "jobs": [job("after", "sleep 300", needs=["crash"])],
        },
    )
    res = ctl.run("deploy")
    assert res.code != 0, res.explain()

    died = the_event(res, "crash-0", "failed")
    assert died["action"] == "ready", died
    assert "died while starting" in died["message"] and "exit code 1" in died["message"], died
    assert "simulated crash after 2 s" in died["message"], died  # the end of its log
    assert "[dflashops] unit=crash-0" in died["message"], died
    waited = died["time"] - event_time(res, "crash-0", "start")
    assert waited < 10, f"the death was reported {waited:.1f}s after start, not at once"

    late = the_event(res, "slow-0", "failed")
    assert late["action"] == "ready", late
    assert "not ready after 3s" in late["message"], late
    assert "last probe: HTTP 503" in late["message"], late
    assert alive(unit_pid(host, "slow-0")), "a unit that timed out is left running for inspection"

    blocked = the_event(res, "after", "failed")
    assert "crash-0" in blocked["message"], blocked
    assert pid_record(host, "after") is None, "a job whose needs failed must not start"
    assert "crash-0" in res.out and "slow-0" in res.out  # the recap names both


def test_drift_running_server_reports_dp2_where_playbook_says_dp1(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("d")
    ctl = ops(fleet)
    port = free_ports(1)
    # A user template override whose exec line starts the engine with TP=2 DP=2 whatever the
    # playbook says (the INCIDENTS.md #2 server that kept running with the old settings).
    (ctl.base / "templates").mkdir()
    (ctl.base / "templates" / "stub.sh.j2").write_text(
        '{% extends "_unit.sh.j2" %}\n'
        "{% block exec %}\n"
        "exec {{ argv|qargv }} --tp-size 2 --dp-size 2\n"
        "{% endblock %}\n"
    )
    ctl.playbook(
        "drift",
        {"hosts": "d", "services": [stub("model", port, tp=2, dp=1)]},
    )
    res = ctl.run("deploy")
    assert res.code != 0, res.explain()
    drifted = the_event(res, "model-0", "failed")
    assert drifted["action"] == "verify" and "drifted" in drifted["message"], drifted
    lines = drifted["message"].splitlines()
    assert any("dp_size" in line and "1 -> 2" in line for line in lines), drifted["message"]
    assert not any(line.split()[:1] == ["tp_size"] for line in lines), drifted["message"]
    assert "expected" in drifted["message"] and "running" in drifted["message"]
    info = http_json(port, "/server_info")
    assert (info["tp_size"], info["dp_size"]) == (2, 2)

    st = ctl.run("status")
    assert st.document is not None, st.explain()
    rows = st.document["units"]
    assert [r["state"] for r in rows if r["unit"] == "model-0"] == ["drifted"], st.explain()
    assert st.code != 0


def test_stale_pid_record_is_never_signalled_and_the_unit_starts(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("p")
    host = fleet["p"]
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("stale", {"hosts": "p", "services": [sglang(port, replicas=1)]})
    assert ctl.run("deploy").code == 0
    assert ctl.run("stop").code == 0
    assert pid_record(host, "sglang-0") is None

    # The pid in the record now belongs to another process (a session leader, like the unit's
    # supervisor was); only its start time tells them apart.
    with foreign_process(["sleep", "300"]) as stranger:
        record = {
            "pid": stranger,
            "pgid": stranger,
            "start_time": start_time(stranger) - 7,
            "boot_id": boot_id(),
            "started_at": "2026-01-01T00:00:00Z",
            "log": "logs/20260101T000000Z.log",
            "run_id": "0123456789abcdef",
        }
        (unit_dir(host, "sglang-0") / "pid").write_text(json.dumps(record))

        stopped = ctl.run("stop")
        assert stopped.code == 0, stopped.explain()
        assert alive(stranger), "stop signalled a process it did not start (stale pid record)"

        up = ctl.run("deploy")
        assert up.code == 0, up.explain()
        assert up.of("sglang-0", action="start", status="changed"), up.explain()
        assert up.of("sglang-0", action="ready", status="changed"), up.explain()
        assert alive(stranger), "deploy signalled a process it did not start (stale pid record)"
        new = unit_pid(host, "sglang-0")
        assert new != stranger and alive(new)
        assert http_status(port, "/health") == 200

        again = ctl.run("stop")
        assert again.code == 0, again.explain()
        assert not alive(new)
        assert alive(stranger)


def test_gpu_memory_held_after_stop_fails_stop_and_blocks_start_unless_forced(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait for GPU memory is 60 s in dflashops and has no option; a short one keeps this
    # test quick (the behaviour under test is the same).
    monkeypatch.setattr(
        dflashops.commands.deploy, "Options", functools.partial(Options, gpu_timeout=2.0)
    )
    fleet = fleet_factory("g")
    host = fleet["g"]
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("gpu", {"hosts": "g", "services": [sglang(port, replicas=1)]})
    assert ctl.run("deploy").code == 0
    engine = engine_pid(host, "sglang-0")
    assert [p["gpus"] for p in gpu_procs(host) if p["pid"] == engine] == [[0]]
    # A wedged driver context: the engine's memory stays listed after the process is gone.
    leak = host.gpu_dir / "held" / "leak.json"
    leak.write_text(json.dumps({"pid": engine, "gpus": [0], "used_mib": 4321, "name": "python3"}))
    try:
        down = ctl.run("stop")
        assert down.code != 0, down.explain()
        failed = the_event(down, "sglang-0", "failed")
        assert "GPU 0" in failed["message"], failed
        assert "4321 MiB" in failed["message"] and f"pid {engine}" in failed["message"], failed
        assert not alive(engine)

        blocked = ctl.run("deploy")
        assert blocked.code != 0, blocked.explain()
        refused = the_event(blocked, "sglang-0", "failed")
        assert refused["action"] == "start", refused
        assert "GPU 0" in refused["message"] and f"pid {engine}" in refused["message"], refused
        assert "--force" in refused["message"], refused
        assert not blocked.of("sglang-0", status="changed"), blocked.explain()
        assert pid_record(host, "sglang-0") is None

        forced = ctl.run("deploy", "--force")
        assert forced.code == 0, forced.explain()
        assert forced.of("sglang-0", action="ready", status="changed"), forced.explain()
    finally:
        leak.unlink()


def test_port_held_by_a_foreign_listener_fails_before_starting(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("l")
    host = fleet["l"]
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("taken", {"hosts": "l", "services": [sglang(port, replicas=1)]})
    listener = [
        "/usr/bin/python3",
        "-c",
        "import socket, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(300)",
    ]
    with foreign_process(listener) as holder:
        wait_for("the foreign listener", lambda: port_listening(port))
        res = ctl.run("deploy")
        assert res.code != 0, res.explain()
        failed = the_event(res, "sglang-0", "failed")
        assert failed["action"] == "start", failed
        assert f"port {port}" in failed["message"] and f"pid {holder}" in failed["message"]
        assert not res.of("sglang-0", status="changed"), "nothing may start on a taken port"
        assert pid_record(host, "sglang-0") is None
        assert alive(holder)


def port_listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_connection_lost_during_rolling_restart_fails_the_host_and_a_rerun_converges(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("c")
    host = fleet["c"]
    ctl = ops(fleet)
    port = free_ports(3)
    replicas = [f"sglang-{i}" for i in range(3)]
    ctl.playbook("lost", {"hosts": "c", "services": [sglang(port, replicas=3)]})
    assert ctl.run("deploy").code == 0
    old = pids(host, replicas)

    # Once the roll has restarted its first replica, every SSH session to the host is cut, and
    # any new one is cut too, for 3 s (a flapping link).
    events = ctl.events_path("restart-servers")
    cuts: list[int] = []

    def cut() -> None:
        def rolling() -> bool:
            if not events.exists():
                return False
            return any(
                json.loads(line)["action"] in ("stop", "restart")
                for line in events.read_text().splitlines()
                if line.strip()
            )

        wait_for("the first restart event", rolling, timeout=30, every=0.01)
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            cuts.append(host.kill_sessions())
            time.sleep(0.02)

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    roll = ctl.run("restart-servers")
    cutter.join(timeout=40)
    assert sum(cuts) > 0, "no SSH session was cut"
    assert roll.code != 0, roll.explain()
    lost = [e for e in roll.of(host="c") if e["status"] in ("failed", "unreachable")]
    assert lost, roll.explain()
    # The replicas after the first were never touched.
    still_running(host, {u: old[u] for u in replicas[1:]})

    fixed = ctl.run("deploy")
    assert fixed.code == 0, fixed.explain()
    assert not fixed.of(status="failed"), fixed.explain()
    for i, u in enumerate(replicas):
        assert fixed.of(u, action="ready"), (u, fixed.explain())
        assert alive(unit_pid(host, u))
        assert http_status(port + i, "/health") == 200
    again = ctl.run("deploy")
    only_statuses(again, "c", replicas, {"ok"})


def test_ctrl_c_during_deploy_leaves_no_half_written_file(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    fleet = fleet_factory("i")
    host = fleet["i"]
    ctl = ops(fleet)
    port = free_ports(1)
    # A large job script, so that Ctrl-C lands while it is being shipped.
    big = ctl.base / "playbooks" / "big.sh"
    with big.open("w") as f:
        f.write("#!/bin/bash\nsleep 300\nexit 0\n")
        line = "# " + "x" * 1021 + "\n"
        for _ in range(48 * 1024):
            f.write(line)
    ctl.playbook(
        "interrupt",
        {
            "hosts": "i",
            "services": [sglang(port, replicas=1)],
            "jobs": [{"name": "bulk", "script": "big.sh", "stop_grace": "2s"}],
        },
    )
    rendered = ctl.base / "rendered"
    assert ctl.run("render", "--out", str(rendered), json_events=False).code == 0
    argv = [sys.executable, "-m", "dflashops.cli", *ctl.argv("deploy", None)]
    argv += ["--json", str(ctl.base / "interrupted.jsonl")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for(
            "a file being shipped",
            lambda: dflashops_tmp_files(host.workdir) or proc.poll() is not None,
            timeout=60,
            every=0.005,
        )
        shipping = dflashops_tmp_files(host.workdir)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - interrupted
    text = out.decode(errors="replace")
    print(f"SIGINT while shipping {[p.name for p in shipping]}; exit after {took:.1f}s\n{text}")
    assert shipping, f"the deploy ended before anything was shipped:\n{text}"
    assert proc.returncode == 130 and "interrupted" in text, text

    assert dflashops_tmp_files(host.workdir) == []
    for path in (host.workdir / "payloads").rglob("*"):
        if path.is_file():  # content-addressed: payloads/<sha256[:16]>/<name>
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert digest.startswith(path.parent.name), f"{path} is incomplete"
    for launch in (host.workdir / "units").glob("*/launch.sh"):
        want = (rendered / "i" / f"{launch.parent.name}.sh").read_text()
        assert launch.read_text() == want, f"{launch} is not the rendered script"

    # And a deploy after the interruption converges.
    after = ctl.run("deploy")
    assert after.code == 0, after.explain()


# ------------------------------------------------------------------------------ 5. status, logs


def test_status_shows_every_state_and_job_progress_and_logs_prints_the_end(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("t")
    host = fleet["t"]
    ctl = ops(fleet)
    port = free_ports(3)
    progress = (
        'for i in $(seq 1 50); do echo "line $i"; done; '
        'echo \'{"done": 5, "total": 10}\' > "$DFLASHOPS_PROGRESS_FILE"; sleep 300'
    )
    ctl.playbook(
        "states",
        {
            "hosts": "t",
            "services": [
                sglang(port, replicas=1),
                stub(
                    "slow",
                    port + 1,
                    {"DFLASHOPS_STUB_STARTUP_SECONDS": "3600"},
                    ready={"timeout": "1s", "interval": "0.2s"},
                ),
                stub(
                    "crashy",
                    port + 2,
                    {"DFLASHOPS_STUB_EXIT_AFTER": "3", "DFLASHOPS_STUB_STARTUP_SECONDS": "0.2"},
                    restart="no",  # dead stays dead (a restarted one: test_supervision.py)
                ),
                {
                    "name": "idle",
                    "engine": "command",
                    "command": ["sleep", "300"],
                    "stop_grace": "2s",
                },
            ],
            "jobs": [
                job("progress", progress),
                job("finish", "echo finished"),
                job("broken", "echo broken >&2; exit 3"),
            ],
        },
    )
    up = ctl.run("deploy")
    assert up.code != 0 and the_event(up, "slow-0", "failed"), up.explain()
    assert up.of("crashy-0", action="ready", status="changed"), up.explain()
    for u in ("crashy-0", "finish", "broken"):
        wait_for(f"{u} to end", lambda u=u: (unit_dir(host, u) / "exit").exists(), timeout=20)
    wait_for("progress", lambda: (unit_dir(host, "progress") / "progress.json").exists())
    assert ctl.run("stop", "--unit", "idle-0").code == 0

    st = ctl.run("status")
    rows = st.rows()
    states = {u: r["state"] for u, r in rows.items()}
    expected = {
        "sglang-0": "ready",
        "slow-0": "starting",
        "crashy-0": "dead",
        "idle-0": "stopped",
        "progress": "running",
        "finish": "done",
        "broken": "failed",
    }
    assert {u: s for u, s in states.items() if u != "idle-0"} == {
        u: s for u, s in expected.items() if u != "idle-0"
    }, st.explain()
    assert st.code != 0, "dead and failed units make status exit non-zero"
    job_progress = rows["progress"]["progress"]  # the job wrote {"done": 5, "total": 10}
    assert job_progress is not None, rows["progress"]
    assert (job_progress["done"], job_progress["total"]) == (5, 10), rows["progress"]
    assert rows["sglang-0"]["pid"] == unit_pid(host, "sglang-0")
    assert rows["sglang-0"]["port"] == port and "200" in rows["sglang-0"]["health"]
    assert rows["crashy-0"]["health"].startswith("exit 1"), rows["crashy-0"]
    assert rows["broken"]["health"].startswith("exit 3"), rows["broken"]
    table = [line.split() for line in st.out.splitlines()]
    shown = {cells[1]: cells[2] for cells in table if len(cells) > 2 and cells[1] in states}
    assert shown == states, st.out  # the table says the same

    logs = ctl.run("logs", "progress", "--lines", "3", json_events=False)
    assert logs.code == 0, logs.explain()
    body = [line for line in logs.out.splitlines() if not line.startswith("==>")]
    assert body == ["line 48", "line 49", "line 50"], logs.out
    broken = ctl.run("logs", "broken", "--lines", "5", json_events=False)
    assert broken.code == 0 and "broken" in broken.out, broken.explain()

    # A service stopped with `dflashops stop` is "stopped", not "dead".
    assert states["idle-0"] == "stopped", st.explain()


def agents_on(host: FleetHost) -> list[int]:
    """Agent processes running under ``host``'s sshd (any session, any action)."""
    found = []
    for pid in all_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"<dflashops-agent>" not in cmd:
            continue
        parent = pid
        while parent > 1:
            info = proc_stat(parent)
            if info is None:
                break
            parent = int(info[1])
            if parent == host.pid:
                found.append(pid)
                break
    return found


def test_ctrl_c_during_the_wait_on_the_hosts_ends_it_on_every_host_at_once(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """Readiness is waited for on each host (one agent call); Ctrl-C on the controller must end
    every such wait right away, not leave them polling until their timeout."""
    fleet = fleet_factory("w1", "w2")
    ctl = ops(fleet, hosts={h: {"vars": {"base": free_ports(1)}} for h in ("w1", "w2")})
    slow = {"DFLASHOPS_STUB_STARTUP_SECONDS": "120"}
    ctl.playbook(
        "slow",
        {
            "hosts": ["w1", "w2"],
            "services": [
                stub("slow", "{{ base }}", env=slow, ready={"timeout": "10m", "interval": "5s"})
            ],
        },
    )
    argv = [sys.executable, "-m", "dflashops.cli", *ctl.argv("deploy", None)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        for name in ("w1", "w2"):
            wait_for(
                f"the unit started and waited for on {name}",
                lambda h=fleet[name]: (
                    proc.poll() is not None
                    or (pid_record(h, "slow-0") is not None and bool(agents_on(h)))
                ),
                timeout=60,
            )
        time.sleep(0.5)  # the start's answer is in: each host's agent is now in its wait
        assert proc.poll() is None, "deploy ended before the units were ready"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 130 and "interrupted" in text, text
    for name in ("w1", "w2"):
        # The host-side wait saw its stdin end and stopped: no agent is left on either host.
        # At once: nothing is left polling on a host after the controller has gone.
        wait_for(f"no agent left on {name}", lambda h=fleet[name]: not agents_on(h), timeout=1.0)
        assert alive(unit_pid(fleet[name], "slow-0")), "the unit itself is left running"
