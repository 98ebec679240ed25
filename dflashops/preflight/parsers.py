"""The installed engine has the last word on a unit's command line (DESIGN "Real parts" 3).

``preflight --live``, and ``deploy`` before it stops a running unit whose command line changed,
send the SGLang and vLLM lines of a host's units to the agent's ``engine_args`` action, which
runs dflashops/builtins/engine_args.py once per python (the unit's environment's, else the
host's) for all its units: the engine's own parser judges each line, parse only. Verdicts:

- ``ok``: the engine's parser takes the line.
- ``rejected``: it does not; the message is the engine's own (``invalid float value: 'lots'``).
- ``cannot-import``: the engine (or what its parser needs) does not import with that python, or
  the check could not run there at all: the unit cannot start either.
- ``unknown``: the engine imports but this dflashops knows no parser entry point for its
  version: a warning, and the verdict of the offline flag list (SGLang: an unknown flag is an
  error; vLLM: a warning, as in pre-flight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field

from dflashops.agent import Agent
from dflashops.agent.answers import FactsModel
from dflashops.agent.client import SLACK
from dflashops.changes.units import Change
from dflashops.engines.base import BUILTINS_DIR, Launch, known_flags
from dflashops.engines.secrets import checked_flags
from dflashops.errors import HostError
from dflashops.plan import Unit

ENGINES = ("sglang", "vllm")
FLAG_LISTS = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.33.0"}
# What a secret flag's value is replaced with: the value reaches the engine through a 0600 file
# (engines/secrets.py), never through this check; the flag and its place in the line do.
PLACEHOLDER = "dflashops-secret"
TIMEOUT = 300.0  # s per python: an engine's import takes 5-15 s, much more on a busy host
_FLAG = re.compile(r"^--[A-Za-z0-9]")

Outcome = Literal["ok", "rejected", "cannot-import", "unknown"]


class LineVerdict(FactsModel):
    ok: bool
    error: str | None = None


class EngineVerdicts(FactsModel):
    status: str  # parsed | cannot-import | no-entry-point
    version: str | None = None
    error: str | None = None
    lines: list[LineVerdict] = Field(default_factory=list)


class PayloadAnswer(FactsModel):
    engines: dict[str, EngineVerdicts]


class GroupAnswer(FactsModel):
    python: str
    ok: bool
    answer: PayloadAnswer | None = None
    error: str | None = None


class EngineArgsAnswer(FactsModel):
    groups: list[GroupAnswer]


@dataclass(frozen=True)
class Line:
    """What one unit's engine parses, and with which python."""

    unit: str
    engine: str
    python: str
    argv: list[str]


@dataclass(frozen=True)
class Verdict:
    unit: str
    outcome: Outcome
    message: str  # for ok: the engine and version that said so
    fails: bool  # unknown: whether the flag list rejects it (SGLang)


def engine_line(unit: Unit, launch: Launch) -> Line | None:
    """The unit's engine argv and python, or None for units no engine parser judges on a host
    (the stub, commands, jobs, Ray nodes)."""
    if unit.engine not in ENGINES or not launch.engine_args:
        return None
    python = f"{unit.env.path}/bin/python" if unit.env is not None else unit.host.python
    return Line(unit.name, unit.engine, python, engine_argv(unit, launch))


def engine_argv(unit: Unit, launch: Launch) -> list[str]:
    """What the engine's parser takes: SGLang's flags (the stub speaks them too); vLLM's are
    what follows ``serve``, the model first. A secret flag keeps its place with a placeholder
    for its value."""
    hidden = checked_flags(unit, launch.secrets)  # names only, at the end of engine_args
    argv = launch.engine_args[: len(launch.engine_args) - len(hidden)]
    for flag in [*launch.secrets.config, *(["api-key"] if launch.secrets.env else [])]:
        argv = [*argv, f"--{flag}", PLACEHOLDER]
    if unit.engine == "vllm":
        argv = [str(getattr(unit.spec, "model", "")), *argv]
    return argv


