"""The lifecycle's decisions that are not I/O: pure functions of what was rendered and what a
host answered (the batches of a rolling restart, the record a unit is shipped with, the probe a
service is judged by, the words for a probe or a stop, the readiness verdict, what blocks a
start). The read-only commands use them too; lifecycle/ acts and emits on their answers, and
tests/operations/ holds them as data.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from dflashops.agent.answers import Holder, HostFacts, Listener, ProbeSpec, StopResult, UnitProbe
from dflashops.agent.remote import layout
from dflashops.changes.orphans import Orphan, blocking, ways_out
from dflashops.changes.units import Change
from dflashops.config.playbook import Job
from dflashops.config.playbook import Ready as ReadySettings
from dflashops.engines import identity
from dflashops.engines.render import Rendered
from dflashops.engines.secrets import auth_headers as secret_auth
from dflashops.output import inert, shorten
from dflashops.plan.model import dial_host, span_of
from dflashops.plan.supervision import policy, restart_policy


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


def ready_settings(r: Rendered) -> ReadySettings:
    spec = r.unit.spec
    return ReadySettings() if isinstance(spec, Job) else spec.ready


def launch_bytes(r: Rendered) -> bytes:
    """launch.sh as shipped: what a start checks on disk."""
    return r.script.encode()


def unit_record(r: Rendered, content: dict[str, str | None] | None = None) -> dict[str, object]:
    u = r.unit
    return {
        "unit_schema": layout.UNIT_SCHEMA,
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


def probe_spec(r: Rendered, secrets: Mapping[str, str], metrics: bool = False) -> ProbeSpec:
    """How the host probes the service; ``secrets``: the run's resolved controller variables
    (lifecycle/secrets.py), for the api-key's Bearer header."""
    spec = r.unit.spec
    bind = getattr(spec, "bind", "127.0.0.1")
    return ProbeSpec(
        name=r.unit.name,
        host=dial_host(bind),
        port=r.unit.port,
        health_path=r.launch.health_path,
        identity_paths=identity.identity_paths(r.unit.engine),
        metrics_path="/metrics" if metrics and r.unit.engine in METRICS_ENGINES else None,
        headers=auth_headers(r, secrets),
    )


def auth_headers(r: Rendered, secrets: Mapping[str, str]) -> dict[str, str]:
    """The key of secret_args' api-key, from the controller's environment as the run resolved
    it: probes never read it from a file on the host (nor from the playbook, where pre-flight
    refuses it)."""
    return secret_auth(r.unit, secrets)


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


