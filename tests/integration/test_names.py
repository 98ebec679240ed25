"""Names against the sshd fleet (DESIGN.md "Operating under pressure" 4, issue 21): a service's
name works wherever a unit's does (deploy, restart-servers, stop --unit; logs UNIT shows each
replica's log, headed), an orphan service's too; an unknown name says "did you mean" and what
there is, and nothing is done; --limit with globs; -v shows the remote calls."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, Result, job, stub, unit_dir, unit_pid

from tests.procs import alive, free_ports

ECHO = ["echo-0", "echo-1"]


def playbook(port: int, echo: bool = True) -> dict[str, Any]:
    """A service echo (2 replicas), a service other, and a job client that needs echo."""
    services = [{**stub("echo", port), "replicas": 2}] if echo else []
    services.append(
        {"name": "other", "engine": "command", "command": ["sleep", "300"], "stop_grace": "2s"}
    )
    needs = {"needs": ["echo"]} if echo else {}
    return {
        "hosts": "s",
        "services": services,
        "jobs": [job("client", "echo working; sleep 300", **needs)],
    }


def started(res: Result) -> set[str]:
    return {e["unit"] for e in res.events if e["action"] == "start" and e["status"] == "changed"}


def running(host: FleetHost, unit: str) -> bool:
    return (unit_dir(host, unit) / "pid").exists() and alive(unit_pid(host, unit))


def refused(res: Result, line: str) -> None:
    assert res.code == 1, res.explain()
    assert line in res.out, res.explain()
    assert not started(res) and not res.of(action="stop"), res.explain()


def test_a_service_name_means_its_replicas_everywhere_and_typos_do_nothing(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(s={"gpus": 4})
    host = fleet["s"]
    ctl = ops(fleet)
    ctl.playbook("p", playbook(free_ports(2)))

    typo = ctl.run("deploy", "--unit", "ecoh")
    refused(typo, "no unit or service named 'ecoh' (did you mean 'echo'?)")
    assert "known: client, echo (echo-0, echo-1), other (other-0)" in typo.out
    assert not unit_dir(host, "echo-0").exists()
    # A unit's needs are not added behind the user's back.
    refused(ctl.run("deploy", "--unit", "client"), "--unit client needs echo-0, echo-1")

    only = ctl.run("deploy", "--unit", "echo")
    assert only.code == 0, only.explain()
    assert started(only) == set(ECHO), only.explain()
    assert all(running(host, u) for u in ECHO)
    assert not unit_dir(host, "other-0").exists() and not unit_dir(host, "client").exists()

    logs = ctl.run("logs", "echo", "--lines", "5", json_events=False)
    assert logs.code == 0, logs.explain()
    heads = re.findall(r"^==> \[s\] (\S+) logs/\S+\.log$", logs.out, re.MULTILINE)
    assert heads == ECHO, logs.out
    # Each replica's own log under its own head.
    second = logs.out.index("==> [s] echo-1 ")
    assert "unit=echo-0 " in logs.out[:second] and "unit=echo-1 " in logs.out[second:]

    before = {u: unit_pid(host, u) for u in ECHO}
    again = ctl.run("restart-servers", "--unit", "echo", "--all-at-once")
    assert again.code == 0, again.explain()
    assert all(unit_pid(host, u) != before[u] for u in ECHO), again.explain()

    assert ctl.run("deploy").code == 0
    everything = [*ECHO, "other-0", "client"]
    assert all(running(host, u) for u in everything)
    refused(ctl.run("stop", "--unit", "ecoh"), "(did you mean 'echo'?)")
    assert all(running(host, u) for u in everything)

    stopped = ctl.run("stop", "--unit", "echo")
    assert stopped.code == 0, stopped.explain()
    assert {e["unit"] for e in stopped.of(action="stop", status="changed")} == set(ECHO)
    assert not any(running(host, u) for u in ECHO)
    assert running(host, "other-0") and running(host, "client")


def test_an_orphan_service_is_stopped_and_read_by_its_name(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(s={"gpus": 4})
    host = fleet["s"]
    ctl = ops(fleet)
    ctl.playbook("p", playbook(free_ports(2)))
    assert ctl.run("deploy", "--unit", "echo,other").code == 0
    ctl.playbook("p", playbook(0, echo=False))  # echo's replicas are orphans now

    logs = ctl.run("logs", "echo", "--host", "s", "--lines", "3", json_events=False)
    assert logs.code == 0, logs.explain()
    assert re.findall(r"^==> \[s\] (\S+) ", logs.out, re.MULTILINE) == ECHO, logs.out

    typo = ctl.run("stop", "--unit", "ecoh")
    refused(typo, "no unit or service named 'ecoh' (did you mean 'echo'?) on s")
    assert all(running(host, u) for u in ECHO)

    stopped = ctl.run("stop", "--unit", "echo")
    assert stopped.code == 0, stopped.explain()
    assert {e["unit"] for e in stopped.of(action="stop", status="changed")} == set(ECHO)
    assert not any(running(host, u) for u in ECHO) and running(host, "other-0")


def test_limit_takes_globs_and_verbose_shows_each_remote_call(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(s={"gpus": 4})
    ctl = ops(fleet)
    ctl.playbook("p", playbook(free_ports(2)))

    plan = ctl.run("deploy", "--limit", "s*", "--unit", "other", "--check", "-v")
    assert plan.code == 0, plan.explain()
    assert [e["unit"] for e in plan.of(action="plan")] == ["other-0"], plan.explain()
    # -v: each remote call with its time, the facts call at least.
    assert re.search(r"^\[s\] facts \d+\.\d{3}s$", plan.out, re.MULTILINE), plan.out
    quiet = ctl.run("deploy", "--limit", "all", "--unit", "other", "--check")
    assert quiet.code == 0 and not re.search(r"^\[s\] facts ", quiet.out, re.MULTILINE)

    unknown = ctl.run("status", "--limit", "x*")
    assert unknown.code == 1 and "--host 'x*' is not in" in unknown.out, unknown.explain()
