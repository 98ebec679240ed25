"""Desired units from configuration: which unit runs on which host, with which GPUs and port,
after which other units. Pure: no host is contacted, nothing is rendered here.

Service ``NAME`` with ``replicas: N`` becomes units ``NAME-0 .. NAME-(N-1)`` on every targeted
host, replica i on ``port + i``. Jobs keep their name. GPUs are handed out per host: explicit
lists first (they are claims), then ``auto`` services in playbook order, then jobs' GPU counts
from what is left.

A service with ``nodes: [a, b]`` spans hosts: each of them has a part ``NAME-0`` with its rank
(the list's order, head first) and tp*dp/len(nodes) GPUs; only the head has a port.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from jinja2 import StrictUndefined, TemplateError, Undefined
from jinja2.nativetypes import NativeEnvironment
from jinja2.sandbox import SandboxedEnvironment
from pydantic import ValidationError

from dflashops.config.inventory import Host, Inventory
from dflashops.config.load import Playbook, located_problems
from dflashops.config.playbook import (
    CommandService,
    Job,
    ModelService,
    PlaybookFile,
    SglangService,
    VllmService,
)
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem
from dflashops.nodestate import EnvPlan, NodeState, plan_node

DEFAULT_PORTS = {"sglang": 30000, "stub": 30000, "vllm": 8000}
Spec = ModelService | CommandService | Job


@dataclass(frozen=True)
class Unit:
    """One process dflashops manages on one host."""

    name: str
    host: Host
    kind: Literal["service", "job"]
    engine: str  # sglang | vllm | stub | command | job
    playbook: Playbook
    spec: Spec  # the playbook entry, with {{ vars }} expanded for this host
    source: PathKey  # where the entry sits in the playbook, e.g. ("services", 0)
    service: str  # the service or job name in the playbook
    replica: int | None = None
    port: int | None = None
    gpus: tuple[int, ...] = ()
    needs: tuple[str, ...] = ()  # unit names that must be ready first
    servers: tuple[str, ...] = ()  # URLs given to a job with `servers:`
    env: EnvPlan | None = None  # the environment it runs in
    content: tuple[str, ...] = ()  # files entries (keys) whose content it runs on: its model
    waits: tuple[str, ...] = ()  # files entries (keys) that must be in place first
    # A part of a unit over several hosts: every host of ``nodes`` (rank order, head first) has
    # a part of that name; ``rank`` is this host's; the others dial ``head``:``dist_port``.
    nodes: tuple[str, ...] = ()
    rank: int | None = None
    head: str | None = None
    dist_port: int | None = None
    # The API server of a vLLM service over a Ray cluster: the Ray nodes' addresses, head
    # first (its Ray port is ``dist_port``); it serves once every one is in with its GPUs.
    cluster: tuple[str, ...] = ()
    # GPUs the process sees without holding them: the Ray API server sees its node's, which
    # that node's Ray part holds (None: it sees what it holds, ``gpus``).
    sees: tuple[int, ...] | None = None

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    @property
    def tp(self) -> int:
        return self.spec.tp if isinstance(self.spec, ModelService) else 1

    @property
    def dp(self) -> int:
        return self.spec.dp if isinstance(self.spec, ModelService) else 1

    def problem(self, message: str, *path: str | int) -> Problem:
        return self.playbook.doc.problem(
            (*self.source, *path), f"[{self.host.name}] {self.name}: {message}"
        )


@dataclass
class HostPlan:
    host: Host
    units: list[Unit] = field(default_factory=list)
    node: NodeState = field(default_factory=NodeState)


@dataclass
class Plan:
    hosts: dict[str, HostPlan]
    problems: list[Problem]

    @property
    def units(self) -> list[Unit]:
        return [u for hp in self.hosts.values() for u in hp.units]


def targets(inventory: Inventory, book: Playbook) -> tuple[list[str], list[Problem]]:
    """Host names a playbook targets, or problems naming the unknown patterns."""
    names: list[str] = []
    problems = []
    for i, pattern in enumerate(book.head.host_patterns):
        try:
            names.extend(n for n in inventory.expand([pattern]) if n not in names)
        except KeyError:
            where: PathKey = ("hosts",) if isinstance(book.head.hosts, str) else ("hosts", i)
            known = ", ".join(sorted([*inventory.hosts, *inventory.groups]))
            problems.append(
                book.doc.problem(
                    where, f"unknown host or group {pattern!r} (inventory has: {known})"
                )
            )
    return names, problems


def build_plan(
    inventory: Inventory, books: list[Playbook], only_hosts: list[str] | None = None
) -> Plan:
    """Lay out every playbook's units on the hosts it targets (restricted to ``only_hosts``)."""
    problems: list[Problem] = []
    placed: dict[str, list[tuple[Playbook, PlaybookFile]]] = {}
    for book in books:
        names, errs = targets(inventory, book)
        problems.extend(errs)
        for name in names:
            if only_hosts is not None and name not in only_hosts:
                continue
            spec = _expand_for_host(book, inventory.hosts[name], problems)
            if spec is not None:
                placed.setdefault(name, []).append((book, spec))
    plan = Plan(hosts={}, problems=problems)
    # A templated playbook is validated once per host: the same mistake must be said once.
    problems[:] = list(dict.fromkeys(problems))
    planned = set(placed)
    for name, entries in placed.items():
        host_plan, errs = _plan_host(inventory, inventory.hosts[name], entries, planned)
        plan.hosts[name] = host_plan
        problems.extend(errs)
    problems[:] = list(dict.fromkeys(problems))  # a multi-node mistake is found on each node
    return plan


