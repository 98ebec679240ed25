"""The units one playbook entry makes on one host: a service's replicas ``NAME-0..N-1`` on
``port + i``, a multi-node part with its rank, a vLLM-over-Ray service's Ray part and API
server, a job."""

from __future__ import annotations

from dataclasses import replace

from dflashops.config.inventory import Host, Inventory
from dflashops.config.load import Playbook
from dflashops.config.playbook import (
    CommandService,
    Job,
    ModelService,
    SglangService,
    VllmService,
    keep_target_problem,
)
from dflashops.config.yamlsource import PathKey
from dflashops.engines.protocol import DEFAULT_PORTS
from dflashops.errors import Problem
from dflashops.plan.gpus import GpuAllocator, gpus_of, parallelism
from dflashops.plan.hosts import span
from dflashops.plan.model import Unit, Where, locator


def job_units(
    host: Host,
    book: Playbook,
    job: Job,
    index: int,
    allocator: GpuAllocator,
    problems: list[Problem],
    inventory: Inventory,
    planned: set[str],
) -> list[Unit]:
    """The job on this host: one unit, or this node's part of a job over several nodes."""
    nodes: list[str] = []
    if job.nodes is not None:
        found = span(inventory, book, job, ("jobs", index), planned, problems)
        if found is None or host.name not in found:
            return []
        nodes = found
    where = locator(book, ("jobs", index, "gpus"), f"job {job.name}: ")
    if job.keep is not None and (why := keep_target_problem(job.keep, host.name, inventory.hosts)):
        problems.append(book.doc.problem(("jobs", index, "keep", "to"), why))
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


def service_units(
    host: Host,
    book: Playbook,
    svc: ModelService | CommandService,
    source: PathKey,
    allocator: GpuAllocator,
    problems: list[Problem],
    inventory: Inventory,
    planned: set[str],
) -> list[Unit]:
    per_replica = gpus_of(svc) if isinstance(svc, ModelService) else svc.gpus_per_replica
    where_gpus = locator(book, (*source, "gpus"), f"service {svc.name}: ")
    nodes: list[str] = []
    if isinstance(svc, (SglangService, VllmService)) and svc.nodes is not None:
        found = span(inventory, book, svc, source, planned, problems)
        if found is None or host.name not in found:
            return []  # unusable (said above), or a service of other hosts
        nodes = found
        per_replica //= len(nodes)  # GPUs of this node's rank
    explicit: list[int] | None = svc.gpus if isinstance(svc.gpus, list) else None
    unfit = _gpu_count_problem(host, svc, explicit, per_replica, nodes)
    if unfit is not None:
        problems.append(where_gpus(unfit))
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


def _gpu_count_problem(
    host: Host,
    svc: ModelService | CommandService,
    explicit: list[int] | None,
    per_replica: int,
    nodes: list[str],
) -> str | None:
    """Why the service's GPUs cannot add up on this host (a list of the wrong length, more than
    the host has), or None."""
    if explicit is not None and len(explicit) != per_replica * svc.replicas:
        if isinstance(svc, CommandService):
            return _command_gpus_problem(svc, len(explicit))
        return (
            f"lists {len(explicit)} GPU(s) but {svc.replicas} replica(s) x tp*dp {per_replica} "
            f"need {per_replica * svc.replicas}"
            + (f" (per node: {len(nodes)} nodes)" if nodes else "")
        )
    if explicit is None and per_replica * svc.replicas > host.gpus:
        # One message for the whole service instead of one per replica that does not fit.
        tp_dp = (
            parallelism(svc) + (f" over {len(nodes)} nodes" if nodes else "")
            if isinstance(svc, ModelService)
            else f"{per_replica} per replica"
        )
        return (
            f"needs {per_replica * svc.replicas} GPUs ({tp_dp} x {svc.replicas} replica(s)) "
            f"but host {host.name} has {host.gpus}"
        )
    return None


def _command_gpus_problem(svc: CommandService, listed: int) -> str:
    """A command service's GPU list against its ``gpus_per_replica`` (it has no tp or dp),
    with the value that would make the list fit, when there is one."""
    need = svc.gpus_per_replica * svc.replicas
    said = (
        f"lists {listed} GPU(s) but {svc.replicas} replica(s) x gpus_per_replica "
        f"{svc.gpus_per_replica} need {need}"
    )
    if listed % svc.replicas == 0:
        return f"{said}: set `gpus_per_replica: {listed // svc.replicas}` (GPUs each replica uses)"
    return f"{said}: list {svc.replicas} x gpus_per_replica GPUs, or change `replicas`"


def _ray_units(
    host: Host,
    book: Playbook,
    svc: VllmService,
    source: PathKey,
    allocator: GpuAllocator,
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
