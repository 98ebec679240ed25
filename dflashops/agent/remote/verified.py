"""The one verified writer: bytes read from stdin into a file, hashed on the way in, under
signals that interrupt it cleanly. ``write`` (whole files, all or none renamed) and ``receive``
(trees, resumable) both land their bytes through ``copy_in`` inside a ``Signals`` guard, and
rename a file into place only when ``mismatch`` finds nothing to say."""

from __future__ import annotations

import signal

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any, Callable

CHUNK = 1 << 20
SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


class Signals:
    """While open, SIGHUP, SIGTERM and SIGINT raise ``error("interrupted by signal N")``, once:
    default handlers would end the process without cleaning up, and a later signal's exception
    could land inside the cleanup and abort it. ``quiet()`` (at the start of the cleanup) stops
    them raising; closing puts the previous handlers back (a session goes on)."""

    def __init__(self, error: Callable[[str], BaseException]) -> None:
        self.error = error
        self.fired: int | None = None  # the signal that interrupted, if one did
        self.raising = True
        self.before: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for signum in SIGNALS:
            self.before[signum] = signal.signal(signum, self.on_signal)
        return self

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.raising and self.fired is None:
            self.fired = signum
            raise self.error(f"interrupted by signal {signum}")

    def quiet(self) -> None:
        self.raising = False

    def __exit__(self, *_exc: object) -> None:
        self.raising = False
        for signum, handler in self.before.items():
            signal.signal(signum, handler)


def copy_in(src: Any, write: Callable[[bytes], Any], size: int, digest: Any) -> int:
    """``size`` bytes of ``src`` (anything with ``read(n)``) through ``write`` and ``digest``;
    how many were missing when the input ended early (0: all arrived)."""
    left = size
    while left:
        chunk = src.read(min(left, CHUNK))
        if not chunk:
            return left
        write(chunk)
        digest.update(chunk)
        left -= len(chunk)
    return 0


def mismatch(digest: Any, sent: str, where: str = "") -> str | None:
    """Why the bytes that arrived are not the ones sent (None: they are)."""
    got = digest.hexdigest()
    if got == sent:
        return None
    return f"sha256 mismatch on the host{where}: got {got}, sent {sent}"
