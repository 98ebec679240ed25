"""Pre-flight results kept between runs: the keys of checks that passed.

A key is the sha256 of what decided the result (the check's name, the checking tool's identity,
the exact content checked), so an entry can only ever stand for that same content: a changed
script has another key and is checked again. Only passes are kept: a failure is re-checked (and
reported in full) every time. The file is one hex key per line in the user's cache folder; a
corrupt or unwritable one costs one warning and the run goes on without it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from dflashops.cache import cache_dir, warn_once

KEEP = 200_000  # newest keys kept (12.8 MB): a fleet of 1,000 hosts x 8 units many times over
_KEY = re.compile(r"^[0-9a-f]{64}$")


def key(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(b"%d:" % len(data))  # length-prefixed: parts cannot run into each other
        digest.update(data)
    return digest.hexdigest()


class Passed:
    """The set of keys that passed, loaded once; ``save`` adds this run's new ones."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else cache_dir() / "preflight-passed"
        self.order: list[str] = []
        self.keys: set[str] = set()
        self.new: list[str] = []
        self._load()

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="ascii")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            warn_once(f"cannot read {self.path}: {exc}")
            return
        lines = text.split()
        if not all(_KEY.fullmatch(line) for line in lines):
            warn_once(f"{self.path} is not a list of check keys (ignored; it is rewritten)")
            return
        self.order = lines
        self.keys = set(lines)

    def __contains__(self, k: str) -> bool:
        return k in self.keys

    def add(self, k: str) -> None:
        if k not in self.keys:
            self.keys.add(k)
            self.new.append(k)

    def save(self) -> None:
        """Write old + new keys (newest last, at most KEEP) beside the file, then rename it into
        place: a reader never sees half a file, two runs at once lose at most the other's keys."""
        if not self.new:
            return
        lines = (self.order + self.new)[-KEEP:]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".preflight-passed.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="ascii") as f:
                    f.write("\n".join(lines) + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            warn_once(f"cannot write {self.path}: {exc}")
            return
        self.order, self.new = lines, []
