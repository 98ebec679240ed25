"""What accumulates on a host over days stays bounded by count (DESIGN.md "Trust boundary" 7):
pruned unit folders (``units/.pruned/``), the agent copies supervisors run from
(``WORKDIR/agent/<sha16>.py``) and partial transfers of content no longer wanted. The newest
are kept; anything a running process uses is never removed."""

from __future__ import annotations

import contextlib
import os

from . import layout, tree

PRUNED_KEEP = 10  # stopped units' folders (logs included) kept in units/.pruned/
AGENT_COPIES_KEEP = 4  # agent versions kept in WORKDIR/agent/ beside those running


def newest_first(folder: str, names: list[str]) -> list[str]:
    """``names`` in ``folder``, newest modification first (gone ones left out)."""
    stamped = []
    for name in names:
        with contextlib.suppress(OSError):
            stamped.append((os.lstat(os.path.join(folder, name)).st_mtime_ns, name))
    return [name for _, name in sorted(stamped, reverse=True)]


def prune_pruned(workdir: str, keep: int = PRUNED_KEEP) -> list[str]:
    """Delete the oldest of ``units/.pruned/*`` beyond ``keep``; the names deleted. Only a
    cleanly stopped unit lands there (stop moves it), so nothing of it runs."""
    import shutil

    folder = os.path.join(workdir, layout.UNITS, layout.PRUNED)
    try:
        names = [e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    gone = []
    for name in newest_first(folder, names)[keep:]:
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        gone.append(name)
    return gone


def running_scripts() -> set[str]:
    """Every path a live process was started with as an argument (``python -S <copy>``)."""
    from . import procfs

    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found.update(arg for arg in procfs.cmdline(int(entry)) if arg.endswith(".py"))
    return found


def prune_agent_copies(workdir: str, keep: int = AGENT_COPIES_KEEP) -> list[str]:
    """Delete the oldest ``WORKDIR/agent/*.py`` beyond ``keep``, never one a live supervisor
    runs from (its code is read at its start, but its command line names it: it stays
    inspectable as long as it runs); the names deleted."""
    folder = os.path.join(workdir, "agent")
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".py")]
    except OSError:
        return []
    ordered = newest_first(folder, names)
    if len(ordered) <= keep:
        return []
    used = {os.path.basename(p) for p in running_scripts() if os.path.dirname(p) == folder}
    gone = []
    for name in ordered[keep:]:
        if name not in used:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
                gone.append(name)
    return gone


def drop_parts(root: str) -> list[str]:
    """Delete every partial transfer under ``root`` (``.<name>.dflashops-part.<sha16>``): called
    once a transfer into ``root`` completed, when none is wanted any more (those of the files
    just sent were renamed into place; any other is for content that changed since, or for a
    file no longer sent). The rels whose parts went."""
    _, parts = tree.walk(root)
    gone = []
    for rel, shas in parts.items():
        path = os.path.join(root, rel) if rel else root
        for sha16 in shas:
            with contextlib.suppress(OSError):
                os.unlink(tree.part_name(path, sha16))
                gone.append(rel)
    return gone