# -- {{ vars }} in playbook strings ---------------------------------------------------------------


class _NativeSandbox(NativeEnvironment, SandboxedEnvironment):
    """`port: "{{ base_port }}"` must stay a number: a value that is exactly one expression
    keeps its type; anything mixed with text is a string. Sandboxed: no attribute tricks."""


_values_env = _NativeSandbox(undefined=StrictUndefined, autoescape=False)


def _expand_for_host(book: Playbook, host: Host, problems: list[Problem]) -> PlaybookFile | None:
    """The playbook with ``{{ name }}`` in string values filled from playbook vars, then host vars
    (the host wins: a host-specific model path beats the playbook's), plus ``host`` and ``gpus``."""
    raw = book.doc.data
    if book.spec is not None:
        return book.spec
    variables: dict[str, Any] = {
        **book.head.vars,
        **host.vars,
        "host": host.name,
        "host_gpus": host.gpus,
        "workdir": host.workdir,
        # Meaningful for local hosts, which share the controller's filesystem.
        "playbook_dir": str(book.path.parent.resolve()),
    }
    errors: list[Problem] = []

    def walk(value: Any, path: PathKey) -> Any:
        if isinstance(value, dict):
            return {
                k: (v if path == () and k == "vars" else walk(v, (*path, k)))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, str) and "{{" in value:
            try:
                out = _values_env.from_string(value).render(variables)
                if isinstance(out, Undefined):
                    str(out)  # a lone {{ nope }} renders natively to Undefined: make it raise
                return out
            except Exception as exc:  # a {{ 1/0 }} is the user's input: report it, never crash
                if not isinstance(exc, TemplateError):
                    exc = TemplateError(f"{type(exc).__name__}: {exc}")
                errors.append(
                    book.doc.problem(path, f"[{host.name}] cannot fill in {value!r}: {exc}")
                )
        return value

    data = walk(raw, ())
    if errors:
        problems.extend(errors)
        return None
    try:
        return PlaybookFile.model_validate(data)
    except ValidationError as exc:
        problems.extend(located_problems(book.doc, PlaybookFile, exc))
        return None


# -- per-host layout --------------------------------------------------------------------------------