# -- readiness ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Ready and verified. ``fresh``: (re)started in this run; ``head``: the part that says a
    unit over several hosts is ready (every rank has joined it)."""

    message: str
    fresh: bool
    head: bool = False

    @property
    def status(self) -> Literal["ok", "changed"]:
        return "changed" if self.fresh else "ok"


@dataclass(frozen=True)
class Dead:
    message: str
    action: str = "ready"


@dataclass(frozen=True)
class Drifted:
    message: str
    action: str = "verify"


@dataclass(frozen=True)
class Pending:
    """Not ready yet, and its time is not up: the last probe, in words."""

    last: str


@dataclass(frozen=True)
class TimedOut:
    message: str
    action: str = "ready"


Verdict = Ready | Dead | Drifted | Pending | TimedOut


def spanned(r: Rendered) -> bool:
    """A service part of a unit over several hosts (see lifecycle/spans.py)."""
    return r.unit.kind == "service" and span_of(r.unit) is not None


def readiness(r: Rendered, p: UnitProbe | None, fresh: bool, late: bool) -> Verdict:
    """The unit's wait judged on its probe ``p``. ``fresh``: (re)started in this run;
    ``late``: its time is up (its ready timeout passed, or the host's wait says it is done)."""
    if p is None:
        return Dead("the probe returned nothing for this unit")
    restarting = p.supervisor is not None and p.supervisor.restarting
    if not (p.alive and p.ours) or restarting:
        return Dead(_died(r, p))
    healthy = (
        r.unit.port is None
        or r.launch.health_path is None
        or (p.health is not None and p.health.status == 200)
    )
    if not healthy:
        if not late:
            return Pending(health_text(p))
        after = (
            "stopped with the unit's other parts (logs kept)"
            if spanned(r)
            else "left running for inspection"
        )
        timeout = ready_settings(r).timeout
        return TimedOut(f"not ready after {timeout:.0f}s (last probe: {health_text(p)}); {after}")
    mismatches = identity.check(r, p)
    if mismatches:
        return Drifted(
            "drifted: the running unit is not the one rendered\n" + identity.describe(mismatches)
        )
    head = spanned(r) and r.unit.port is not None and r.launch.health_path is not None
    if fresh:
        return Ready(f"ready and verified (pid {p.pid}, fingerprint {r.short})", True, head)
    return Ready(f"ok (pid {p.pid}, fingerprint {r.short})", False, head)


def _died(r: Rendered, p: UnitProbe) -> str:
    code = f"exit code {p.exit.code}" if p.exit and p.exit.code is not None else "no exit code"
    log = "\n".join(f"    {line}" for line in (p.log_tail or [])) or "    (log is empty)"
    then = ""
    if spanned(r):
        then = "; the unit stops on every host"  # lifecycle/ready.py settles it everywhere
    elif p.supervisor is not None and p.supervisor.restarting:
        then = (
            f"; its supervisor restarts it ({restart_policy(r.unit)}, in "
            f"{p.supervisor.next_start_in or 0:g}s): `dflashops stop --unit {r.unit.name}` ends that"
        )
    return f"died while starting ({code}){then}; last lines of its log:\n{log}"


# -- what blocks a start --------------------------------------------------------------------


def start_blocker(
    r: Rendered,
    facts: HostFacts,
    orphans: list[Orphan],
    secrets: Mapping[str, str],
    force: bool = False,
) -> str | None:
    """Why the unit must not start on this host (None: it may): a foreign listener on its
    port, an orphan holding its port or GPUs, GPU memory held by foreign processes (unless
    ``force``), a controller variable its secrets need that ``secrets`` (the run's resolved
    ones) lacks."""
    unit = r.unit
    ours = {p for uf in facts.units.values() if uf.running for p in uf.group_pids}
    taken = port_taken(unit.port, facts.listening, ours) if unit.port is not None else None
    if taken is not None:
        return taken
    for orphan, held in blocking(orphans, facts, unit.port, unit.gpus):
        return (
            f"{held} held by orphan {orphan.name} ({orphan.describe()}), which no playbook "
            f"defines any more; not started: {ways_out(orphan.name)}"
        )
    for gpu in unit.gpus:
        foreign = [p for p in facts.gpus.processes if p.gpu_index == gpu and p.pid not in ours]
        if foreign and not force:
            held = ", ".join(f"pid {p.pid} ({p.used_mib} MiB)" for p in foreign)
            return f"GPU {gpu} holds memory of processes dflashops did not start: {held}; not started (--force starts anyway)"
    sources = [*unit.spec.secret_env.values(), *r.launch.secrets.sources()]
    missing = sorted({src for src in sources if src not in secrets})
    if missing:
        return (
            f"secret_env/secret_args need {', '.join(missing)} set on the controller; not started"
        )
    return None


CMDLINE_SHOWN = 100  # characters of a port holder's command line in the message
LONG_PATH = 40  # a path argument longer than this is shown by its last part
NEW_PORT = "or give this unit another `port:` in the playbook"


def port_taken(port: int, listening: list[Listener], ours: set[int]) -> str | None:
    """Why ``port`` is not free for a unit to start (None: free, or held by this workdir's
    running units)."""
    held = port_holder(port, listening, ours)
    return None if held is None else f"{held[0]}; not started: {held[1]}"


def port_holder(port: int, listening: list[Listener], ours: set[int]) -> tuple[str, str] | None:
    """Who holds ``port`` besides ``ours`` (pid, command line, the dflashops unit it is and of
    which workdir) and what to do, or None. A holder this user cannot see is in the way too,
    never assumed ours. For deploy (``port_taken``) and live pre-flight alike."""
    for listener in listening:
        if listener.port != port:
            continue
        if not listener.pids:
            owner = f" of user {_shown(listener.user)}" if listener.user else ""
            return (
                f"port {port} is held by a process{owner} this user cannot see",
                f"free it (`sudo ss -ltnp 'sport = :{port}'` names it) {NEW_PORT}",
            )
        strangers = [pid for pid in listener.pids if pid not in ours]
        if strangers:
            who, todo = _holder(strangers, listener.holders)
            return f"port {port} is already taken by {who}", todo
    return None


def _holder(pids: list[int], holders: list[Holder]) -> tuple[str, str]:
    """The first of ``pids`` in words (the others by number), and what to do about it."""
    pid = pids[0]
    more = f" (and pid {', '.join(map(str, pids[1:]))})" if len(pids) > 1 else ""
    found = next((h for h in holders if h.pid == pid), None)
    kill = f"stop it (`kill {pid}`) if it is not needed, {NEW_PORT}"
    if found is None:
        return f"pid {pid}{more}", kill
    who = f"pid {pid} ({_command(found.cmdline) or 'no command line'}){more}"
    if found.unit is None:
        return f"{who}, not a dflashops unit", kill
    name = _shown(found.unit)
    if found.this_workdir:
        return (
            f"{who}, dflashops unit {name} of this workdir that its pid record does not prove running (a leftover)",
            kill,
        )
    return (
        f"{who}, dflashops unit {name} of workdir {_shown(found.workdir or '?')} (another project)",
        f"stop it there (`dflashops stop --unit {name} -i <that project's inventory>`) " + NEW_PORT,
    )


def _command(args: list[str]) -> str:
    """A holder's command line, short: a long path is its last part (`…/stub_engine.py`), the
    whole is cut at a word boundary."""
    words = []
    for arg in args:
        word = shlex.quote(arg)
        if "'" in arg and not any(c in arg for c in '"$`\\'):
            word = f'"{arg}"'  # reads better than '"'"' and means the same to a shell
        if len(word) > LONG_PATH and word == arg and "/" in arg.rstrip("/"):
            word = "…/" + arg.rstrip("/").rsplit("/", 1)[1]
        words.append(word)
    return _shown(" ".join(words), CMDLINE_SHOWN)


def _shown(text: str, limit: int = 200) -> str:
    """Host text in a one-line message: no control characters, no line breaks, not too long."""
    return shorten(inert(text), limit)


@dataclass(frozen=True)
class Blocked:
    """A unit held back by its node state: failed, or waiting for a files entry."""

    status: Literal["failed", "waiting"]
    message: str


def node_blocked(
    c: Change,
    envs_failed: Mapping[str, str],
    entries: Mapping[str, str],
    reasons: Mapping[str, str],
) -> Blocked | None:
    """Whether a unit to (re)start is held back by what it stands on (lifecycle/stage.py's
    outcome: ``envs_failed`` env -> why, ``entries`` files key -> state, ``reasons`` files
    key -> why): its environment did not build, or its files entries are not in place. A
    unit with nothing to start is never held: it keeps running what it runs."""
    unit = c.rendered.unit
    env_why = envs_failed.get(unit.env.name) if unit.env is not None else None
    waits = [k for k in unit.waits if entries.get(k) not in ("ok", "changed")]
    if (env_why is None and not waits) or not c.runs_after:
        return None
    still = " (still running its old process)" if c.action == "restart" else ""
    if env_why is not None and unit.env is not None:
        verb = "restarted" if still else "started"
        return Blocked("failed", f"not {verb}: environment {unit.env.name} did not build{still}")
    failed = [k for k in waits if entries.get(k) == "failed"]
    if failed:
        return Blocked("failed", f"not started: files {', '.join(failed)} not in place{still}")
    return Blocked("waiting", f"waiting: {'; '.join(reasons.get(k, k) for k in waits)}{still}")
