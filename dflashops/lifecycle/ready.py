"""Readiness: wait for the units a run started, judge each ready and verified, dead, drifted or
out of time, and settle the units that run over several hosts (spans.py) with the other hosts.

``Readiness`` is the part of a host's run (deploy.py's HostRun) that waits and judges; it holds
the run's outcome so far: which units are ready, which failed, which wait for a files entry.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field

from dflashops.agent.answers import UnitProbe
from dflashops.changes.units import Change
from dflashops.changes.verdicts import (
    Pending,
    Ready,
    probe_spec,
    readiness,
    ready_settings,
    stop_problem,
    stopped_text,
)
from dflashops.engines.render import Rendered
from dflashops.lifecycle.options import Board, Interrupted, Options
from dflashops.lifecycle.session import HostSession
from dflashops.plan.model import label, span_of

POLL = 0.25  # s between readiness checks on the host (at most: a unit's interval may be less)
REPORT_EVERY = 2.0  # s between the host's progress reports while it waits


@dataclass
class Readiness(HostSession):
    opts: Options = field(default_factory=Options)
    board: Board = lambda host, text: None
    ready: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)  # units held back by a files entry

    def __post_init__(self) -> None:
        super().__post_init__()
        self.by_name = {r.unit.name: r for r in self.rendered}
        # Services over several hosts this host has a part of (see spans.py).
        self.told: set[str] = set()  # spans whose failure this host has reported in full
        self.spans = {
            s for r in self.rendered if r.unit.kind == "service" and (s := span_of(r.unit))
        }

    def fail(self, unit: str, action: str, message: str, origin: bool = True) -> None:
        self.failed.add(unit)
        self.emit(unit, "failed", action, message)
        r = self.by_name.get(unit)
        span = span_of(r.unit) if r is not None else None
        if origin and span in self.spans and action in ("start", "ready", "verify"):
            assert span is not None and r is not None
            self.opts.spans.fail(span, f"{label(r.unit)}: {message}")

    def check_abort(self) -> None:
        if self.opts.abort.is_set():
            raise Interrupted(
                self.host.name,
                "interrupted (Ctrl-C): stopped between steps; `dflashops status` shows where it stands",
            )

    def _wait_ready(
        self,
        units: list[Rendered],
        changes: dict[str, Change],
        first: dict[str, UnitProbe] | None = None,
    ) -> None:
        """Judge each unit ready and verified, dead (reported at once with its log) or out of
        time. Units not (re)started in this run are judged on ``first`` (the probe made with
        the facts) when it has them; the rest are waited for on the host: one ``wait`` call
        that polls there and reports as units finish (round trips: 1, however long it takes)."""
        pending = {r.unit.name: r for r in units}
        started = time.monotonic()
        deadline = {n: started + ready_settings(r).timeout for n, r in pending.items()}
        for name, r in list(pending.items()):
            c = changes.get(name)
            fresh = c is not None and c.runs_after
            if first and name in first and not fresh and self._judge(r, first[name], c, False):
                del pending[name]
        seen: dict[str, UnitProbe] = {}  # the last full probe of each unit
        while pending:
            if self._span_casualties(pending):
                continue
            now = time.monotonic()
            specs = [
                (probe_spec(r, self.resolved.values), max(0.0, deadline[n] - now))
                for n, r in pending.items()
            ]
            poll = min([POLL] + [ready_settings(r).interval for r in pending.values()])
            held = {n for n, r in pending.items() if self._held(r)}
            stream = self.agent.wait(
                self.workdir,
                specs,
                poll=poll,
                report_every=REPORT_EVERY,
                abort=self.opts.abort,
                hold=held,
            )
            with closing(stream) as reports:  # a break below ends the host's wait too
                for report in reports:
                    for name, p in report.units.items():
                        if name not in pending:
                            continue
                        seen[name] = p
                        late = time.monotonic() > deadline[name]
                        if name not in report.done and not late:
                            continue  # a progress line: the host's rule says it is not done yet
                        late = late or name in report.done
                        if self._judge(pending[name], p, changes.get(name), late):
                            del pending[name]
                    if self._joined(held, pending, seen, changes):
                        break  # the host still watches them: a new wait, without hold
                    if pending:
                        self.board(
                            self.host.name,
                            f"{len(units) - len(pending)}/{len(units)} ready, waiting for "
                            f"{', '.join(sorted(pending))} ({time.monotonic() - started:.0f}s)",
                        )
                    if any(self.opts.spans.failure(span_of(r.unit)) for r in pending.values()):
                        break  # a part elsewhere failed: this wait ends now (the stream closes)
            if self.opts.abort.is_set():
                raise Interrupted(
                    self.host.name,
                    f"interrupted while waiting for {', '.join(sorted(pending))}",
                )
        self.board(self.host.name, "")

    def _joined(
        self,
        held: set[str],
        pending: dict[str, Rendered],
        seen: dict[str, UnitProbe],
        changes: dict[str, Change],
    ) -> bool:
        """Ranks watched while their unit got ready: it is, and they still run (a probe from
        before their banner: the next wait, without hold, says). True when there were any."""
        joined = [
            n for n in held & set(pending) if self.opts.spans.is_ready(span_of(pending[n].unit))
        ]
        for name in joined:
            got = seen.get(name)
            if (
                got is not None
                and got.banner is not None
                and self._judge(pending[name], got, changes.get(name), False)
            ):
                del pending[name]
        return bool(joined)

    def _held(self, r: Rendered) -> bool:
        """A part of a multi-host unit with no readiness of its own (a worker rank, a Ray
        node): ready at its banner alone, it is watched until its unit's head part is ready,
        so that dying meanwhile (even right after the banner) fails the unit."""
        span = span_of(r.unit)
        return (
            span in self.spans
            and not self.opts.spans.is_ready(span)
            and (r.unit.port is None or r.launch.health_path is None)
        )

    def _span_casualties(self, pending: dict[str, Rendered]) -> bool:
        """Fail (and stop waiting for) the pending parts of units that failed elsewhere."""
        hit = False
        for name, r in list(pending.items()):
            why = self._span_failure(r)
            if why is not None:
                del pending[name]
                self.fail(name, "ready", f"not ready: {why}", False)
                hit = True
        return hit

    def _span_failure(self, r: Rendered) -> str | None:
        """Why the unit this part belongs to failed (None: it did not). The failing part's log
        tail is told once per host: the host's first part to hear it."""
        span = span_of(r.unit)
        why = self.opts.spans.failure(span)
        if why is None or span is None:
            return None
        if span in self.told:
            first = why.splitlines()[0].removesuffix("; last lines of its log:")
            why = f"{first} (its log is above)" if "\n" in why else first
        self.told.add(span)
        return f"{r.unit.service} failed: {why}"

    def _settle_spans(self, spans: set[str]) -> None:
        """Once the other hosts of these multi-host units are done with them too: a failed
        unit stops on every host, its parts here included (even ready ones, and a crashed one
        its supervisor would restart): one rank alone only holds GPUs."""
        if not spans:
            return
        self.opts.spans.end(spans, self.host.name)
        parts = [r for r in self.rendered if span_of(r.unit) in spans]
        longest = max(ready_settings(r).timeout for r in parts)
        self.opts.spans.settle(spans, self.host.name, longest + 30.0, self.opts.abort)
        doomed = [r for r in parts if self.opts.spans.failure(span_of(r.unit)) is not None]
        if not doomed:
            return
        for r in doomed:
            self.ready.discard(r.unit.name)
            if r.unit.name not in self.failed:
                self.fail(r.unit.name, "ready", self._span_failure(r) or "", False)
        self.check_abort()
        results = self.agent.stop(
            self.workdir,
            [(r.unit.name, r.unit.spec.stop_grace) for r in doomed],
            gpu_timeout=self.opts.gpu_timeout,
        )
        for r in doomed:
            res = results.get(r.unit.name)
            if res is None or not res.ok:
                self.emit(r.unit.name, "failed", "stop", f"stop incomplete: {stop_problem(res)}")
            elif res.was_running:
                self.emit(
                    r.unit.name,
                    "changed",
                    "stop",
                    f"stopped with the rest of {r.unit.service} ({stopped_text(res)}; logs kept)",
                )

    def _judge(self, r: Rendered, p: UnitProbe | None, c: Change | None, late: bool) -> bool:
        """Act on the unit's readiness verdict (changes/verdicts.py): True when its wait is
        over (ready, drifted, dead or timed out)."""
        name = r.unit.name
        verdict = readiness(r, p, fresh=c is not None and c.runs_after, late=late)
        if isinstance(verdict, Pending):
            return False
        if not isinstance(verdict, Ready):
            self.fail(name, verdict.action, verdict.message)
            return True
        self.ready.add(name)
        span = span_of(r.unit)
        if verdict.head and span is not None:
            self.opts.spans.mark_ready(span)  # its head: every rank has joined it
        self.emit(name, verdict.status, "ready", verdict.message)
        return True
