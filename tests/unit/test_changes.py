"""changes.py as data: each case is what runs on the host (facts) and what should run (the
playbook) -> the action per unit. After applying a case's actions to its facts, planning again
must say `ok` for every unit: idempotency by construction, as pyinfra's operation tests do."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent.answers import HostFacts
from dflashops.changes.units import Change, plan_changes, script_sha
from dflashops.config.load import load_inventory, load_playbook
from dflashops.engines.render import Rendered, render_plan
from dflashops.plan import build_plan

INVENTORY = "hosts:\n  h: {address: 127.0.0.1, gpus: 4}\n"
PLAYBOOK = """
name: p
hosts: h
services:
  - {name: web, engine: stub, model: m, port: 31000}
jobs:
  - {name: gen, script: job.py, needs: [web], restart_with: [web]}
  - {name: side, command: [sleep, "60"]}
"""
BOOT = "b00t"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    root = tmp_path_factory.mktemp("changes")
    (root / "playbooks").mkdir()
    (root / "inventory.yaml").write_text(INVENTORY)
    (root / "playbooks" / "p.yaml").write_text(PLAYBOOK)
    (root / "playbooks" / "job.py").write_text("print('hi')\n")
    plan = build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks/p.yaml")]
    )
    out, problems = render_plan(plan, [])
    assert not problems
    return {r.unit.name: r for r in out}


# ---------------------------------------------------------------------------- host states


def unit_state(r: Rendered, state: str) -> dict[str, Any]:
    """One unit's facts in a named state, for the rendered unit ``r``."""
    running = state in ("running", "running-old", "running-hand-edited", "running-backoff")
    fp = "0" * 64 if state == "running-old" else r.fingerprint
    sha = "f" * 64 if state == "running-hand-edited" else script_sha(r)
    pid = {"pid": 100, "pgid": 100, "start_time": 5, "boot_id": BOOT}
    exit_code = {"done": 0, "failed": 1, "dead": 137}.get(state)
    return {
        "name": r.unit.name,
        "script_sha256": sha if state != "never" else None,
        "unit": {"unit": r.unit.name, "fingerprint": fp} if state != "never" else None,
        "pid": pid if state not in ("never", "stopped", "done", "failed") else None,
        "process": {
            "alive": running,
            "ours": running,
            "pid": 100 if running else None,
            "pgid": 100 if running else None,
            "state": "S" if running else None,
            "start_time": 5 if running else None,
            "cmdline": [],
            "reason": None if running else "pid 100 is gone",
        },
        "group_pids": [100, 101] if running else [],
        "exit": {"code": exit_code} if exit_code is not None else None,
        "stopped": {"stopped_at": "2026-01-01T00:00:00Z"} if state == "stopped" else None,
        "logs": {"count": 1, "current": "x.log", "current_size": 1},
        "progress": None,
        "supervisor": {"state": "backoff", "restarts": 0} if state == "running-backoff" else None,
    }


def host_facts(
    units: dict[str, Any], payloads: dict[str, str], more: dict[str, Any] | None = None
) -> HostFacts:
    """Facts of host h; ``more``: gpus_available, gpu_processes, listening."""
    more = more or {}
    return HostFacts.model_validate(
        {
            "host": "h",
            "hostname": "h",
            "time": 0.0,
            "python": "3.11.2",
            "python_executable": "/usr/bin/python3",
            "boot_id": BOOT,
            "clock_ticks": 100,
            "uptime_s": 1.0,
            "workdir": "/w",
            "workdir_exists": True,
            "disk": None,
            "gpus": {
                "available": more.get("gpus_available", False),
                "error": None,
                "devices": [],
                "processes": more.get("gpu_processes", []),
            },
            "listening": more.get("listening", []),
            "payloads": payloads,
            "units": units,
            "imports": {},
            "paths": {},
        }
    )


def shipped(rendered: dict[str, Rendered]) -> dict[str, str]:
    return {
        f.remote.removeprefix("payloads/"): f.sha256 for r in rendered.values() for f in r.files
    }


@dataclass
class Case:
    id: str
    states: dict[str, str]  # unit -> state on the host
    expect: dict[str, str]  # unit -> action
    payloads: bool = True  # the shipped files are on the host
    rerun: bool = False
    reasons: dict[str, str] = field(default_factory=dict)  # unit -> text in the reason


