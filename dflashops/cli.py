"""The `dflashops` console script, generated from the command table (commands/table.py), as
the invoke tasks are: `dflashops deploy -i inventory.yaml --host b200 --check` ==
`invoke deploy -i inventory.yaml --host b200 --check`. Only argparse is imported up front."""

from __future__ import annotations

import argparse
import sys

from dflashops import __version__
from dflashops.commands.table import COMMANDS, Command, Option


def _add(parser: argparse.ArgumentParser, opt: Option) -> None:
    kwargs: dict[str, object] = {"help": opt.help_text()}
    if opt.kind == "bool":
        kwargs.update(action="store_true", default=False)
    elif opt.kind == "list":
        kwargs.update(action="append", default=[], metavar=opt.metavar or opt.dest.upper())
    else:
        kwargs.update(default=opt.default, metavar=opt.metavar or opt.long.upper())
        if opt.kind == "int":
            kwargs["type"] = int
        if opt.choices:
            kwargs["choices"] = opt.choices
        if opt.const is not None:
            kwargs.update(nargs="?", const=opt.const)
    if opt.positional:
        parser.add_argument(opt.dest, **kwargs)  # type: ignore[arg-type]
        return
    if opt.required:
        kwargs["required"] = True
    parser.add_argument(*opt.flags, dest=opt.dest, **kwargs)  # type: ignore[arg-type]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="dflashops",
        description="Deploy and run LLM serving and training work on multi-GPU nodes over SSH.",
    )
    top.add_argument("--version", action="version", version=f"dflashops {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=command.details or None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(_command=command)
        for opt in command.arguments:
            _add(p, opt)
    return top


def subparser(top: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def main(argv: list[str] | None = None) -> int:
    top = parser()
    # argparse reports a flag the subcommand does not know from the top parser, with the top
    # usage; the subcommand's own usage is what helps (`dflashops deploy --bogus`).
    namespace, extra = top.parse_known_args(argv)
    args = vars(namespace)
    command: Command = args.pop("_command")
    if extra:
        subparser(top, command.name).error(f"unrecognized arguments: {' '.join(extra)}")
    args.pop("command")
    from dflashops.commands import execute

    return execute(command, args)


if __name__ == "__main__":
    sys.exit(main())
