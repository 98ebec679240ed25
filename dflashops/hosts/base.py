"""What every connection kind shares: a count of remote commands and a checked ``get``."""

from __future__ import annotations

from abc import ABC, abstractmethod

from dflashops.hosts.connection import Command, Input, Result, Sink, Stream
from dflashops.hosts.untrusted import Bounded


class BaseConnection(ABC):
    host: str
    commands: int = 0  # remote commands run: the round trips that tests and benchmarks count

    @abstractmethod
    def run(
        self,
        command: Command,
        *,
        input: Input = None,
        timeout: float | None = 60.0,
        check: bool = True,
        stdout: Sink | None = None,
    ) -> Result: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def stream(self, command: Command) -> Stream:
        """Start ``command`` and keep it: requests go in, answer lines come out."""

    def get(self, path: str, timeout: float | None = 120.0) -> bytes:
        """Read a file from the host (checked: a missing file raises, it does not return b'');
        at most ANSWER_LIMIT bytes, as any answer (HostileHost past it)."""
        sink = Bounded(self.host)
        self.run(["cat", "--", path], timeout=timeout, stdout=sink)
        return bytes(sink.data)
