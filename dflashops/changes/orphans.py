"""Orphans: units dflashops started on a host that no playbook of the project defines for that
host any more (renamed, removed, replicas lowered). Pure: facts and names in, findings out.

"The project" is every playbook beside the inventory, even when ``-p`` narrows what a command
works on, so another playbook's units are never orphans. What an orphan holds comes from the
host itself: the port and GPUs recorded in its unit.json at deploy, its listening sockets and
its GPU memory (nvidia-smi pids in its process group).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflashops.agent.answers import HostFacts, UnitFacts


@dataclass(frozen=True)
class Orphan:
    name: str
    facts: UnitFacts

    @property
    def running(self) -> bool:
        return self.facts.running or bool(self.facts.group_pids)

    @property
    def pids(self) -> list[int]:
        return self.facts.group_pids

    @property
    def port(self) -> int | None:
        return self.facts.unit.port if self.facts.unit is not None else None

    @property
    def gpus(self) -> list[int]:
        return list(self.facts.unit.gpus) if self.facts.unit is not None else []

    def describe(self) -> str:
        """`running (pid 123, port 30002, GPUs 2)` or `stopped (folder kept)`."""
        if not self.running:
            return "not running (its folder is kept)"
        parts = [f"pid {self.facts.process.pid or ', '.join(map(str, self.pids))}"]
        if self.port is not None:
            parts.append(f"port {self.port}")
        if self.gpus:
            parts.append(f"GPUs {','.join(map(str, self.gpus))}")
        return f"running ({', '.join(parts)})"


def find(facts: HostFacts, known: set[str]) -> list[Orphan]:
    """Units on the host that dflashops deployed or started and ``known`` does not name."""
    return [
        Orphan(name, uf)
        for name, uf in sorted(facts.units.items())
        if name not in known and (uf.unit is not None or uf.pid is not None or uf.group_pids)
    ]


def ways_out(orphan: str) -> str:
    return f"`dflashops deploy --prune` stops it, or `dflashops stop --unit {orphan}`"


def blocking(
    orphans: list[Orphan], facts: HostFacts, port: int | None, gpus: tuple[int, ...]
) -> list[tuple[Orphan, str]]:
    """(orphan, what it holds) for each running orphan holding ``port`` or one of ``gpus``."""
    listener_pids = set()
    if port is not None:
        listener = facts.listener(port)
        listener_pids = set(listener.pids) if listener is not None else set()
    out: list[tuple[Orphan, str]] = []
    for o in orphans:
        if not o.running:
            continue
        held: list[str] = []
        if port is not None and (o.port == port or listener_pids & set(o.pids)):
            held.append(f"port {port}")
        memory = {p.gpu_index for p in facts.gpus.processes if p.pid in set(o.pids)}
        shared = sorted((set(o.gpus) | {g for g in memory if g is not None}) & set(gpus))
        if shared:
            held.append(f"GPU{'s' if len(shared) > 1 else ''} {','.join(map(str, shared))}")
        if held:
            out.append((o, " and ".join(held)))
    return out
