"""The one connection interface the rest of dflashops uses to touch a host, whatever the
transport: run a command (checked), keep one running (``stream``), get a file, close."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from dflashops.hosts.connection import (
    Command,
    CommandError,
    Input,
    Result,
    Sink,
    Stream,
    as_shell,
    chunks,
)
from dflashops.hosts.untrusted import Bounded


class BaseConnection(ABC):
    host: str  # the inventory name, for messages
    commands: int = 0  # remote commands run: the round trips that tests and benchmarks count

    def run(
        self,
        command: Command,
        *,
        input: Input = None,
        timeout: float | None = 60.0,
        check: bool = True,
        stdout: Sink | None = None,
    ) -> Result:
        """Run ``command`` with ``input`` as its stdin; its stdout is returned whole, or handed
        to ``stdout`` chunk by chunk. ``check``: a non-zero exit raises CommandError."""
        shell = as_shell(command)
        code, out, err = self.execute(shell, chunks(input), timeout, stdout)
        result = Result(shell, code, out, err)
        if check and code != 0:
            raise CommandError(self.host, result)
        return result

    @abstractmethod
    def execute(
        self, shell: str, input: Iterable[bytes], timeout: float | None, sink: Sink | None
    ) -> tuple[int, bytes, bytes]:
        """Run ``shell`` to its end, ``input`` its stdin: its exit code, stdout (b"" when
        ``sink`` took it), the end of its stderr. CommandTimeout past ``timeout``; counts itself
        in ``commands``."""

    @abstractmethod
    def close(self) -> None: ...

    def stream(self, command: Command) -> Stream:
        """Start ``command`` and keep it: requests go in, answer lines come out."""
        return self.keep(as_shell(command))

    @abstractmethod
    def keep(self, shell: str) -> Stream:
        """``stream`` on this transport; counts itself in ``commands``."""

    def get(self, path: str, timeout: float | None = 120.0) -> bytes:
        """Read a file from the host (checked: a missing file raises, it does not return b'');
        at most ANSWER_LIMIT bytes, as any answer (HostileHost past it)."""
        sink = Bounded(self.host)
        self.run(["cat", "--", path], timeout=timeout, stdout=sink)
        return bytes(sink.data)
