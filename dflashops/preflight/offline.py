"""Offline pre-flight: everything that can be known before touching a GPU host.

Validates inventory and playbooks, lays out every unit on every targeted host, renders every
launch script, runs ``bash -n`` on each (once per shape, see bash_syntax.py), compiles every
shipped ``.py`` (INCIDENTS.md #1: a SyntaxError found only after launch), and checks engine
flags against the engines' real flag lists. Passes are kept by content (memo.py): a run whose
scripts did not change re-checks nothing. A large plan is rendered and checked one slice per
core (spread.py). Results are per check and subject (report.py).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops.config import reads
from dflashops.engines.base import ShippedFile, known_flags
from dflashops.engines.protocol import protocol
from dflashops.engines.render import Rendered, render_units, template_dirs
from dflashops.engines.secrets import looks_secret
from dflashops.errors import Problem
from dflashops.plan import Plan, Unit, build_plan
from dflashops.plan.expand import Unfilled, derived
from dflashops.preflight.bash_syntax import Verdict, check_scripts
from dflashops.preflight.memo import Passed, key
from dflashops.preflight.report import (
    Check,
    Report,
    Severity,
    to_json,
    to_junit,
    write_outputs,
)
from dflashops.preflight.spread import cores, spread
from dflashops.project import Selection

__all__ = [
    "Check",
    "Report",
    "Severity",
    "run_preflight",
    "to_json",
    "to_junit",
    "write_outputs",
]

FLAG_TOKEN = re.compile(r"^--?[A-Za-z]")  # -1 or -0.5 are values, not flags
# From this many units on, a slice per core wins: in a fresh process, 504 units take 0.145 s
# serially and 0.115 s over 2 cores (a fork and the child's own Jinja environment cost ~0.03 s).
SPREAD_FROM = 500


@dataclass
class Part:
    """What checking a slice of the plan's units gives: all that a forked child sends back."""

    problems: list[Problem]  # rendering's, in unit order
    checks: list[Check]  # bash-syntax and flags, per rendered unit in order
    shipped: dict[ShippedFile, list[str]]  # every shipped file -> the units shipping it
    hosts: list[str]  # hosts with a rendered unit
    units: int  # units rendered
    passed: list[str]  # memo keys that passed in this slice
    facts: dict[reads.FactKey, str] = field(default_factory=dict)  # what it looked at
    rendered: list[Rendered] = field(default_factory=list)  # only when asked to keep them


def run_preflight(selection: Selection, *, keep_rendered: bool = True) -> Report:
    """Every offline check. ``keep_rendered``: the report carries every Rendered unit (deploy
    ships them); without it, a plan of SPREAD_FROM units or more is rendered and checked one
    slice per core in forked children, which send back only their checks."""
    report = Report()
    for problem in selection.problems:
        report.add(Check.failed("config", problem.file, problem))
    plan = build_plan(selection.inventory, selection.playbooks, selection.hosts)
    report.plan = plan
    unfilled = [p for p in plan.problems if isinstance(p, Unfilled)]
    for problem in plan.problems:
        if not derived(problem, unfilled):
            report.add(Check.failed("layout", problem.file, problem))
    for host, host_plan in plan.hosts.items():
        report.add(Check("layout", host, True, f"{len(host_plan.units)} units"))
    _look_at_node_state(plan)
    dirs = template_dirs(b.path for b in selection.playbooks)
    passed = Passed()
    units = plan.units

    def check(lo: int, hi: int) -> Part:
        return check_units(units[lo:hi], dirs, passed, keep_rendered)

    workers = 1 if keep_rendered or len(units) < SPREAD_FROM else cores()
    parts = spread(check, len(units), workers)
    for part in parts:  # every render problem first, then the checks, as one serial run
        for problem in part.problems:
            if not derived(problem, unfilled):
                report.add(Check.failed("render", problem.file, problem))
    recorder = reads.current()
    shipped: dict[ShippedFile, list[str]] = {}
    hosts: set[str] = set()
    for part in parts:
        report.checks.extend(part.checks)
        report.rendered.extend(part.rendered)
        report.units += part.units
        hosts.update(part.hosts)
        for k in part.passed:
            passed.add(k)
        if recorder is not None:
            recorder.merge(part.facts)
        for f, subjects in part.shipped.items():
            shipped.setdefault(f, []).extend(subjects)
    report.hosts = sorted(hosts)
    for f, subjects in shipped.items():
        reads.known(f.local, f.sha256)  # the sha256 of the very bytes the unit ships
        if f.name.endswith(".py"):
            report.add(compile_python(f, subjects, passed))
    passed.save()
    _note_empty(report, plan)
    return report


def check_units(
    units: Sequence[Unit], dirs: list[Path], passed: Passed, keep_rendered: bool = True
) -> Part:
    """Render ``units`` and check each script (bash -n by shape, engine flags)."""
    rendered, problems = render_units(units, dirs)
    verdicts = check_scripts([(r.script, r.fingerprint) for r in rendered], passed)
    checks: list[Check] = []
    shipped: dict[ShippedFile, list[str]] = {}
    hosts: dict[str, None] = {}
    for r, verdict in zip(rendered, verdicts, strict=True):
        checks.append(bash_syntax(r, verdict))
        checks.extend(engine_flags(r))
        checks.extend(secret_literals(r))
        for f in r.files:
            shipped.setdefault(f, []).append(subject(r))
        hosts[r.unit.host.name] = None
    recorder = reads.current()
    return Part(
        problems,
        checks,
        shipped,
        list(hosts),
        len(rendered),
        list(passed.new),
        dict(recorder.facts) if recorder is not None else {},
        rendered if keep_rendered else [],
    )


