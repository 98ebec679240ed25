"""The plan of every host: each targeted host's playbooks (vars filled in), its node state, its
units with their GPUs, links and checks."""

from __future__ import annotations

from dflashops.config.inventory import Host, Inventory
from dflashops.config.load import Playbook
from dflashops.config.playbook import PlaybookFile
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem
from dflashops.plan.checks import check_cycles, check_names, check_ports, check_vllm_dp
from dflashops.plan.expand import expand_for_host
from dflashops.plan.gpus import GpuAllocator
from dflashops.plan.hosts import targets
from dflashops.plan.links import link_jobs, link_node
from dflashops.plan.model import HostPlan, Plan, Unit
from dflashops.plan.nodestate import plan_node
from dflashops.plan.units import job_units, service_units


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
            spec = expand_for_host(book, inventory.hosts[name], problems)
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
    allocator = GpuAllocator(host, problems)
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
                            service_units(
                                host, book, svc, source, allocator, problems, inventory, planned
                            ),
                        )
                    )
        for b, (book, spec) in enumerate(entries):
            for i, job in enumerate(spec.jobs):
                if isinstance(job.gpus, list) == explicit:
                    parts = job_units(host, book, job, i, allocator, problems, inventory, planned)
                    made.append(((b, 1, i), parts))
    units = [u for _, group in sorted(made, key=lambda m: m[0]) for u in group]
    problems.extend(check_names(units))
    problems.extend(check_ports(units))
    units = link_node(link_jobs(units, node, problems), node, problems)
    problems.extend(check_cycles(units))
    problems.extend(check_vllm_dp(units))
    return HostPlan(host, units, node), problems
