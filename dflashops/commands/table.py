"""One definition of every command: name, options, defaults and help. The `dflashops` console
script (cli.py) and the invoke collection (tasks.py) are both generated from this table, so the
two front ends cannot drift. Importing it costs nothing: each command's code is imported only
when that command runs.

Positional arguments are single and required (``logs UNIT``): invoke cannot parse an optional
or repeated positional, so lists of names are options (``stop --unit a,b``), as ``--host`` is.
An option's first long flag is its name on both command lines; the others are aliases
(``--limit`` for ``--host``, as Ansible users type it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dflashops.commands.states import LEGEND

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
    # The value when the flag is given without one (``status --json``): argparse's nargs="?"
    # and const, invoke's optional value. None: the flag always takes its value.
    const: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flags

    @property
    def long(self) -> str:
        """The option's name on both command lines: ``--all-at-once`` -> ``all-at-once``."""
        return next((f[2:] for f in self.flags if f.startswith("--")), self.dest)

    @property
    def longs(self) -> tuple[str, ...]:
        """Every long name: ``("host", "limit")``."""
        return tuple(f[2:] for f in self.flags if f.startswith("--")) or (self.dest,)

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
    options: tuple[Option, ...] = field(default_factory=tuple)  # the function's keywords
    details: str = ""  # shown under the command's own help (--help), line breaks kept
    touches_hosts: bool = False  # takes -v/--verbose, which execute() handles

    @property
    def func_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def arguments(self) -> tuple[Option, ...]:
        """Everything on the command line: the function's options, then -v where it applies
        (execute() takes it: a command's function sees it only if it asks for it)."""
        return (*self.options, VERBOSE) if self.touches_hosts else self.options


