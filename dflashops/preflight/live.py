"""Live pre-flight: what only the hosts can tell, one facts round trip per host.

Reachable with the right key; at least the inventory's GPU count; free disk; a python that can
run the agent; the engines the playbooks use import on the host, and their own parsers take
every unit's command line (parsers.py); model paths exist; every
port a unit will listen on is free or held by that very unit. For a unit over several nodes:
each node's net_if exists, and each worker rank opens a TCP connection to the head's
internal_address:dist_port while the head listens for the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashops.agent import Agent
from dflashops.agent.answers import HostFacts
from dflashops.agent.transfer import diff, human, listing, space_problem
from dflashops.changes.verdicts import port_holder
from dflashops.config.inventory import Host
from dflashops.config.playbook import ModelService, VllmService
from dflashops.engines import launch_for
from dflashops.engines.base import HOST_PREFIX
from dflashops.errors import HostError
from dflashops.hosts import connect
from dflashops.lifecycle.fleet import on_hosts
from dflashops.lifecycle.session import envs_request, files_request
from dflashops.plan import HostPlan, Plan, Unit
from dflashops.plan.nodestate import local_scan
from dflashops.preflight import parsers
from dflashops.preflight.offline import Check, Report
from dflashops.preflight.parsers import Verdict

ENGINE_MODULES = {"sglang": "sglang", "vllm": "vllm"}
MIN_FREE_BYTES = 1 << 30  # below this a deploy would fail on its first write
LOW_FREE_BYTES = 20 << 30  # model-serving hosts fill up with logs and checkpoints
MIN_PYTHON = (3, 9)


def host_paths(units: list[Unit]) -> list[str]:
    """Absolute model paths and host-side scripts the units rely on (hub ids are not paths)."""
    paths: list[str] = []
    for u in units:
        spec = u.spec
        if (
            isinstance(spec, ModelService)
            and spec.engine != "stub"
            and spec.model.startswith(("/", "~"))
            and not u.content  # a files dest: deploy puts it there first
        ):
            paths.append(spec.model)
        if (
            isinstance(spec, VllmService)
            and spec.launcher
            and spec.launcher.script.startswith(HOST_PREFIX)
        ):
            paths.append(spec.launcher.script[len(HOST_PREFIX) :])
    return sorted(set(paths))


@dataclass
class Gathered:
    """A host's facts, and its engines' verdicts on its units' command lines."""

    facts: HostFacts
    parsed: dict[str, Verdict] = field(default_factory=dict)  # unit -> verdict
    parse_error: str | None = None  # the engine_args call itself failed


def gather(host_plan: HostPlan) -> Gathered:
    """One facts call: the host, its engines' imports (with each unit's environment python when
    it has one), its model paths, the environments' builds and the files entries' dests. Then,
    for the units whose engine imports there, one engine_args call: the engine's own parser
    judges each command line (DESIGN "Real parts" 3)."""
    host = host_plan.host
    engines = [u for u in host_plan.units if u.engine in ENGINE_MODULES]
    imports = sorted({ENGINE_MODULES[u.engine] for u in engines if u.env is None})
    env_imports = {
        (u.env.name, ENGINE_MODULES[u.engine]): u.env.path for u in engines if u.env is not None
    }
    conn = connect(host)
    try:
        agent = Agent(conn, host.python)
        facts = agent.facts(
            host.workdir,
            imports=imports,
            paths=host_paths(host_plan.units),
            files=files_request(host_plan.node),
            envs=envs_request(host_plan.node),
            env_imports=[
                {"env": env, "module": module, "python": f"{path}/bin/python"}
                for (env, module), path in sorted(env_imports.items())
            ],
        )
        gathered = Gathered(facts)
        try:
            gathered.parsed = parsers.ask(agent, facts.workdir, parse_lines(engines, facts))
        except HostError as exc:
            gathered.parse_error = str(exc)
        return gathered
    finally:
        conn.close()


def parse_lines(units: list[Unit], facts: HostFacts) -> list[parsers.Line]:
    """The engine units whose engine imports on the host (a failed import is reported by
    itself; an environment not built yet is judged when deploy has built it)."""
    lines = []
    for u in units:
        module = ENGINE_MODULES[u.engine]
        key = f"{u.env.name}/{module}" if u.env is not None else module
        built = u.env is None or (
            (state := facts.envs.get(u.env.name)) is not None and state.state == "ok"
        )
        imported = facts.imports.get(key)
        line = parsers.engine_line(u, launch_for(u))
        if built and imported is not None and imported.ok and line is not None:
            lines.append(line)
    return lines


