"""Units over several hosts, as one unit: what the hosts of one run tell each other.

Each host runs in its own thread (run.py) and deploys its own part of a unit that spans nodes
(the ranks of a multi-node SGLang, vLLM or torchrun unit; the Ray nodes and API server of a
vLLM service over Ray). A part that fails to start or to become ready fails the whole unit:
its message, with its rank and log tail, ends the other hosts' waits for their parts at once
(instead of their ready timeout), and every host stops its parts of that unit, so no rank is
left holding GPUs at a rendezvous that can never complete.

A part with no readiness of its own (a worker rank, a Ray node: ready at its banner alone)
is watched until the unit's head part is ready (``mark_ready``): dying in that time, even right
after its banner, fails the unit. A host's verdict on a span waits for the other hosts of that
span that are in this run and still working on it (``settle``), so a failure found late on one
host still reaches all.
Hosts not started yet (more hosts than ``--forks``) or unreachable are never waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Spans:
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _failed: dict[str, str] = field(default_factory=dict)
    _working: dict[str, set[str]] = field(default_factory=dict)  # span -> hosts on it
    _arrived: dict[str, set[str]] = field(default_factory=dict)  # span -> hosts at the meeting
    _ready: set[str] = field(default_factory=set)  # spans whose head part is ready

    def mark_ready(self, span: str) -> None:
        """The part with the unit's readiness (the head, the API server) is ready: every rank
        has joined it, so the ranks without readiness of their own are ready too."""
        with self._cond:
            self._ready.add(span)
            self._cond.notify_all()

    def is_ready(self, span: str | None) -> bool:
        with self._cond:
            return span in self._ready

    def begin(self, spans: Iterable[str], host: str) -> None:
        with self._cond:
            for s in spans:
                self._working.setdefault(s, set()).add(host)

    def end(self, spans: Iterable[str], host: str) -> None:
        with self._cond:
            for s in spans:
                self._working.get(s, set()).discard(host)
            self._cond.notify_all()

    def fail(self, span: str, message: str) -> None:
        """The first failure of a span is the one every host reports."""
        with self._cond:
            self._failed.setdefault(span, message)
            self._cond.notify_all()

    def failure(self, span: str | None) -> str | None:
        with self._cond:
            return self._failed.get(span) if span is not None else None

    def settle(
        self, spans: Iterable[str], host: str, timeout: float, abort: threading.Event
    ) -> None:
        """Wait until no other host is still working on these spans (or ``timeout``, or
        Ctrl-C): then every failure of theirs is known here."""
        wanted = set(spans)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not abort.is_set():
                others = [s for s in wanted if self._working.get(s, set()) - {host}]
                left = deadline - time.monotonic()
                if not others or left <= 0:
                    return
                self._cond.wait(min(left, 0.25))  # 0.25: Ctrl-C is seen soon

    def meet(self, span: str, host: str, timeout: float, abort: threading.Event) -> None:
        """Wait until every host working on ``span`` is here too (or ``timeout``, or
        Ctrl-C), so that its parts restart together: a rolling restart's one replica."""
        deadline = time.monotonic() + timeout
        with self._cond:
            here = self._arrived.setdefault(span, set())
            here.add(host)
            self._cond.notify_all()
            while not abort.is_set():
                left = deadline - time.monotonic()
                if self._working.get(span, set()) <= here or left <= 0:
                    return
                self._cond.wait(min(left, 0.25))
