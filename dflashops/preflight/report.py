"""What pre-flight says: checks per subject, for humans (text, in commands/preflight.py) and CI
(JSON, JUnit XML). Light on purpose: a pre-flight answered from its result cache (runcache.py)
builds its report and output from this module alone, without the loader, planner or renderer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from xml.etree import ElementTree as ET

from dflashops.errors import Problem
from dflashops.output import shorten

if TYPE_CHECKING:
    from dflashops.engines.render import Rendered
    from dflashops.plan import Plan

Severity = Literal["error", "warning"]


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

    def row(self) -> list[Any]:
        """Its fields in order (what the result cache keeps); ``Check(*row)`` is it again."""
        return [
            self.check,
            self.subject,
            self.ok,
            self.message,
            self.severity,
            self.file,
            self.line,
        ]


def in_order(checks: list[Check]) -> list[Check]:
    """By file, then line (a check on the whole file first in it); checks about no file (a
    host, a unit) after every file's, in the order they were made."""
    return sorted(checks, key=lambda c: (c.file is None, c.file or "", c.line or 0))


FIELDS = tuple(f.name for f in fields(Check))  # in order: a row's and the JSON's keys


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    # The rendered units: kept only when asked for (deploy ships them); pre-flight alone
    # needs only how many there were and on which hosts.
    rendered: list[Rendered] = field(default_factory=list)
    plan: Plan | None = None
    units: int = 0  # units rendered
    hosts: list[str] = field(default_factory=list)  # hosts with a rendered unit, sorted

    @property
    def errors(self) -> list[Check]:
        """Failed checks by file and line (what is not in a file last), as they are printed."""
        return in_order([c for c in self.checks if not c.ok and c.severity == "error"])

    @property
    def warnings(self) -> list[Check]:
        return in_order([c for c in self.checks if not c.ok and c.severity == "warning"])

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, check: Check) -> None:
        self.checks.append(check)


def to_json(report: Report) -> str:
    body = {
        "ok": report.ok,
        "errors": len(report.errors),
        "warnings": len(report.warnings),
        # dict(zip(...)): asdict's deep copy took 0.3 s for 17,000 checks; the same mapping
        "checks": [dict(zip(FIELDS, c.row(), strict=True)) for c in report.checks],
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
                    case, "failure", message=shorten(c.message.splitlines()[0], 500)
                ).text = c.message
            elif not c.ok:
                ET.SubElement(case, "system-out").text = f"warning: {c.message}"
    return ET.tostring(suites, encoding="unicode")


def write_outputs(report: Report, json_path: str | None, junit_path: str | None) -> None:
    for path, render in ((json_path, to_json), (junit_path, to_junit)):
        if path == "-":  # `--json -`: stdout is the document's alone (people's lines: stderr)
            sys.stdout.write(render(report) + "\n")
            sys.stdout.flush()
        elif path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(report) + "\n", encoding="utf-8")
