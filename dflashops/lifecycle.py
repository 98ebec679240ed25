"""Carry out changes on one host: ship, stop, start, wait for readiness, verify identity.

One ``HostRun`` per host (hosts run in parallel, see run.py). It holds the host's connection
and agent and reports every step through the shared EventLog. Round trips: facts (1), then only
what the changes need: ship (1, or 2 when units restart), stop (1), start (1 per batch), and
one wait on the host for everything started (polled there, reported as it happens); the facts
call probes the services too, so a deploy with nothing to do costs that one call. Orphans
(units no project playbook defines for the host, see orphans.py) are named, block only what
they hold, and go with --prune.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone

from dflashops.agent import Agent
from dflashops.agent.answers import HostFacts, ProbeSpec, StopResult, UnitProbe
from dflashops.agent.lock import take as hold_lock
from dflashops.changes import Change, describe_state, plan_changes
from dflashops.config.inventory import Host
from dflashops.config.playbook import Job, Ready
from dflashops.engines import identity
from dflashops.engines.secrets import auth_headers as secret_auth
from dflashops.engines.secrets import files as secret_files
from dflashops.errors import HostError
from dflashops.events import EventLog
from dflashops.hosts import connect
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.inert import inert
from dflashops.nodestate import NodeState
from dflashops.orphans import Orphan, blocking, find, ways_out
from dflashops.preflight.parsers import before_restart
from dflashops.render import Rendered
from dflashops.spans import Spans, label, span_of
from dflashops.stage import Stage, envs_request, files_request
from dflashops.supervision import policy, restart_policy

POLL = 0.25  # s between readiness checks on the host (at most: a unit's interval may be less)
REPORT_EVERY = 2.0  # s between the host's progress reports while it waits
Board = Callable[[str, str], None]  # host, text: the live progress line (no-op off a terminal)


@dataclass
class Options:
    check: bool = False
    diff: bool = False
    force: bool = False  # start even where GPUs hold memory of processes that are not ours
    rerun: bool = False  # run jobs again that finished with exit 0
    prune: bool = False  # deploy: stop orphans and move their folders to units/.pruned/
    keep_logs: int = 20
    gpu_timeout: float = 60.0
    lock_wait: float = 0.0  # s to wait for a host's deploy lock held by another actor
    abort: threading.Event = field(default_factory=threading.Event)  # set on Ctrl-C
    spans: Spans = field(default_factory=Spans)  # the hosts' word on units over several hosts


class Interrupted(HostError):
    """Ctrl-C: the host stops between steps (never in the middle of a verified put)."""


@dataclass
class HostRun:
    host: Host
    rendered: list[Rendered]
    events: EventLog
    opts: Options = field(default_factory=Options)
    board: Board = lambda host, text: None
    # Unit names the project's playbooks define for this host; None: unknown (a project
    # playbook did not load), so nothing is called an orphan.
    known: set[str] | None = None
    node: NodeState = field(default_factory=NodeState)  # environments and files for this host
    peers: dict[str, Host] = field(default_factory=dict)  # the inventory: relay sources
    ready: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)  # units held back by a files entry
    orphans: list[Orphan] = field(default_factory=list)
    warm: BaseConnection | None = None  # opened while pre-flight ran (prewarm.py)

    def __post_init__(self) -> None:
        self.conn = self.warm if self.warm is not None else connect(self.host)
        # One agent kept for the run: facts, write, stop, start and wait are requests to it,
        # not a new interpreter each (round trips stay; processes and their start-up go).
        self.agent = Agent(self.conn, self.host.python, keep=True)
        self.by_name = {r.unit.name: r for r in self.rendered}
        self.workdir = self.host.workdir  # replaced by the host's absolute path at the first facts
        self.peer_agents: dict[str, Agent] = {}
        self.stage: Stage | None = None
        # Services over several hosts this host has a part of (see spans.py).
        self.told: set[str] = set()  # spans whose failure this host has reported in full
        self.spans = {
            s for r in self.rendered if r.unit.kind == "service" and (s := span_of(r.unit))
        }

    def peer(self, name: str) -> Agent:
        """The agent on another inventory host (a relay's source), connected once."""
        if name == self.host.name:
            return self.agent
        if name not in self.peer_agents:
            if name not in self.peers:
                raise HostError(self.host.name, f"{name} is not in the inventory")
            other = self.peers[name]
            self.peer_agents[name] = Agent(connect(other), other.python)
        return self.peer_agents[name]

    def peer_workdir(self, name: str) -> str:
        return self.workdir if name == self.host.name else self.peers[name].workdir

    # -- helpers ---------------------------------------------------------------------------

    def emit(
        self, unit: str | None, status: str, action: str, message: str, **data: object
    ) -> None:
        self.events.emit(self.host.name, unit, status, action, message, **data)  # type: ignore[arg-type]

    def fail(self, unit: str, action: str, message: str, origin: bool = True) -> None:
        self.failed.add(unit)
        self.emit(unit, "failed", action, message)
        r = self.by_name.get(unit)
        span = span_of(r.unit) if r is not None else None
        if origin and span in self.spans and action in ("start", "ready", "verify"):
            assert span is not None and r is not None
            self.opts.spans.fail(span, f"{label(r.unit)}: {message}")

    def unit_dir(self, name: str) -> str:
        return f"{self.workdir}/units/{name}"

    def gather(self, probe: bool = False) -> HostFacts:
        """Facts (with ``probe``: the services' probes too, for a deploy's first verdicts)."""
        facts = self.agent.facts(
            self.host.workdir,
            files=files_request(self.node),
            envs=envs_request(self.node),
            ports=[r.unit.port for r in self.rendered if r.unit.port is not None],
            probes=[probe_spec(r) for r in self.rendered if r.unit.kind == "service"]
            if probe
            else (),
            settled=None
            if self.opts.rerun or not probe
            else {
                r.unit.name: {"fingerprint": r.fingerprint, "job": r.unit.kind == "job"}
                for r in self.rendered
            },
        )
        self.workdir = facts.workdir
        self.orphans = find(facts, self.known) if self.known is not None else []
        return facts

    def check_abort(self) -> None:
        if self.opts.abort.is_set():
            raise Interrupted(
                self.host.name,
                "interrupted (Ctrl-C): stopped between steps; `dflashops status` shows where it stands",
            )

    def close(self) -> None:
        # For --json readers and benchmarks: how many round trips this host cost.
        self.agent.close()
        self.events.emit(
            self.host.name,
            None,
            "info",
            "stats",
            f"{self.agent.round_trips} round trips, {self.conn.commands} remote commands",
            show=False,
            commands=self.conn.commands,
            round_trips=self.agent.round_trips,
        )
        self.conn.close()
        for agent in self.peer_agents.values():
            agent.close()
            agent.conn.close()

    # -- deploy ----------------------------------------------------------------------------

    def deploy(self) -> None:
        """Orphans, environments, files, then services and jobs (DESIGN.md's order)."""
        self.opts.spans.begin(self.spans, self.host.name)
        try:
            self._deploy()
        finally:
            self.opts.spans.end(self.spans, self.host.name)

    def take_lock(self, command: str) -> None:
        """The host's deploy lock, held by this run's agent session until close() (one actor
        per host: a second is refused naming us, or waits with --lock-wait)."""

        def waiting(text: str) -> None:
            self.emit(None, "info", "lock", text)

        hold_lock(
            self.agent, self.host.workdir, command, self.opts.lock_wait, self.opts.abort, waiting
        )

    def _deploy(self) -> None:
        if not self.opts.check:  # a plan changes nothing: it needs no lock
            self.take_lock("deploy")
        facts = self.gather(probe=True)
        self._orphans()
        self.stage = stage = Stage(self, self.node, facts)
        stage.environments()
        stage.files()
        changes = plan_changes(
            self.rendered, facts, rerun=self.opts.rerun, content=self._content(stage)
        )
        if self.opts.diff:
            self._show_diffs(facts, changes)
        changes = self._node_blocked(changes, stage)
        if facts.gpus.skipped and any(c.runs_after for c in changes) and not self.opts.check:
            # The facts call judged nothing would start; something does (files moved under a
            # running unit): its GPU check needs nvidia-smi after all.
            facts = facts.model_copy(update={"gpus": self.agent.gpus(self.workdir)})
        if self.opts.check:
            for c in changes:
                status = "ok" if c.action == "ok" else "changed"
                verb = {
                    "ok": "ok",
                    "ship": "would ship files",
                    "start": "would start",
                    "restart": "would restart",
                }[c.action]
                self.emit(c.name, status, "plan", f"{verb} ({c.reason})")
            return
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

    def _notify(self, facts: HostFacts) -> list[tuple[bytes, str, int]]:
        """The host's webhook, as WORKDIR/notify.json (0600), when it is not there already:
        supervisors read it when they restart a unit. The URL is a secret: redacted."""
        spec = self.host.webhook
        url = spec
        if spec is not None and spec.startswith("env:"):
            url = os.environ.get(spec[4:])
            if not url:
                self.emit(
                    None,
                    "failed",
                    "notify",
                    f"notify: {spec[4:]} is not set on the controller, so restarts on this host are not reported: set it (or remove notify) and deploy again",
                    entry="notify",
                )
                self.failed.add("notify")
                return []
        body = (json.dumps({"webhook": url, "host": self.host.name}) if url else "{}").encode()
        if facts.notify_sha256 == hashlib.sha256(body).hexdigest() or (
            not url and facts.notify_sha256 is None
        ):
            return []
        if url:
            self.events.add_secrets([url])
        if self.opts.check:
            self.emit(
                None,
                "changed",
                "notify",
                "notify: would set the host's webhook"
                if url
                else "notify: would clear the host's webhook",
                entry="notify",
            )
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
        return [(body, f"{self.workdir}/notify.json", 0o600)]

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
            unit = c.rendered.unit
            env_why = stage.envs_failed.get(unit.env.name) if unit.env is not None else None
            waits = [k for k in unit.waits if stage.entries.get(k) not in ("ok", "changed")]
            if env_why is None and not waits:
                kept.append(c)
                continue
            if not c.runs_after:
                kept.append(c)  # nothing to start: it stays as it is
                continue
            still = " (still running its old process)" if c.action == "restart" else ""
            if env_why is not None and unit.env is not None:
                verb = "restarted" if still else "started"
                self.fail(
                    c.name, "start", f"not {verb}: environment {unit.env.name} did not build{still}"
                )
                continue
            failed = [k for k in waits if stage.entries.get(k) == "failed"]
            if failed:
                self.fail(
                    c.name, "start", f"not started: files {', '.join(failed)} not in place{still}"
                )
                continue
            self.emit(
                c.name,
                "waiting",
                "start",
                f"waiting: {'; '.join(stage.reasons.get(k, k) for k in waits)}{still}",
            )
            self.waiting.add(c.name)
        return kept

    def _may_run(self, c: Change, facts: HostFacts) -> bool:
        """Refuse to start on top of something that is not ours: a foreign listener on the
        port, GPU memory held by foreign processes (unless --force), a missing secret."""
        unit = c.rendered.unit
        ours = {p for uf in facts.units.values() if uf.running for p in uf.group_pids}
        if unit.port is not None:
            listener = facts.listener(unit.port)
            if listener is not None and not set(listener.pids) <= ours:
                holder = ", ".join(map(str, listener.pids)) or "a process we cannot see"
                self.fail(
                    c.name,
                    "start",
                    f"port {unit.port} is already taken by pid {holder} (not a dflashops unit); not started",
                )
                return False
        for orphan, held in blocking(self.orphans, facts, unit.port, unit.gpus):
            self.fail(
                c.name,
                "start",
                f"{held} held by orphan {orphan.name} ({orphan.describe()}), which no playbook "
                f"defines any more; not started: {ways_out(orphan.name)}",
            )
            return False
        for gpu in unit.gpus:
            foreign = [p for p in facts.gpus.processes if p.gpu_index == gpu and p.pid not in ours]
            if foreign and not self.opts.force:
                held = ", ".join(f"pid {p.pid} ({p.used_mib} MiB)" for p in foreign)
                self.fail(
                    c.name,
                    "start",
                    f"GPU {gpu} holds memory of processes dflashops did not start: {held}; not started (--force starts anyway)",
                )
                return False
        sources = [*unit.spec.secret_env.values(), *c.rendered.launch.secrets.sources()]
        missing = sorted({src for src in sources if src not in os.environ})
        if missing:
            self.fail(
                c.name,
                "start",
                f"secret_env/secret_args need {', '.join(missing)} set on the controller; not started",
            )
            return False
        self.events.add_secrets(os.environ[src] for src in sources)
        return True

    def _show_diffs(self, facts: HostFacts, changes: list[Change]) -> None:
        for c in changes:
            if c.action == "ok":
                continue
            uf = facts.unit(c.name)
            old = ""
            if uf is not None and uf.script_sha256:
                got = self.conn.get(f"{self.unit_dir(c.name)}/launch.sh")
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
            (launch_bytes(r), f"{base}/launch.sh", 0o700),
            (
                json.dumps(unit_record(r, self._content_of(r)), indent=1).encode() + b"\n",
                f"{base}/unit.json",
                0o600,
            ),
        ]
        hidden = secret_files(r.launch.secrets, r.unit.spec.secret_env, os.environ)
        files.extend((body, f"{base}/{name}", 0o600) for name, body in hidden.items())
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
            self.emit(name, "changed", "stop", f"stopped ({stopped_text(res)}; logs kept)")

    def _orphans(self) -> None:
        """Name every orphan; with --prune, stop them first (proven group only, grace, GPU
        release) and move their folders to units/.pruned/, logs included."""
        if not self.orphans:
            return
        if not self.opts.prune or self.opts.check:
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
            self.emit(
                o.name,
                "changed",
                "prune",
                f"orphan pruned ({how}; folder moved to {res.pruned_to})",
            )
        self.orphans = kept

    # -- readiness and identity ------------------------------------------------------------

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
        last: dict[str, str] = {}
        for name, r in list(pending.items()):
            c = changes.get(name)
            fresh = c is not None and c.runs_after
            if (
                first
                and name in first
                and not fresh
                and self._judge(r, first[name], c, False, last)
            ):
                del pending[name]
        seen: dict[str, UnitProbe] = {}  # the last full probe of each unit
        while pending:
            if self._span_casualties(pending):
                continue
            now = time.monotonic()
            specs = [(probe_spec(r), max(0.0, deadline[n] - now)) for n, r in pending.items()]
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
                        if self._judge(pending[name], p, changes.get(name), late, last):
                            del pending[name]
                    # Ranks watched while their unit got ready: it is, and they still run
                    # (a probe from before their banner: the next wait, without hold, says).
                    joined = [
                        n
                        for n in held & set(pending)
                        if self.opts.spans.is_ready(span_of(pending[n].unit))
                    ]
                    for name in joined:
                        got = seen.get(name)
                        if (
                            got is not None
                            and got.banner is not None
                            and self._judge(pending[name], got, changes.get(name), False, last)
                        ):
                            del pending[name]
                    if joined:
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

    def _judge(
        self, r: Rendered, p: UnitProbe | None, c: Change | None, late: bool, last: dict[str, str]
    ) -> bool:
        """True when the unit's wait is over (ready, drifted, dead or timed out)."""
        name = r.unit.name
        if p is None:
            self.fail(name, "ready", "the probe returned nothing for this unit")
            return True
        restarting = p.supervisor is not None and p.supervisor.restarting
        if not (p.alive and p.ours) or restarting:
            code = (
                f"exit code {p.exit.code}" if p.exit and p.exit.code is not None else "no exit code"
            )
            log = "\n".join(f"    {line}" for line in (p.log_tail or [])) or "    (log is empty)"
            then = ""
            if span_of(r.unit) in self.spans:
                then = "; the unit stops on every host"  # see _settle_spans
            elif restarting and p.supervisor is not None:
                then = (
                    f"; its supervisor restarts it ({restart_policy(r.unit)}, in "
                    f"{p.supervisor.next_start_in or 0:g}s): `dflashops stop --unit {name}` ends that"
                )
            self.fail(
                name, "ready", f"died while starting ({code}){then}; last lines of its log:\n{log}"
            )
            return True
        healthy = (
            r.unit.port is None
            or r.launch.health_path is None
            or (p.health is not None and p.health.status == 200)
        )
        if not healthy:
            last[name] = health_text(p)
            if late:
                timeout = ready_settings(r).timeout
                after = (
                    "stopped with the unit's other parts (logs kept)"
                    if span_of(r.unit) in self.spans
                    else "left running for inspection"
                )
                self.fail(
                    name,
                    "ready",
                    f"not ready after {timeout:.0f}s (last probe: {last[name]}); {after}",
                )
                return True
            return False
        mismatches = identity.check(r, p)
        if mismatches:
            self.fail(
                name,
                "verify",
                "drifted: the running unit is not the one rendered\n"
                + identity.describe(mismatches),
            )
            return True
        self.ready.add(name)
        span = span_of(r.unit)
        if span in self.spans and r.unit.port is not None and r.launch.health_path is not None:
            self.opts.spans.mark_ready(span)  # its head: every rank has joined it
        fresh = c is not None and c.runs_after
        self.emit(
            name,
            "ok" if not fresh else "changed",
            "ready",
            f"ready and verified (pid {p.pid}, fingerprint {r.short})"
            if fresh
            else f"ok (pid {p.pid}, fingerprint {r.short})",
        )
        return True

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
            self._start([c for c in batch if c.runs_after and c.name not in self.failed])
            for c in batch:
                if c.name in self.failed:
                    continue
                if not c.runs_after:
                    self.emit(c.name, "ok", "verify", c.reason)
                self.ready.add(c.name)


