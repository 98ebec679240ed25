"""Reading what the agent prints, bounded (DESIGN.md "Trust boundary" 2): the answer object of
a command's output, and a ``send`` answer streamed as file frames. Neither keeps more than
``ANSWER_LIMIT`` bytes of a host's answer, nor parses JSON nested deeper than ``DEPTH_LIMIT``.
"""

from __future__ import annotations

from typing import Any

from dflashops.hosts.untrusted import (
    ANSWER_LIMIT,
    HostileHost,
    TooDeep,
    loads,
    too_large,
)


def last_json_object(text: str) -> dict[str, Any] | None:
    """The answer: the whole output, or else its last line (a login shell that prints a banner
    to stdout must not break the call). None when neither is a JSON object; ``TooDeep`` when
    one nests deeper than any agent answer does."""
    for candidate in (text, text.rsplit("\n", 1)[-1]):
        try:
            value = loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


class Frames:
    """A ``send`` answer as it streams: each file's header line and bytes go to the file that
    ``open_file(header)`` returns (append mode, from the header's offset); what follows the
    last file is the answer line. A header that is not {rel: str, size, offset: ints} fails
    the host (HostileHost), as does more than ``ANSWER_LIMIT`` bytes outside files."""

    def __init__(self, open_file: Any, host: str = "") -> None:
        self.open_file = open_file
        self.host = host
        self.buffer = bytearray()
        self.scanned = 0  # bytes of buffer known to hold no newline
        self.current: Any = None
        self.left = 0
        self.tail = b""

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while self.buffer:
            if self.current is not None:
                take = min(self.left, len(self.buffer))
                self.current.write(bytes(self.buffer[:take]))
                del self.buffer[:take]
                self.left -= take
                if self.left == 0:
                    self.current.close()
                    self.current = None
                continue
            end = self.buffer.find(b"\n", self.scanned)
            if end < 0:
                self.scanned = len(self.buffer)
                if len(self.buffer) + len(self.tail) > ANSWER_LIMIT:
                    raise too_large(self.host, "the agent's send answer", ANSWER_LIMIT)
                return
            line = bytes(self.buffer[: end + 1])
            del self.buffer[: end + 1]
            self.scanned = 0
            try:
                header = last_json_object(line.decode("utf-8", "replace").strip())
            except TooDeep as exc:
                raise HostileHost(self.host, f"the agent's send answer: {exc}") from None
            if header is None or "rel" not in header or "schema" in header:
                self.tail += line  # the answer (or a login banner before the first file)
                if len(self.tail) > ANSWER_LIMIT:
                    raise too_large(self.host, "the agent's send answer", ANSWER_LIMIT)
                continue
            self._start(header)

    def _start(self, header: dict[str, Any]) -> None:
        rel, size, offset = header.get("rel"), header.get("size"), header.get("offset")
        if not (isinstance(rel, str) and type(size) is int and type(offset) is int) or not (
            0 <= offset <= size
        ):
            raise HostileHost(self.host, f"the agent sent a malformed file header: {header!r:.200}")
        self.current = self.open_file(header)
        self.left = size - offset
        if self.left == 0:
            self.current.close()
            self.current = None

    def close(self) -> None:
        """The stream ended: a file cut short stays as it is (a partial, resumed next time)."""
        if self.current is not None:
            self.current.close()
            self.current = None
        self.tail += bytes(self.buffer)
        self.buffer.clear()