def _plan_host(
    inventory: Inventory,
    host: Host,
    entries: list[tuple[Playbook, PlaybookFile]],
    planned: set[str],
) -> tuple[HostPlan, list[Problem]]:
    problems: list[Problem] = []
    node = plan_node(
        inventory,
        host,
        [(book, list(spec.environments.items()), spec.files) for book, spec in entries],
        problems,
    )
    allocator = _GpuAllocator(host, problems)
    made: list[tuple[tuple[int, int, int], list[Unit]]] = []
    # Explicit GPU lists are claims, honoured before any `auto` allocation wherever they sit in
    # the files; then auto services in playbook order; then jobs' GPU counts from what is left.
    for explicit in (True, False):
        for b, (book, spec) in enumerate(entries):
            for i, svc in enumerate(spec.services):
                if isinstance(svc.gpus, list) == explicit:
                    source: PathKey = ("services", i)
                    made.append(
                        (
                            (b, 0, i),
                            _service_units(
                                host, book, svc, source, allocator, problems, inventory, planned
                            ),
                        )
                    )
        for b, (book, spec) in enumerate(entries):
            for i, job in enumerate(spec.jobs):
                if isinstance(job.gpus, list) == explicit:
                    parts = _job_units(host, book, job, i, allocator, problems, inventory, planned)
                    made.append(((b, 1, i), parts))
    units = [u for _, group in sorted(made, key=lambda m: m[0]) for u in group]
    problems.extend(_check_names(units))
    problems.extend(_check_ports(units))
    units = _link_node(_link_jobs(units, node, problems), node, problems)
    problems.extend(_check_cycles(units))
    problems.extend(_check_vllm_dp(units))
    return HostPlan(host, units, node), problems


def _link_node(units: list[Unit], node: NodeState, problems: list[Problem]) -> list[Unit]:
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


Where = Callable[[str], Problem]  # turns a message into a located problem


def _locator(book: Playbook, path: PathKey, prefix: str) -> Where:
    return lambda message: book.doc.problem(path, prefix + message)


def _job_units(
    host: Host,
    book: Playbook,
    job: Job,
    index: int,
    allocator: _GpuAllocator,
    problems: list[Problem],
    inventory: Inventory,
    planned: set[str],
) -> list[Unit]:
    """The job on this host: one unit, or this node's part of a job over several nodes."""
    nodes: list[str] = []
    if job.nodes is not None:
        found = _nodes(inventory, book, job, ("jobs", index), planned, problems)
        if found is None or host.name not in found:
            return []
        nodes = found
    where = _locator(book, ("jobs", index, "gpus"), f"job {job.name}: ")
    return [
        Unit(
            name=job.name,
            host=host,
            kind="job",
            engine="job",
            playbook=book,
            spec=job,
            source=("jobs", index),
            service=job.name,
            gpus=allocator.take_job(job, where),
            nodes=tuple(nodes),
            rank=nodes.index(host.name) if nodes else None,
            head=inventory.hosts[nodes[0]].dial_address if nodes else None,
            dist_port=job.dist_port if nodes else None,
        )
    ]


class _GpuAllocator:
    def __init__(self, host: Host, problems: list[Problem]) -> None:
        self.host = host
        self.owner: dict[int, str] = {}
        self.problems = problems  # shared, so problems come out in the order they were found

    def free(self) -> list[int]:
        return [g for g in range(self.host.gpus) if g not in self.owner]

    def claim(self, gpus: list[int], unit: str, where: Where) -> tuple[int, ...]:
        for g in gpus:
            if g >= self.host.gpus:
                self.problems.append(
                    where(
                        f"GPU {g} does not exist: host {self.host.name} has {self.host.gpus} GPUs (0-{self.host.gpus - 1})"
                        if self.host.gpus
                        else f"GPU {g} does not exist: host {self.host.name} has no GPUs (gpus: 0)"
                    )
                )
            elif g in self.owner:
                self.problems.append(
                    where(f"GPU {g} is already used by {self.owner[g]} on host {self.host.name}")
                )
            else:
                self.owner[g] = unit
        if len(set(gpus)) != len(gpus):
            self.problems.append(where(f"GPU list {gpus} names a GPU twice"))
        return tuple(gpus)

    def take(self, count: int, unit: str, where: Where) -> tuple[int, ...]:
        free = self.free()
        if count > len(free):
            self.problems.append(
                where(
                    f"needs {count} GPU(s) but host {self.host.name} has only {len(free)} left of {self.host.gpus}"
                    + (f" (taken: {self._taken()})" if self.owner else "")
                )
            )
            return ()
        return self.claim(free[:count], unit, where)

    def take_job(self, job: Job, where: Where) -> tuple[int, ...]:
        if isinstance(job.gpus, list):
            return self.claim(job.gpus, job.name, where)
        return self.take(job.gpus, job.name, where) if job.gpus else ()

    def _taken(self) -> str:
        by_unit: dict[str, list[int]] = {}
        for g, u in sorted(self.owner.items()):
            by_unit.setdefault(u, []).append(g)
        return ", ".join(f"{u} {gs}" for u, gs in by_unit.items())


