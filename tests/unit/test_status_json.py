"""status as data and words (issue 21): every state it can show is in the legend `status --help`
prints, the restarts column and the health text agree, a restarted unit keeps its last exit,
`--json -` is one document of raw values on stdout, and messages are shortened at a word."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from dflashops.agent.answers import HostFacts, UnitFacts, UnitProbe
from dflashops.changes.orphans import Orphan
from dflashops.commands import states, status, top
from dflashops.commands.common import Target
from dflashops.commands.status import Row, Seen, state_of
from dflashops.engines.metrics import Memory
from dflashops.engines.render import Rendered
from dflashops.events import EventLog
from dflashops.lifecycle.fleet import Outcome
from dflashops.output import shorten
from tests.unit.test_changes import host_facts
from tests.unit.test_operations import PROBE, fill, render, unit_facts

FRAGMENT = json.dumps(
    {
        "services": [{"name": "web", "engine": "stub", "model": "/m", "port": 30000}],
        "jobs": [{"name": "gen", "command": ["true"]}],
    }
)
NOW = 1_800_000_000.0
AT = "2027-01-15T08:00:00Z"  # 1_800_000_000 is 08:00:00Z that day: AT is NOW


def rendered() -> dict[str, Rendered]:
    return render(FRAGMENT)


def facts(units: dict[str, Any]) -> HostFacts:
    data = host_facts(units, {}).model_dump()
    return HostFacts.model_validate({**data, "time": NOW})


def uf(name: str, how: str, **more: Any) -> dict[str, Any]:
    return {**unit_facts(name, how, rendered()), **more}


def probe(name: str, **given: Any) -> UnitProbe:
    return UnitProbe.model_validate(fill({**PROBE, **given}, rendered()[name]))


CRASHED = {"crashed": {"at": AT}, "supervisor": {"state": "crashed", "restarts": 2}}
RESTARTED = {  # a unit its supervisor restarted once: running again, its exit kept
    "exit": {"code": 137, "signal": "SIGKILL", "finished_at": "2027-01-15T07:59:00Z"},
    "supervisor": {"state": "running", "restarts": 1},
}
# (unit, its facts (None: the host has none), probe changes (None: no probe), the state)
CASES: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str]] = [
    ("web-0", None, None, "absent"),
    ("web-0", uf("web-0", "never"), None, "absent"),
    ("web-0", uf("web-0", "stopped"), None, "stopped"),
    ("web-0", uf("web-0", "dead"), None, "dead"),
    ("web-0", uf("web-0", "dead", **CRASHED), None, "crashed"),
    ("web-0", uf("web-0", "running-backoff"), None, "restarting"),
    ("web-0", uf("web-0", "running"), {}, "ready"),
    ("web-0", uf("web-0", "running", **RESTARTED), {}, "ready"),
    ("web-0", uf("web-0", "running"), {"health": {"status": 503, "error": None}}, "starting"),
    ("web-0", uf("web-0", "running-old"), {}, "outdated"),
    (
        "web-0",
        uf("web-0", "running"),
        {"identity": {"path": "/", "status": 200, "body": {}}},
        "drifted",
    ),
    ("gen", uf("gen", "running"), None, "running"),
    ("gen", uf("gen", "done"), None, "done"),
    ("gen", uf("gen", "failed"), None, "failed"),
]


def judged(name: str, unit: dict[str, Any] | None, given: dict[str, Any] | None) -> Row:
    host = facts({name: unit} if unit is not None else {})
    p = probe(name, **given) if given is not None else None
    seen = Seen.of(rendered()[name])
    state, health = state_of(seen, host.unit(name), p, host.time)
    return Row("h", seen, host.unit(name), host, state, health, "playbook", p)


def produced() -> set[str]:
    """Every state the cases make status show, orphans and unreachable hosts included."""
    words = {judged(n, u, p).state for n, u, p, _ in CASES}
    host = facts({"old-0": {**uf("web-0", "running"), "name": "old-0"}})
    orphan = Orphan("old-0", host.units["old-0"])
    outcome: Outcome[Any] = Outcome("h", value=(host, {}, {}, [orphan]))
    target = Target({}, {}, None)
    words |= {row.state for row in status.collect(target, {"h": outcome}, Memory(persist=False))}
    return words | {status.UNREACHABLE}


@pytest.mark.parametrize(("name", "unit", "given", "state"), CASES)
def test_each_case_has_its_state(
    name: str, unit: dict[str, Any] | None, given: dict[str, Any] | None, state: str
) -> None:
    row = judged(name, unit, given)
    assert row.state == state, row.health


@pytest.mark.parametrize("state", sorted(produced()))
def test_every_state_status_shows_is_in_the_legend(state: str) -> None:
    assert f"\n  {state} " in states.LEGEND


def test_the_legend_lists_every_state_of_the_design() -> None:
    design = [
        *["ready", "starting", "restarting", "crashed", "drifted", "outdated", "absent"],
        *["stopped", "waiting", "running", "done", "failed", "orphan", "unreachable", "dead"],
        *["lost", "re-provisioned"],
        "rolled back",
    ]
    assert [s for s in design if f"\n  {s} " not in states.LEGEND] == []
    assert "import" not in states.LEGEND and len(produced()) >= 14


def test_restarts_and_the_health_text_agree_and_a_restart_keeps_its_last_exit() -> None:
    restarting = judged("web-0", uf("web-0", "running-backoff"), None)
    assert restarting.restarts == 1 and restarting.health.startswith("restart 1")
    crashed = judged("web-0", uf("web-0", "dead", **CRASHED), None)
    assert crashed.restarts == 2 and crashed.health.startswith("gave up after 2 restarts")
    ready = judged("web-0", uf("web-0", "running", **RESTARTED), {})
    assert ready.restarts == 1 and ready.state == "ready"
    assert ready.as_json()["last_exit"] == {
        "code": 137,
        "signal": "SIGKILL",
        "time": "2027-01-15T07:59:00Z",
        "reason": None,
    }
    assert "code 137 (SIGKILL) 1m00s ago" in ready.cells()
    # top counts the same way from a probe.
    p = probe("web-0", supervisor={"state": "backoff", "restarts": 0})
    assert top.restarts_of(p.supervisor, p.running) == 1
    assert top.unit_state(Seen.of(rendered()["web-0"]), p) == "restarting"


def test_a_unit_row_as_json_holds_raw_values() -> None:
    started = {"pid": 100, "pgid": 100, "start_time": 5, "boot_id": "b00t", "started_at": AT}
    running = uf("web-0", "running", pid=started)
    row = judged("web-0", running, {})
    data = row.as_json()
    assert data["uptime_s"] == 0 and data["started_at"] == AT and data["pid"] == 100
    assert data["fingerprint"]["match"] is True and data["http_status"] == 200
    assert data["restarts"] == 0 and data["last_exit"] is None and data["running"] is True
    assert data["gpus"] == [{"index": 0, "used_bytes": 0, "util_pct": None}]
    assert data["service"] == "web" and data["kind"] == "service"
    job = judged("gen", uf("gen", "running", progress={"done": 4, "total": 10, "eta_s": 6.0}), None)
    assert job.as_json()["progress"] == {
        "done": 4,
        "total": 10,
        "failed": None,
        "requests_per_s": None,
        "eta_s": 6.0,
        "state": None,
    }


def test_a_unit_only_its_host_records_is_shown_from_its_records() -> None:
    record: dict[str, Any] = uf("web-0", "running")
    record["unit"] = {**record["unit"], "kind": "service", "port": 31000, "gpus": [1]}
    seen = Seen.recorded("web-0", UnitFacts.model_validate(record))
    assert (seen.kind, seen.port, seen.gpus, seen.rendered) == ("service", 31000, (1,), None)
    assert state_of(seen, UnitFacts.model_validate(record), None, NOW) == ("running", "not probed")


def local_project(tmp_path: Path, playbook: str) -> Path:
    """A project on a `connection: local` host (no SSH): its inventory."""
    host = {"connection": "local", "gpus": 1, "workdir": str(tmp_path / "w"), "python": "python3"}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"local": host}}))
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "p.yaml").write_text(playbook)
    return tmp_path / "inventory.yaml"


def test_status_json_dash_is_one_document_on_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = local_project(
        tmp_path, 'name: p\nhosts: local\njobs:\n  - {name: gen, command: ["true"]}\n'
    )
    people = io.StringIO()
    code = status.status(Console(file=people, width=200), inventory=str(inventory), json_path="-")
    doc = json.loads(capsys.readouterr().out)  # stdout: the document and nothing else
    assert code == 0 and doc["schema"] == 1 and doc["ok"] is True and doc["warnings"] == []
    assert doc["hosts"][0]["host"] == "local" and doc["hosts"][0]["reachable"] is True
    (row,) = doc["units"]
    assert (row["unit"], row["state"], row["uptime_s"], row["restarts"]) == (
        "gen",
        "absent",
        None,
        0,
    )
    assert "absent" in people.getvalue()  # the table went to the people's console

    # A half-edited playbook beside it: a warning naming file and line, the same document.
    (tmp_path / "playbooks" / "wip.yaml").write_text(
        "name: wip\nhosts: local\njobs:\n  - name: [oops\n"
    )
    path = tmp_path / "status.json"
    code = status.status(
        Console(file=people, width=200), inventory=str(inventory), json_path=str(path)
    )
    doc = json.loads(path.read_text())
    assert code == 0 and capsys.readouterr().out == ""
    assert "wip.yaml:4: does not load (" in doc["warnings"][0]
    assert "wip.yaml:4: does not load (" in people.getvalue()


def test_events_on_stdout_with_json_dash(capsys: pytest.CaptureFixture[str]) -> None:
    people = io.StringIO()
    log = EventLog(Console(file=people), "-")
    log.emit("h", "u", "changed", "start", "started")
    log.close()
    (event,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["unit"] == "u" and event["status"] == "changed"
    assert "changed: [h] u started" in people.getvalue() and not Path("-").exists()


@pytest.mark.parametrize(
    ("text", "limit", "shortened"),
    [
        ("short enough", 20, "short enough"),
        ("connection refused by the host over there", 24, "connection refused by…"),
        ("a, b, c, d, e, f, g", 10, "a, b, c…"),
        ("averyveryverylongwordwithoutspaces here", 12, "averyveryve…"),
        ("two\nlines  and\ttabs", 40, "two lines and tabs"),
    ],
)
def test_shorten_cuts_at_a_word(text: str, limit: int, shortened: str) -> None:
    got = shorten(text, limit)
    assert got == shortened and len(got) <= limit
