"""One error root for everything dflashops reports to a person.

Every message names what it is about (file and line, host, unit) and, where there is one, the next
step. The CLI prints these without a traceback; anything else escaping is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass


class DflashopsError(Exception):
    """Base of every error dflashops raises on purpose."""

    def message_for(self, host: str) -> str:
        """The message for a line that names ``host`` already (the host's own name is not
        repeated; an error about another host, a peer, still names that one)."""
        return str(self)


@dataclass(frozen=True)
class Problem:
    """One finding in a user file: where it is and what is wrong."""

    file: str
    message: str
    line: int | None = None
    column: int | None = None
    field: str = ""

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class ConfigError(DflashopsError):
    """Inventory or playbook input that cannot be used; carries every problem found, not only the
    first, so one run shows the user everything to fix."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class HostError(DflashopsError):
    """A host could not be reached or did not do what it was asked.

    Keeps its parts (``host``, ``detail``, ``next_step``) so that a line which names the host
    already shows the rest (``message_for``) instead of cutting the name off the text; ``str()``
    is ``[host] detail``, then ``. next_step`` where there is one."""

    # The host answered (its sshd let us in) but cannot do what was asked: its outcome is
    # "failed", not "unreachable", since the fix is in the inventory or on the host, not the
    # network. Connection errors leave it False.
    reached: bool = False

    def __init__(self, host: str, detail: str, next_step: str | None = None) -> None:
        self.host = host
        self.detail = detail
        self.next_step = next_step
        super().__init__(f"[{host}] {self.reason}")

    @property
    def reason(self) -> str:
        """What happened and what to do next, without the host's name."""
        if not self.next_step:
            return self.detail
        stop = "" if self.detail.endswith((".", "?", "!")) else "."
        return f"{self.detail}{stop} {self.next_step}"

    def message_for(self, host: str) -> str:
        return self.reason if host == self.host else str(self)


class HostBusy(HostError):
    """The host answered, but another actor holds its deploy lock: nothing was changed there.
    Reported as failed, not unreachable: the host is fine, the operator has to wait or unlock."""

    reached = True


class TransferError(HostError):
    """A file did not arrive intact; the previous version is still in place."""