def live_checks(host_plan: HostPlan, gathered: Gathered) -> list[Check]:
    host, facts = host_plan.host, gathered.facts
    checks = [Check("live-reachable", host.name, True, f"{facts.hostname}, python {facts.python}")]
    checks.append(_gpus(host, facts, needs_real_gpus(host_plan.units)))
    checks.append(_disk(host, facts))
    checks.append(_python(host, facts))
    for module, result in sorted(facts.imports.items()):
        if "/" in module:
            continue  # an engine in an environment: _env_imports
        if result.ok:
            checks.append(
                Check("live-engines", f"{host.name}/{module}", True, result.version or "")
            )
        else:
            detail = (result.error or "").strip().splitlines()[-1:] or ["no output"]
            checks.append(
                Check(
                    "live-engines",
                    f"{host.name}/{module}",
                    False,
                    f"[{host.name}] `{host.python} -c 'import {module}'` fails: {detail[0]}",
                )
            )
    checks.extend(_env_imports(host_plan, facts))
    checks.extend(_engine_args(host_plan, gathered))
    checks.extend(_files(host_plan, facts))
    for path, found in sorted(facts.paths.items()):
        ok = found.exists
        checks.append(
            Check(
                "live-paths",
                f"{host.name}:{path}",
                ok,
                "" if ok else f"[{host.name}] {path} does not exist on the host",
            )
        )
    checks.extend(_ports(host_plan.units, facts))
    return checks


def _env_imports(host_plan: HostPlan, facts: HostFacts) -> list[Check]:
    """An engine that an environment provides is checked in that environment, once it is
    built; before that, deploy builds it first, so it is not a failure."""
    host = host_plan.host.name
    checks = []
    for key, result in sorted(facts.imports.items()):
        if "/" not in key:
            continue
        env, module = key.split("/", 1)
        state = facts.envs.get(env)
        subject = f"{host}/{module}@{env}"
        if state is None or state.state != "ok":
            checks.append(
                Check(
                    "live-engines",
                    subject,
                    True,
                    f"provided by environment {env}, which deploy builds first",
                )
            )
        elif result.ok:
            checks.append(Check("live-engines", subject, True, result.version or ""))
        else:
            detail = (result.error or "").strip().splitlines()[-1:] or ["no output"]
            checks.append(
                Check(
                    "live-engines",
                    subject,
                    False,
                    f"[{host}] environment {env} is built but `import {module}` fails in it: {detail[0]}",
                )
            )
    return checks


def _engine_args(host_plan: HostPlan, gathered: Gathered) -> list[Check]:
    """The engine's own parser on each unit's command line: rejected or not importable is an
    error; no parser entry point known for its version, a warning and the flag list's word."""
    host = host_plan.host.name
    if gathered.parse_error is not None:
        return [
            Check(
                "live-engine-args",
                host,
                False,
                f"[{host}] could not ask the engines to parse the units' command lines: "
                f"{gathered.parse_error}",
            )
        ]
    checks = []
    for unit, v in sorted(gathered.parsed.items()):
        subject = f"{host}/{unit}"
        if v.outcome == "ok":
            checks.append(Check("live-engine-args", subject, True, v.message))
        elif v.outcome == "unknown" and not v.fails:
            checks.append(
                Check(
                    "live-engine-args", subject, False, f"[{host}] {unit}: {v.message}", "warning"
                )
            )
        else:
            checks.append(
                Check("live-engine-args", subject, False, f"[{host}] {unit}: {v.message}")
            )
    return checks


def _files(host_plan: HostPlan, facts: HostFacts) -> list[Check]:
    """Every files entry: a same-host source exists, and each dest has room for what is
    still to be written (controller sources: exactly; same-host sources: their size)."""
    checks = []
    for f in host_plan.node.files:
        state = facts.files.get(f.key)
        subject = f"{f.host.name}:{f.dest}"
        if state is None:
            checks.append(
                Check(
                    "live-files",
                    subject,
                    False,
                    f"[{f.host.name}] {f.label}: facts did not report it",
                )
            )
            continue
        if f.kind == "host" and state.src is not None and not state.src.exists:
            checks.append(
                Check(
                    "live-files",
                    subject,
                    False,
                    f"[{f.host.name}] {f.label}: the source {f.src} does not exist on the host",
                )
            )
            continue
        need = 0
        if (
            f.kind == "controller"
            and f.local is not None
            and state.digest != (scanned := local_scan(f.local))["digest"]
        ):
            need = diff(
                listing(scanned["files"]), listing(state.files), state.parts or {}, f.entry.delete
            ).bytes
        elif f.kind == "host" and state.src is not None and state.src.digest != state.digest:
            need = state.src.bytes
        problem = space_problem(need, state, f.dest)
        checks.append(
            Check(
                "live-files",
                subject,
                problem is None,
                f"[{f.host.name}] {f.label}: {problem}"
                if problem
                else f"{human(need)} to write, {human(state.free.free_bytes)} free",
            )
        )
    return checks


