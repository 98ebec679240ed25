"""The controller's calls to a host's ``history`` action (agent/remote/history.py): record a
revision, list them, show one's kept scripts, restore them, and the units a rollback put back.

``record`` and ``restore`` need the deploy lock held by the same kept session (the command
recording holds it); ``rolled_ahead`` rides with the session's next call (status and deploy
send it with their facts: no round trip of its own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from dflashops.agent.answers import FactsModel
from dflashops.agent.calling import SLACK, AgentError
from dflashops.agent.client import Agent
from dflashops.errors import HostError


class KeptUnit(FactsModel):
    fingerprint: str | None = None
    script_sha256: str
    unit_sha256: str | None = None


class Revision(FactsModel):
    """``history/<rev>/revision.json``, and whether its scripts are still kept."""

    revision: int
    time: str | None = None
    who: str | None = None
    command: str | None = None
    units: dict[str, str | None] = Field(default_factory=dict)  # the units it changed
    rollback_to: int | None = None
    kept: dict[str, KeptUnit] = Field(default_factory=dict)
    scripts: bool = False
    error: str | None = None  # its record could not be read


class RolledUnit(FactsModel):
    revision: int  # the kept revision it runs
    fingerprint: str | None = None
    by: int | None = None  # the rollback's own revision


class HistoryAnswer(FactsModel):
    ok: bool
    error: str | None = None
    revision: int | None = None  # record: the new revision
    revisions: list[Revision] = Field(default_factory=list)  # newest first
    rolled: dict[str, RolledUnit] = Field(default_factory=dict)
    record: Revision | None = None  # show
    launch: dict[str, str] = Field(default_factory=dict)  # show: each kept unit's launch.sh


def _call(agent: Agent, workdir: str, request: dict[str, Any]) -> HistoryAnswer:
    data = agent.call("history", {"workdir": workdir, **request}, timeout=2 * SLACK)
    got = agent.validate(HistoryAnswer, data, "history")
    if not got.ok:
        raise HostError(agent.host, f"history ({request['op']}): {got.error}")
    return got


def record(
    agent: Agent,
    workdir: str,
    command: str,
    who: str,
    units: dict[str, str | None],
    rollback_to: int | None = None,
) -> int:
    """A new revision on the host (under the deploy lock this session holds): its number."""
    request = {
        "op": "record",
        "command": command,
        "who": who,
        "units": units,
        "rollback_to": rollback_to,
    }
    got = _call(agent, workdir, request)
    assert got.revision is not None
    return got.revision


def listing(agent: Agent, workdir: str) -> HistoryAnswer:
    """Every revision on record (newest first) and the rolled-back units."""
    return _call(agent, workdir, {"op": "list"})


def show(agent: Agent, workdir: str, revision: int) -> HistoryAnswer:
    return _call(agent, workdir, {"op": "show", "revision": revision})


def restore(agent: Agent, workdir: str, revision: int, names: list[str]) -> None:
    _call(agent, workdir, {"op": "restore", "revision": revision, "names": names})


def rolled_ahead(agent: Agent, workdir: str, then: Callable[[dict[str, RolledUnit]], None]) -> None:
    """The units a rollback put on a kept revision, asked with the session's next call;
    ``then`` gets them (nothing when the host could not say: status and deploy go on)."""

    def took(data: dict[str, Any]) -> None:
        try:
            got = agent.validate(HistoryAnswer, data, "history")
        except AgentError:  # an older or odd host: nothing said, nothing shown
            then({})
            return
        then(got.rolled if got.ok else {})

    agent.kept().send_ahead("history", {"workdir": workdir, "op": "rolled"}, took)