CASES = [
    Case(
        "nothing-yet",
        {"web-0": "never", "gen": "never", "side": "never"},
        {"web-0": "start", "gen": "start", "side": "start"},
        payloads=False,
    ),
    Case(
        "all-running",
        {"web-0": "running", "gen": "running", "side": "running"},
        {"web-0": "ok", "gen": "ok", "side": "ok"},
    ),
    Case(
        "service-changed-restarts-its-restart_with-job",
        {"web-0": "running-old", "gen": "running", "side": "running"},
        {"web-0": "restart", "gen": "restart", "side": "ok"},
        reasons={"web-0": "fingerprint 000000000000 ->", "gen": "restart_with: web"},
    ),
    Case(
        "service-down-restarts-its-job-too",
        {"web-0": "dead", "gen": "running", "side": "running"},
        {"web-0": "start", "gen": "restart", "side": "ok"},
    ),
    Case(
        "hand-edited-script-is-shipped-not-restarted",
        {"web-0": "running-hand-edited", "gen": "running", "side": "running"},
        {"web-0": "ship", "gen": "ok", "side": "ok"},
        reasons={"web-0": "launch.sh differs"},
    ),
    Case(
        "lost-payload-is-shipped",
        {"web-0": "running", "gen": "running", "side": "running"},
        {"web-0": "ship", "gen": "ship", "side": "ok"},
        payloads=False,
        reasons={"gen": "payload files missing"},
    ),
    Case(
        "a-crashed-server-in-its-backoff-is-restarted-now",
        {"web-0": "running-backoff", "gen": "running", "side": "running"},
        {"web-0": "restart", "gen": "restart", "side": "ok"},
        reasons={"web-0": "crashed, in its supervisor's backoff"},
    ),
    Case(
        "done-job-stays-done",
        {"web-0": "running", "gen": "done", "side": "done"},
        {"web-0": "ok", "gen": "ok", "side": "ok"},
        reasons={"gen": "done (exit 0)"},
    ),
    Case(
        "rerun-runs-done-jobs-again",
        {"web-0": "running", "gen": "done", "side": "done"},
        {"web-0": "ok", "gen": "start", "side": "start"},
        rerun=True,
    ),
    Case(
        "failed-and-stopped-jobs-start",
        {"web-0": "running", "gen": "failed", "side": "stopped"},
        {"web-0": "ok", "gen": "start", "side": "start"},
        reasons={"gen": "exited with code 1", "side": "stopped"},
    ),
]


def apply(changes: list[Change], facts: HostFacts, rendered: dict[str, Rendered]) -> HostFacts:
    """What the executor leaves behind: started units run their new rendering, shipped files
    are in place."""
    units = {n: u.model_dump() for n, u in facts.units.items()}
    for c in changes:
        if c.action in ("start", "restart"):
            units[c.name] = unit_state(c.rendered, "running")
        elif c.action == "ship":
            units[c.name]["script_sha256"] = script_sha(c.rendered)
    return host_facts(units, shipped(rendered))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_changes_table(case: Case, rendered: dict[str, Rendered]) -> None:
    units = {n: unit_state(rendered[n], s) for n, s in case.states.items()}
    facts = host_facts(units, shipped(rendered) if case.payloads else {})
    order = list(rendered.values())
    changes = plan_changes(order, facts, rerun=case.rerun)
    assert {c.name: c.action for c in changes} == case.expect
    for name, text in case.reasons.items():
        assert text in next(c.reason for c in changes if c.name == name), (name, changes)
    if not case.payloads:
        assert {f.name for c in changes for f in c.missing_payloads} >= {"job.py"}

    again = plan_changes(order, apply(changes, facts, rendered))
    assert {c.name: c.action for c in again} == {n: "ok" for n in case.expect}


def test_every_action_appears_in_the_table() -> None:
    assert {a for c in CASES for a in c.expect.values()} == {"ok", "ship", "start", "restart"}


def test_script_sha_is_the_rendered_script(rendered: dict[str, Rendered]) -> None:
    r = rendered["web-0"]
    assert script_sha(r) == hashlib.sha256(r.script.encode()).hexdigest()
    assert Path(r.files[0].local).name == "stub_engine.py"
