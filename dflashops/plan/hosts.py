"""Which hosts: the ones a playbook targets, and the nodes a multi-node service or job spans
(rank order, head first), each checked against the inventory and the hosts selected."""

from __future__ import annotations

from dflashops.config.inventory import Inventory
from dflashops.config.load import Playbook
from dflashops.config.playbook import Job, SglangService, VllmService
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem
from dflashops.plan.gpus import gpus_of, parallelism
from dflashops.plan.model import Where, locator


def targets(inventory: Inventory, book: Playbook) -> tuple[list[str], list[Problem]]:
    """Host names a playbook targets, or problems naming the unknown patterns."""
    names: list[str] = []
    problems = []
    for i, pattern in enumerate(book.head.host_patterns):
        try:
            names.extend(n for n in inventory.expand([pattern]) if n not in names)
        except KeyError:
            where: PathKey = ("hosts",) if isinstance(book.head.hosts, str) else ("hosts", i)
            problems.append(
                book.doc.problem(
                    where, f"unknown host or group {pattern!r} (inventory has: {known(inventory)})"
                )
            )
    return names, problems


def span(
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
    where = locator(book, (*source, "nodes"), f"{kind} {spec.name}: ")
    seen = _members(inventory, spec.nodes, where, problems)
    if seen is None:
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
            locator(book, (*source, "tp"), f"service {spec.name}: ")(
                f"{parallelism(spec)} = {gpus_of(spec)} GPUs do not split evenly "
                f"over {len(seen)} nodes"
            )
        )
        return None
    return seen


def _members(
    inventory: Inventory, patterns: list[str], where: Where, problems: list[Problem]
) -> list[str] | None:
    """The hosts ``nodes:`` names, each once, in order; None (with problems) if any is unknown
    or named twice."""
    seen: list[str] = []
    ok = True
    for name in patterns:
        try:
            members = inventory.expand([name])
        except KeyError:
            problems.append(
                where(
                    f"unknown host or group {name!r} in nodes (inventory has: {known(inventory)})"
                )
            )
            ok = False
            continue
        for m in members:
            if m in seen:
                problems.append(where(f"host {m} is named twice in nodes: each node runs one rank"))
                ok = False
            else:
                seen.append(m)
    return seen if ok else None


# More names than this are counted, not listed: a 1,000-host inventory is not one line.
LISTED = 20


def known(inventory: Inventory) -> str:
    """The host and group names a pattern may use, sorted, the first LISTED of them."""
    names = sorted([*inventory.hosts, *inventory.groups])
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more
