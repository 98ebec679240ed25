"""The invoke collection: `invoke preflight`, `invoke render` ... from an ops repo whose tasks.py
re-exports `namespace`. Options match the `dflashops` console script (cli.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task, task

from dflashops import commands, operate
from dflashops.errors import ConfigError, DflashopsError
from dflashops.output import console
from dflashops.run import DEFAULT_FORKS

SELECTION_HELP = {
    "inventory": "inventory file (default: inventory.yaml, else inventory.example.yaml)",
    "host": "host or group names, comma-separated, repeatable (default: every host the playbooks target)",
    "playbook": "playbook file, repeatable (default: every playbooks/*.yaml that targets the hosts)",
}


class OpsTask(Task[Any]):
    """Short flags exactly as the console script has them (-i, -p); invoke's automatic ones would
    make -h mean --host and shadow --help."""

    SHORT: ClassVar[dict[str, str]] = {"inventory": "i", "playbook": "p"}

    def arg_opts(self, name: str, default: Any, taken_names: set[str]) -> dict[str, Any]:
        opts: dict[str, Any] = super().arg_opts(name, default, taken_names)
        if name in self.SHORT:
            opts["names"] = [*opts["names"], self.SHORT[name]]
        return opts


def _run(fn: object, **kwargs: object) -> None:
    try:
        code = fn(console(), **kwargs)  # type: ignore[operator]
    except ConfigError as exc:
        raise Exit("\n".join(f"error: {p}" for p in exc.problems), code=1) from None
    except DflashopsError as exc:
        raise Exit(f"error: {exc}", code=1) from None
    if code:
        raise Exit(code=code)


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook"],
    help={
        **SELECTION_HELP,
        "json": "write the results as JSON",
        "junit": "write the results as JUnit XML",
        "live": "also check the hosts (one facts round trip each)",
        "forks": "hosts in parallel (default 10)",
    },
)
def preflight(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    json: str | None = None,
    junit: str | None = None,
    live: bool = False,
    forks: int = DEFAULT_FORKS,
) -> None:
    """Offline checks for CI: validate, render, bash -n, compile payloads, check GPUs/ports/flags."""
    _run(
        commands.preflight,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        json_path=json,
        junit_path=junit,
        live=live,
        forks=forks,
    )


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook"],
    help={**SELECTION_HELP, "out": "write DIR/<host>/<unit>.sh instead of printing"},
)
def render(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    out: str | None = None,
) -> None:
    """Print or write the rendered launch scripts, for review."""
    _run(commands.render, inventory=inventory, hosts=host, playbooks=playbook, out_dir=out)


@task(klass=OpsTask, auto_shortflags=False, help={"which": "all, inventory or playbook"})
def schema(c: Context, which: str = "all") -> None:
    """Print the JSON Schema of the inventory and playbook files."""
    _run(commands.schema, which=which)


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host"],
    help={
        "inventory": SELECTION_HELP["inventory"],
        "host": "host or group names, comma-separated",
        "yes": "record without asking",
    },
)
def trust(
    c: Context, inventory: str | None = None, host: list[str] | None = None, yes: bool = False
) -> None:
    """Fetch, show and record hosts' SSH keys (asks on a terminal; --yes for scripts)."""
    _run(commands.trust, inventory=inventory, hosts=host, yes=yes)


FLEET_HELP = {
    "forks": "hosts in parallel (default 10)",
    "json": "write one JSON event per line to FILE",
}


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook"],
    help={
        **SELECTION_HELP,
        **FLEET_HELP,
        "check": "plan only: change nothing",
        "diff": "show unified diffs of launch scripts that would change",
        "force": "start even where GPUs hold memory of processes not started by dflashops",
        "rerun": "run jobs again that finished with exit 0",
    },
)
def deploy(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    check: bool = False,
    diff: bool = False,
    force: bool = False,
    rerun: bool = False,
    forks: int = DEFAULT_FORKS,
    json: str | None = None,
) -> None:
    """Make hosts match the playbooks: ship what changed, (re)start what changed or is not running, verify."""
    _run(
        operate.deploy,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        check=check,
        diff=diff,
        force=force,
        rerun=rerun,
        forks=forks,
        json_path=json,
    )


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook"],
    help={
        **SELECTION_HELP,
        **FLEET_HELP,
        "all_at_once": "restart every replica together instead of rolling",
        "force": "start even where GPUs hold foreign memory",
    },
)
def restart_servers(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    all_at_once: bool = False,
    force: bool = False,
    forks: int = DEFAULT_FORKS,
    json: str | None = None,
) -> None:
    """Restart service units, rolling one replica at a time per host (next only when ready)."""
    _run(
        operate.restart_servers,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        all_at_once=all_at_once,
        force=force,
        forks=forks,
        json_path=json,
    )


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook", "unit"],
    help={
        **SELECTION_HELP,
        **FLEET_HELP,
        "unit": "unit to stop, repeatable (default: all on the selected hosts)",
    },
)
def stop(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    unit: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json: str | None = None,
) -> None:
    """Stop units dflashops started (all targeted by default): TERM, grace, KILL, GPUs freed."""
    _run(
        operate.stop,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        units=unit,
        forks=forks,
        json_path=json,
    )


@task(
    klass=OpsTask,
    auto_shortflags=False,
    iterable=["host", "playbook"],
    help={**SELECTION_HELP, **FLEET_HELP},
)
def status(
    c: Context,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    forks: int = DEFAULT_FORKS,
    json: str | None = None,
) -> None:
    """Per host and unit: state, pid, uptime, port, health, fingerprint, GPU memory, job progress."""
    _run(
        operate.status,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        forks=forks,
        json_path=json,
    )


@task(
    klass=OpsTask,
    auto_shortflags=False,
    positional=["unit"],
    iterable=["host", "playbook"],
    help={
        **SELECTION_HELP,
        "unit": "the unit",
        "lines": "lines to show (default 100)",
        "follow": "keep printing new output",
    },
)
def logs(
    c: Context,
    unit: str,
    inventory: str | None = None,
    host: list[str] | None = None,
    playbook: list[str] | None = None,
    lines: int = 100,
    follow: bool = False,
) -> None:
    """The end of a unit's current log."""
    _run(
        operate.logs,
        unit=unit,
        inventory=inventory,
        hosts=host,
        playbooks=playbook,
        lines=lines,
        follow=follow,
    )


namespace = Collection(
    deploy, restart_servers, stop, status, logs, preflight, render, schema, trust
)