def _nodes(
    inventory: Inventory,
    book: Playbook,
    spec: SglangService | VllmService | Job,
    source: PathKey,
    planned: set[str],
    problems: list[Problem],
) -> list[str] | None:
    """The hosts a multi-node service or job spans, in rank order; None (with problems) if
    unusable."""
    assert spec.nodes is not None
    kind = "job" if isinstance(spec, Job) else "service"
    where = _locator(book, (*source, "nodes"), f"{kind} {spec.name}: ")
    seen: list[str] = []
    ok = True
    for name in spec.nodes:
        try:
            members = inventory.expand([name])
        except KeyError:
            known = ", ".join(sorted([*inventory.hosts, *inventory.groups]))
            problems.append(
                where(f"unknown host or group {name!r} in nodes (inventory has: {known})")
            )
            ok = False
            continue
        for m in members:
            if m in seen:
                problems.append(where(f"host {m} is named twice in nodes: each node runs one rank"))
                ok = False
            else:
                seen.append(m)
    if not ok:
        return None
    targeted, _ = targets(inventory, book)
    outside = [n for n in seen if n not in targeted]
    if outside:
        problems.append(
            where(
                f"nodes {', '.join(outside)} are not hosts this playbook targets "
                f"(hosts: {', '.join(book.head.host_patterns)})"
            )
        )
        return None
    left_out = [n for n in seen if n not in planned]
    if left_out and len(left_out) < len(seen):
        problems.append(
            where(
                f"spans {', '.join(seen)}, but {', '.join(left_out)} are not selected: select "
                "every node of it (--host) or none, a rank alone waits for the others forever"
            )
        )
        return None
    if isinstance(spec, (SglangService, VllmService)) and gpus_of(spec) % len(seen):
        problems.append(
            _locator(book, (*source, "tp"), f"service {spec.name}: ")(
                f"{parallelism(spec)} = {gpus_of(spec)} GPUs do not split evenly "
                f"over {len(seen)} nodes"
            )
        )
        return None
    return seen


def gpus_of(spec: ModelService) -> int:
    """GPUs of one replica: tp x dp (x pp for vLLM)."""
    return spec.tp * spec.dp * (spec.pp if isinstance(spec, VllmService) else 1)


def parallelism(spec: ModelService) -> str:
    pp = f" x pp {spec.pp}" if isinstance(spec, VllmService) and spec.pp > 1 else ""
    return f"tp {spec.tp}{pp} x dp {spec.dp}"


