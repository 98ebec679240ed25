"""The lifecycle's decisions that are not I/O: pure functions of what was rendered and what a
host answered (the batches of a rolling restart, the record a unit is shipped with, the probe a
service is judged by, the words for a probe or a stop). The read-only commands use them too.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from dflashops.agent.answers import ProbeSpec, StopResult, UnitProbe
from dflashops.changes.units import Change
from dflashops.config.playbook import Job, Ready
from dflashops.engines import identity
from dflashops.engines.render import Rendered
from dflashops.engines.secrets import auth_headers as secret_auth
from dflashops.lifecycle.spans import span_of
from dflashops.plan.supervision import policy


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
