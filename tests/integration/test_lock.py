"""One actor per host (issue 19, DESIGN "Trust boundary" 3): the deploy lock against the sshd
fleet, with real controllers (`.venv/bin/dflashops` subprocesses) colliding on one host.

The unit every test deploys is gated: its server starts only once the test creates a file, so
a controller is held in its readiness wait (holding the lock) for exactly as long as a test
needs, with no timing involved. A holder is recognised on the host itself: the holder record
names the controller's pid, and /proc shows which processes have the lock file open.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, foreign_process, pid_record, unit_dir, unit_processes

from dflashops.agent import Agent, AgentError, lock
from dflashops.cli import main
from dflashops.config.load import load_inventory
from dflashops.hosts import connect
from tests.procs import alive, all_pids, free_ports, start_time, wait_for

DFLASHOPS = Path(sys.executable).with_name("dflashops")  # the venv's console script
UNIT = "gated-0"


# ------------------------------------------------------------------------------ helpers


def gated(port: int, gate: Path, who: str = "a") -> dict[str, Any]:
    """A server that listens only once `gate` exists: its deploy waits until the test says."""
    script = (
        f"while [ ! -e {gate} ]; do sleep 0.1; done; "
        f"exec /usr/bin/python3 -m http.server {port} --bind 127.0.0.1"
    )
    return {
        "name": "gated",
        "engine": "command",
        "command": ["bash", "-c", script],
        "port": port,
        "env": {"WHO": who},
        "ready": {"timeout": "5m", "interval": "0.2s", "path": "/"},
        "stop_grace": "2s",
    }


def setup(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> tuple[Ops, FleetHost, Path]:
    fleet = fleet_factory("l1")
    ctl = ops(fleet, hosts={"l1": {}})
    gate = tmp_path / "gate"
    ctl.playbook("serve", {"hosts": ["l1"], "services": [gated(free_ports(1), gate)]})
    return ctl, fleet["l1"], gate


@contextlib.contextmanager
def controller(ctl: Ops, command: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """`dflashops COMMAND` as a process of its own; killed (by pid) if the test leaves it."""
    argv = [str(DFLASHOPS), *ctl.argv(command, None, *extra)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:  # not finished by the test
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
            proc.communicate()


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out.decode(errors="replace")


def holder(host: FleetHost) -> dict[str, Any] | None:
    try:
        return dict(json.loads((host.workdir / "deploy.holder.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def lock_holders(host: FleetHost) -> list[int]:
    """Processes with the host's lock file open (the lock is held while one is)."""
    target = (host.workdir / "deploy.lock").resolve()
    found = []
    for pid in all_pids():
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if Path(os.readlink(fd.path)) == target:
                        found.append(pid)
                        break
    return found


def held_by(host: FleetHost, proc: subprocess.Popen[bytes]) -> bool:
    """The lock is held, and its record names this controller (its agent holds it)."""
    rec = holder(host)
    if proc.poll() is not None:
        raise AssertionError(f"the controller ended early:\n{finish(proc)[1]}")
    return (
        rec is not None
        and rec.get("controller_pid") == proc.pid
        and rec.get("agent_pid") in lock_holders(host)
    )


