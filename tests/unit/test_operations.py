"""The pure decisions as data, the way pyinfra tests its operations: each file in
tests/operations/<op>/ is one case, ``{rendered, unit, facts, expect}``: ``rendered`` a
playbook fragment (rendered for host ``h``), ``unit`` the unit judged, ``facts`` a compact
description of what the host answered, ``expect`` the decision. One test runs them all.

Placeholders in ``facts`` and ``expect`` stand for what rendering computes: ``$unit``,
``$fingerprint``, ``$short``, ``$port``, ``$model``, ``$tp``, ``$dp`` (a string that is exactly
a placeholder becomes the value itself, an int for ``$port``). ``plan_changes`` cases are
re-planned on the facts their changes leave behind, and must then change nothing.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent.answers import HostFacts, UnitProbe
from dflashops.changes.orphans import find
from dflashops.changes.units import Change, plan_changes, script_sha
from dflashops.changes.verdicts import (
    Pending,
    Ready,
    node_blocked,
    readiness,
    start_blocker,
)
from dflashops.changes.watch import Acted, History, Looked, Settings, acted, looked_at, step
from dflashops.config.load import load_inventory, load_playbook
from dflashops.engines.render import Rendered, render_plan
from dflashops.plan import build_plan
from tests.unit.test_changes import host_facts, shipped

OPERATIONS = Path(__file__).parents[1] / "operations"
CASES = sorted(OPERATIONS.glob("*/*.json"))
INVENTORY = {"hosts": {"h": {"address": "127.0.0.1", "gpus": 4}}}
BOOT = "b00t"


@cache
def render(fragment: str) -> dict[str, Rendered]:
    """Host h's rendered units of the playbook ``{name: p, hosts: h, **fragment}``."""
    root = Path(tempfile.mkdtemp(prefix="operations-"))
    (root / "playbooks").mkdir()
    (root / "inventory.yaml").write_text(json.dumps(INVENTORY))  # JSON is YAML
    book = {"name": "p", "hosts": "h", **json.loads(fragment)}
    (root / "playbooks" / "p.yaml").write_text(json.dumps(book))
    plan = build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks/p.yaml")]
    )
    out, problems = render_plan(plan, [])
    assert not problems and not plan.problems, (problems, plan.problems)
    return {r.unit.name: r for r in out}


def fill(value: Any, r: Rendered) -> Any:
    """``value`` with the placeholders of the rendered unit ``r`` put in."""
    spec = r.unit.spec
    known: dict[str, Any] = {
        "$unit": r.unit.name,
        "$fingerprint": r.fingerprint,
        "$short": r.short,
        "$port": r.unit.port,
        "$model": getattr(spec, "model", None),
        "$tp": r.unit.tp,
        "$dp": r.unit.dp,
    }
    if isinstance(value, dict):
        return {k: fill(v, r) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, r) for v in value]
    if isinstance(value, str):
        if value in known:
            return known[value]
        for k in sorted(known, key=len, reverse=True):
            value = value.replace(k, str(known[k]))
    return value


# ---------------------------------------------------------------------------- facts


def unit_facts(name: str, how: str | dict[str, Any], rendered: dict[str, Rendered]) -> Any:
    """One unit's facts: a state name (``never``, ``running``, ``running-old``,
    ``running-hand-edited``, ``running-backoff``, ``done``, ``failed``, ``dead``,
    ``stopped``), or ``{state, port, gpus, pids}`` for a unit no playbook renders (an orphan)."""
    desc = {"state": how} if isinstance(how, str) else how
    state = desc["state"]
    r = rendered.get(name)
    running = state in ("running", "running-old", "running-hand-edited", "running-backoff")
    pids = desc.get("pids", [100, 101])
    record: dict[str, Any] = {"unit": name, "fingerprint": r.fingerprint if r else "e" * 64}
    if state == "running-old":
        record["fingerprint"] = "0" * 64
    record.update({k: desc[k] for k in ("port", "gpus") if k in desc})
    sha = "f" * 64 if state == "running-hand-edited" or r is None else script_sha(r)
    exit_code = {"done": 0, "failed": 1, "dead": 137}.get(state)
    never = state == "never"
    return {
        "name": name,
        "script_sha256": None if never else sha,
        "unit": None if never else record,
        "pid": None
        if state in ("never", "stopped", "done", "failed")
        else {"pid": pids[0], "pgid": pids[0], "start_time": 5, "boot_id": BOOT},
        "process": {
            "alive": running,
            "ours": running,
            "pid": pids[0] if running else None,
            "pgid": pids[0] if running else None,
            "state": "S" if running else None,
            "start_time": 5 if running else None,
            "cmdline": [],
            "reason": None if running else f"pid {pids[0]} is gone",
        },
        "group_pids": pids if running else [],
        "exit": {"code": exit_code} if exit_code is not None else None,
        "stopped": {"stopped_at": "2026-01-01T00:00:00Z"} if state == "stopped" else None,
        "logs": {"count": 1, "current": "x.log", "current_size": 1},
        "progress": None,
        "supervisor": {"state": "backoff", "restarts": 0} if state == "running-backoff" else None,
    }