def needs_real_gpus(units: list[Unit]) -> bool:
    """The stub only rehearses a GPU layout; anything else given GPUs needs them for real."""
    return any(u.gpus and u.engine != "stub" for u in units)


def _gpus(host: Host, facts: HostFacts, needed: bool) -> Check:
    if host.gpus == 0:
        return Check("live-gpus", host.name, True, "no GPUs expected")
    if not needed and not facts.gpus.available:
        return Check(
            "live-gpus",
            host.name,
            True,
            "no GPUs here, and only stub units (which use none) ask for them",
        )
    if not facts.gpus.available:
        return Check(
            "live-gpus",
            host.name,
            False,
            f"[{host.name}] inventory says {host.gpus} GPUs but nvidia-smi is unusable: {facts.gpus.error}",
        )
    found = len(facts.gpus.devices)
    if found < host.gpus:
        return Check(
            "live-gpus",
            host.name,
            False,
            f"[{host.name}] inventory says {host.gpus} GPUs, nvidia-smi lists {found}",
        )
    return Check("live-gpus", host.name, True, f"{found} GPUs")


def _disk(host: Host, facts: HostFacts) -> Check:
    if facts.disk is None:
        return Check(
            "live-disk",
            host.name,
            False,
            f"[{host.name}] could not measure free disk at {facts.workdir}",
        )
    free = facts.disk.free_bytes
    where = f"{free / 2**30:.1f} GiB free at {facts.disk.path}"
    if free < MIN_FREE_BYTES:
        return Check(
            "live-disk",
            host.name,
            False,
            f"[{host.name}] only {where}: free space before deploying",
        )
    if free < LOW_FREE_BYTES:
        return Check(
            "live-disk",
            host.name,
            False,
            f"[{host.name}] {where}: logs and checkpoints may fill it",
            "warning",
        )
    return Check("live-disk", host.name, True, where)


def _python(host: Host, facts: HostFacts) -> Check:
    version = tuple(int(p) for p in facts.python.split(".")[:2] if p.isdigit())
    if version < MIN_PYTHON:
        return Check(
            "live-python",
            host.name,
            False,
            f"[{host.name}] {host.python} is Python {facts.python}; the agent needs 3.9+",
        )
    return Check("live-python", host.name, True, facts.python)


def _ports(units: list[Unit], facts: HostFacts) -> list[Check]:
    checks = []
    for u in units:
        if u.port is None:
            continue
        listener = facts.listener(u.port)
        subject = f"{u.host.name}/{u.name}:{u.port}"
        if listener is None:
            checks.append(Check("live-ports", subject, True, "free"))
            continue
        mine = facts.unit(u.name)
        ours = set(mine.group_pids) if mine is not None and mine.running else set()
        held = port_holder(u.port, [listener], ours)
        if held is None:
            checks.append(Check("live-ports", subject, True, f"held by {u.name} itself"))
        else:
            what, todo = held
            checks.append(
                Check("live-ports", subject, False, f"[{u.host.name}] {u.name}: {what}: {todo}")
            )
    return checks


def run_live(plan: Plan, report: Report, forks: int) -> None:
    hosts = list(plan.hosts.values())
    by_name = {hp.host.name: hp for hp in hosts}
    outcomes = on_hosts([hp.host for hp in hosts], lambda h: gather(by_name[h.name]), forks)
    facts: dict[str, HostFacts] = {}
    for name, outcome in outcomes.items():
        if outcome.value is None:
            report.add(Check("live-reachable", name, False, outcome.error or "unknown failure"))
            continue
        facts[name] = outcome.value.facts
        for check in live_checks(by_name[name], outcome.value):
            report.add(check)
    for check in multi_node_checks(plan, facts):
        report.add(check)


