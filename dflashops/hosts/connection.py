"""What a connection speaks, whatever the transport: commands, results, errors, kept streams.

The interface itself is ``hosts.base.BaseConnection``; two kinds implement it: ``SshConnection``
(Fabric/paramiko, strict host keys) and ``LocalConnection`` (this machine, for the embedded
default). Every call returns a checked ``Result``; a non-zero exit raises ``CommandError`` with
the command, the exit code and the end of its output, so no caller can mistake silence for
success.
"""

from __future__ import annotations

import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dflashops.errors import HostError
from dflashops.hosts.untrusted import LINE_LIMIT, too_large
from dflashops.output import shorten

Command = str | Sequence[str]
# stdin: bytes, or chunks produced while the command runs (a large transfer never sits whole in
# memory); stdout: returned whole, or handed chunk by chunk to a sink as it arrives.
Input = bytes | Iterable[bytes] | None
Sink = Callable[[bytes], None]


def chunks(data: Input) -> Iterable[bytes]:
    if data is None:
        return ()
    return (data,) if isinstance(data, bytes) else data


def host_word(path: str) -> str:
    """A host path as one shell word: ``~/x`` expands to the home of the user running it (a
    quoted ~ would not), anything else is quoted as it is (a bare name is left to PATH)."""
    return '"$HOME"/' + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def as_shell(command: Command) -> str:
    """A command for the remote shell: argv is quoted part by part, a string is taken as shell."""
    return command if isinstance(command, str) else shlex.join(command)


@dataclass(frozen=True)
class Result:
    command: str
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def tail(text: str, lines: int = 15) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in kept)


class CommandError(HostError):
    """A command ran and failed: says which, how, and what it printed last."""

    def __init__(self, host: str, result: Result, what: str = "") -> None:
        self.result = result
        shown = shorten(result.command, 200)
        lines = [f"{what or 'command'} failed with exit code {result.exit_code}: {shown}"]
        if result.err.strip():
            lines.append("  stderr (last lines):\n" + tail(result.err))
        if result.out.strip():
            lines.append("  stdout (last lines):\n" + tail(result.out))
        super().__init__(host, "\n".join(lines))


class CommandTimeout(HostError):
    """The command did not finish in time; it may still be running on the host."""


class StreamEnded(HostError):
    """The kept command ended or its connection dropped: open a new one."""


class Stream(ABC):
    """A command kept running: bytes in, lines out (a served agent session)."""

    host: str
    buffer: bytearray  # what arrived after the last line read
    scanned: int  # bytes of buffer known to hold no newline

    @abstractmethod
    def send(self, data: bytes) -> None: ...

    @abstractmethod
    def receive(self, wait: float) -> bytes:
        """What arrives within ``wait`` seconds (b"" if nothing did); StreamEnded at its end."""

    @abstractmethod
    def kill(self) -> None:
        """End the command now, unread: it floods."""

    @abstractmethod
    def ending(self) -> Result:
        """Once ``readline`` raised StreamEnded: the command's exit status, what it printed
        after its last line, and its stderr (for the error that says why it ended)."""

    @abstractmethod
    def close(self) -> None: ...

    def readline(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while (end := self.buffer.find(b"\n", self.scanned)) < 0:
            self.scanned = len(self.buffer)
            if self.scanned > LINE_LIMIT:
                self.kill()  # nothing it says next is read
                raise too_large(self.host, "a line of the agent's answer", LINE_LIMIT)
            left = deadline - time.monotonic()
            data = self.receive(max(left, 0.0))
            if data:
                self.buffer += data
            elif left <= 0:
                raise CommandTimeout(self.host, f"no answer within {timeout:.0f}s")
        line = bytes(self.buffer[: end + 1])
        del self.buffer[: end + 1]
        self.scanned = 0
        return line
