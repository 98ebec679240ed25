"""One definition of every command: name, options, defaults and help. The `dflashops` console
script (cli.py) and the invoke collection (tasks.py) are both generated from this table, so the
two front ends cannot drift. Importing it costs nothing: each command's code is imported only
when that command runs.

Positional arguments are single and required (``logs UNIT``): invoke cannot parse an optional
or repeated positional, so lists of names are options (``stop --unit a,b``), as ``--host`` is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["str", "int", "bool", "list"]
# Hosts in parallel. Work on a host is mostly waiting (an engine loading for minutes), so the
# default must cover a rack: with 10, the 11th host of 16 did not start until a whole host had
# finished, readiness wait included.
DEFAULT_FORKS = 64


@dataclass(frozen=True)
class Option:
    dest: str  # the keyword argument of the command's function
    flags: tuple[str, ...]  # ("-i", "--inventory"); empty for a positional
    help: str
    kind: Kind = "str"
    default: Any = None
    metavar: str | None = None
    required: bool = False
    choices: tuple[str, ...] = ()

    @property
    def positional(self) -> bool:
        return not self.flags

    @property
    def long(self) -> str:
        """The option's name on both command lines: ``--all-at-once`` -> ``all-at-once``."""
        return next((f[2:] for f in self.flags if f.startswith("--")), self.dest)

    @property
    def short(self) -> str | None:
        return next((f[1:] for f in self.flags if len(f) == 2), None)

    def help_text(self) -> str:
        if self.kind in ("int", "str") and self.default is not None:
            return f"{self.help} (default {self.default})"
        return self.help


@dataclass(frozen=True)
class Command:
    name: str  # as typed: "restart-servers"
    help: str  # one line
    target: str  # "module:function", imported when the command runs
    options: tuple[Option, ...] = field(default_factory=tuple)

    @property
    def func_name(self) -> str:
        return self.name.replace("-", "_")


INVENTORY = Option(
    "inventory",
    ("-i", "--inventory"),
    "inventory file (default: inventory.yaml, else inventory.example.yaml)",
    metavar="FILE",
)
HOSTS = Option(
    "hosts",
    ("--host",),
    "host or group names, comma-separated, repeatable (default: every host the playbooks target)",
    kind="list",
    metavar="NAMES",
)
PLAYBOOKS = Option(
    "playbooks",
    ("-p", "--playbook"),
    "playbook file, repeatable (default: every playbooks/*.yaml that targets the hosts)",
    kind="list",
    metavar="FILE",
)
FORKS = Option(
    "forks", ("--forks",), "hosts in parallel", kind="int", default=DEFAULT_FORKS, metavar="N"
)
EVENTS = Option("json_path", ("--json",), "write one JSON event per line to FILE", metavar="FILE")
SELECTION = (INVENTORY, HOSTS, PLAYBOOKS)
FLEET = (FORKS, EVENTS)
NAMED_HOSTS = Option(
    "hosts",
    ("--host",),
    "host or group names, comma-separated, repeatable",
    kind="list",
    metavar="NAMES",
    required=True,
)
LOCK_WAIT = Option(
    "lock_wait",
    ("--lock-wait",),
    "when another actor holds a host's deploy lock, wait up to DURATION (30s, 5m) for it "
    "instead of being refused at once",
    metavar="DURATION",
)


def flag(dest: str, help: str) -> Option:
    return Option(dest, ("--" + dest.replace("_", "-"),), help, kind="bool", default=False)


