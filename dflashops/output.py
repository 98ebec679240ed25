"""Console output: one place that decides how dflashops talks to a person."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape as rich_escape

from dflashops.errors import DflashopsError
from dflashops.hosts.inert import inert


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
