"""What a host sends is checked before the controller acts on it (DESIGN.md "Trust boundary"
1-2): a rented node may answer anything, and nothing it answers may write outside the place the
operator named, exhaust the controller's memory, or crash it.

- Answers are bounded: at most ``ANSWER_LIMIT`` bytes per answer (a kept session's answer is
  one line: the same cap per line), a file header line at most ``HEADER_LIMIT``, stderr kept to
  its last ``STDERR_KEEP`` bytes, JSON nested at most ``DEPTH_LIMIT`` deep.
- Paths a host reports (a fetch's or relay's file list) are plain relative paths: checked all
  together before the first byte is written (transfer.py writes them without following links).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

from dflashops.errors import HostError

ANSWER_LIMIT = 64 << 20
LINE_LIMIT = ANSWER_LIMIT  # a kept session answers with one line
HEADER_LIMIT = 64 << 10  # a streamed file's header line: a path, a size, an offset
STDERR_KEEP = 1 << 20  # stderr is only ever shown as its last lines
DEPTH_LIMIT = 100
NAME_MAX = 255  # bytes per path component (Linux)
PATH_MAX = 4096


class HostileHost(HostError):
    """The host answered what no dflashops agent answers: a path outside the destination, an
    answer too large or nested too deep. That host's call ends; nothing it sent is used."""


def too_large(host: str, what: str, limit: int) -> HostileHost:
    return HostileHost(
        host,
        f"{what} passed {limit >> 20 or limit} {'MiB' if limit >> 20 else 'bytes'} "
        "(the most any answer may be): the call was ended and nothing from it is used; "
        "a broken or hostile host (check the agent's python and what prints to its stdout)",
    )


class Bounded:
    """A sink for a command's stdout that keeps at most ``limit`` bytes: one byte more and it
    raises, which ends the command (the connection stops reading and closes it)."""

    def __init__(self, host: str, limit: int = ANSWER_LIMIT) -> None:
        self.host = host
        self.limit = limit
        self.data = bytearray()

    def __call__(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self.limit:
            raise too_large(self.host, "the agent's answer", self.limit)
        self.data += chunk


def keep_tail(buffer: bytearray, chunk: bytes, keep: int = STDERR_KEEP) -> None:
    """Append ``chunk``, keeping about the last ``keep`` bytes (trimmed in steps, not per call)."""
    buffer += chunk
    if len(buffer) > 2 * keep:
        del buffer[:-keep]


# -- JSON ---------------------------------------------------------------------------------------

_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class TooDeep(Exception):
    """JSON nested deeper than ``DEPTH_LIMIT`` (json.loads would recurse until it fails)."""

    def __init__(self, depth: int) -> None:
        super().__init__(f"JSON nested {depth} deep (at most {DEPTH_LIMIT})")
        self.depth = depth


def depth(text: str) -> int:
    """How deep ``text`` nests (exact for valid JSON; brackets in strings do not count), at
    C speed: strings out, then everything but brackets out, then a running sum."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(text: str | bytes) -> Any:
    """``json.loads`` of host text, refusing nesting deeper than ``DEPTH_LIMIT`` (TooDeep)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    found = depth(text)
    if found > DEPTH_LIMIT:
        raise TooDeep(found)
    return json.loads(text)


# -- paths --------------------------------------------------------------------------------------


def path_problem(rel: Any) -> str | None:
    """Why ``rel`` is not a plain relative path under a destination ('' is the destination
    itself), or None."""
    if not isinstance(rel, str):
        return "not a string"
    if "\0" in rel:
        return "it holds a NUL"
    if rel.startswith("/"):
        return "it is absolute"
    if len(rel.encode("utf-8", "surrogateescape")) > PATH_MAX:
        return "it is longer than a path may be"
    if not rel:
        return None
    for part in rel.split("/"):
        if part == "..":
            return "it climbs out with '..'"
        if part in ("", "."):
            return "it is not in plain form (an empty or '.' component)"
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return "a name in it is longer than a file name may be"
    return None


def check_listing(host: str, rels: Iterable[Any], what: str = "its file list") -> None:
    """Every path of a host's file list, checked before anything is written from it; one bad
    path fails the host as hostile (HostileHost) and nothing from the list is written."""
    listed = list(rels)
    for rel in listed:
        why = path_problem(rel)
        if why is not None:
            raise HostileHost(
                host,
                f"host {host} sent an unsafe path {rel!r} in {what} ({why}): refusing to "
                "write anything from it",
            )
    if "" in listed and len(listed) > 1:
        raise HostileHost(
            host,
            f"host {host} sent a file list naming the destination itself and files under it: "
            "refusing to write anything from it",
        )
    folders = {rel.rsplit("/", i)[0] for rel in listed for i in range(1, rel.count("/") + 1)}
    clash = sorted(folders.intersection(listed))
    if clash:
        raise HostileHost(
            host,
            f"host {host} sent {clash[0]!r} in {what} both as a file and as a folder: refusing "
            "to write anything from it",
        )
