"""Checks over one host's units (names, ports, needs cycles, vLLM's data parallelism) and the
order they start in."""

from __future__ import annotations

from dflashops.config.playbook import VllmService
from dflashops.errors import Problem
from dflashops.plan.model import Unit


def check_names(units: list[Unit]) -> list[Problem]:
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


def check_ports(units: list[Unit]) -> list[Problem]:
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


def check_cycles(units: list[Unit]) -> list[Problem]:
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


def check_vllm_dp(units: list[Unit]) -> list[Problem]:
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
