"""``{{ vars }}`` in playbook strings, filled in per host before the playbook is validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import StrictUndefined, TemplateError, Undefined
from jinja2.nativetypes import NativeEnvironment
from jinja2.sandbox import SandboxedEnvironment
from pydantic import ValidationError

from dflashops.config.inventory import Host
from dflashops.config.load import Playbook, in_order, located_problems
from dflashops.config.playbook import PlaybookFile
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem


class _NativeSandbox(NativeEnvironment, SandboxedEnvironment):
    """`port: "{{ base_port }}"` must stay a number: a value that is exactly one expression
    keeps its type; anything mixed with text is a string. Sandboxed: no attribute tricks."""


_values_env = _NativeSandbox(undefined=StrictUndefined, autoescape=False)


@dataclass(frozen=True)
class Unfilled(Problem):
    """A ``{{ }}`` that could not be filled in for ``host``. Planning goes on with the text as
    written, so one run also finds the playbook's other mistakes; what only that text caused
    (a file named ``{{ dir }}/x.py`` not found) is left out of pre-flight's report
    (``derived``)."""

    host: str = ""


def derived(problem: Problem, unfilled: list[Unfilled]) -> bool:
    """A later problem at the place of an unfilled value, for its host, about that text."""
    return (
        not isinstance(problem, Unfilled)
        and "{{" in problem.message
        and any(
            u.file == problem.file and u.line == problem.line and f"[{u.host}]" in problem.message
            for u in unfilled
        )
    )


def reportable(problems: list[Problem]) -> list[Problem]:
    """Problems of a run as a person reads them: by file and line, each once, without those an
    unfilled value caused (for a front end that prints plan and render problems together)."""
    unfilled = [p for p in problems if isinstance(p, Unfilled)]
    return in_order([p for p in problems if not derived(p, unfilled)])


def expand_for_host(book: Playbook, host: Host, problems: list[Problem]) -> PlaybookFile | None:
    """The playbook with ``{{ name }}`` in string values filled from playbook vars, then the
    host's inventory vars (defaults, then its groups', then its own: a host-specific model path
    beats the playbook's), plus ``host`` and ``gpus``. A value that cannot be filled in is a
    problem and stays as written; the rest is still validated (and, if that passes, planned),
    so that one run reports every mistake it can."""
    raw = book.doc.data
    if book.spec is not None:
        return book.spec
    variables: dict[str, Any] = {
        **book.head.vars,
        **host.vars,
        "host": host.name,
        "host_gpus": host.gpus,
        "workdir": host.workdir,
        # Meaningful for local hosts, which share the controller's filesystem.
        "playbook_dir": str(book.path.parent.resolve()),
    }
    failed: list[str] = []

    def walk(value: Any, path: PathKey) -> Any:
        if isinstance(value, dict):
            return {
                k: (v if path == () and k == "vars" else walk(v, (*path, k)))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, str) and "{{" in value:
            try:
                out = _values_env.from_string(value).render(variables)
                if isinstance(out, Undefined):
                    str(out)  # a lone {{ nope }} renders natively to Undefined: make it raise
                return out
            except Exception as exc:  # a {{ 1/0 }} is the user's input: report it, never crash
                if not isinstance(exc, TemplateError):
                    exc = TemplateError(f"{type(exc).__name__}: {exc}")
                p = book.doc.problem(path, f"[{host.name}] cannot fill in {value!r}: {exc}")
                problems.append(Unfilled(p.file, p.message, p.line, p.column, p.field, host.name))
                failed.append(p.field)
        return value

    data = walk(raw, ())
    try:
        return PlaybookFile.model_validate(data)
    except ValidationError as exc:
        found = located_problems(book.doc, PlaybookFile, exc)
        # A value left as written may well be of the wrong type: said once, as unfilled.
        problems.extend(p for p in found if not any(_within(p.field, f) for f in failed))
        return None


def _within(field: str, at: str) -> bool:
    return field == at or field.startswith((f"{at}.", f"{at}["))
