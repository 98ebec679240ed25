"""The invoke collection, generated from the command table (commands/table.py) like the
`dflashops` console script: `invoke preflight --host b200` from an ops repo whose tasks.py
re-exports `namespace`. Same names, options, defaults and help as `dflashops preflight ...`."""

from __future__ import annotations

from typing import Any

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.parser.argument import Argument
from invoke.tasks import Task

from dflashops.commands.table import COMMANDS, Command, Option

KINDS: dict[str, type] = {"str": str, "int": int, "bool": bool, "list": list}


class TableArgument(Argument):
    """An invoke argument named as its flags are (``--host``, alias ``--limit``), which keeps
    the table's keyword (``hosts``) in ``dest``. Not invoke's ``attr_name``: invoke's help
    looks the flag up by that name (``--hosts``) and fails."""

    def __init__(self, opt: Option) -> None:
        longs = [opt.dest] if opt.positional else list(opt.longs)
        default: Any = [] if opt.kind == "list" else opt.default
        if opt.kind == "bool":
            default = False
        super().__init__(
            names=[*longs, *([opt.short] if opt.short else [])],
            kind=KINDS[opt.kind],
            default=default,
            help=opt.help_text(),
            positional=opt.positional,
            optional=opt.const is not None,
        )
        self.dest = opt.dest


def keywords(command: Command, parsed: dict[str, Any]) -> dict[str, Any]:
    """invoke's values by argument name -> the command's keywords; a flag given without its
    optional value (invoke says True) becomes the table's ``const``."""
    out: dict[str, Any] = {}
    for opt in command.arguments:
        arg = TableArgument(opt)
        value = parsed.get(arg.name or opt.dest, arg.default)
        out[opt.dest] = opt.const if opt.const is not None and value is True else value
    return out


def check(command: Command, kwargs: dict[str, Any]) -> None:
    """What argparse checks itself: required options, choices."""
    for opt in command.arguments:
        if opt.required and not kwargs.get(opt.dest):
            name = opt.flags[-1] if opt.flags else opt.dest
            raise Exit(f"{command.name}: {name} is required", code=2)
        if opt.choices and kwargs.get(opt.dest) not in opt.choices:
            raise Exit(f"{command.name}: --{opt.long} must be one of {', '.join(opt.choices)}", 2)


class TableTask(Task[Any]):
    """A task whose arguments come from the table instead of the body's signature."""

    def __init__(self, command: Command) -> None:
        def body(c: Context, **parsed: Any) -> None:
            from dflashops.commands import execute

            kwargs = keywords(command, parsed)
            check(command, kwargs)
            code = execute(command, kwargs)
            if code:
                raise Exit(code=code)

        body.__doc__ = command.help + (f"\n\n{command.details}" if command.details else "")
        super().__init__(
            body,
            name=command.name,
            positional=[o.dest for o in command.arguments if o.positional],
            auto_shortflags=False,
        )
        self.command = command

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        args: list[Argument] = [TableArgument(o) for o in self.command.arguments]
        return [a for a in args if a.positional] + [a for a in args if not a.positional]


namespace = Collection(*(TableTask(c) for c in COMMANDS))