def facts_of(case: dict[str, Any], rendered: dict[str, Rendered]) -> HostFacts:
    facts = case["facts"]
    units = {n: unit_facts(n, how, rendered) for n, how in facts.get("units", {}).items()}
    payloads = shipped(rendered) if facts.get("payloads", True) else {}
    return host_facts(units, payloads, {"gpus_available": True, **facts})


# ---------------------------------------------------------------------------- operations

PROBE = {  # a probe that finds the rendered unit running, healthy and itself
    "alive": True,
    "ours": True,
    "pid": 100,
    "exit": None,
    "health": {"status": 200, "error": None},
    "identity": {
        "path": "/server_info",
        "status": 200,
        "body": {"tp_size": "$tp", "dp_size": "$dp", "model_path": "$model", "port": "$port"},
    },
    "banner": {"line": "[dflashops] unit=$unit", "unit": "$unit", "fingerprint": "$fingerprint"},
    "log_tail": None,
}


def op_readiness(case: dict[str, Any], rendered: dict[str, Rendered]) -> dict[str, Any]:
    r = rendered[case["unit"]]
    facts = case["facts"]
    given = facts.get("probe", {})
    p = None if given is None else UnitProbe.model_validate(fill({**PROBE, **given}, r))
    v = readiness(r, p, fresh=facts.get("fresh", False), late=facts.get("late", False))
    got: dict[str, Any] = {"verdict": type(v).__name__}
    if isinstance(v, Pending):
        got["last"] = v.last
    else:
        got["message"] = v.message
    if isinstance(v, Ready):
        got.update(status=v.status, head=v.head)
    elif not isinstance(v, Pending):
        got["action"] = v.action
    return got


def op_start_blocker(case: dict[str, Any], rendered: dict[str, Rendered]) -> dict[str, Any]:
    facts = facts_of(case, rendered)
    secrets = {name: f"value-of-{name}" for name in case["facts"].get("secrets", [])}
    why = start_blocker(
        rendered[case["unit"]],
        facts,
        find(facts, set(rendered)),
        secrets,
        force=case["facts"].get("force", False),
    )
    return {"blocker": why}


def op_node_blocked(case: dict[str, Any], rendered: dict[str, Rendered]) -> dict[str, Any]:
    f = case["facts"]
    c = Change(rendered[case["unit"]], f["action"], "because")
    b = node_blocked(c, f.get("envs_failed", {}), f.get("entries", {}), f.get("reasons", {}))
    return {"blocked": None if b is None else {"status": b.status, "message": b.message}}


def apply(changes: list[Change], facts: HostFacts, rendered: dict[str, Rendered]) -> HostFacts:
    """What the executor leaves behind: started units run their new rendering, shipped files
    are in place."""
    units = {n: u.model_dump() for n, u in facts.units.items()}
    for c in changes:
        if c.action in ("start", "restart"):
            units[c.name] = unit_facts(c.name, "running", rendered)
        elif c.action == "ship":
            units[c.name]["script_sha256"] = script_sha(c.rendered)
    return host_facts(units, shipped(rendered))


def op_plan_changes(case: dict[str, Any], rendered: dict[str, Rendered]) -> dict[str, Any]:
    facts = facts_of(case, rendered)
    order = list(rendered.values())
    changes = plan_changes(order, facts, rerun=case["facts"].get("rerun", False))
    again = plan_changes(order, apply(changes, facts, rendered))
    assert [c.action for c in again] == ["ok"] * len(again), [(c.name, c.reason) for c in again]
    got: dict[str, Any] = {"actions": {c.name: c.action for c in changes}}
    if "reasons" in case["expect"]:
        got["reasons"] = {c.name: c.reason for c in changes if c.name in case["expect"]["reasons"]}
    return got