COMMANDS: tuple[Command, ...] = (
    Command(
        "deploy",
        "make hosts match the playbooks: ship what changed, (re)start what changed or is down, verify",
        "dflashops.commands.deploy:deploy",
        (
            *SELECTION,
            *FLEET,
            LOCK_WAIT,
            flag("check", "plan only: change nothing"),
            flag("diff", "show unified diffs of launch scripts that would change"),
            flag(
                "force",
                "start even where GPUs hold memory of processes not started by dflashops, "
                "or where a multi-node unit's ranks cannot reach its head",
            ),
            flag("rerun", "run jobs again that finished with exit 0"),
            flag("prune", "stop orphans (units no playbook defines) and move their folders aside"),
        ),
    ),
    Command(
        "restart-servers",
        "restart service units, rolling one replica at a time per host (next only when ready)",
        "dflashops.commands.deploy:restart_servers",
        (
            *SELECTION,
            *FLEET,
            LOCK_WAIT,
            flag("all_at_once", "restart every replica together instead of rolling"),
            flag(
                "force", "start even where GPUs hold memory of processes not started by dflashops"
            ),
        ),
    ),
    Command(
        "stop",
        "stop units dflashops started (default: all on the targeted hosts): TERM, grace, KILL",
        "dflashops.commands.deploy:stop",
        (
            *SELECTION,
            *FLEET,
            LOCK_WAIT,
            Option(
                "units",
                ("--unit",),
                "units to stop, comma-separated, repeatable; orphans too (default: all)",
                kind="list",
                metavar="NAMES",
            ),
        ),
    ),
    Command(
        "status",
        "per host and unit: state, pid, uptime, port, health, fingerprint, GPUs, progress",
        "dflashops.commands.status:status",
        (*SELECTION, *FLEET),
    ),
    Command(
        "top",
        "a live view of servers and jobs: tok/s, requests, KV cache, GPUs, restarts, progress, ETA",
        "dflashops.commands.top:top",
        (
            *SELECTION,
            Option("interval", ("--interval",), "time between refreshes", default="2s"),
            flag("once", "print one frame and exit (for scripts)"),
            FORKS,
        ),
    ),
    Command(
        "logs",
        "the end of a unit's current log",
        "dflashops.commands.logs:logs",
        (
            Option("unit", (), "the unit", metavar="UNIT", required=True),
            *SELECTION,
            Option("lines", ("-n", "--lines"), "lines to show", kind="int", default=100),
            Option(
                "follow", ("-f", "--follow"), "keep printing new output (Ctrl-C stops)", kind="bool"
            ),
            flag(
                "raw",
                "print the log as the host has it, escape sequences included (by default control "
                "characters other than newline and tab are removed: host text is inert)",
            ),
        ),
    ),
    Command(
        "preflight",
        "offline checks for CI: validate, render, bash -n, compile shipped .py, GPUs, ports, flags",
        "dflashops.commands.preflight:preflight",
        (
            *SELECTION,
            Option("json_path", ("--json",), "write the results as JSON to FILE", metavar="FILE"),
            Option(
                "junit_path", ("--junit",), "write the results as JUnit XML to FILE", metavar="FILE"
            ),
            flag("live", "also check the hosts (one facts round trip each)"),
            FORKS,
        ),
    ),
    Command(
        "render",
        "print or write the rendered launch scripts, for review",
        "dflashops.commands.preflight:render",
        (
            *SELECTION,
            Option(
                "out_dir",
                ("--out",),
                "write DIR/<host>/<unit>.sh instead of printing",
                metavar="DIR",
            ),
        ),
    ),
    Command(
        "trust",
        "fetch, show and record hosts' SSH keys (asks on a terminal; --yes for scripts)",
        "dflashops.commands.trust:trust",
        (
            INVENTORY,
            NAMED_HOSTS,
            flag("yes", "record without asking (for scripts)"),
        ),
    ),
    Command(
        "unlock",
        "show who holds a host's deploy lock and release a stuck one (asks on a terminal; --yes)",
        "dflashops.commands.unlock:unlock",
        (
            INVENTORY,
            NAMED_HOSTS,
            flag("yes", "release without asking (for scripts)"),
        ),
    ),
    Command(
        "fetch",
        "copy a host path to the controller, verified (sha256) and resumable",
        "dflashops.commands.fetch:fetch",
        (
            Option("remote", (), "the path on the host", metavar="REMOTE", required=True),
            Option("local", (), "where it goes on this machine", metavar="LOCAL", required=True),
            INVENTORY,
            Option(
                "hosts",
                ("--host",),
                "the host (one)",
                kind="list",
                metavar="NAME",
                required=True,
            ),
        ),
    ),
    Command(
        "schema",
        "print the JSON Schema of the inventory and playbook files, for editors",
        "dflashops.commands.preflight:schema",
        (
            Option(
                "which",
                ("--which",),
                "which schema",
                default="all",
                choices=("all", "inventory", "playbook"),
            ),
        ),
    ),
)


def load(command: Command) -> Any:
    """The command's function, imported now."""
    import importlib

    module, _, name = command.target.partition(":")
    return getattr(importlib.import_module(module), name)
