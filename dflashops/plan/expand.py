"""``{{ vars }}`` in playbook strings, filled in per host before the playbook is validated."""

from __future__ import annotations

from typing import Any

from jinja2 import StrictUndefined, TemplateError, Undefined
from jinja2.nativetypes import NativeEnvironment
from jinja2.sandbox import SandboxedEnvironment
from pydantic import ValidationError

from dflashops.config.inventory import Host
from dflashops.config.load import Playbook, located_problems
from dflashops.config.playbook import PlaybookFile
from dflashops.config.yamlsource import PathKey
from dflashops.errors import Problem


class _NativeSandbox(NativeEnvironment, SandboxedEnvironment):
    """`port: "{{ base_port }}"` must stay a number: a value that is exactly one expression
    keeps its type; anything mixed with text is a string. Sandboxed: no attribute tricks."""


_values_env = _NativeSandbox(undefined=StrictUndefined, autoescape=False)


def expand_for_host(book: Playbook, host: Host, problems: list[Problem]) -> PlaybookFile | None:
    """The playbook with ``{{ name }}`` in string values filled from playbook vars, then host vars
    (the host wins: a host-specific model path beats the playbook's), plus ``host`` and ``gpus``."""
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
    errors: list[Problem] = []

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
                errors.append(
                    book.doc.problem(path, f"[{host.name}] cannot fill in {value!r}: {exc}")
                )
        return value

    data = walk(raw, ())
    if errors:
        problems.extend(errors)
        return None
    try:
        return PlaybookFile.model_validate(data)
    except ValidationError as exc:
        problems.extend(located_problems(book.doc, PlaybookFile, exc))
        return None
