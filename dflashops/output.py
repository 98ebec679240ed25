"""Console output: one place that decides how dflashops talks to a person. It imports nothing
of dflashops: the host code uses it too (``inert``, ``shorten``, ``trace``).

Host text made inert before a terminal sees it (DESIGN.md "Trust boundary" 2).

A unit's log, an agent's stderr, a progress file: whatever a host sends may hold escape
sequences that retitle the operator's terminal, rewrite what it shows, or worse. ``inert``
removes control characters other than newline and tab: whole escape sequences (CSI, OSC and
other string sequences, two-character escapes, in their 7-bit and C1 forms), then any C0, DEL
or C1 character left. The printable text around them stays, so a coloured log still reads.
"""

from __future__ import annotations

import re
import sys

from rich.console import Console
from rich.markup import escape as rich_escape

from dflashops.errors import DflashopsError

# A CSI: ESC [ (or C1 CSI), parameter bytes, intermediate bytes, a final byte.
_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
# OSC, DCS, SOS, PM, APC: a string up to its terminator (BEL, ST), or to the end of the line
# when unterminated (a terminal would swallow it; a log's next lines must stay readable).
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
# Any other escape: ESC, intermediate bytes, a final byte (charset switches, cursor saves...).
_OTHER = r"\x1b[ -/]*[0-~]?"
_SEQUENCES = re.compile(f"{_CSI}|{_STRING}|{_OTHER}")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """``text`` without control characters but newline and tab (escape sequences removed whole)."""
    if _CONTROLS.search(text) is None:  # the common case: nothing to do, no copy
        return text
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))


def shorten(text: str, limit: int) -> str:
    """``text`` on one line (whitespace runs, newlines included, become one space) and at most
    ``limit`` characters: cut at the last space that keeps at least half of it, never inside a
    word unless one word fills half the limit, and ended with "…". The one way a message is
    shortened for a table cell or a summary line."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: max(0, limit - 1)]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"


def console(stderr: bool = False) -> Console:
    # highlight=False: rich would otherwise colour numbers and paths inside our messages at random.
    # Off a terminal (CI logs, pipes) tables get a wide page instead of 80 columns of wrapping.
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


_verbose = False


def set_verbose(on: bool) -> None:
    """``-v``: show each remote call and its timing (``trace``), for the rest of the run."""
    global _verbose
    _verbose = on


def verbose() -> bool:
    return _verbose


def trace(host: str, what: str, seconds: float) -> None:
    """One remote call, with ``-v``: ``[h1] facts 0.084s``. On stderr: ``--json -`` and
    ``status --json`` keep stdout to themselves."""
    if _verbose:
        console(stderr=True).print(
            f"[dim]\\[{escape(host)}] {escape(inert(what))} {seconds:.3f}s[/]"
        )


def err(message: str) -> None:
    # Errors carry host text (an agent's stderr, a log's end): shown inert.
    console(stderr=True).print(f"[bold red]error:[/] {escape(inert(message))}")


def escape(text: str) -> str:
    """Text shown as is, even if it holds [brackets] that rich would read as markup."""
    return rich_escape(text)


def duration(seconds: float | None) -> str:
    """`42s`, `12m05s`, `3h07m`, `2d04h`; `-` for nothing."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def some(names: list[str], limit: int = 5) -> str:
    """`a, b, c, d, e and 995 more`: a summary line names a handful, whatever the fleet's size."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def confirm(question: str, refused: str) -> bool:
    """Ask on a terminal; off one there is nobody to ask: ``refused`` says what to pass."""
    if not sys.stdin.isatty():
        raise DflashopsError(f"not on a terminal, so there is nobody to confirm: {refused}")
    return input(question).strip().lower() in ("y", "yes")
