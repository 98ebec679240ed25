"""Carry out changes on one host: ship, stop, start, wait for readiness, verify identity.

One ``HostRun`` per host (hosts run in parallel, see run.py), built on the host's session
(session.py) and its readiness wait (ready.py); it reports every step through the shared
EventLog. Round trips: facts (1), then only what the changes need: ship (1, or 2 when units
restart), stop (1), start (1 per batch), and one wait on the host for everything started
(polled there, reported as it happens); the facts call probes the services too, so a deploy
with nothing to do costs that one call. Orphans (units no project playbook defines for the
host, see orphans.py) are named, block only what they hold, and go with --prune.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflashops.agent import history_actions
from dflashops.agent.answers import HostFacts
from dflashops.agent.history_actions import RolledUnit
from dflashops.agent.lock import holder
from dflashops.agent.lock import take as hold_lock
from dflashops.agent.remote import layout
from dflashops.changes.history import command_line, reapplies
from dflashops.changes.orphans import ways_out
from dflashops.changes.units import Change, describe_state, plan_changes
from dflashops.changes.verdicts import (
    launch_bytes,
    node_blocked,
    replica_batches,
    start_blocker,
    stop_problem,
    stopped_text,
    unit_record,
)
from dflashops.engines.render import Rendered
from dflashops.engines.secrets import files as secret_files
from dflashops.errors import DflashopsError
from dflashops.lifecycle import keep
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.ready import Readiness
from dflashops.lifecycle.stage import Stage
from dflashops.output import inert
from dflashops.plan.model import span_of
from dflashops.preflight.parsers import before_restart

MEET_TIMEOUT = 120.0  # s a host waits for the other hosts of a unit to restart it together
PLAN_VERBS = {  # --check's word for each decided action
    "ok": "ok",
    "ship": "would ship files",
    "start": "would start",
    "restart": "would restart",
}


@dataclass
class HostRun(Readiness):
    # The project's state folder (.dflashops/ beside the inventory): where kept outputs are
    # mirrored (lifecycle/keep.py). None: this run mirrors and restores nothing.
    state_dir: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stage: Stage | None = None
        self.restored: set[str] = set()  # kept jobs whose outputs were put back before start
        # What this run changed (unit -> the fingerprint it runs now), for its revision in the
        # host's history; and the units a rollback put on a kept revision (asked with facts).
        self.changed: dict[str, str | None] = {}
        self.rolled: dict[str, RolledUnit] = {}

    # -- deploy ----------------------------------------------------------------------------

    def deploy(self) -> None:
        """Orphans, environments, files, then services and jobs (DESIGN.md's order)."""
        self.opts.spans.begin(self.spans, self.host.name)
        try:
            self._deploy()
        finally:
            self.opts.spans.end(self.spans, self.host.name)
            self.record("deploy")

    def take_lock(self, command: str) -> None:
        """The host's deploy lock, held by this run's agent session until close() (one actor
        per host: a second is refused naming us, or waits with --lock-wait)."""

        def waiting(text: str) -> None:
            self.emit(None, "info", "lock", text)

        hold_lock(
            self.agent, self.host.workdir, command, self.opts.lock_wait, self.opts.abort, waiting
        )

    def _deploy(self) -> None:
        """Decide, then apply or not: --check prints the very decisions a deploy acts on
        (environments and files entries are decided the same way, in stage.py)."""
        apply = not self.opts.check
        if apply:  # a plan changes nothing: it needs no lock
            self.take_lock("deploy")
        history_actions.rolled_ahead(self.agent, self.workdir, self.rolled.update)
        facts = self.gather(probe=True, rerun=self.opts.rerun)
        if apply:  # the lock just gave a new node its id: remember it, or status warns after
            self._remember(facts)
        self._orphans(prune=apply and self.opts.prune)
        changes = self._decide(facts)
        self._reapply(changes, facts)
        if apply:
            self._apply(changes, facts)
        else:
            for c in changes:
                status = "ok" if c.action == "ok" else "changed"
                self.emit(c.name, status, "plan", f"{PLAN_VERBS[c.action]} ({c.reason})")
            keep.before_start(self, self.state_dir, [c for c in changes if c.runs_after])

    def _reapply(self, changes: list[Change], facts: HostFacts) -> None:
        """Say first which units a rollback left on a kept revision this deploy puts back on
        the playbooks' rendering (DESIGN fleet-page 4)."""
        running = {n: uf.fingerprint for n, uf in facts.units.items()}
        named = reapplies(self.rolled, running, [c.name for c in changes if c.action != "ok"])
        if named:
            verb = "would re-apply" if self.opts.check else "re-applies"
            self.emit(
                None,
                "info",
                "history",
                f"{verb} the playbooks to what `dflashops rollback` left: {', '.join(named)}",
            )

    def record(self, command: str, rollback_to: int | None = None) -> None:
        """The host's revision for what this run changed (none when nothing did), made while
        the run still holds the deploy lock; one call. A failure to record is said, and the
        run's outcome stands."""
        if not self.changed or self.opts.check:
            return
        line = command_line(sys.argv, command, self.events.redact)
        try:
            revision = history_actions.record(
                self.agent,
                self.workdir,
                line,
                str(holder(command)["who"]),
                dict(self.changed),
                rollback_to,
            )
        except DflashopsError as exc:
            self.emit(None, "info", "history", f"no revision recorded on this host: {exc}")
            return
        self.emit(None, "info", "history", f"recorded as revision {revision}", revision=revision)

    def _decide(self, facts: HostFacts) -> list[Change]:
        """What each unit needs, after its environments and files entries (which stage.py
        makes so, or with --check says it would)."""
        self.stage = stage = Stage(
            self, self.node, facts, self.opts.check, self.check_abort, self.failed
        )
        stage.both()
        changes = plan_changes(
            self.rendered, facts, rerun=self.opts.rerun, content=self._content(stage)
        )
        if self.opts.diff:
            self._show_diffs(facts, changes)
        return self._node_blocked(changes, stage)

    def _apply(self, changes: list[Change], facts: HostFacts) -> None:
        if facts.gpus.skipped and any(c.runs_after for c in changes):
            # The facts call judged nothing would start; something does (files moved under a
            # running unit): its GPU check needs nvidia-smi after all.
            facts = facts.model_copy(update={"gpus": self.agent.gpus(self.workdir)})
        runnable = [c for c in changes if c.runs_after and self._may_run(c, facts)]
        restarts = [c for c in runnable if c.action == "restart"]
        # unit.json names what runs: a restarting unit gets its new files only once the old
        # process is gone, so a failed stop never leaves a record that lies about it.
        self._ship(
            [c for c in changes if c.action == "ship" or (c.action == "start" and c in runnable)],
            payloads=changes,
            extra=self._notify(facts),
        )
        # The engine in the unit's environment judges a changed command line before the old
        # process goes: one it rejects fails here and keeps running (DESIGN "Real parts" 3).
        restarts = before_restart(self, restarts)
        self._stop(restarts)
        self._ship([c for c in restarts if c.name not in self.failed])
        services = [c for c in changes if c.rendered.unit.kind == "service"]
        self._start([c for c in services if c.runs_after and c.name not in self.failed])
        self._wait_ready(
            [c.rendered for c in services if c.name not in self.failed],
            {c.name: c for c in changes},
            first=facts.probe.units if facts.probe is not None else None,
        )
        self._settle_spans(self.spans)
        self._run_jobs([c for c in changes if c.rendered.unit.kind == "job"], facts)
        # The one mirror of this deploy, for the kept jobs whose start did not do it.
        keep.after(
            self,
            self.state_dir,
            [r.unit for r in self.rendered if r.unit.name not in self.restored],
        )

    def _notify(self, facts: HostFacts) -> list[tuple[bytes, str, int]]:
        """The host's webhook, as WORKDIR/notify.json (0600), when it is not there already:
        supervisors read it when they restart a unit. The URL is a secret: redacted (the
        session registered it)."""
        unset = self.resolved.webhook_unset
        if unset is not None:
            self.emit(
                None,
                "failed",
                "notify",
                f"notify: {unset} is not set on the controller, so restarts on this host are not reported: set it (or remove notify) and deploy again",
                entry="notify",
            )
            self.failed.add("notify")
            return []
        url = self.resolved.webhook
        body = (json.dumps({"webhook": url, "host": self.host.name}) if url else "{}").encode()
        if facts.notify_sha256 == hashlib.sha256(body).hexdigest() or (
            not url and facts.notify_sha256 is None
        ):
            return []
        self.emit(
            None,
            "changed",
            "notify",
            "notify: the host reports restarts to its webhook"
            if url
            else "notify: webhook removed",
            entry="notify",
        )
        return [(body, posixpath.join(self.workdir, layout.NOTIFY), 0o600)]

    def _content(self, stage: Stage) -> dict[str, dict[str, str | None]]:
        """What each unit's files entries hold now (or, with --check, will hold)."""
        out: dict[str, dict[str, str | None]] = {}
        for r in self.rendered:
            if r.unit.content:
                out[r.unit.name] = {k: stage.expected(k) for k in r.unit.content}
        return out

    def _node_blocked(self, changes: list[Change], stage: Stage) -> list[Change]:
        """Units whose environment did not build, or whose files entries are not in place:
        not (re)started; a running one keeps running what it runs. The rest go on."""
        kept = []
        for c in changes:
            blocked = node_blocked(c, stage.envs_failed, stage.entries, stage.reasons)
            if blocked is None:
                kept.append(c)
            elif blocked.status == "failed":
                self.fail(c.name, "start", blocked.message)
            else:
                self.emit(c.name, "waiting", "start", blocked.message)
                self.waiting.add(c.name)
        return kept

    def _may_run(self, c: Change, facts: HostFacts) -> bool:
        """Refuse to start on top of something that is not ours (changes/verdicts.py's
        start_blocker): the unit fails, naming what is in the way."""
        why = start_blocker(c.rendered, facts, self.orphans, self.resolved.values, self.opts.force)
        if why is not None:
            self.fail(c.name, "start", why)
        return why is None

    def _show_diffs(self, facts: HostFacts, changes: list[Change]) -> None:
        for c in changes:
            if c.action == "ok":
                continue
            uf = facts.unit(c.name)
            old = ""
            if uf is not None and uf.script_sha256:
                got = self.conn.get(layout.unit_file(self.workdir, c.name, layout.LAUNCH))
                old = inert(got.decode("utf-8", "replace"))  # the host's bytes, printed
            diff = "".join(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    c.rendered.script.splitlines(keepends=True),
                    f"{self.host.name}:{c.name}/launch.sh (on host)",
                    f"{self.host.name}:{c.name}/launch.sh (rendered)",
                )
            )
            if diff:
                self.events.console.print(self.events.redact(diff), markup=False, highlight=False)

    def _ship(
        self,
        changes: list[Change],
        payloads: list[Change] | None = None,
        extra: list[tuple[bytes, str, int]] | None = None,
    ) -> None:
        """One verified round trip for every file of this step: the payloads ``payloads`` lack
        on the host, then each unit's launch.sh, unit.json and (0600) secrets.env (and
        ``extra``: the host's notify.json when it changed)."""
        self.check_abort()
        missing = {f.remote: f for c in payloads or [] for f in c.missing_payloads}.values()
        files = [(f.local.read_bytes(), f"{self.workdir}/{f.remote}", 0o755) for f in missing]
        for c in changes:
            files.extend(self._unit_files(c))
        files.extend(extra or [])
        self.agent.write(self.workdir, files)
        for f in missing:
            self.emit(None, "changed", "ship", f"shipped {f.name} ({f.sha256[:12]})")
        for c in changes:
            if c.action == "ship":
                self.changed[c.name] = c.rendered.fingerprint
                self.emit(
                    c.name,
                    "changed",
                    "ship",
                    f"files shipped ({c.reason}); still running, not restarted",
                )

    def _unit_files(self, c: Change) -> list[tuple[bytes, str, int]]:
        r = c.rendered
        base = self.unit_dir(c.name)
        # Only the host's user reads what a unit runs with (DESIGN trust 4).
        files = [
            (launch_bytes(r), posixpath.join(base, layout.LAUNCH), 0o700),
            (
                json.dumps(unit_record(r, self._content_of(r)), indent=1).encode() + b"\n",
                posixpath.join(base, layout.UNIT_RECORD),
                0o600,
            ),
        ]
        hidden = secret_files(r.launch.secrets, r.unit.spec.secret_env, self.resolved.values)
        files.extend((body, posixpath.join(base, name), 0o600) for name, body in hidden.items())
        return files

    def _content_of(self, r: Rendered) -> dict[str, str | None]:
        return {k: self.stage.expected(k) for k in r.unit.content} if self.stage else {}

    def _stop(self, changes: list[Change]) -> None:
        self.check_abort()
        if not changes:
            return
        results = self.agent.stop(
            self.workdir,
            [(c.name, c.rendered.unit.spec.stop_grace) for c in changes],
            gpu_timeout=self.opts.gpu_timeout,
        )
        for c in changes:
            res = results.get(c.name)
            if res is None or not res.ok:
                self.fail(
                    c.name,
                    "stop",
                    f"could not stop the old process: {stop_problem(res)}; not restarted",
                )

    def _start(self, changes: list[Change]) -> None:
        self.check_abort()
        if not changes:
            return
        # The launch.sh each start must find on disk: the one this run shipped (or found there
        # already, the same bytes): another actor's script is never started in our name.
        shipped = {c.name: hashlib.sha256(launch_bytes(c.rendered)).hexdigest() for c in changes}
        results = self.agent.start(
            self.workdir, [(c.name, self.opts.keep_logs) for c in changes], shipped
        )
        for c in changes:
            res = results.get(c.name)
            if res is None or not res.ok:
                self.fail(c.name, "start", f"start failed: {res.error if res else 'no answer'}")
                continue
            verb = "restarted" if c.action == "restart" else "started"
            self.changed[c.name] = c.rendered.fingerprint
            old = c.old_fingerprint
            detail = (
                f"fingerprint {old[:12]} -> {c.rendered.short}"
                if c.action == "restart" and old and old != c.rendered.fingerprint
                else c.reason
            )
            self.emit(
                c.name,
                "changed",
                c.action,
                f"{verb} (pid {res.pid}; {detail})",
                pid=res.pid,
                log=res.log,
            )

    def put_back(self, changes: list[Change], restore: Callable[[list[str]], None]) -> None:
        """Rollback's entry point: stop ``changes``' units, put their files back (``restore``
        with the names whose stop went well), then start and verify them as a deploy does."""
        self._stop([c for c in changes if c.action == "restart"])
        going = [c for c in changes if c.name not in self.failed]
        if not going:
            return
        restore([c.name for c in going])
        self._start(going)
        self._wait_ready(
            [
                c.rendered
                for c in going
                if c.rendered.unit.kind == "service" and c.name not in self.failed
            ],
            {c.name: c for c in going},
        )

    # -- restart-servers and stop ---------------------------------------------------------

    def restart_services(self, rolling: bool) -> None:
        """Restart every service unit, even unchanged ones. Rolling: one replica at a time,
        the next only when the previous is ready again, so the fleet keeps serving; the roll
        stops at the first replica that does not come back, leaving the rest on the old,
        healthy processes. A unit over several hosts is one replica: its parts restart
        together on all its hosts, before this host's other replicas."""
        self.opts.spans.begin(self.spans, self.host.name)
        try:
            self._restart_services(rolling)
        finally:
            self.opts.spans.end(self.spans, self.host.name)
            self.record("restart-servers")

    def _remember(self, facts: HostFacts) -> None:
        memory = HostMemory.at(self.state_dir)
        memory.look(self, facts)
        for line in memory.problems:
            self.emit(None, "ok", "identity", line)

    def _restart_services(self, rolling: bool) -> None:
        self.take_lock("restart-servers")
        facts = self.gather()
        changes = [
            c for c in plan_changes(self.rendered, facts) if c.rendered.unit.kind == "service"
        ]
        for c in changes:
            uf = facts.unit(c.name)
            c.action = "restart" if uf is not None and uf.running else "start"
            c.reason = "restart-servers"
        self._ship([], payloads=changes)
        batches = replica_batches(changes) if rolling else [changes]
        for i, batch in enumerate(batches):
            batch = [c for c in batch if self._may_run(c, facts)]
            spans = {s for c in batch if (s := span_of(c.rendered.unit)) in self.spans}
            for span in sorted(spans):  # the hosts of a unit over several restart it together
                self.opts.spans.meet(span, self.host.name, MEET_TIMEOUT, self.opts.abort)
            self._stop([c for c in batch if c.action == "restart"])
            self._ship([c for c in batch if c.name not in self.failed])
            self._start([c for c in batch if c.name not in self.failed])
            self._wait_ready(
                [c.rendered for c in batch if c.name not in self.failed], {c.name: c for c in batch}
            )
            self._settle_spans(spans)
            if rolling and any(c.name in self.failed for c in batch):
                for rest in (c for later in batches[i + 1 :] for c in later):
                    self.emit(
                        rest.name,
                        "skipped",
                        "restart",
                        f"not restarted: the roll stopped after {batch[0].name} failed; still on its old process",
                    )
                return

    def stop(self, names: list[str] | None, everything: bool) -> None:
        """Stop units dflashops started here: the ``names`` given (orphans too); else every
        unit in the host's workdir (``everything``: no -p); else the selected playbooks' units
        and the orphans. Jobs first, then services, then the rest. Units of the playbooks keep
        their stop_grace; any other unit stops with the grace recorded when it was deployed."""
        self.take_lock("stop")
        facts = self.gather()
        grace: dict[str, float | None] = {
            r.unit.name: r.unit.spec.stop_grace for r in self.rendered
        }
        ours = [r.unit.name for r in reversed(self.rendered)]
        if names is not None:
            order = [n for n in names if n in facts.units or n in grace]
        elif everything:
            order = ours + [n for n in sorted(facts.units) if n not in ours]
        else:
            order = ours + [o.name for o in self.orphans]
        running = [
            n for n in order if (uf := facts.unit(n)) is not None and (uf.running or uf.group_pids)
        ]
        for name in order:
            if name not in running:
                self.emit(name, "ok", "stop", f"not running ({describe_state(facts.unit(name))})")
        results = self.agent.stop(
            self.workdir, [(n, grace.get(n)) for n in running], gpu_timeout=self.opts.gpu_timeout
        )
        for name in running:
            res = results.get(name)
            if res is None or not res.ok:
                self.fail(name, "stop", f"stop incomplete: {stop_problem(res)}")
                continue
            self.changed[name] = uf.fingerprint if (uf := facts.unit(name)) else None
            self.emit(name, "changed", "stop", f"stopped ({stopped_text(res)}; logs kept)")
        self.record("stop")
        # Kept jobs are mirrored once more, all their output written by now.
        keep.after(self, self.state_dir, [r.unit for r in self.rendered if r.unit.name in order])

    def _orphans(self, prune: bool) -> None:
        """Name every orphan; with ``prune`` (--prune, not --check), stop them first (proven
        group only, grace, GPU release) and move their folders to units/.pruned/, logs
        included."""
        if not self.orphans:
            return
        if not prune:
            for o in self.orphans:
                verb = "--prune would stop it" if self.opts.prune else ways_out(o.name)
                self.emit(
                    o.name,
                    "orphan",
                    "orphan",
                    f"{o.describe()}; no playbook defines it for this host any more: {verb}",
                    pid=o.facts.process.pid,
                    port=o.port,
                    gpus=o.gpus,
                )
            return
        self.check_abort()
        results = self.agent.stop(
            self.workdir,
            [(o.name, None) for o in self.orphans],
            prune=True,
            gpu_timeout=self.opts.gpu_timeout,
        )
        kept = []
        for o in self.orphans:
            res = results[o.name]
            if not res.ok:
                kept.append(o)
                self.fail(o.name, "prune", f"orphan not pruned: {stop_problem(res)}")
                continue
            how = stopped_text(res) if res.was_running else "was not running"
            self.changed[o.name] = o.facts.fingerprint
            self.emit(
                o.name,
                "changed",
                "prune",
                f"orphan pruned ({how}; folder moved to {res.pruned_to})",
            )
        self.orphans = kept

    # -- jobs ------------------------------------------------------------------------------

    def _run_jobs(self, jobs: list[Change], facts: HostFacts) -> None:
        pending = {c.name: c for c in jobs}
        while pending:
            batch = []
            for name, c in list(pending.items()):
                needs = c.rendered.unit.needs
                held = [n for n in needs if n in self.waiting]
                if held:
                    del pending[name]
                    if c.runs_after:
                        self.waiting.add(name)
                        self.emit(name, "waiting", "start", f"waiting: {', '.join(held)} waiting")
                    continue
                if any(
                    n in self.failed
                    or (n not in self.ready and n not in pending and n in self.by_name)
                    for n in needs
                ):
                    blocked = [n for n in needs if n not in self.ready]
                    del pending[name]
                    if c.runs_after:
                        self.fail(name, "start", f"not started: {', '.join(blocked)} not ready")
                    continue
                if all(n in self.ready for n in needs):
                    batch.append(c)
                    del pending[name]
            if not batch:
                for name in pending:  # a cycle, which pre-flight rejects
                    self.fail(name, "start", "needs can never be satisfied (cycle?)")
                return
            starting = [c for c in batch if c.runs_after and c.name not in self.failed]
            # A kept job starts on its outputs: those the host lost are put back first.
            self.restored.update(c.name for c in starting)
            self._start(keep.before_start(self, self.state_dir, starting))
            for c in batch:
                if c.name in self.failed:
                    continue
                if not c.runs_after:
                    self.emit(c.name, "ok", "verify", c.reason)
                self.ready.add(c.name)
