"""What a unit's supervisor on the host is told (unit.json's ``supervise``): its restart
policy, backoff, limit, liveness probe and stop grace. Pure. It is part of the unit's
fingerprint: a changed policy restarts the unit under the new one, and what runs is what was
rendered."""

from __future__ import annotations

from typing import Any

from dflashops.config.playbook import Job
from dflashops.engines import secrets
from dflashops.plan import Unit
from dflashops.plan.model import dial_host


def restart_policy(unit: Unit) -> str:
    if unit.spec.restart is not None:
        return unit.spec.restart
    return "no" if isinstance(unit.spec, Job) else "on-failure"


def policy(unit: Unit) -> dict[str, Any]:
    spec = unit.spec
    liveness = None
    probe = getattr(spec, "liveness", None)
    if probe is not None and unit.port is not None:
        bind = getattr(spec, "bind", "127.0.0.1")
        # Never the key itself (unit.json is not a secret file): where the supervisor reads it.
        bearer = secrets.bearer(unit, secrets.split(unit))
        liveness = {
            "host": dial_host(bind),
            "port": unit.port,
            "path": probe.path,
            "interval": probe.interval,
            "timeout": probe.timeout,
            "failures": probe.failures,
            "headers": {},
            **({"bearer": bearer} if bearer else {}),
        }
    return {
        "restart": restart_policy(unit),
        "backoff": [spec.restart_backoff.initial, spec.restart_backoff.max],
        "limit": [spec.restart_limit.count, spec.restart_limit.window],
        "liveness": liveness,
        "stop_grace": spec.stop_grace,
        # Only when set: a policy without it keeps the fingerprint units were deployed with.
        **({"log_max_bytes": spec.log_max_size} if spec.log_max_size is not None else {}),
    }
