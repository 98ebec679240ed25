"""The `dflashops` console script. Same commands and options as the invoke tasks (tasks.py):
`dflashops deploy -i inventory.yaml --host b200 --check` == `invoke deploy -i inventory.yaml --host b200 --check`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from dflashops import __version__, commands, operate
from dflashops.errors import ConfigError, DflashopsError
from dflashops.output import console, err
from dflashops.run import DEFAULT_FORKS

HELP = {
    "inventory": "inventory file (default: inventory.yaml, else inventory.example.yaml)",
    "host": "host or group names, comma-separated, repeatable (default: every host the playbooks target)",
    "playbook": "playbook file, repeatable (default: every playbooks/*.yaml that targets the hosts)",
    "forks": f"hosts in parallel (default {DEFAULT_FORKS})",
    "json": "write one JSON event per line to FILE",
}


def _selection() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-i", "--inventory", help=HELP["inventory"])
    common.add_argument(
        "--host", dest="hosts", action="append", default=[], metavar="NAMES", help=HELP["host"]
    )
    common.add_argument(
        "-p",
        "--playbook",
        dest="playbooks",
        action="append",
        default=[],
        metavar="FILE",
        help=HELP["playbook"],
    )
    return common


def _fleet() -> argparse.ArgumentParser:
    fleet = argparse.ArgumentParser(add_help=False)
    fleet.add_argument("--forks", type=int, default=DEFAULT_FORKS, metavar="N", help=HELP["forks"])
    fleet.add_argument("--json", dest="json_path", metavar="FILE", help=HELP["json"])
    return fleet


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="dflashops",
        description="Deploy and run LLM serving and training work on multi-GPU nodes over SSH.",
    )
    top.add_argument("--version", action="version", version=f"dflashops {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sel, fleet = _selection(), _fleet()

    d = sub.add_parser(
        "deploy", parents=[sel, fleet], help="make hosts match the playbooks, verify everything"
    )
    d.add_argument("--check", action="store_true", help="plan only: change nothing")
    d.add_argument(
        "--diff", action="store_true", help="show unified diffs of launch scripts that would change"
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="start even where GPUs hold memory of processes not started by dflashops",
    )
    d.add_argument("--rerun", action="store_true", help="run jobs again that finished with exit 0")
    d.set_defaults(run=operate.deploy)

    r = sub.add_parser(
        "restart-servers",
        parents=[sel, fleet],
        help="restart service units, one replica at a time per host",
    )
    r.add_argument(
        "--all-at-once",
        action="store_true",
        help="restart every replica together instead of rolling",
    )
    r.add_argument("--force", action="store_true", help="start even where GPUs hold foreign memory")
    r.set_defaults(run=operate.restart_servers)

    s = sub.add_parser(
        "stop", parents=[sel, fleet], help="stop units dflashops started (all targeted by default)"
    )
    s.add_argument(
        "units",
        nargs="*",
        metavar="UNIT",
        help="units to stop (default: all on the selected hosts)",
    )
    s.set_defaults(run=operate.stop)

    st = sub.add_parser(
        "status",
        parents=[sel, fleet],
        help="state, pid, uptime, health, fingerprint, GPUs, progress",
    )
    st.set_defaults(run=operate.status)

    lg = sub.add_parser("logs", parents=[sel], help="the end of a unit's current log")
    lg.add_argument("unit", metavar="UNIT")
    lg.add_argument("-n", "--lines", type=int, default=100, help="lines to show (default 100)")
    lg.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new output (Ctrl-C stops)"
    )
    lg.set_defaults(run=operate.logs)

    p = sub.add_parser(
        "preflight", parents=[sel], help="offline checks for CI (--live adds checks on the hosts)"
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--junit", dest="junit_path", metavar="FILE", help="write the results as JUnit XML"
    )
    p.add_argument(
        "--live", action="store_true", help="also check the hosts (one facts round trip each)"
    )
    p.add_argument("--forks", type=int, default=DEFAULT_FORKS, metavar="N", help=HELP["forks"])
    p.set_defaults(run=commands.preflight)

    rd = sub.add_parser("render", parents=[sel], help="print or write the rendered launch scripts")
    rd.add_argument(
        "--out",
        dest="out_dir",
        metavar="DIR",
        help="write DIR/<host>/<unit>.sh instead of printing",
    )
    rd.set_defaults(run=commands.render)

    t = sub.add_parser("trust", help="fetch, show and record hosts' SSH keys (asks on a terminal)")
    t.add_argument("-i", "--inventory", help=HELP["inventory"])
    t.add_argument(
        "--host",
        dest="hosts",
        action="append",
        default=[],
        metavar="NAMES",
        required=True,
        help="host or group names, comma-separated",
    )
    t.add_argument("--yes", action="store_true", help="record without asking (for scripts)")
    t.set_defaults(run=commands.trust)

    sc = sub.add_parser("schema", help="print the JSON Schema of the inventory and playbook files")
    sc.add_argument("which", nargs="?", choices=["all", "inventory", "playbook"], default="all")
    sc.set_defaults(run=commands.schema)
    return top


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    run: Callable[..., int] = args.pop("run")
    args.pop("command")
    out = console()
    try:
        return run(out, **args)
    except ConfigError as exc:
        for problem in exc.problems:
            err(str(problem))
        return 1
    except DflashopsError as exc:
        err(str(exc))
        return 1
    except KeyboardInterrupt:
        err("interrupted: hosts may be mid-change; `dflashops status` shows where they stand")
        return 130


if __name__ == "__main__":
    sys.exit(main())
