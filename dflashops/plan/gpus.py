"""GPUs: how many one replica of a model service needs, and handing them out on one host
(explicit lists are claims, counts take what is left, in order)."""

from __future__ import annotations

from dflashops.config.inventory import Host
from dflashops.config.playbook import Job, ModelService, VllmService
from dflashops.errors import Problem
from dflashops.plan.model import Where


def gpus_of(spec: ModelService) -> int:
    """GPUs of one replica: tp x dp (x pp for vLLM)."""
    return spec.tp * spec.dp * (spec.pp if isinstance(spec, VllmService) else 1)


def parallelism(spec: ModelService) -> str:
    pp = f" x pp {spec.pp}" if isinstance(spec, VllmService) and spec.pp > 1 else ""
    return f"tp {spec.tp}{pp} x dp {spec.dp}"


class GpuAllocator:
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