INVENTORY = Option(
    "inventory",
    ("-i", "--inventory"),
    "inventory file (default: inventory.yaml, else inventory.example.yaml)",
    metavar="FILE",
)
HOSTS = Option(
    "hosts",
    ("--host", "--limit"),
    "host or group names, comma-separated, repeatable; `all` and shell globs ('h100-*') too "
    "(default: every host the playbooks target)",
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
EVENTS = Option(
    "json_path", ("--json",), "write one JSON event per line to FILE (`-`: stdout)", metavar="FILE"
)
SELECTION = (INVENTORY, HOSTS, PLAYBOOKS)
FLEET = (FORKS, EVENTS)
NAMED_HOSTS = Option(
    "hosts",
    ("--host", "--limit"),
    "host or group names, comma-separated, repeatable; `all` and shell globs ('h100-*') too",
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


VERBOSE = Option(
    "verbose",
    ("-v", "--verbose"),
    "show each remote call and its timing (on stderr)",
    kind="bool",
    default=False,
)
UNIT_HELP = "unit or service names (a service: all its replicas), comma-separated, repeatable"


def units(what: str) -> Option:
    """``--unit NAMES``: ``what`` says what the command does with them."""
    return Option("units", ("--unit",), f"{UNIT_HELP}: {what}", kind="list", metavar="NAMES")


def flag(dest: str, help: str) -> Option:
    return Option(dest, ("--" + dest.replace("_", "-"),), help, kind="bool", default=False)


COMMANDS: tuple[Command, ...] = (
    Command(
        "deploy",
        "make hosts match the playbooks: ship what changed, (re)start what changed or is down, verify",
        "dflashops.commands.deploy:deploy",
        (
            *SELECTION,
            units(
                "deploy these alone, with the environments and files entries they use; a unit "
                "they need is not added (name it too: unchanged, it is left alone); no orphan "
                "is pruned"
            ),
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
        touches_hosts=True,
    ),
    Command(
        "restart-servers",
        "restart service units, rolling one replica at a time per host (next only when ready)",
        "dflashops.commands.deploy:restart_servers",
        (
            *SELECTION,
            units("restart these alone (services only)"),
            *FLEET,
            LOCK_WAIT,
            flag("all_at_once", "restart every replica together instead of rolling"),
            flag(
                "force", "start even where GPUs hold memory of processes not started by dflashops"
            ),
        ),
        touches_hosts=True,
    ),
    Command(
        "stop",
        "stop units dflashops started (default: all on the targeted hosts): TERM, grace, KILL",
        "dflashops.commands.deploy:stop",
        (
            *SELECTION,
            *FLEET,
            LOCK_WAIT,
            units("stop these alone, orphans too (default: all)"),
        ),
        touches_hosts=True,
    ),
    Command(
        "status",
        "per host and unit: state, pid, uptime, port, health, fingerprint, GPUs, progress",
        "dflashops.commands.status:status",
        (
            *SELECTION,
            units("show these alone"),
            FORKS,
            Option(
                "json_path",
                ("--json",),
                "the status as JSON with raw values (seconds, booleans, bytes): one document "
                "on stdout with no FILE or with `-`, else written to FILE",
                metavar="FILE",
                const="-",
            ),
        ),
        details=LEGEND,
        touches_hosts=True,
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
        touches_hosts=True,
    ),
    Command(
        "watch",
        "the fleet's control loop: call every host each interval, start what is down, notify",
        "dflashops.commands.watch:watch",
        (
            *SELECTION,
            Option("interval", ("--interval",), "time between calls to a host", default="30s"),
            Option(
                "lost_after",
                ("--lost-after",),
                "a host is lost after this long of failed calls in a row (at least --interval)",
                default="2m",
                metavar="DURATION",
            ),
            Option(
                "heal",
                ("--heal",),
                "also start units their supervisor gave up on (crashed)",
                choices=("crashed",),
                metavar="WHAT",
            ),
            flag(
                "once",
                "one call to every host and what it needs, a line per host, then exit (non-zero "
                "when a host could not be read or a start failed)",
            ),
            *FLEET,
        ),
        details=(
            "Each tick: one facts call per host (a session kept open), then, under the host's\n"
            "deploy lock and through deploy's own code, it starts what should run and does not:\n"
            "units gone with their supervisor (killed with it, a reboot), a host back empty.\n"
            "It never restarts a running unit, nor starts one `stop` stopped; a crashed unit is\n"
            "reported (started with --heal crashed). A failed call is never acted on: a host is\n"
            "lost after --lost-after of failed calls (called with backoff, up to interval x 8).\n"
            "A changed host key stops all action there until `dflashops trust`. Notices go to\n"
            "the host's notify webhook: host_lost, host_back, reprovisioned, key_changed,\n"
            "redeployed, restored, job_done. The inventory and playbooks are loaded again when\n"
            "they change on disk; one that does not load stops the starting, not the looking."
        ),
        touches_hosts=True,
    ),
    Command(
        "logs",
        "the end of a unit's current log",
        "dflashops.commands.logs:logs",
        (
            Option(
                "unit",
                (),
                "the unit, or a service: each of its units' logs, headed by the unit's name",
                metavar="UNIT",
                required=True,
            ),
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
        touches_hosts=True,
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
        touches_hosts=True,  # with --live
    ),
    Command(
        "render",
        "print or write the rendered launch scripts, for review",
        "dflashops.commands.preflight:render",
        (
            *SELECTION,
            units("render these alone"),
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
        touches_hosts=True,
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
        touches_hosts=True,
    ),
    Command(
        "history",
        "what was deployed where, when and by whom: each host's revisions, newest first",
        "dflashops.commands.history:history",
        (
            *SELECTION,
            units("the revisions that changed these alone"),
            FORKS,
            Option(
                "json_path",
                ("--json",),
                "the revisions as one JSON document: on stdout with `-`, else written to FILE",
                metavar="FILE",
            ),
        ),
        details=(
            "Every deploy, restart-servers, stop and rollback that changed units is recorded on\n"
            "the host (WORKDIR/history/): revision, UTC time, who (user@machine), the command\n"
            "(secrets redacted), the units it changed and their fingerprints. The scripts of the\n"
            "last 10 revisions are kept: `dflashops rollback --to REV` goes back to one of them."
        ),
        touches_hosts=True,
    ),
    Command(
        "rollback",
        "restart a host's units on a kept revision's scripts (default: the previous one), verified",
        "dflashops.commands.history:rollback",
        (
            INVENTORY,
            NAMED_HOSTS,
            PLAYBOOKS,
            Option(
                "to",
                ("--to",),
                "the revision to go back to (`dflashops history` lists them; default: the one "
                "before the newest)",
                kind="int",
                metavar="REV",
            ),
            units("roll these back alone (default: every unit whose script differs)"),
            *FLEET,
            LOCK_WAIT,
        ),
        details=(
            "Under the host's deploy lock (refused, naming the holder, when another actor holds\n"
            "it): the units whose kept script of that revision differs from what they have are\n"
            "stopped, put back on it, started and verified (readiness and identity) like a\n"
            "deploy, and the rollback is recorded as a revision. `status` shows them as\n"
            "`rolled back` until the next deploy, which says first what it re-applies."
        ),
        touches_hosts=True,
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
                ("--host", "--limit"),
                "the host (one)",
                kind="list",
                metavar="NAME",
                required=True,
            ),
        ),
        touches_hosts=True,
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
    Command(
        "inventory",
        "the inventory as dflashops sees it: hosts, groups, vars, provider-resolved addresses",
        "dflashops.commands.inventory:inventory",
        (
            INVENTORY,
            Option(
                "hosts",
                ("--host", "--limit"),
                "host or group names, comma-separated, repeatable; `all` and shell globs "
                "('h100-*') too (default: every host)",
                kind="list",
                metavar="NAMES",
            ),
            Option(
                "as_json",
                ("--list",),
                "print it as JSON, like `ansible-inventory --list`: hosts with their "
                "address, port, user, workdir, gpus, python, provider and vars; groups",
                kind="bool",
                default=False,
            ),
        ),
    ),
    Command(
        "dashboard",
        "the fleet on one web page: units, jobs, events, log ends, plots over time, /metrics",
        "dflashops.commands.dashboard:dashboard",
        (
            *SELECTION,
            Option(
                "listen",
                ("--listen",),
                "ADDRESS:PORT to serve on; beyond loopback (127.0.0.0/8, ::1) --token is required",
                default="127.0.0.1:8765",
                metavar="ADDRESS:PORT",
            ),
            Option(
                "token",
                ("--token",),
                "env:NAME: every request must carry the token in NAME (Authorization: Bearer, "
                "or ?token= once: a cookie)",
                metavar="env:NAME",
            ),
            Option("interval", ("--interval",), "time between looks at the fleet", default="2s"),
            Option(
                "keep",
                ("--keep",),
                "samples kept this long in .dflashops/samples.sqlite (7d, 12h)",
                default="7d",
                metavar="DURATION",
            ),
            FORKS,
        ),
        details=(
            "Every --interval one probe per host over sessions kept open (what `top` does),\n"
            "kept in .dflashops/samples.sqlite beside the inventory. The page updates itself at\n"
            "the same pace, works offline (plots drawn by the server), and /metrics serves the\n"
            "fleet's own series: dflashops_unit_up, dflashops_unit_restarts_total,\n"
            "dflashops_job_progress_ratio, dflashops_host_reachable. Ctrl-C stops it."
        ),
        touches_hosts=True,
    ),
    Command(
        "prometheus-targets",
        "every engine's own /metrics as a Prometheus file_sd_configs file (host, unit, engine)",
        "dflashops.commands.prometheus:prometheus_targets",
        (
            *SELECTION,
            Option(
                "out_path",
                ("--out",),
                "write it to FILE, whole, at once (default: stdout)",
                metavar="FILE",
            ),
        ),
    ),
)


def load(command: Command) -> Any:
    """The command's function, imported now."""
    import importlib

    module, _, name = command.target.partition(":")
    return getattr(importlib.import_module(module), name)
