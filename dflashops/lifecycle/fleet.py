"""Many hosts at once: a bounded pool (``--forks``), and every host's outcome kept.

Like Fabric's GroupResult, each host maps to its result or its error; one unreachable host never
hides what happened on the others. Unlike Fabric's ThreadingGroup, the pool is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dflashops.config.inventory import Host
from dflashops.errors import DflashopsError, HostError

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    host: str
    value: T | None = None
    error: str | None = None
    unexpected: bool = False  # an exception that is a dflashops bug, not a host problem
    # The host answered, yet the work could not be done there (another actor holds its deploy
    # lock, its python is missing): failed, not unreachable; the fix is on the host.
    reached: bool = False
    # What was raised, kept whole (Invoke's Failure keeps its Result): its parts, not its text.
    exception: Exception | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def reason(self) -> str | None:
        """``error`` for a line that names the host already: without the host's own name."""
        if isinstance(self.exception, DflashopsError):
            return self.exception.message_for(self.host)
        return self.error


def on_hosts(
    hosts: Sequence[Host],
    fn: Callable[[Host], T],
    forks: int,
    abort: threading.Event | None = None,
) -> dict[str, Outcome[T]]:
    """Run ``fn`` for every host, at most ``forks`` at a time; results in the hosts' order.

    Ctrl-C sets ``abort`` before the pool waits for its threads, so host work that checks it
    (readiness waits, the steps of a deploy) winds down instead of running to completion."""

    def one(host: Host) -> Outcome[T]:
        try:
            return Outcome(host.name, value=fn(host))
        except DflashopsError as exc:
            reached = isinstance(exc, HostError) and exc.reached  # HostBusy, PythonMissing
            return Outcome(host.name, error=str(exc), reached=reached, exception=exc)
        except Exception as exc:  # reported per host: one bug never hides the other hosts
            error = f"internal error ({type(exc).__name__}: {exc})"
            return Outcome(host.name, error=error, unexpected=True, exception=exc)

    if not hosts:
        return {}
    with ThreadPoolExecutor(
        max_workers=max(1, min(forks, len(hosts))), thread_name_prefix="host"
    ) as pool:
        futures = [pool.submit(one, h) for h in hosts]
        try:
            outcomes = [f.result() for f in futures]
        except KeyboardInterrupt:
            if abort is not None:
                abort.set()
            for f in futures:
                f.cancel()  # hosts not begun yet are not begun at all
            raise
    return {o.host: o for o in outcomes}
