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


def argument(opt: Option) -> Argument:
    names = [opt.dest if opt.positional else opt.long] + ([opt.short] if opt.short else [])
    default: Any = [] if opt.kind == "list" else opt.default
    if opt.kind == "bool":
        default = False
    return Argument(
        names=names,
        kind=KINDS[opt.kind],
        default=default,
        help=opt.help_text(),
        positional=opt.positional,
        attr_name=opt.dest if opt.dest != names[0] else None,
    )


class TableTask(Task[Any]):
    """A task whose arguments come from the table instead of the body's signature."""

    def __init__(self, command: Command) -> None:
        def body(c: Context, **kwargs: Any) -> None:
            from dflashops.commands import execute

            for opt in command.options:
                if opt.required and not kwargs.get(opt.dest):
                    raise Exit(
                        f"{command.name}: {opt.flags[-1] if opt.flags else opt.dest} is required",
                        code=2,
                    )
                if opt.choices and kwargs.get(opt.dest) not in opt.choices:
                    raise Exit(
                        f"{command.name}: --{opt.long} must be one of {', '.join(opt.choices)}",
                        code=2,
                    )
            code = execute(command, kwargs)
            if code:
                raise Exit(code=code)

        body.__doc__ = command.help
        super().__init__(
            body,
            name=command.name,
            positional=[o.dest for o in command.options if o.positional],
            auto_shortflags=False,
        )
        self.command = command

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        args = [argument(o) for o in self.command.options]
        return [a for a in args if a.positional] + [a for a in args if not a.positional]


namespace = Collection(*(TableTask(c) for c in COMMANDS))
