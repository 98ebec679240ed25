"""What a run looked at in the user's files, for results kept by that content (see
preflight/runcache.py: a pre-flight whose every input is unchanged reuses its last result).

A run that wants to know its inputs sets a ``Reads`` for its duration (``recording``). The few
places that look at the user's files (config/yamlsource.py, project.py, render.py's templates,
pre-flight's own reads) call ``look`` *before* they read: when nothing records it does nothing.
A fact is what was at a path then: absent, a folder, or a file's sha256 (or, for the few kinds
below, a folder listing, a tree digest, existence). Because each fact is taken before its
reader reads, and a run's facts are all taken again before its result is kept, a file that
changes while the run reads it is never kept as content the run did not see.

Stdlib only and cheap to import: a warm pre-flight checks facts before importing the loader.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ABSENT = "-"
FOLDER = "dir"
OTHER = "other"  # neither a folder nor a readable regular file

FactKey = tuple[str, str]  # (kind, path)


class Reads:
    """The facts of one run, (kind, path) -> value. Two different values for one fact (a file
    hashed twice that changed in between) make the run unfit to keep: ``unstable``."""

    def __init__(self) -> None:
        self.facts: dict[FactKey, str] = {}
        self.unstable: str | None = None

    def note(self, kind: str, path: str, value: str) -> None:
        old = self.facts.setdefault((kind, path), value)
        if old != value and self.unstable is None:
            self.unstable = f"{path} changed while it was read"

    def merge(self, facts: dict[FactKey, str]) -> None:
        for (kind, path), value in facts.items():
            self.note(kind, path, value)

    def refuse(self, why: str) -> None:
        """This run's result must not be kept (something it relied on cannot be a fact)."""
        if self.unstable is None:
            self.unstable = why


_current: Reads | None = None


@contextmanager
def recording() -> Iterator[Reads]:
    global _current
    previous, _current = _current, Reads()
    try:
        yield _current
    finally:
        _current = previous


def current() -> Reads | None:
    return _current


def look(path: str | os.PathLike[str], kind: str = "path") -> str | None:
    """Record what is at ``path`` now, before the caller reads it; the value, or None when
    nothing records (then nothing is looked at: no cost for commands that do not cache)."""
    if _current is None:
        return None
    where = os.fspath(path)
    value = observe(kind, where)
    _current.note(kind, where, value)
    return value


def is_file(value: str | None) -> bool:
    """A ``path`` fact's value that is a regular file's content (its sha256)."""
    return value is not None and value not in (ABSENT, FOLDER, OTHER)


def known(path: str | os.PathLike[str], sha256: str) -> None:
    """Record a file's sha256 that its reader computed from the very bytes it used."""
    if _current is not None:
        _current.note("path", os.fspath(path), sha256)


def observe(kind: str, path: str) -> str:
    """The value of fact (kind, path) now.

    - ``path``: ABSENT, FOLDER, the file's sha256, or ``other``
    - ``exists``: ``1`` or ``0`` (a files entry's source: only its existence is checked offline,
      and it may be a model of many gigabytes)
    - ``glob:PATTERN``: the sorted matches of PATTERN in folder ``path`` (Path.glob, as the
      caller globs)
    - ``tree``: a file's sha256, or a folder's: over every file under it (wheels)
    """
    if kind == "path":
        return _path(path)
    if kind == "exists":
        return "1" if os.path.exists(path) else "0"
    if kind.startswith("glob:"):
        return "\n".join(str(p) for p in sorted(Path(path).glob(kind[len("glob:") :])))
    if kind == "tree":
        return _tree(path)
    raise ValueError(f"unknown kind of fact {kind!r}")


def changed(facts: dict[FactKey, str]) -> str | None:
    """The first fact that is not what it was (its path), or None when all still hold."""
    for (kind, path), value in facts.items():
        try:
            now = observe(kind, path)
        except (OSError, ValueError):
            return path
        if now != value:
            return path
    return None


def _path(path: str) -> str:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return ABSENT
    except OSError:
        return OTHER  # unreadable: the reader fails on it, and failures are never kept
    if stat.S_ISDIR(st.st_mode):
        return FOLDER
    if not stat.S_ISREG(st.st_mode):
        return OTHER
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return OTHER
    return digest.hexdigest()


def _tree(path: str) -> str:
    """A file's or a folder's content: sha256 over every file under it (its path inside and its
    sha256), following links as os.walk and agent/remote/tree.py's scan do; a superset of what
    that scan counts, so nothing it hashes can change unseen. Read whole each time: wheels and
    requirements are small, and the agent's tree module would import the agent client here."""
    top = _path(path)
    if top != FOLDER:
        return top
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            digest.update(f"{os.path.relpath(full, path)}\0{_path(full)}\n".encode())
    return f"{FOLDER}:{digest.hexdigest()}"
