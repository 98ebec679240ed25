"""What every engine produces: the argv to exec, the files it needs on the host, its probe."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops.agent.remote import layout
from dflashops.errors import Problem

BUILTINS_DIR = Path(__file__).resolve().parent.parent / "builtins"
BUILTIN_PREFIX = "dflashops:"
HOST_PREFIX = "host:"  # a file already on the host: not shipped, not compiled here


@dataclass(frozen=True)
class ShippedFile:
    """A controller file that goes to the host's content-addressed payload folder."""

    local: Path
    sha256: str
    name: str

    @property
    def remote(self) -> str:
        """Path relative to the host's workdir; the hash in it makes every version distinct."""
        return layout.payload(self.sha256, self.name)

    @classmethod
    def of(cls, path: Path) -> ShippedFile:
        return cls(path, hashlib.sha256(path.read_bytes()).hexdigest(), path.name)


@dataclass(frozen=True)
class WorkPath:
    """An argv element naming a file under the host's workdir, which the script knows only at run
    time (it derives the workdir from its own location)."""

    relative: str


@dataclass(frozen=True)
class HostPath:
    """A path on the host as the inventory spells it: ``~/venv/bin/python3`` must expand to the
    host user's home when the script runs (a quoted ~ would not)."""

    path: str


@dataclass(frozen=True)
class EnvPython:
    """The python of an environment, resolved when the unit starts: PATH links to the current
    build, and the unit keeps the build it started with however PATH moves later."""

    path: str


@dataclass(frozen=True)
class BesideTool:
    """An executable of the unit's Python installation (torchrun, ray): the one beside its
    python (an environment's bin/), else the host's PATH's. Resolved when the script runs."""

    python: HostPath | EnvPython
    name: str


@dataclass(frozen=True)
class UnitFile:
    """An argv element naming a file in the unit's own folder on the host (a 0600 secret file
    such as the engine's --config), known to the script only at run time."""

    name: str


@dataclass(frozen=True)
class ShellVar:
    """An argv element whose value the launch script holds in a shell variable read from a
    0600 file at exec time (a secret flag of a program with no other way to take it)."""

    name: str


Token = str | WorkPath | HostPath | EnvPython | BesideTool | UnitFile | ShellVar


@dataclass
class Launch:
    """How a unit starts: argv (exec'd by the launch script), shipped files, probe."""

    argv: list[Token]
    engine_args: list[str] = field(default_factory=list)  # what the engine itself parses
    files: list[ShippedFile] = field(default_factory=list)
    health_path: str | None = None
    problems: list[Problem] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set by the engine (the unit's env wins)
    # Stop TERMs only the process the launch script exec'd, not its whole group: `ray start
    # --block` then ends its own raylet, GCS and workers in order in a few seconds, where a
    # group-wide TERM leaves it waiting about 30 s on a GCS that is already gone. KILL after
    # the grace still takes the whole group.
    stop_leader: bool = False
    # secret_args, delivered without argv (engines/secrets.py): which file carries which flag.
    secrets: SecretArgs = field(default_factory=lambda: SecretArgs())


@dataclass
class SecretArgs:
    """Where a unit's ``secret_args`` go on the host (see engines/secrets.py): each maps what
    the host side knows it by to the controller's environment variable holding the value."""

    env: dict[str, str] = field(default_factory=dict)  # variable in secrets.env (VLLM_API_KEY)
    config: dict[str, str] = field(default_factory=dict)  # flag in the engine's --config file
    argv: dict[str, str] = field(default_factory=dict)  # shell variable read into a flag

    def __bool__(self) -> bool:
        return bool(self.env or self.config or self.argv)

    def sources(self) -> list[str]:
        """The controller's variables these need."""
        return sorted({*self.env.values(), *self.config.values(), *self.argv.values()})


def to_flags(args: dict[str, Any]) -> list[str]:
    """`key: value` -> --key value; true -> --key; false/null -> nothing; list -> --key a b;
    mapping -> --key '<compact JSON>'."""
    out: list[str] = []
    for key, value in args.items():
        flag = f"--{key}"
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out.extend([flag, *(_scalar(v) for v in value)])
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value, separators=(",", ":"), sort_keys=True)])
        else:
            out.extend([flag, _scalar(value)])
    return out


def _scalar(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def resolve_file(ref: str, base: Path) -> Path:
    """'dflashops:NAME' -> the built-in workload NAME.py; otherwise a path relative to ``base``."""
    if ref.startswith(BUILTIN_PREFIX):
        name = ref[len(BUILTIN_PREFIX) :]
        return BUILTINS_DIR / f"{name}.py"
    path = Path(ref).expanduser()
    # normpath: messages should say scripts/x.py, not playbooks/../scripts/x.py
    return Path(os.path.normpath(path if path.is_absolute() else base / path))


@functools.cache  # read once per run: pre-flight asks for every unit
def known_flags(engine: str) -> frozenset[str]:
    data = Path(__file__).resolve().parent.parent / "data" / f"{engine}-flags.txt"
    return frozenset(line.strip() for line in data.read_text().splitlines() if line.strip())
