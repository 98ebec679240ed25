"""The two front ends (the `dflashops` console script and the invoke tasks) come from one table:
walk both and compare every command, option, short flag, default and help text."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from invoke import Program

from dflashops.cli import parser
from dflashops.commands.table import COMMANDS, load
from dflashops.tasks import namespace

REPO = Path(__file__).resolve().parents[2]


def argparse_view() -> dict[str, dict[str, Any]]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, dict[str, Any]] = {}
    for name, p in sub.choices.items():
        opts = {}
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            longs = [s[2:] for s in a.option_strings if s.startswith("--")]
            shorts = [s[1:] for s in a.option_strings if len(s) == 2]
            key = longs[0] if longs else a.dest
            kind = (
                "bool"
                if isinstance(a, argparse._StoreTrueAction)
                else "list"
                if isinstance(a, argparse._AppendAction)
                else "int"
                if a.type is int
                else "str"
            )
            opts[key] = {
                "short": shorts[0] if shorts else None,
                "positional": not a.option_strings,
                "kind": kind,
                "default": a.default,
                "help": a.help,
                "dest": a.dest,
            }
        out[name] = opts
    return out


def invoke_view() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in namespace.task_names:
        task = namespace[name]
        opts = {}
        for a in task.get_arguments():
            long = next(n for n in a.names if len(n) > 1)
            short = next((n for n in a.names if len(n) == 1), None)
            opts[long] = {
                "short": short,
                "positional": a.positional,
                "kind": {bool: "bool", list: "list", int: "int"}.get(a.kind, "str"),
                "default": a.default,
                "help": a.help,
                "dest": a.dest,
            }
        out[name] = opts
    return out


def test_both_front_ends_have_the_same_commands_and_options() -> None:
    cli, tasks = argparse_view(), invoke_view()
    assert sorted(cli) == sorted(tasks) == sorted(c.name for c in COMMANDS)
    for name in cli:
        assert cli[name] == tasks[name], name


def test_defaults_in_help_come_from_the_defaults() -> None:
    for command in COMMANDS:
        for opt in command.options:
            if opt.kind in ("int", "str") and opt.default is not None:
                assert opt.help_text().endswith(f"(default {opt.default})")
    assert "(default 64)" in argparse_view()["deploy"]["forks"]["help"]


def test_every_command_function_takes_exactly_the_table_options() -> None:
    import inspect

    for command in COMMANDS:
        params = inspect.signature(load(command)).parameters
        dests = {o.dest for o in command.options}
        assert dests <= set(params), command.name
        # Anything else is for tests (trust's confirm callback), never an option in disguise.
        extra = set(params) - dests - {"out"}
        assert all(params[p].default is None for p in extra), (command.name, extra)


def test_the_invoke_front_end_runs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    program = Program(namespace=namespace, name="invoke", binary="invoke")
    program.run(["invoke", "schema", "--which", "inventory"], exit=False)
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "InventoryFile"


def test_the_invoke_front_end_passes_exit_codes(tmp_path: Path) -> None:
    """The repo's own tasks.py, run the way a user runs it: a bad inventory is exit 1."""
    (tmp_path / "inventory.yaml").write_text("hosts: {}\n")
    (tmp_path / "tasks.py").write_text("from dflashops.tasks import namespace\n")
    proc = subprocess.run(
        [sys.executable, "-m", "invoke", "preflight"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "inventory.yaml" in proc.stderr and "hosts" in proc.stderr


def test_stop_takes_units_the_same_way_in_both() -> None:
    assert (
        argparse_view()["stop"]["unit"]["kind"] == invoke_view()["stop"]["unit"]["kind"] == "list"
    )
    args = parser().parse_args(["stop", "--unit", "a,b", "--unit", "c"])
    assert args.units == ["a,b", "c"]
