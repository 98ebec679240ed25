"""`status` says `rolled back` (revision N, playbooks differ) for a unit a rollback put on a
kept revision while it still runs that revision, and `outdated` once anything else changed it;
the state is in the legend and coloured as one that needs no one."""

from __future__ import annotations

from typing import Any

from dflashops.agent.history_actions import RolledUnit
from dflashops.commands import states, status
from dflashops.commands.common import Target
from dflashops.engines.metrics import Memory
from dflashops.lifecycle.fleet import Outcome
from tests.unit.test_status_json import facts, rendered, uf


def row_of(rolled: dict[str, RolledUnit]) -> status.Row:
    unit = uf("web-0", "running-old")
    host = facts({"web-0": unit})
    running = host.unit("web-0")
    assert running is not None and running.fingerprint != rendered()["web-0"].fingerprint
    outcome: Outcome[Any] = Outcome("h", value=(host, {}, {}, [], rolled))
    target = Target({}, {"h": [rendered()["web-0"]]}, None)
    (row,) = status.collect(target, {"h": outcome}, Memory(persist=False))
    return row


def test_a_rolled_back_unit_is_shown_so_until_it_changes() -> None:
    fingerprint = facts({"web-0": uf("web-0", "running-old")}).unit("web-0").fingerprint  # type: ignore[union-attr]
    row = row_of({"web-0": RolledUnit(revision=3, fingerprint=fingerprint, by=5)})
    assert row.state == "rolled back"
    assert row.health.startswith("revision 3, playbooks differ"), row.health
    assert row_of({"web-0": RolledUnit(revision=3, fingerprint="other", by=5)}).state == "outdated"
    assert row_of({}).state == "outdated"
    assert "\n  rolled back " in states.LEGEND and states.STYLE["rolled back"] != "red"
