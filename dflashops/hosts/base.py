"""What every connection kind shares: a count of remote commands and a checked ``get``."""

from __future__ import annotations

from abc import ABC, abstractmethod

from dflashops.hosts.connection import Command, Result


class BaseConnection(ABC):
    host: str
    commands: int = 0  # remote commands run: the round trips that tests and benchmarks count

    @abstractmethod
    def run(
        self,
        command: Command,
        *,
        input: bytes | None = None,
        timeout: float | None = 60.0,
        check: bool = True,
    ) -> Result: ...

    @abstractmethod
    def close(self) -> None: ...

    def get(self, path: str, timeout: float | None = 120.0) -> bytes:
        """Read a file from the host (checked: a missing file raises, it does not return b'')."""
        return self.run(["cat", "--", path], timeout=timeout).stdout
