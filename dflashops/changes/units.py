"""What each unit needs, from what should run (rendered) and what runs (facts). Pure.

- ``ok``: fingerprint matches, the process is ours and alive (or a job finished with exit 0),
  and its files are in place: nothing to do but verify.
- ``ship``: it runs the right thing, but a file on the host is missing or differs (a hand edit,
  a lost payload): put the files back, restart nothing.
- ``start``: not running (never started, stopped, died, or a job that failed).
- ``restart``: running, but not what the playbooks now say (fingerprint changed), or a service
  named in its ``restart_with`` restarts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from dflashops.agent.answers import HostFacts, UnitFacts
from dflashops.agent.remote import layout
from dflashops.config.playbook import Job
from dflashops.engines.base import ShippedFile
from dflashops.engines.render import Rendered

Action = Literal["ok", "ship", "start", "restart"]


@dataclass
class Change:
    rendered: Rendered
    action: Action
    reason: str
    old_fingerprint: str | None = None
    missing_payloads: list[ShippedFile] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.rendered.unit.name

    @property
    def runs_after(self) -> bool:
        """Whether the unit is started by this change."""
        return self.action in ("start", "restart")


def script_sha(r: Rendered) -> str:
    return hashlib.sha256(r.script.encode()).hexdigest()


def describe_state(uf: UnitFacts | None) -> str:
    if uf is None or (uf.pid is None and uf.exit is None and uf.unit is None):
        return "never started"
    if uf.running:
        return f"running (pid {uf.process.pid})"
    if uf.stopped is not None and uf.pid is None:
        return "stopped"
    if uf.exit is not None and uf.exit.code is not None:
        return f"exited with code {uf.exit.code}"
    if uf.pid is None:
        return "stopped"
    return f"dead ({uf.process.reason or 'process gone'})"


def job_done(uf: UnitFacts | None) -> bool:
    """Finished by itself with exit 0 (a unit that `stop` ended is stopped, not done)."""
    return (
        uf is not None
        and not uf.running
        and uf.stopped is None
        and uf.exit is not None
        and uf.exit.code == 0
    )


Content = dict[str, dict[str, str | None]]  # unit -> {files entry key: dest digest}


def plan_changes(
    rendered: list[Rendered],
    facts: HostFacts,
    *,
    rerun: bool = False,
    content: Content | None = None,
) -> list[Change]:
    """``content``: what the files entries each unit runs on (its model) hold now; a running
    unit whose unit.json recorded other content restarts."""
    content = content or {}
    changes = [_change(r, facts, rerun, content.get(r.unit.name, {})) for r in rendered]
    restarting = {c.rendered.unit.service for c in changes if c.action == "restart"}
    restarting |= {
        c.rendered.unit.service
        for c in changes
        if c.action == "start" and c.rendered.unit.kind == "service"
    }
    for c in changes:
        spec = c.rendered.unit.spec
        uf = facts.unit(c.name)
        if (
            not isinstance(spec, Job)
            or c.action not in ("ok", "ship")
            or uf is None
            or not uf.running
        ):
            continue
        hit = sorted(set(spec.restart_with) & restarting)
        if hit:
            c.action = "restart"
            c.reason = f"restart_with: {', '.join(hit)} restarts"
    return changes


def _change(r: Rendered, facts: HostFacts, rerun: bool, content: dict[str, str | None]) -> Change:
    uf = facts.unit(r.unit.name)
    missing = [
        f
        for f in r.files
        if not facts.has_payload(f.remote.removeprefix(f"{layout.PAYLOADS}/"), f.sha256)
    ]
    old = uf.fingerprint if uf else None
    same = old == r.fingerprint
    if uf is not None and uf.running:
        if uf.supervisor is not None and uf.supervisor.restarting and same:
            # Crashed, and waiting out its backoff: deploy need not wait for it.
            return Change(r, "restart", "crashed, in its supervisor's backoff", old, missing)
        if not same:
            was = old[:12] if old else "unknown"
            return Change(r, "restart", f"fingerprint {was} -> {r.short}", old, missing)
        recorded = uf.unit.content if uf.unit is not None else {}
        moved = sorted(k for k, digest in content.items() if recorded.get(k) != digest)
        if moved:
            return Change(
                r, "restart", f"content of files {', '.join(moved)} changed", old, missing
            )
        if uf.script_sha256 != script_sha(r) or missing:
            what = (
                "launch.sh differs on the host"
                if uf.script_sha256 != script_sha(r)
                else "payload files missing"
            )
            return Change(r, "ship", what, old, missing)
        return Change(r, "ok", f"running (pid {uf.process.pid})", old, missing)
    if r.unit.kind == "job" and same and job_done(uf) and not rerun:
        return Change(r, "ok", "done (exit 0); --rerun runs it again", old, missing)
    return Change(r, "start", describe_state(uf), old, missing)