# -- units over several nodes --------------------------------------------------------------


def multi_node_checks(plan: Plan, facts: dict[str, HostFacts]) -> list[Check]:
    """Each node's net_if exists, and each worker rank reaches its head's rendezvous port
    (the head listens for the check): what makes rank 0 hang at NCCL init otherwise."""
    checks: list[Check] = []
    heads = [u for hp in plan.hosts.values() for u in hp.units if u.multi_node and u.rank == 0]
    for head in heads:
        parts = (
            [u for n in head.nodes for u in plan.hosts[n].units if u.name == head.name]
            if all(n in plan.hosts for n in head.nodes)
            else []
        )
        for u in parts:
            nic, got = u.host.net_if, facts.get(u.host.name)
            if nic is None or got is None:
                continue
            ok = nic in got.interfaces
            checks.append(
                Check(
                    "live-net-if",
                    f"{u.host.name}/{nic}",
                    ok,
                    ""
                    if ok
                    else f"[{u.host.name}] net_if {nic} (for {u.name}) is not an interface of "
                    f"the host (it has: {', '.join(got.interfaces) or 'none'}); NCCL would fail "
                    "at init. Fix net_if in the inventory",
                )
            )
        if all(n in facts for n in head.nodes):
            hosts = {n: plan.hosts[n].host for n in head.nodes}
            checks.append(rendezvous(head, hosts, facts[head.host.name]))
    return checks


def rendezvous(head: Unit, hosts: dict[str, Host], head_facts: HostFacts | None = None) -> Check:
    """The head of ``head``'s unit listens on its rendezvous, every other node dials it.
    The head's facts (its port's listener: asked for only when the port is taken, unless
    given) tell a port held by the unit itself from a port someone else holds."""
    assert head.head is not None and head.dist_port is not None
    where = f"{head.head}:{head.dist_port}"
    subject = f"{head.host.name}/{head.name}@{where}"
    workers = [n for n in head.nodes if n != head.host.name]
    conns = {n: connect(hosts[n]) for n in head.nodes}
    try:
        agents = {n: Agent(c, hosts[n].python) for n, c in conns.items()}
        with agents[head.host.name].listening(
            hosts[head.host.name].workdir, head.head, head.dist_port, len(workers), 10.0
        ) as (first, finish):
            if not first.listening:
                if head_facts is None and first.held:
                    head_facts = agents[head.host.name].facts(
                        hosts[head.host.name].workdir, ports=[head.dist_port]
                    )
                mine = head_facts.unit(head.name) if head_facts is not None else None
                if first.held and mine is not None and mine.process.alive and mine.process.ours:
                    return Check(
                        "live-rendezvous", subject, True, f"held by the running {head.name}"
                    )
                holder = head_facts.listener(head.dist_port) if head_facts is not None else None
                pids = (
                    f" (pids {', '.join(map(str, holder.pids))})" if holder and holder.pids else ""
                )
                cause = (
                    f"port {head.dist_port} is taken on {head.host.name}{pids}: pick another "
                    "dist_port or stop what holds it"
                    if first.held
                    else f"is {head.head} an address of {head.host.name}? (internal_address)"
                )
                return Check(
                    "live-rendezvous",
                    subject,
                    False,
                    f"[{head.host.name}] the head of {head.name} cannot listen on {where}, "
                    f"where the ranks on {', '.join(workers)} dial it: {first.error}; {cause}",
                )
            dialled = on_hosts(
                [hosts[n] for n in workers],
                lambda h: agents[h.name].dial(
                    h.workdir,
                    head.head or "",
                    head.dist_port or 0,
                    h.name,
                    5.0,
                ),
                forks=len(workers),  # a unit's ranks dial at once: a handful of hosts
            )
            finish()
    finally:
        for c in conns.values():
            c.close()
    failed = []
    for name, outcome in dialled.items():
        got = outcome.value
        if got is None or not got.ok:
            why = got.error if got is not None else outcome.error
            failed.append(
                f"[{name}] cannot reach the head {head.host.name} of {head.name} at {where} "
                f"({why}): open TCP port {head.dist_port} on {head.host.name} to {name}, and "
                f"check that {head.head} is the address {name} reaches it at (internal_address); "
                "a rank that cannot reach the head hangs at NCCL init"
            )
    if failed:
        return Check("live-rendezvous", subject, False, "; ".join(failed))
    return Check("live-rendezvous", subject, True, f"{', '.join(workers)} reached {where}")
