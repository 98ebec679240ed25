"""The dashboard's loop: every interval one look at the fleet (``sample_fleet``: the kept
sessions of fleet.Watch, what `top` refreshes), kept in the store with what changed since
the look before, and the last look held for the page and /metrics.

A unit's log end is fetched only while the page shows it (asked for in the last
``TAIL_WANTED_S``), on the same kept session, right after that host's probe.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable

from dflashops.dashboard.fleet import Watch
from dflashops.dashboard.sample import Event, Sample, changes, of_watch
from dflashops.dashboard.store import Store
from dflashops.output import inert

TAIL_WANTED_S = 30.0
RECENT = 200  # events held in memory when the store cannot keep them


def sample_fleet(watch: Watch, at: float | None = None) -> Sample:
    """One look at every host of ``watch`` (one probe each, kept sessions) as a Sample,
    stamped with the time the look began (``at``, default now)."""
    began = time.time() if at is None else at
    watch.refresh()
    return of_watch(watch, began)


class Sampler:
    """``step()`` is one look, kept; ``run(stop)`` steps every ``interval`` until ``stop``.
    ``say`` gets one line for each problem of the store (once per kind of problem)."""

    def __init__(
        self, watch: Watch, store: Store | None, interval: float, say: Callable[[str], None]
    ) -> None:
        self.watch = watch
        self.store = store
        self.interval = interval
        self.say = say
        self.latest: Sample | None = None
        self.recent: deque[Event] = deque(maxlen=RECENT)
        self.wanted: dict[tuple[str, str], float] = {}  # (host, unit) -> asked at (monotonic)
        self.tails: dict[tuple[str, str], str] = {}
        self.lock = threading.Lock()
        self.said: set[str] = set()
        self.samples = 0
        watch.tails = self.tails_for

    def tails_for(self, host: str) -> list[str]:
        now = time.monotonic()
        with self.lock:
            return [
                u for (h, u), at in self.wanted.items() if h == host and now - at < TAIL_WANTED_S
            ]

    def tail(self, host: str, unit: str) -> str | None:
        """The log end of ``unit`` as last fetched (None: not yet: it is fetched from now on,
        with each look). Host text made inert."""
        with self.lock:
            self.wanted[(host, unit)] = time.monotonic()
            text = self.tails.get((host, unit))
        return inert(text) if text is not None else None

    def step(self) -> Sample:
        sample = sample_fleet(self.watch)
        events = changes(self.latest, sample)
        for name, view in self.watch.views.items():
            for unit, text in view.tails.items():
                with self.lock:
                    self.tails[(name, unit)] = text
        self.keep(sample, events)
        with self.lock:
            self.latest = sample
            self.recent.extendleft(events)
            self.samples += 1
        return sample

    def keep(self, sample: Sample, events: list[Event]) -> None:
        if self.store is None:
            return
        try:
            self.store.add(sample, events)
        except sqlite3.Error as exc:
            kind = type(exc).__name__
            if kind not in self.said:
                self.said.add(kind)
                self.say(
                    f"samples not kept in {self.store.path}: {exc}; the page goes on from "
                    "memory (check the disk, or move the file aside and restart)"
                )

    def run(self, stop: threading.Event) -> None:
        """Look every ``interval`` (measured from the start of each look) until ``stop``."""
        while not stop.is_set():
            began = time.monotonic()
            self.step()
            stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def events(self, limit: int = 50) -> list[Event]:
        """The newest events, newest first: the store's (earlier runs too), else this run's."""
        if self.store is not None:
            try:
                return self.store.events(limit)
            except sqlite3.Error:
                pass
        with self.lock:
            return list(self.recent)[:limit]
