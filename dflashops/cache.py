"""The controller's cache folder ($XDG_CACHE_HOME/dflashops, else ~/.cache/dflashops;
$DFLASHOPS_CACHE overrides): what can be recomputed, kept so that it need not be. Everything in
it is keyed by the content it describes, so a stale entry can never stand for changed content,
and a cache that cannot be used is only slower: one warning, then work goes on without it."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

_warned = threading.Event()


def cache_dir() -> Path:
    env = os.environ.get("DFLASHOPS_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflashops"


def warn_once(problem: str) -> None:
    """Say once per run that the cache is not usable (and why); never fail for it."""
    if not _warned.is_set():
        _warned.set()
        sys.stderr.write(f"warning: dflashops cache {cache_dir()} not used: {problem}\n")
