"""Whole pre-flight runs kept by everything they read, the way a build system keeps a manifest
(ninja's deps log, ccache's manifests): a run whose inputs are all byte for byte those of an
earlier passing run is that run's result, and loads, plans and renders nothing.

Two parts make up what a run depends on:

- the fixed part, known before the run: the selection as given (``-i``, ``-p``, ``--host``),
  the working folder (relative paths are read from it) and ``HOME`` (``~/x.py`` is read from
  it: the only environment variable the loader reads), the Python, the installed
  distributions (names and versions), bash's identity (bash_syntax.py), and dflashops' own
  code: the sha256 of every file of the package (its .py, its data such as the engines' flag
  lists, its templates). Its digest names the entry.
- the facts the run itself recorded (dflashops/config/reads.py): the inventory, every playbook and
  the playbooks folder's listing, every template path looked up (misses too: an override
  added later beside a playbook is a change), every shipped file, environments' inputs,
  files entries' sources.

An entry, ``preflight-runs/<digest of the fixed part>.json`` in the cache folder, holds the
facts and the run's checks and summary counts. Another run with that fixed part takes every
fact again; if each still holds, the kept checks are its result (output, ``--json`` and
``--junit`` are made from them exactly as from a run's); if any does not, it runs in full and
replaces the entry. Only runs that passed (warnings allowed) are kept: a failure is always run
again and reported in full. A run is not kept either when a fact changed while it ran (see
reads.py) or when the fixed part did (code edited meanwhile). Entries are written atomically
(a temporary file renamed into place), the newest KEEP are kept, and each carries the sha256 of
its body: a corrupt or unusable entry or folder costs one warning and a full run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dflashops
from dflashops.cache import cache_dir, warn_once
from dflashops.config import reads
from dflashops.preflight.bash_syntax import bash_identity
from dflashops.preflight.memo import key
from dflashops.preflight.report import Check, Report

FORMAT = 1  # of an entry; a new format is a new key, so old entries are never misread
KEEP = 16  # entries: one per selection (and code version) in use
MAX_BYTES = 256 << 20  # an entry past this is not written (a fleet far larger than 1,000 x 8)
SEVERITIES = ("error", "warning")


@dataclass(frozen=True)
class RunKey:
    """The selection as the command was given it (spelled differently is only a miss)."""

    inventory: str | None
    playbooks: list[str] = field(default_factory=list)
    hosts: list[str] | str | None = None

    def digest(self) -> str:
        fixed = {
            "format": FORMAT,
            "selection": [self.inventory, self.playbooks, self.hosts],
            "cwd": os.getcwd(),
            "home": os.environ.get("HOME"),
            "python": [sys.version, sys.platform, sys.executable],
            "distributions": distributions(),
            "bash": bash_identity(),
            "code": code_identity(),
        }
        return key("preflight-run", json.dumps(fixed, sort_keys=True))


def run(run_key: RunKey, full: Callable[[], Report]) -> Report:
    """The kept result of ``run_key`` if every input it read is unchanged, else ``full()``
    (recording what it reads) kept for next time when it passes."""
    digest = run_key.digest()
    kept = lookup(digest)
    if kept is not None:
        return kept
    with reads.recording() as recorded:
        report = full()
    if keepable(report, recorded) and run_key.digest() == digest:
        store(digest, recorded, report)
    return report


def keepable(report: Report, recorded: reads.Reads) -> bool:
    """A passing run that saw each input one way only, and whose inputs still hold."""
    return (
        report.ok
        and recorded.unstable is None
        and bool(recorded.facts)
        and reads.changed(recorded.facts) is None
    )


def entry_path(digest: str) -> Path:
    return cache_dir() / "preflight-runs" / f"{digest}.json"


def lookup(digest: str) -> Report | None:
    path = entry_path(digest)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warn_once(f"cannot read {path}: {exc}")
        return None
    entry = _parse(data)
    if entry is None:
        warn_once(f"{path} is not a kept pre-flight result (ignored; it is rewritten)")
        return None
    facts, report = entry
    if reads.changed(facts) is not None:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: pruned last
    return report


def store(digest: str, recorded: reads.Reads, report: Report) -> None:
    body = json.dumps(
        {
            "facts": [[kind, path, value] for (kind, path), value in recorded.facts.items()],
            "units": report.units,
            "hosts": report.hosts,
            "checks": [c.row() for c in report.checks],
        },
        separators=(",", ":"),
    ).encode()
    if len(body) > MAX_BYTES:
        return
    data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    path = entry_path(digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".run.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(path.parent)
    except OSError as exc:
        warn_once(f"cannot write {path}: {exc}")


def _prune(folder: Path) -> None:
    """The newest KEEP entries stay; a file that vanished meanwhile (another run pruned it)
    is no concern."""
    entries = []
    for p in folder.glob("*.json"):
        with contextlib.suppress(OSError):
            entries.append((p.stat().st_mtime_ns, p))
    for _, p in sorted(entries, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            p.unlink()


def _parse(data: bytes) -> tuple[dict[reads.FactKey, str], Report] | None:
    """An entry's facts and report, or None for anything not exactly what store writes."""
    digest, _, body = data.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    try:
        entry = json.loads(body)
        facts = {(str(k), str(p)): str(v) for k, p, v in entry["facts"]}
        checks = [_check(row) for row in entry["checks"]]
        units, hosts = entry["units"], entry["hosts"]
    except (ValueError, TypeError, KeyError):
        return None
    if (
        not facts
        or None in checks
        or not isinstance(units, int)
        or not isinstance(hosts, list)
        or not all(isinstance(h, str) for h in hosts)
    ):
        return None
    report = Report(checks=[c for c in checks if c is not None], units=units, hosts=hosts)
    return facts, report


def _check(row: Any) -> Check | None:
    if not isinstance(row, list) or len(row) != 7:
        return None
    check, subject, ok, message, severity, file, line = row
    if not (
        isinstance(check, str)
        and isinstance(subject, str)
        and isinstance(ok, bool)
        and isinstance(message, str)
        and severity in SEVERITIES
        and (file is None or isinstance(file, str))
        and (line is None or (isinstance(line, int) and not isinstance(line, bool)))
    ):
        return None
    return Check(check, subject, ok, message, severity, file, line)


def distributions() -> list[str]:
    """Every installed distribution with its version (the names of the .dist-info folders on
    sys.path): pydantic, Jinja2 or PyYAML upgraded is a new key. One listing per folder."""
    found: list[str] = []
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        found.extend(n for n in names if n.endswith((".dist-info", ".egg-info")))
    return sorted(found)


def code_identity() -> str:
    """sha256 over every file of the dflashops package (but bytecode) and of the built-in
    templates beside it in a source checkout (render.builtin_templates looks in both places):
    the code that decides every check, its flag lists and templates included. ~1 MB."""
    root = Path(dflashops.__file__).resolve().parent
    digest = hashlib.sha256()
    sources: list[tuple[Path, str | None]] = [(root, None)]  # (folder, only names ending so)
    if (root.parent / "templates").is_dir():
        sources.append((root.parent / "templates", ".j2"))
    for base, suffix in sources:
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".pyc", ".pyo")) or (suffix and not name.endswith(suffix)):
                    continue
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as f:
                        content = hashlib.sha256(f.read()).hexdigest()
                except OSError:
                    content = reads.OTHER
                digest.update(f"{os.path.relpath(path, base.parent)}\0{content}\n".encode())
    return digest.hexdigest()