def _service_units(
    host: Host,
    book: Playbook,
    svc: ModelService | CommandService,
    source: PathKey,
    allocator: _GpuAllocator,
    problems: list[Problem],
    inventory: Inventory,
    planned: set[str],
) -> list[Unit]:
    per_replica = gpus_of(svc) if isinstance(svc, ModelService) else svc.gpus_per_replica
    where_gpus = _locator(book, (*source, "gpus"), f"service {svc.name}: ")
    nodes: list[str] = []
    if isinstance(svc, (SglangService, VllmService)) and svc.nodes is not None:
        found = _nodes(inventory, book, svc, source, planned, problems)
        if found is None or host.name not in found:
            return []  # unusable (said above), or a service of other hosts
        nodes = found
        per_replica //= len(nodes)  # GPUs of this node's rank
    explicit: list[int] | None = svc.gpus if isinstance(svc.gpus, list) else None
    if explicit is not None and len(explicit) != per_replica * svc.replicas:
        problems.append(
            where_gpus(
                f"lists {len(explicit)} GPU(s) but {svc.replicas} replica(s) x tp*dp {per_replica} "
                f"need {per_replica * svc.replicas}"
                + (f" (per node: {len(nodes)} nodes)" if nodes else "")
            )
        )
        return []
    if explicit is None and per_replica * svc.replicas > host.gpus:
        # One message for the whole service instead of one per replica that does not fit.
        tp_dp = (
            parallelism(svc) + (f" over {len(nodes)} nodes" if nodes else "")
            if isinstance(svc, ModelService)
            else f"{per_replica} per replica"
        )
        problems.append(
            where_gpus(
                f"needs {per_replica * svc.replicas} GPUs ({tp_dp} x {svc.replicas} replica(s)) "
                f"but host {host.name} has {host.gpus}"
            )
        )
        return []
    base_port = svc.port or DEFAULT_PORTS.get(svc.engine)
    rank = nodes.index(host.name) if nodes else None
    if isinstance(svc, VllmService) and svc.backend == "ray" and rank is not None:
        return _ray_units(host, book, svc, source, allocator, where_gpus, inventory, nodes, rank)
    if rank:  # a worker rank serves no HTTP: readiness and identity are the head's
        base_port = None
    units = []
    for r in range(svc.replicas):
        name = f"{svc.name}-{r}"
        if explicit is not None:
            gpus = allocator.claim(
                explicit[r * per_replica : (r + 1) * per_replica], name, where_gpus
            )
        else:
            gpus = allocator.take(per_replica, name, where_gpus) if per_replica else ()
        units.append(
            Unit(
                name=name,
                host=host,
                kind="service",
                engine=svc.engine,
                playbook=book,
                spec=svc,
                source=source,
                service=svc.name,
                replica=r,
                port=base_port + r if base_port is not None else None,
                gpus=gpus,
                nodes=tuple(nodes),
                rank=rank,
                head=inventory.hosts[nodes[0]].dial_address if nodes else None,
                dist_port=svc.dist_port
                if nodes and isinstance(svc, (SglangService, VllmService))
                else None,
            )
        )
    return units


def _ray_units(
    host: Host,
    book: Playbook,
    svc: VllmService,
    source: PathKey,
    allocator: _GpuAllocator,
    where_gpus: Where,
    inventory: Inventory,
    nodes: list[str],
    rank: int,
) -> list[Unit]:
    """vLLM over Ray: every node runs the Ray part ``NAME-ray`` (the head on the first node,
    holding this node's GPUs); the first node also runs the API server ``NAME-0``, which holds
    no GPU of its own (Ray's workers on every node do) and starts serving once the cluster
    shows every node with its GPUs."""
    per_node = gpus_of(svc) // len(nodes)
    head = inventory.hosts[nodes[0]].dial_address
    name = f"{svc.name}-ray"
    if isinstance(svc.gpus, list):
        gpus = allocator.claim(svc.gpus, name, where_gpus)
    else:
        gpus = allocator.take(per_node, name, where_gpus)
    ray = Unit(
        name=name,
        host=host,
        kind="service",
        engine="ray",
        playbook=book,
        spec=svc,
        source=source,
        service=svc.name,
        replica=0,
        gpus=gpus,
        nodes=tuple(nodes),
        rank=rank,
        head=head,
        dist_port=svc.dist_port,
    )
    if rank:
        return [ray]
    server = replace(
        ray,
        name=f"{svc.name}-0",
        engine="vllm",
        port=svc.port or DEFAULT_PORTS["vllm"],
        gpus=(),
        nodes=(),
        rank=None,
        cluster=tuple(inventory.hosts[n].dial_address for n in nodes),
        sees=gpus,
    )
    return [ray, server]


