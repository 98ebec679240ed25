"""History and rollback against the sshd fleet (issue 23, DESIGN fleet-page 4): every deploy
that changed units is a revision on the host; `history` lists them; `rollback` restarts a unit
on a kept revision's script, verified, under the deploy lock; `status` says `rolled back`; the
next deploy says what it re-applies. Checked on the host's own files (WORKDIR/history/)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, Result, stub, unit_dir, unit_pid

from dflashops.agent import Agent, lock
from dflashops.config.load import load_inventory
from dflashops.hosts import connect
from tests.procs import alive, free_ports

UNIT = "web-0"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def revisions(res: Result) -> list[dict[str, Any]]:
    """`history --json FILE`: one document (the Result reads it as one event)."""
    assert res.code == 0 and len(res.events) == 1, res.explain()
    (host,) = res.events[0]["hosts"]
    return list(host["revisions"])


def recorded(res: Result) -> int:
    (event,) = res.of(action="history", status="info")
    return int(event["data"]["revision"])


def deploy_two_versions(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> tuple[Ops, FleetHost, dict[int, str]]:
    """v1 then v2 of a stub service; the launch.sh sha256 each one shipped."""
    fleet = fleet_factory("h1")
    ctl = ops(fleet, hosts={"h1": {}})
    port = free_ports(1)
    shas = {}
    for version in (1, 2):
        ctl.playbook(
            "web", {"hosts": ["h1"], "services": [stub("web", port, env={"V": str(version)})]}
        )
        res = ctl.run("deploy")
        assert res.code == 0, res.explain()
        assert recorded(res) == version, res.explain()
        shas[version] = sha(unit_dir(fleet["h1"], UNIT) / "launch.sh")
    assert shas[1] != shas[2]
    return ctl, fleet["h1"], shas


def test_history_rollback_status_and_the_deploy_that_reapplies(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    ctl, host, shas = deploy_two_versions(fleet_factory, ops)
    # A deploy with nothing to do changes nothing and records nothing.
    same = ctl.run("deploy")
    assert same.code == 0 and not same.of(action="history"), same.explain()

    listed = ctl.run("history")
    revs = revisions(listed)
    assert [r["revision"] for r in revs] == [2, 1], revs
    assert all(set(r["units"]) == {UNIT} and r["scripts"] for r in revs), revs
    assert revs[0]["command"].split()[1] == "deploy" and "@" in revs[0]["who"], revs[0]
    assert revs[0]["kept"][UNIT]["script_sha256"] == shas[2]
    assert revs[1]["kept"][UNIT]["script_sha256"] == shas[1]
    table = ctl.run("history", json_events=False)
    assert table.code == 0 and "deploy" in table.out and UNIT in table.out, table.explain()

    before = unit_pid(host, UNIT)
    back = ctl.run("rollback", "--host", "h1")
    assert back.code == 0, back.explain()
    assert back.of(UNIT, action="restart", status="changed"), back.explain()
    assert back.of(UNIT, action="ready", status="changed"), back.explain()
    assert recorded(back) == 3
    assert sha(unit_dir(host, UNIT) / "launch.sh") == shas[1]  # v1's script runs again
    assert not alive(before) and alive(unit_pid(host, UNIT))
    newest = revisions(ctl.run("history", "--unit", "web"))[0]
    assert newest["revision"] == 3 and newest["rollback_to"] == 1, newest
    assert newest["command"].split()[1] == "rollback"

    status = ctl.run("status")
    row = status.rows()[UNIT]
    assert row["state"] == "rolled back", row
    assert "revision 1, playbooks differ" in row["health"], row

    check = ctl.run("deploy", "--check")
    assert any(
        "would re-apply" in e["message"] and f"{UNIT} (on revision 1)" in e["message"]
        for e in check.of(action="history")
    ), check.explain()
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    said = [e for e in again.events if e["action"] == "history" and "re-applies" in e["message"]]
    restarted = again.of(UNIT, action="restart", status="changed")
    assert said and restarted and said[0]["time"] <= restarted[0]["time"], again.explain()
    assert sha(unit_dir(host, UNIT) / "launch.sh") == shas[2]
    assert ctl.run("status").rows()[UNIT]["state"] == "ready"


def test_rollback_refuses_a_pruned_revision_and_a_held_lock(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    ctl, host, shas = deploy_two_versions(fleet_factory, ops)
    # What pruning leaves of a revision older than the last 10: its record, not its scripts.
    shutil.rmtree(host.workdir / "history" / "1" / "units")
    res = ctl.run("rollback", "--host", "h1", "--to", "1")
    assert res.code == 2 and res.of(status="failed", action="host"), res.explain()
    assert "revision 1 of h1 is no longer kept" in res.out and "kept revisions: 2" in res.out
    assert sha(unit_dir(host, UNIT) / "launch.sh") == shas[2]  # nothing was done

    spec = load_inventory(ctl.inventory).hosts["h1"]
    conn = connect(spec)
    try:
        other = Agent(conn, spec.python, keep=True)
        bob = {"who": "bob@elsewhere", "command": "dflashops deploy", "controller_pid": os.getpid()}
        assert lock.acquire(other, spec.workdir, bob).ok
        pid = unit_pid(host, UNIT)
        held = ctl.run("rollback", "--host", "h1")
        assert held.code == 2 and "locked by bob@elsewhere" in held.out, held.explain()
        assert unit_pid(host, UNIT) == pid and sha(unit_dir(host, UNIT) / "launch.sh") == shas[2]
    finally:
        other.close()
        conn.close()
    assert len(revisions(ctl.run("history"))) == 2  # refusals record nothing
