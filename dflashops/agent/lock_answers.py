"""What the agent's ``lock`` action answers: the holder record of a host's deploy lock, and
whether the lock was taken, is held, or was released (see agent/remote/lock.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from dflashops.agent.answers import FactsModel, invalid_records


class LockHolder(FactsModel):
    """WORKDIR/deploy.holder.json: who holds (or last held) the host's deploy lock."""

    who: str | None = None  # user@machine of the controller
    command: str | None = None  # "dflashops deploy"
    since: str | None = None  # UTC, ISO 8601
    controller_pid: int | None = None
    agent_pid: int | None = None  # the agent session holding the lock on the host
    agent_start_time: int | None = None
    error: str | None = None  # the record could not be read

    def describe(self) -> str:
        """``alice@laptop (dflashops deploy, since 2026-12-02T07:40:00Z, pid 1234)``"""
        if self.error is not None:
            return f"a holder whose record is unreadable ({self.error})"
        return (
            f"{self.who or 'someone'} ({self.command or 'an unknown command'}, since "
            f"{self.since or 'an unknown time'}, pid {self.controller_pid or '?'})"
        )


class LockAnswer(FactsModel):
    """The ``lock`` action: taken or refused (``holder``: the holder), shown, or released."""

    ok: bool
    holder: LockHolder | None = None
    holder_alive: bool = False  # the recorded agent is alive and holds the lock file open
    held: bool | None = None  # show: someone holds the lock now
    pids: list[int] = Field(default_factory=list)  # show: processes with the lock file open
    signalled: str | None = None  # release: the last signal sent to the holding agent
    error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _demote_bad_record(cls, data: Any) -> Any:
        """A holder record of the wrong shape is named as such, not the host's failure."""
        bad = invalid_records(data, [("holder", LockHolder)])
        if not bad:
            return data
        return dict(data, holder={"error": f"deploy.holder.json: {bad['holder']}"})