def unlock(ctl: Ops, *extra: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(["unlock", "-i", str(ctl.inventory), "--host", "l1", *extra])
    print(buf.getvalue())
    return code, buf.getvalue()


def refused(text: str, pid: int, command: str = "deploy") -> bool:
    """The refusal names the holder: who, the command, since when, the controller's pid."""
    return (
        "host l1 is locked by " in text
        and "unreachable: [l1]" not in text  # the host answered: a refusal, counted as failed
        and f"(dflashops {command}, since 20" in text
        and f", pid {pid})" in text
        and "--lock-wait" in text
        and "dflashops unlock --host l1" in text
    )


# ------------------------------------------------------------------------------ tests


def test_a_second_controller_is_refused_at_once_naming_the_holder(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """Two controllers deploy one host: the second is refused before it changes anything,
    the first finishes, and the host runs exactly the first one's unit. stop and
    restart-servers are refused too; status and logs work all along (they never lock)."""
    ctl, host, gate = setup(fleet_factory, ops, tmp_path)
    other = ops(ctl.fleet, hosts={"l1": {}})
    other.playbook("serve", {"hosts": ["l1"], "services": [gated(free_ports(1), gate, "b")]})
    with controller(ctl, "deploy") as first:
        started = wait_for(
            "the first deploy to hold the lock and start its unit",
            lambda: held_by(host, first) and pid_record(host, UNIT),
            timeout=60,
        )
        second = other.run("deploy")
        assert second.code == 2 and refused(second.out, first.pid), second.explain()
        assert not second.of(action="start") and not second.of(action="ship"), second.explain()
        for command in ("stop", "restart-servers"):
            res = other.run(command)
            assert res.code == 2 and refused(res.out, first.pid), res.explain()
        assert pid_record(host, UNIT) == started, "a refused controller changed the unit"
        status = ctl.run("status")
        assert status.code == 0 and UNIT in status.out, status.explain()
        logs = ctl.run("logs", UNIT)
        assert logs.code == 0, logs.explain()
        assert held_by(host, first), "a read-only command took or broke the lock"
        gate.touch()
        code, out = finish(first)
    assert code == 0, out
    # Consistent: what runs is the first controller's rendering, and it says so.
    again = ctl.run("deploy")
    assert again.code == 0 and not again.of(status="changed"), again.explain()
    assert again.of(UNIT, action="ready", status="ok"), again.explain()
    # The lock rides with the facts request: a deploy with nothing to do stays one round trip.
    assert [e["data"]["round_trips"] for e in again.of(action="stats")] == [1], again.events
    # Released with the session (its agent exits as its stdin ends): no unit process
    # (supervisor, server) inherited the lock file.
    units = unit_processes(host)
    assert units, "the unit should be running"
    assert not set(units) & set(lock_holders(host)), "a unit process holds the lock file"
    wait_for("the lock to be released", lambda: not lock_holders(host), timeout=30)


def test_lock_wait_waits_for_the_holder_then_proceeds(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    ctl, host, gate = setup(fleet_factory, ops, tmp_path)
    with controller(ctl, "deploy") as first:
        wait_for("the first deploy to hold the lock", lambda: held_by(host, first), timeout=60)
        events = ctl.events_path("deploy")
        with controller(ctl, "deploy", "--lock-wait", "2m", "--json", str(events)) as second:

            def told() -> bool:
                text = events.read_text() if events.exists() else ""
                return '"action": "lock"' in text and "waiting up to 2m" in text

            wait_for("the second deploy to say it waits for the lock", told, timeout=60)
            assert second.poll() is None and held_by(host, first)
            gate.touch()
            code, out = finish(first)
            assert code == 0, out
            code, out = finish(second)
    assert code == 0, out
    waited = [json.loads(line) for line in events.read_text().splitlines()]
    note = next(e for e in waited if e["action"] == "lock")
    assert f"pid {first.pid})" in note["message"] and note["host"] == "l1", note
    assert any(e["unit"] == UNIT and e["action"] == "ready" for e in waited), out


def test_unlock_releases_the_lock_of_a_stopped_controller(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """A controller stopped (SIGSTOP) while it holds the lock: its session lives on, so the
    lock stays held until `unlock` ends its agent on the host; then a deploy works."""
    ctl, host, gate = setup(fleet_factory, ops, tmp_path)
    with controller(ctl, "deploy") as stuck:
        wait_for("the deploy to hold the lock", lambda: held_by(host, stuck), timeout=60)
        agent_pid = holder(host)["agent_pid"]  # type: ignore[index]
        os.kill(stuck.pid, signal.SIGSTOP)
        try:
            blocked = ctl.run("deploy")
            assert blocked.code == 2 and refused(blocked.out, stuck.pid), blocked.explain()
            # No terminal to confirm on and no --yes: shown, not released.
            code, out = unlock(ctl)
            assert code == 1 and "pass --yes" in out and f"pid {agent_pid}" in out, out
            assert "dflashops deploy" in out and alive(agent_pid), out
            code, out = unlock(ctl, "--yes")
            assert code == 0, out
            assert f"pid {stuck.pid})" in out and "released" in out, out
            assert not alive(agent_pid) and lock_holders(host) == [], out
            code, out = unlock(ctl)
            assert code == 0 and "[l1] deploy lock is free" in out, out  # named, not markup
            gate.touch()
            after = ctl.run("deploy")
            assert after.code == 0 and after.of(UNIT, action="ready"), after.explain()
        finally:
            os.kill(stuck.pid, signal.SIGKILL)
            os.kill(stuck.pid, signal.SIGCONT)


def test_a_controller_killed_mid_deploy_leaves_no_lock_behind(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """kill -9 during the readiness wait: the host's kernel drops the lock with the session
    (no unlock, no --lock-wait), and the next deploy carries on from where it stopped."""
    ctl, host, gate = setup(fleet_factory, ops, tmp_path)
    with controller(ctl, "deploy") as killed:
        wait_for(
            "the deploy to wait for its started unit",
            lambda: held_by(host, killed) and pid_record(host, UNIT) is not None,
            timeout=60,
        )
        agent_pid = holder(host)["agent_pid"]  # type: ignore[index]
        os.kill(killed.pid, signal.SIGKILL)
        finish(killed)
    wait_for("the killed controller's agent to end", lambda: not alive(agent_pid), timeout=30)
    assert lock_holders(host) == []
    gate.touch()
    after = ctl.run("deploy")
    assert after.code == 0 and after.of(UNIT, action="ready"), after.explain()
    assert holder(host)["controller_pid"] == os.getpid()  # type: ignore[index]


def test_unlock_never_signals_a_process_that_is_not_the_recorded_agent(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """A record naming some other process that holds the lock file (forged, or a pid reused):
    unlock refuses and signals nothing; deploy is refused meanwhile."""
    ctl, host, _gate = setup(fleet_factory, ops, tmp_path)
    lock_file = host.workdir / "deploy.lock"
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); time.sleep(300)"
    )
    with foreign_process(["/usr/bin/python3", "-c", hold, str(lock_file)]) as pid:
        wait_for("the stranger to hold the lock", lambda: pid in lock_holders(host))
        record = {
            "who": "mallory@elsewhere",
            "command": "dflashops deploy",
            "controller_pid": 1,
            "since": "2026-01-01T00:00:00Z",
            "agent_pid": pid,
            "agent_start_time": start_time(pid),
        }
        (host.workdir / "deploy.holder.json").write_text(json.dumps(record))
        blocked = ctl.run("deploy")
        assert blocked.code == 2 and "locked by mallory@elsewhere" in blocked.out, blocked.explain()
        code, out = unlock(ctl, "--yes")
        assert code == 1 and "not a dflashops agent" in out, out
        assert alive(pid) and pid in lock_holders(host)


def test_a_start_refuses_a_launch_script_changed_on_disk(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """The start request carries the sha256 of the launch.sh the run shipped; another
    actor's script in its place is not started."""
    ctl, host, gate = setup(fleet_factory, ops, tmp_path)
    gate.touch()
    assert ctl.run("deploy").code == 0
    assert ctl.run("stop").code == 0
    script = unit_dir(host, UNIT) / "launch.sh"
    shipped = hashlib.sha256(script.read_bytes()).hexdigest()
    script.write_text(script.read_text() + "# changed by another actor\n")
    inv = load_inventory(ctl.inventory)
    conn = connect(inv.hosts["l1"])
    try:
        agent = Agent(conn, inv.hosts["l1"].python)
        got = agent.start(inv.hosts["l1"].workdir, [(UNIT, 20)], {UNIT: shipped})[UNIT]
    finally:
        conn.close()
    assert not got.ok and got.pid is None, got
    assert f"launch script of {UNIT} on disk is not the one this deploy shipped" in (
        got.error or ""
    )
    assert "another actor changed it" in (got.error or "")
    assert not unit_processes(host), "the changed script was started"


def test_a_session_that_ends_mid_run_takes_the_lock_again_or_stops(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """A run's agent session can end mid-run (a readiness wait cut short ends it): the next
    session takes the lock again before anything else, and when another actor got it in
    between, the run stops on that host naming them instead of acting beside them."""
    ctl, host, _gate = setup(fleet_factory, ops, tmp_path)
    inv = load_inventory(ctl.inventory)
    spec = inv.hosts["l1"]
    me = {"who": "test@here", "command": "dflashops deploy", "controller_pid": os.getpid()}
    conns = [connect(spec), connect(spec)]
    try:
        run = Agent(conns[0], spec.python, keep=True)
        assert lock.acquire(run, spec.workdir, me).ok
        first = holder(host)["agent_pid"]  # type: ignore[index]
        run.close()  # what a cut-short wait does to the session
        assert lock.state(run, spec.workdir).holder_alive  # a new session, holding it again
        second = holder(host)["agent_pid"]  # type: ignore[index]
        assert second != first and second in lock_holders(host) and not alive(first)
        run.close()
        wait_for("the session's agent to end", lambda: not alive(second), timeout=30)
        other = Agent(conns[1], spec.python, keep=True)
        theirs = dict(me, who="bob@elsewhere")
        assert lock.acquire(other, spec.workdir, theirs).ok
        try:
            lock.state(run, spec.workdir)
        except AgentError as exc:
            assert "lost the deploy lock" in str(exc) and "bob@elsewhere" in str(exc), exc
        else:
            raise AssertionError("a run whose lock another actor took went on")
        other.close()
    finally:
        for conn in conns:
            conn.close()