MEET_TIMEOUT = 120.0  # s a host waits for the other hosts of a unit to restart it together


def replica_batches(changes: list[Change]) -> list[list[Change]]:
    """A rolling restart's steps: the parts of each unit over several hosts together, first,
    in the same order on every host (so the hosts meet on them in turn); then each other
    replica alone."""
    spans: dict[str, list[Change]] = {}
    alone: list[list[Change]] = []
    for c in changes:
        span = span_of(c.rendered.unit)
        if span is None:
            alone.append([c])
        else:
            spans.setdefault(span, []).append(c)
    return [spans[s] for s in sorted(spans)] + alone


def health_text(p: UnitProbe) -> str:
    if p.health is None:
        return "not probed"
    if p.health.status:
        return f"HTTP {p.health.status}"
    return p.health.error or "no answer"


def ready_settings(r: Rendered) -> Ready:
    spec = r.unit.spec
    return Ready() if isinstance(spec, Job) else spec.ready


def launch_bytes(r: Rendered) -> bytes:
    """launch.sh as shipped: what a start checks on disk."""
    return r.script.encode()


def unit_record(r: Rendered, content: dict[str, str | None] | None = None) -> dict[str, object]:
    u = r.unit
    return {
        "unit": u.name,
        "fingerprint": r.fingerprint,
        "engine": u.engine,
        "kind": u.kind,
        "port": u.port,
        "gpus": list(u.gpus),
        "tp": u.tp,
        "dp": u.dp,
        "playbook": u.playbook.name,
        "stop_grace": u.spec.stop_grace,
        "stop_signal_to": "leader" if r.launch.stop_leader else "group",
        "supervise": policy(u),
        "content": content or {},
        "deployed_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


METRICS_ENGINES = ("sglang", "vllm", "stub")


def probe_spec(r: Rendered, metrics: bool = False) -> ProbeSpec:
    spec = r.unit.spec
    bind = getattr(spec, "bind", "127.0.0.1")
    return ProbeSpec(
        name=r.unit.name,
        host="127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind,
        port=r.unit.port,
        health_path=r.launch.health_path,
        identity_paths=identity.identity_paths(r.unit.engine),
        metrics_path="/metrics" if metrics and r.unit.engine in METRICS_ENGINES else None,
        headers=auth_headers(r),
    )


def auth_headers(r: Rendered) -> dict[str, str]:
    """The key of secret_args' api-key, from the controller's environment: probes never read
    it from a file on the host (nor from the playbook, where pre-flight refuses it)."""
    return secret_auth(r.unit, os.environ)


def stopped_text(res: StopResult) -> str:
    how = "SIGKILL after the grace period" if res.killed else "SIGTERM"
    gpu = "; GPU memory released" if res.gpu_freed else ""
    return f"pids {', '.join(map(str, res.pids))} by {how}{gpu}"


def stop_problem(res: object) -> str:
    if res is None:
        return "no answer from the host"
    held = getattr(res, "gpu_held", None)
    if held:
        return "GPU memory still held after stop: " + ", ".join(
            f"GPU {h.gpu_index}: {h.used_mib} MiB by pid {h.pid}" for h in held
        )
    return str(getattr(res, "error", None) or "processes survived SIGKILL")