def watch_unit(name: str, how: str, rendered: dict[str, Rendered]) -> Any:
    """``unit_facts``, and what only watch tells apart: ``gone`` (dead, and its supervisor's
    record still says it runs: killed with it), ``crashed`` (its supervisor gave up),
    ``exited`` (its supervisor ended, its policy did not restart it)."""
    uf = unit_facts(name, "dead" if how in ("gone", "crashed", "exited") else how, rendered)
    if how == "gone":
        uf.update(exit=None, supervisor={"state": "running", "restarts": 0})
    elif how == "crashed":
        uf.update(supervisor={"state": "crashed", "restarts": 5}, crashed={"restarts": 5})
    elif how == "exited":
        uf.update(exit={"code": 0}, supervisor={"state": "ended", "restarts": 0})
    return uf


def watch_calls(calls: list[Any]) -> list[Any]:
    """``{"repeat": N, "call": C}`` is C, N times."""
    out = []
    for c in calls:
        out += [c["call"]] * c["repeat"] if isinstance(c, dict) and "repeat" in c else [c]
    return out


def op_watch(case: dict[str, Any], rendered: dict[str, Rendered]) -> dict[str, Any]:
    """``calls``: what each call to host h gave, made when the host's memory says it is due:
    ``"fail"``, ``"untrusted"`` (its key changed), or ``{units, boot_id, node_id, converge,
    act}`` (``act``: what the deploy of that call's units did, changes.watch.Acted's fields).
    ``expect`` names what is compared: ``at``, ``state``, ``status``, ``changed`` (lists, a
    value per call), ``notices`` (``"CALL:event"``), ``starts``, ``deploys`` and ``mirrors``
    ({CALL: units}), ``text`` ({CALL: words the line holds})."""
    given = case["settings"]
    settings = Settings(given["interval"], given["lost_after"], frozenset(given.get("heal", [])))
    h = History()
    got: dict[str, Any] = {"at": [], "state": [], "status": [], "changed": [], "notices": []}
    got.update(starts={}, deploys={}, mirrors={}, text={})
    for i, call in enumerate(watch_calls(case["calls"])):
        if call in ("fail", "untrusted"):
            seen = Looked(failure=f"{call}!", untrusted=call == "untrusted")
        else:
            units = {n: watch_unit(n, how, rendered) for n, how in call["units"].items()}
            facts = host_facts(units, shipped(rendered)).model_copy(
                update={"boot_id": call.get("boot_id", BOOT), "node_id": call.get("node_id")}
            )
            seen = looked_at(list(rendered.values()), facts)
        now = h.due
        done = step(
            h, seen, now, settings, None if call in ("fail", "untrusted") else call.get("converge")
        )
        got["notices"] += [f"{i}:{n.event}" for n in done.notices]
        if isinstance(call, dict) and "act" in call:
            act = call["act"]
            done = acted(
                done, Acted(tuple(act.get("started", ())), act.get("failed", {}), act.get("busy"))
            )
            got["notices"] += [f"{i}:{n.event}" for n in done.notices]
        got["at"].append(now)
        got["state"].append(done.history.state)
        got["status"].append(done.status)
        got["changed"].append(done.changed)
        if done.start:
            got["starts"][str(i)] = list(done.start)
            got["deploys"][str(i)] = list(done.deploy)
        if done.mirror:
            got["mirrors"][str(i)] = list(done.mirror)
        for words in case["expect"].get("text", {}).get(str(i), []):
            if words in done.text:
                got["text"].setdefault(str(i), []).append(words)
            else:
                got["text"].setdefault(str(i), []).append(f"NOT IN: {done.text}")
        h = replace(done.history, said=done.key)
    return {k: got[k] for k in case["expect"]}


OPS = {
    "readiness": op_readiness,
    "start_blocker": op_start_blocker,
    "node_blocked": op_node_blocked,
    "plan_changes": op_plan_changes,
    "watch": op_watch,
}


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_operation(path: Path) -> None:
    case = json.loads(path.read_text())
    rendered = render(json.dumps(case["rendered"], sort_keys=True))
    got = OPS[path.parent.name](case, rendered)
    some = rendered[case["unit"]] if "unit" in case else next(iter(rendered.values()))
    assert got == fill(case["expect"], some)


def test_every_operation_and_verdict_has_cases() -> None:
    assert len(CASES) >= 20
    assert {p.parent.name for p in CASES} == set(OPS)
    verdicts = {
        json.loads(p.read_text())["expect"]["verdict"]
        for p in CASES
        if p.parent.name == "readiness"
    }
    assert verdicts == {"Ready", "Dead", "Drifted", "Pending", "TimedOut"}
