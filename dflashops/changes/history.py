"""History and rollback decided as data (pure): what a revision records, which revision a
rollback goes to, which units it restarts, and what a unit on a kept revision is called."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable, Sequence

from dflashops.agent.history_actions import Revision, RolledUnit

FRONT_ENDS = ("dflashops", "inv", "invoke")  # the programs whose command line is ours to record


def command_line(argv: Sequence[str], command: str, redact: Callable[[str], str]) -> str:
    """The command as typed (``dflashops deploy --host b200``), its secrets redacted; when this
    process is not one of the front ends (a test, a REPL calling ``cli.main``), its own
    command line would say nothing: ``dflashops COMMAND``."""
    prog = os.path.basename(argv[0]) if argv else ""
    if prog not in FRONT_ENDS:
        return f"dflashops {command}"
    return redact(shlex.join([prog, *argv[1:]]))


def pick(revisions: Sequence[Revision], to: int | None, host: str) -> Revision | str:
    """The revision a rollback goes to (``to``, else the one before the newest), or why not:
    unknown, or its scripts pruned (the kept ones named)."""
    kept = [r.revision for r in revisions if r.scripts]
    listed = ", ".join(str(n) for n in sorted(kept)) or "none"
    if to is None:
        if len(revisions) < 2:
            return (
                f"{host} has {len(revisions)} revision(s) on record: no previous one to go back to"
            )
        found: Revision | None = revisions[1]
    else:
        found = next((r for r in revisions if r.revision == to), None)
        if found is None:
            return f"{host} has no revision {to} on record; kept revisions: {listed}"
    assert found is not None
    if not found.scripts:
        return (
            f"revision {found.revision} of {host} is no longer kept (its scripts were pruned); "
            f"kept revisions: {listed}"
        )
    return found


def to_restart(
    target: Revision, scripts: dict[str, str | None], names: Iterable[str] | None
) -> list[str]:
    """The units whose kept script differs from what their folder holds now (``scripts``:
    unit -> the sha256 of its launch.sh on the host, as facts say), in name order; ``names``:
    among these only."""
    wanted = set(names) if names is not None else None
    return [
        name
        for name, kept in sorted(target.kept.items())
        if (wanted is None or name in wanted) and scripts.get(name) != kept.script_sha256
    ]


def rolled_back(rolled: dict[str, RolledUnit], name: str, fingerprint: str | None) -> int | None:
    """The kept revision a unit runs when a rollback put it there and it still runs that
    (its recorded fingerprint unchanged); None otherwise."""
    got = rolled.get(name)
    if got is None or fingerprint is None or got.fingerprint != fingerprint:
        return None
    return got.revision


def reapplies(
    rolled: dict[str, RolledUnit], running: dict[str, str | None], changing: Iterable[str]
) -> list[str]:
    """``unit (on revision N)`` for each rolled-back unit this deploy changes again."""
    out = []
    for name in sorted(set(changing)):
        revision = rolled_back(rolled, name, running.get(name))
        if revision is not None:
            out.append(f"{name} (on revision {revision})")
    return out


def touching(revisions: Sequence[Revision], units: Iterable[str] | None) -> list[Revision]:
    """The revisions that changed any of ``units`` (all of them when None)."""
    if units is None:
        return list(revisions)
    wanted = set(units)
    return [r for r in revisions if wanted & set(r.units)]


def changed_text(r: Revision, width: int = 6) -> str:
    """``web, gen (+3 more)``."""
    names = sorted(r.units)
    if r.error is not None:
        return f"(record unreadable: {r.error})"
    more = f" (+{len(names) - width} more)" if len(names) > width else ""
    return (", ".join(names[:width]) or "-") + more