def _check_names(units: list[Unit]) -> list[Problem]:
    seen: dict[str, Unit] = {}
    problems = []
    for u in units:
        other = seen.get(u.name)
        if other is not None:
            problems.append(
                u.problem(
                    f"unit name is also used by {other.playbook.path} ({other.service}); "
                    "names must be unique per host",
                    "name",
                )
            )
        seen.setdefault(u.name, u)
    return problems


def _check_ports(units: list[Unit]) -> list[Problem]:
    """Every port a unit listens on is its own on the host: HTTP ports, and the rendezvous port
    of a multi-node unit on its head."""
    seen: dict[int, Unit] = {}
    problems = []
    for u in units:
        ports = [(u.port, "port")] if u.port is not None else []
        if u.rank == 0 and u.dist_port is not None:
            ports.append((u.dist_port, "dist_port"))
        for port, field_name in ports:
            if port > 65535:
                problems.append(
                    u.problem(f"port {port} is above 65535 (port + replica index)", field_name)
                )
            elif port in seen:
                what = "rendezvous port" if field_name == "dist_port" else "port"
                problems.append(
                    u.problem(f"{what} {port} is also used by {seen[port].name}", field_name)
                )
            seen.setdefault(port, u)
    return problems


def _link_jobs(units: list[Unit], node: NodeState, problems: list[Problem]) -> list[Unit]:
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
    host = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
    return f"[{host}]" if ":" in host else host


def _check_cycles(units: list[Unit]) -> list[Problem]:
    graph = {u.name: u.needs for u in units}
    problems: list[Problem] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done
    reported: set[frozenset[str]] = set()

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for nxt in graph.get(name, ()):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt] if nxt in stack else [name, nxt]
                key = frozenset(cycle)
                if key not in reported:
                    reported.add(key)
                    unit = next(u for u in units if u.name == nxt)
                    problems.append(
                        unit.problem(f"needs form a cycle: {' -> '.join(cycle)}", "needs")
                    )
            elif state.get(nxt) is None:
                visit(nxt, [*stack, nxt])
        state[name] = 2

    for u in units:
        if state.get(u.name) is None:
            visit(u.name, [u.name])
    return problems


DP_ADVICE = (
    "vLLM with data-parallel-size {dp} on {gpus}: vLLM offsets each DP rank's devices itself, so this "
    "crashed in the field with 'DP adjusted local rank ... is out of bounds' and a broken pipe "
    "(INCIDENTS.md #2). For a dense model use `replicas: {dp}` with `dp: 1` (one server per GPU set, "
    "each with its own port); set `allow_dp: true` only for MoE models that need vLLM's DP."
)


def _check_vllm_dp(units: list[Unit]) -> list[Problem]:
    problems = []
    for u in units:
        if (
            isinstance(u.spec, VllmService)
            and u.spec.dp > 1
            and not u.spec.allow_dp
            and u.replica == 0
        ):
            gpus = f"CUDA_VISIBLE_DEVICES={','.join(map(str, u.gpus))}" if u.gpus else "its GPUs"
            problems.append(u.problem(DP_ADVICE.format(dp=u.spec.dp, gpus=gpus), "dp"))
    return problems


def topo_order(units: list[Unit]) -> list[Unit]:
    """Units in an order where every unit comes after what it needs (services first)."""
    done: set[str] = set()
    out: list[Unit] = []
    pending = sorted(units, key=lambda u: u.kind != "service")
    while pending:
        progress = [u for u in pending if all(n in done for n in u.needs)]
        if not progress:  # a cycle; pre-flight reports it, keep the rest in file order
            progress = pending
        for u in progress:
            out.append(u)
            done.add(u.name)
        pending = [u for u in pending if u.name not in done]
    return out
