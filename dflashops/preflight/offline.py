"""Offline pre-flight: everything that can be known before touching a GPU host.

Validates inventory and playbooks, lays out every unit on every targeted host, renders every
launch script, runs ``bash -n`` on each (once per shape, see bash_syntax.py), compiles every
shipped ``.py`` (INCIDENTS.md #1: a SyntaxError found only after launch), and checks engine
flags against the engines' real flag lists. Passes are kept by content (memo.py): a run whose
scripts did not change re-checks nothing. Results are per check and subject, for humans (text)
and CI (JSON, JUnit XML).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal
from xml.etree import ElementTree as ET

from dflashops.engines.base import ShippedFile, known_flags
from dflashops.errors import Problem
from dflashops.plan import Plan, build_plan
from dflashops.preflight.bash_syntax import Verdict, check_scripts
from dflashops.preflight.memo import Passed, key
from dflashops.project import Selection
from dflashops.render import Rendered, render_plan, template_dirs

Severity = Literal["error", "warning"]
FLAG_TOKEN = re.compile(r"^--?[A-Za-z]")  # -1 or -0.5 are values, not flags


@dataclass
class Check:
    """One check on one subject (a file, a host, a unit). ``message`` is empty when it passed."""

    check: str
    subject: str
    ok: bool
    message: str = ""
    severity: Severity = "error"
    file: str | None = None
    line: int | None = None

    @classmethod
    def failed(
        cls, check: str, subject: str, problem: Problem, severity: Severity = "error"
    ) -> Check:
        return cls(check, subject, False, str(problem), severity, problem.file, problem.line)


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    rendered: list[Rendered] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def errors(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and c.severity == "error"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and c.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, check: Check) -> None:
        self.checks.append(check)


def run_preflight(selection: Selection) -> Report:
    report = Report()
    for problem in selection.problems:
        report.add(Check.failed("config", problem.file, problem))
    plan = build_plan(selection.inventory, selection.playbooks, selection.hosts)
    report.plan = plan
    for problem in plan.problems:
        report.add(Check.failed("layout", problem.file, problem))
    for host, host_plan in plan.hosts.items():
        report.add(Check("layout", host, True, f"{len(host_plan.units)} units"))
    rendered, problems = render_plan(plan, template_dirs(b.path for b in selection.playbooks))
    for problem in problems:
        report.add(Check.failed("render", problem.file, problem))
    report.rendered = rendered
    passed = Passed()
    verdicts = check_scripts([(r.script, r.fingerprint) for r in rendered], passed)
    for r, verdict in zip(rendered, verdicts, strict=True):
        report.add(bash_syntax(r, verdict))
        for check in engine_flags(r):
            report.add(check)
    for shipped, units in _shipped_python(rendered).items():
        report.add(compile_python(shipped, units, passed))
    passed.save()
    _note_empty(report, plan)
    return report


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


def _shipped_python(rendered: Iterable[Rendered]) -> dict[ShippedFile, list[str]]:
    out: dict[ShippedFile, list[str]] = {}
    for r in rendered:
        for f in r.files:
            if f.name.endswith(".py"):
                out.setdefault(f, []).append(subject(r))
    return out


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
        if hashlib.sha256(source).hexdigest() != shipped.sha256:
            memo = key("py-compile", sys.version, hashlib.sha256(source).hexdigest())
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
    engine = r.unit.engine
    if engine not in ("sglang", "stub", "vllm"):
        return []
    argv = r.launch.engine_args
    list_name = "vllm" if engine == "vllm" else "sglang"
    allowed = known_flags(list_name)
    unknown = [
        t.split("=", 1)[0]
        for t in argv
        if FLAG_TOKEN.match(t) and t.split("=", 1)[0] not in allowed
    ]
    check = f"{list_name}-flags"
    if not unknown:
        return [Check(check, subject(r), True)]
    if engine == "vllm":
        message = f"not in vLLM 0.33.0's flag list (check it against the host's vLLM): {', '.join(unknown)}"
        return [Check.failed(check, subject(r), r.unit.problem(message, "args"), "warning")]
    hint = ""
    if "--tp" in unknown or "--dp" in unknown:
        hint = " (SGLang has no --tp/--dp: the playbook's tp/dp become --tp-size/--dp-size)"
    message = f"SGLang 0.5.23 does not accept {', '.join(unknown)}{hint}"
    return [Check.failed(check, subject(r), r.unit.problem(message, "args"))]


# -- output -------------------------------------------------------------------------------------


def to_json(report: Report) -> str:
    body = {
        "ok": report.ok,
        "errors": len(report.errors),
        "warnings": len(report.warnings),
        "checks": [asdict(c) for c in report.checks],
    }
    return json.dumps(body, indent=2)


def to_junit(report: Report) -> str:
    suites = ET.Element("testsuites", name="dflashops preflight")
    by_check: dict[str, list[Check]] = {}
    for c in report.checks:
        by_check.setdefault(c.check, []).append(c)
    for name, checks in by_check.items():
        failures = [c for c in checks if not c.ok and c.severity == "error"]
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=name,
            tests=str(len(checks)),
            failures=str(len(failures)),
            errors="0",
        )
        for i, c in enumerate(checks):
            case = ET.SubElement(
                suite, "testcase", classname=f"preflight.{name}", name=f"{c.subject}#{i}"
            )
            if c.file:
                case.set("file", c.file)
            if c.line:
                case.set("line", str(c.line))
            if not c.ok and c.severity == "error":
                ET.SubElement(
                    case, "failure", message=c.message.splitlines()[0][:500]
                ).text = c.message
            elif not c.ok:
                ET.SubElement(case, "system-out").text = f"warning: {c.message}"
    return ET.tostring(suites, encoding="unicode")


def write_outputs(report: Report, json_path: str | None, junit_path: str | None) -> None:
    for path, render in ((json_path, to_json), (junit_path, to_junit)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(report) + "\n", encoding="utf-8")