def _look_at_node_state(plan: Plan) -> None:
    """Environments' requirements and wheels and files entries' controller sources are
    inputs too; planning (nodestate.py) has checked they exist. A recording run notes them:
    wheels and requirements by content (they are in the units' fingerprints), sources by
    existence (offline, only that is checked: a source may be a model of many gigabytes)."""
    recorder = reads.current()
    if recorder is None:
        return
    for host_plan in plan.hosts.values():
        node = host_plan.node
        for env in node.envs.values():
            for path in (env.requirements, env.wheels):
                # Taken after planning saw it: gone now means planning may have seen
                # something else, and such a run is not kept.
                if path is not None and reads.look(path, "tree") == reads.ABSENT:
                    recorder.refuse(f"{path} went missing during the run")
        for f in node.files:
            if f.local is not None and reads.look(f.local, "exists") != "1":
                recorder.refuse(f"{f.local} went missing during the run")


def _note_empty(report: Report, plan: Plan) -> None:
    if not plan.units and report.ok:
        report.add(
            Check(
                "layout",
                "playbooks",
                False,
                "the playbooks define no units for the selected hosts",
                "warning",
            )
        )


def subject(r: Rendered) -> str:
    return f"{r.unit.host.name}/{r.unit.name}"


def bash_syntax(r: Rendered, verdict: Verdict) -> Check:
    if verdict.ok:
        return Check("bash-syntax", subject(r), True)
    problem = r.unit.problem(f"rendered launch script does not parse (bash -n): {verdict.detail}")
    return Check.failed("bash-syntax", subject(r), problem)


def compile_python(shipped: ShippedFile, units: list[str], passed: Passed | None = None) -> Check:
    """Compile with the controller's Python. Compile-time errors (including 'name used prior to
    global declaration', which no linter flagged in the field) surface here, before shipping.
    A pass is kept by the file's sha256 and this Python's version."""
    name = str(shipped.local)
    memo = key("py-compile", sys.version, shipped.sha256)
    if passed is not None and memo in passed:
        return Check("py-compile", name, True)
    try:
        source = shipped.local.read_bytes()
        sha256 = hashlib.sha256(source).hexdigest()
        reads.known(shipped.local, sha256)  # changed since it was hashed: the run is not kept
        if sha256 != shipped.sha256:
            memo = key("py-compile", sys.version, sha256)
        compile(source, name, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or name}:{exc.lineno}" + (f":{exc.offset}" if exc.offset else "")
        text = f"{where}: {type(exc).__name__}: {exc.msg} (shipped by {', '.join(units)})"
        return Check("py-compile", name, False, text, "error", exc.filename or name, exc.lineno)
    except (OSError, ValueError) as exc:
        return Check("py-compile", name, False, f"{name}: cannot compile: {exc}", "error", name)
    if passed is not None:
        passed.add(memo)
    return Check("py-compile", name, True)


def engine_flags(r: Rendered) -> list[Check]:
    """Every flag of an SGLang (or stub) command must be one SGLang 0.5.23 accepts; vLLM flags
    outside its list are warnings, since that list can miss generated flags."""
    list_name = protocol(r.unit.engine)
    if list_name is None:
        return []
    argv = r.launch.engine_args
    allowed = known_flags(list_name)
    unknown = [
        t.split("=", 1)[0]
        for t in argv
        if FLAG_TOKEN.match(t) and t.split("=", 1)[0] not in allowed
    ]
    check = f"{list_name}-flags"
    if not unknown:
        return [Check(check, subject(r), True)]
    if list_name == "vllm":
        message = f"not in vLLM 0.33.0's flag list (check it against the host's vLLM): {', '.join(unknown)}"
        return [Check.failed(check, subject(r), r.unit.problem(message, "args"), "warning")]
    hint = ""
    if "--tp" in unknown or "--dp" in unknown:
        hint = " (SGLang has no --tp/--dp: the playbook's tp/dp become --tp-size/--dp-size)"
    message = f"SGLang 0.5.23 does not accept {', '.join(unknown)}{hint}"
    return [Check.failed(check, subject(r), r.unit.problem(message, "args"))]


def secret_literals(r: Rendered) -> list[Check]:
    """A credential written as a value in `args` (or a launcher's args) would sit in argv for
    every user's `ps`, in the launch script, its log banner and unit.json: refused, pointing at
    secret_args (DESIGN trust 4). A bare `true` carries no value and passes."""
    spec = r.unit.spec
    launcher = getattr(spec, "launcher", None)
    places: list[tuple[tuple[str, ...], dict[str, Any]]] = [(("args",), getattr(spec, "args", {}))]
    if launcher is not None and not isinstance(launcher, str):
        places.append((("launcher", "args"), launcher.args))
    checks = []
    for where, args in places:
        for flag, value in args.items():
            if value is None or isinstance(value, bool) or not looks_secret(flag):
                continue
            message = (
                f"`{flag}` looks like a secret and its value is written in the playbook: it "
                f"would be in the engine's argv (any user's `ps`), the launch script and its "
                f"log; give it with `secret_args: {{{flag}: VAR}}` and VAR exported on the "
                "controller"
            )
            problem = r.unit.problem(message, *where, flag)
            checks.append(Check.failed("secret-args", subject(r), problem))
    return checks
