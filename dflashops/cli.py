"""The `dflashops` console script. Same commands and options as the invoke tasks (tasks.py):
`dflashops preflight -i inventory.yaml --host b200` == `invoke preflight -i inventory.yaml --host b200`."""

from __future__ import annotations

import argparse
import sys

from dflashops import __version__, commands
from dflashops.errors import ConfigError, DflashopsError
from dflashops.output import console, err
from dflashops.run import DEFAULT_FORKS


def _selection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-i",
        "--inventory",
        help="inventory file (default: inventory.yaml, else inventory.example.yaml)",
    )
    common.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAMES",
        help="host or group names, comma-separated, repeatable (default: every host the playbooks target)",
    )
    common.add_argument(
        "-p",
        "--playbook",
        action="append",
        default=[],
        metavar="FILE",
        help="playbook file, repeatable (default: every playbooks/*.yaml that targets the hosts)",
    )
    return common


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="dflashops",
        description="Deploy and run LLM serving and training work on multi-GPU nodes over SSH.",
    )
    top.add_argument("--version", action="version", version=f"dflashops {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _selection_options()

    p = sub.add_parser(
        "preflight", parents=[common], help="offline checks for CI (nothing touches a host)"
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--junit", dest="junit_path", metavar="FILE", help="write the results as JUnit XML"
    )
    p.add_argument(
        "--live", action="store_true", help="also check the hosts (one facts round trip each)"
    )
    p.add_argument(
        "--forks",
        type=int,
        default=DEFAULT_FORKS,
        metavar="N",
        help="hosts in parallel (default 10)",
    )

    r = sub.add_parser(
        "render", parents=[common], help="print or write the rendered launch scripts"
    )
    r.add_argument(
        "--out",
        dest="out_dir",
        metavar="DIR",
        help="write DIR/<host>/<unit>.sh instead of printing",
    )

    t = sub.add_parser("trust", help="fetch, show and record hosts' SSH keys (asks on a terminal)")
    t.add_argument(
        "-i",
        "--inventory",
        help="inventory file (default: inventory.yaml, else inventory.example.yaml)",
    )
    t.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAMES",
        required=True,
        help="host or group names, comma-separated",
    )
    t.add_argument("--yes", action="store_true", help="record without asking (for scripts)")

    s = sub.add_parser("schema", help="print the JSON Schema of the inventory and playbook files")
    s.add_argument("which", nargs="?", choices=["all", "inventory", "playbook"], default="all")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = console()
    try:
        if args.command == "preflight":
            return commands.preflight(
                out,
                inventory=args.inventory,
                hosts=args.host,
                playbooks=args.playbook,
                json_path=args.json_path,
                junit_path=args.junit_path,
                live=args.live,
                forks=args.forks,
            )
        if args.command == "render":
            return commands.render(
                out,
                inventory=args.inventory,
                hosts=args.host,
                playbooks=args.playbook,
                out_dir=args.out_dir,
            )
        if args.command == "trust":
            return commands.trust(out, inventory=args.inventory, hosts=args.host, yes=args.yes)
        return commands.schema(out, which=args.which)
    except ConfigError as exc:
        for problem in exc.problems:
            err(str(problem))
        return 1
    except DflashopsError as exc:
        err(str(exc))
        return 1
    except KeyboardInterrupt:
        err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