def ask(agent: Agent, workdir: str, lines: list[Line]) -> dict[str, Verdict]:
    """One agent call: every python's units judged by its engines, each python once."""
    if not lines:
        return {}
    pythons = sorted({line.python for line in lines})
    groups = [
        {
            "python": python,
            "engines": {
                engine: [
                    line.argv for line in lines if line.python == python and line.engine == engine
                ]
                for engine in ENGINES
                if any(line.python == python and line.engine == engine for line in lines)
            },
        }
        for python in pythons
    ]
    request = {
        "workdir": workdir,
        "payload": (BUILTINS_DIR / "engine_args.py").read_text(encoding="utf-8"),
        "groups": groups,
        "timeout": TIMEOUT,
    }
    data = agent.call("engine_args", request, timeout=TIMEOUT + SLACK)
    answer = agent.validate(EngineArgsAnswer, data, "engine_args")
    if len(answer.groups) != len(groups):
        raise HostError(agent.host, "the engine_args answer does not cover every python asked")
    verdicts: dict[str, Verdict] = {}
    for python, got in zip(pythons, answer.groups, strict=True):
        for engine in ENGINES:
            mine = [line for line in lines if line.python == python and line.engine == engine]
            verdicts.update(_judged(mine, engine, got))
    return verdicts


def _judged(lines: list[Line], engine: str, got: GroupAnswer) -> dict[str, Verdict]:
    if not lines:
        return {}
    python = lines[0].python
    found = got.answer.engines.get(engine) if got.answer is not None else None
    if found is None or not got.ok:
        why = got.error or f"the parser payload answered nothing for {engine}"
        text = f"could not ask {engine} at {python} to parse the command line: {why}"
        return {line.unit: Verdict(line.unit, "cannot-import", text, True) for line in lines}
    who = f"{engine} {found.version or '(version unknown)'} at {python}"
    if found.status == "cannot-import":
        text = f"cannot import {engine} with {python}: {found.error}"
        return {line.unit: Verdict(line.unit, "cannot-import", text, True) for line in lines}
    if found.status != "parsed" or len(found.lines) != len(lines):
        why = found.error or f"{who} answered {len(found.lines)} verdicts for {len(lines)} lines"
        return {line.unit: _flag_list(line, why) for line in lines}
    return {
        line.unit: Verdict(line.unit, "ok", who, False)
        if v.ok
        else Verdict(line.unit, "rejected", f"{who} rejects the command line: {v.error}", True)
        for line, v in zip(lines, found.lines, strict=True)
    }


def _flag_list(line: Line, why: str) -> Verdict:
    """No parser to ask: the offline flag list judges (what pre-flight does without a host)."""
    allowed = known_flags(line.engine)
    unknown = sorted(
        {t.split("=", 1)[0] for t in line.argv if _FLAG.match(t)} - allowed,
    )
    listed = FLAG_LISTS[line.engine]
    verdict = (
        f"{', '.join(unknown)} not in {listed}'s flag list"
        if unknown
        else f"every flag is in {listed}'s flag list"
    )
    fails = bool(unknown) and line.engine == "sglang"  # vLLM's list may miss generated flags
    return Verdict(line.unit, "unknown", f"{why}; judged by the flag list only: {verdict}", fails)


# -- deploy: before a running unit whose command line changed is stopped ------------------


class Run(Protocol):
    """What of lifecycle.deploy.HostRun this needs (it imports this module, not the reverse)."""

    agent: Agent
    workdir: str

    def fail(self, unit: str, action: str, message: str, origin: bool = True) -> None: ...

    def emit(
        self, unit: str | None, status: str, action: str, message: str, **data: object
    ) -> None: ...


def before_restart(run: Run, restarts: list[Change]) -> list[Change]:
    """The restarts that may go on: their engine takes the new command line, or no engine
    parses it. The others fail with the engine's own message and keep their running process.
    Asked only where the fingerprint changed (a crashed unit restarting as it was is not)."""
    lines = [
        line
        for c in restarts
        if c.old_fingerprint != c.rendered.fingerprint
        and (line := engine_line(c.rendered.unit, c.rendered.launch)) is not None
    ]
    verdicts = ask(run.agent, run.workdir, lines)
    kept = []
    for c in restarts:
        v = verdicts.get(c.name)
        if v is not None and v.outcome == "unknown":
            run.emit(c.name, "info", "check", f"warning: {v.message}")
        if v is not None and v.fails:
            run.fail(
                c.name,
                "check",
                f"not restarted, still running its old process: {v.message} (fix the unit's "
                "args, or the engine where it runs, then deploy again)",
            )
            continue
        kept.append(c)
    return kept
