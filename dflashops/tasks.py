"""The invoke collection: `invoke preflight`, `invoke render` ... from an ops repo whose tasks.py
re-exports `namespace`. Options match the `dflashops` console script (cli.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task, task

from dflashops import commands
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


namespace = Collection(preflight, render, schema, trust)
