"""The commands: ``table`` defines them once; each module holds the code of a few of them;
``execute`` runs one the same way for both front ends (cli.py, tasks.py)."""

from __future__ import annotations

import inspect
from typing import Any

from dflashops.commands.table import Command, load


def execute(command: Command, kwargs: dict[str, Any]) -> int:
    """Run ``command`` with parsed options; errors are printed (no traceback) and become the
    exit status: 1 for bad input, 2 for failed hosts (the command's own), 130 for Ctrl-C.
    ``verbose`` (-v) is taken here: the function gets it only if it has a parameter for it."""
    from dflashops.errors import ConfigError, DflashopsError
    from dflashops.output import console, err, set_verbose

    kwargs = dict(kwargs)
    verbose = bool(kwargs.pop("verbose", False))
    set_verbose(verbose)  # for this run: one process may run several (tests, a REPL)
    try:
        func = load(command)
        if verbose and "verbose" in inspect.signature(func).parameters:
            kwargs["verbose"] = True
        # `--json -`: stdout carries the JSON alone; what people read goes to stderr.
        return int(func(console(stderr=kwargs.get("json_path") == "-"), **kwargs))
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
