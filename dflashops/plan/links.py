"""What each unit is linked to on its host: a job's needs, servers URLs and restart_with; a
unit's environment and the files entries it runs on or waits for."""

from __future__ import annotations

from dataclasses import replace

from dflashops.config.playbook import Job, ModelService
from dflashops.errors import Problem
from dflashops.plan.model import Unit, dial_host
from dflashops.plan.nodestate import NodeState


def link_node(units: list[Unit], node: NodeState, problems: list[Problem]) -> list[Unit]:
    """Each unit's environment, and the files entries it runs on (a model that is a files
    dest: its content restarts the unit when it changes, and the unit waits for it)."""
    out = []
    for u in units:
        env = None
        if u.spec.environment is not None:
            env = node.envs.get(u.spec.environment)
            if env is None:
                known = ", ".join(sorted(node.envs)) or "none"
                problems.append(
                    u.problem(
                        f"environment {u.spec.environment!r} is not declared for host "
                        f"{u.host.name} (declared: {known})",
                        "environment",
                    )
                )
        content: tuple[str, ...] = ()
        if isinstance(u.spec, ModelService) and (fp := node.by_dest(u.spec.model)) is not None:
            content = (fp.key,)
        out.append(
            replace(u, env=env, content=content, waits=tuple(dict.fromkeys((*u.waits, *content))))
        )
    return out


def link_jobs(units: list[Unit], node: NodeState, problems: list[Problem]) -> list[Unit]:
    """Resolve each job's needs/servers/restart_with to unit names and URLs on the same host
    (a need may also name a files entry: the job waits until it is in place)."""
    entries = {f.entry.name: f.key for f in node.files if f.entry.name}
    by_service: dict[str, list[Unit]] = {}
    for u in units:
        by_service.setdefault(u.service, []).append(u)
    by_unit = {u.name: u for u in units}
    out = []
    for u in units:
        if not isinstance(u.spec, Job):
            out.append(u)
            continue
        job = u.spec
        needs: list[str] = []
        waits: list[str] = []
        for i, name in enumerate(job.needs):
            if name in entries:
                waits.append(entries[name])
            elif name == job.name:
                problems.append(u.problem("a job cannot need itself", "needs", i))
            elif name in by_service:
                needs.extend(x.name for x in by_service[name] if x.name not in needs)
            elif name in by_unit:
                needs.append(name) if name not in needs else None
            else:
                problems.append(
                    u.problem(
                        f"needs unknown unit, service or files entry {name!r} on host {u.host.name}",
                        "needs",
                        i,
                    )
                )
        servers: list[str] = []
        if job.servers is not None:
            replicas = [x for x in by_service.get(job.servers, []) if x.kind == "service"]
            if not replicas:
                problems.append(
                    u.problem(
                        f"servers names unknown service {job.servers!r} on host {u.host.name}",
                        "servers",
                    )
                )
            elif any(x.port is None for x in replicas):
                problems.append(
                    u.problem(f"service {job.servers!r} has no port to build URLs from", "servers")
                )
            else:
                servers = [f"http://{_url_host(x)}:{x.port}" for x in replicas]
                needs.extend(x.name for x in replicas if x.name not in needs)
        for i, name in enumerate(job.restart_with):
            if not any(x.kind == "service" for x in by_service.get(name, [])):
                problems.append(
                    u.problem(f"restart_with names unknown service {name!r}", "restart_with", i)
                )
        out.append(replace(u, needs=tuple(needs), servers=tuple(servers), waits=tuple(waits)))
    return out


def _url_host(unit: Unit) -> str:
    bind = unit.spec.bind if not isinstance(unit.spec, Job) else "127.0.0.1"
    host = dial_host(bind)
    return f"[{host}]" if ":" in host else host
