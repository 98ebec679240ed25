"""Launch scripts from units: Jinja2 with StrictUndefined, and quoting enforced by construction.

The environment's ``finalize`` refuses any ``{{ value }}`` that did not pass through the ``q``
(shell-quote) or ``name`` (validated identifier) filter, so a template cannot emit a raw value
even by mistake. Templates ship in the package; a ``templates/`` folder beside the user's
``playbooks/`` folder (or inside it) overrides them by file name.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import (
    Environment,
    FileSystemLoader,
    StrictUndefined,
    TemplateError,
    TemplateNotFound,
    TemplateSyntaxError,
)
from jinja2.loaders import split_template_path
from jinja2.utils import missing

from dflashops import __version__
from dflashops.config import reads
from dflashops.engines import launch_for
from dflashops.engines.base import (
    BesideTool,
    EnvPython,
    HostPath,
    Launch,
    ShellVar,
    ShippedFile,
    Token,
    UnitFile,
    WorkPath,
)
from dflashops.engines.secrets import ARGS_FILE, CONFIG_FILE
from dflashops.errors import Problem
from dflashops.hosts.connection import host_word
from dflashops.plan import Plan, Unit
from dflashops.plan.supervision import policy

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Quoted(str):
    """Text that is safe to place in a shell script as is."""


_QUOTED: dict[str, Quoted] = {}  # the same words recur in every unit of a fleet


def quote(value: Any) -> Quoted:
    kind = type(value)
    if kind is Quoted:
        return value  # type: ignore[no-any-return]
    if kind is str:  # the common case, first: pre-flight quotes ~50 words per unit
        found = _QUOTED.get(value)
        if found is None:
            found = Quoted(shlex.quote(value))
            if len(_QUOTED) < 65536:
                _QUOTED[value] = found
        return found
    if isinstance(value, Quoted):
        return value
    if isinstance(value, WorkPath):
        return Quoted('"${DFLASHOPS_WORKDIR}"/' + shlex.quote(value.relative))
    if isinstance(value, HostPath):
        return Quoted(host_word(value.path))
    if isinstance(value, UnitFile):
        return Quoted('"$DFLASHOPS_UNIT_DIR"/' + shlex.quote(value.name))
    if isinstance(value, ShellVar):
        return Quoted(f'"${env_name(value.name)}"')
    if isinstance(value, EnvPython):
        # _unit.sh.j2 resolves the environment's link into VIRTUAL_ENV before anything runs.
        return Quoted('"${VIRTUAL_ENV:?the unit environment is not set}"/bin/python')
    if isinstance(value, BesideTool):
        # The tool beside the python the unit runs with (command -v finds a bare `python3` on
        # PATH first), else the one on PATH: decided on the host, when the script runs.
        name = shlex.quote(value.name)
        here = f'"$(dirname -- "$(command -v {quote(value.python)})")"/{name}'
        return Quoted(f'"$(t={here}; if [ -x "$t" ]; then echo "$t"; else echo {name}; fi)"')
    if value is None:
        return Quoted("''")
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return Quoted(shlex.quote(str(value)))


def quote_argv(argv: Iterable[Token]) -> Quoted:
    return Quoted(" ".join(quote(t) for t in argv))


def quote_text(value: Any) -> Quoted:
    """Quote the text form of anything, already-quoted text included (for printing a command)."""
    return Quoted(shlex.quote(str(value)))


def env_name(value: str) -> Quoted:
    if not _ENV_NAME.fullmatch(value):
        raise TemplateError(f"{value!r} is not an environment variable name")
    return Quoted(value)


def _finalize(value: Any) -> Any:
    if isinstance(value, Quoted):
        return value
    raise TemplateError(
        f"unquoted value {value!r} in a template: pipe every value through `|q` (or `|name` for a variable name)"
    )


def template_dirs(playbook_paths: Iterable[Path]) -> list[Path]:
    """User override folders: ``templates/`` beside or inside each playbooks folder."""
    dirs: list[Path] = []
    for path in playbook_paths:
        for candidate in (path.parent / "templates", path.parent.parent / "templates"):
            reads.look(candidate)  # a folder made later overrides: a recording run depends on it
            if candidate.is_dir() and candidate not in dirs:
                dirs.append(candidate)
    return dirs


def builtin_templates() -> Path:
    """The built-in templates: the repo's top-level templates/ in a source checkout (and an
    editable install), dflashops/templates/ in an installed wheel (pyproject maps one onto the
    other: there is one copy)."""
    here = Path(__file__).resolve().parent.parent  # the package (this file is in engines/)
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / "_unit.sh.j2").is_file():
            return candidate
    raise RuntimeError(
        f"dflashops' templates are missing (looked in {here}/templates and ../templates)"
    )


class _Loader(FileSystemLoader):
    """Jinja's FileSystemLoader that tells a recording run (dflashops.config.reads) every path it
    looks at for a template, found or not: an override added later beside a playbook must read
    as a change, as must an edit of the built-in it shadows."""

    def get_source(
        self, environment: Environment, template: str
    ) -> tuple[str, str, Callable[[], bool]]:
        if reads.current() is not None:
            pieces = split_template_path(template)
            for searchpath in self.searchpath:  # the order FileSystemLoader searches in
                if reads.is_file(reads.look(posixpath.join(searchpath, *pieces))):
                    break
        return super().get_source(environment, template)


class _Strict(StrictUndefined):
    """An undefined name or field said in a template author's words, not as a Python class."""

    @property
    def _undefined_message(self) -> str:
        name, obj = self._undefined_name, self._undefined_obj
        if self._undefined_hint:
            return self._undefined_hint
        if obj is missing:
            return f"`{name}` is not defined (a template sees: {', '.join(CONTEXT)})"
        if isinstance(obj, _UnitView):
            return f"unit {obj.name} has no field `{name}` (a unit has: {', '.join(UNIT_FIELDS)})"
        kind = type(obj).__name__.strip("_")
        return (
            f"`{name}` is not a field of {obj!r}"
            if len(repr(obj)) <= 40
            else f"a {kind} has no `{name}`"
        )


def make_environment(override_dirs: list[Path]) -> Environment:
    env = Environment(
        loader=_Loader([*(str(d) for d in override_dirs), str(builtin_templates())]),
        undefined=_Strict,
        finalize=_finalize,
        autoescape=False,
        auto_reload=False,  # one run renders with one set of templates: no stat per unit
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = quote
    env.filters["qargv"] = quote_argv
    env.filters["name"] = env_name
    env.filters["qtext"] = quote_text
    return env


@dataclass
class Rendered:
    """A unit with its launch script and the fingerprint that identifies what it runs."""

    unit: Unit
    script: str
    fingerprint: str
    launch: Launch
    env: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[ShippedFile]:
        return self.launch.files

    @property
    def short(self) -> str:
        return self.fingerprint[:12]


_FINGERPRINT = Quoted("@@dflashops-fingerprint@@")


def template_name(unit: Unit) -> str:
    return "job.sh.j2" if unit.kind == "job" else f"{unit.engine}.sh.j2"


def render_unit(env: Environment, unit: Unit) -> Rendered:
    """Render one unit. The fingerprint hashes the script (rendered without it), the content of
    every shipped file and the names of its secrets, so any change to what runs changes it."""
    launch = launch_for(unit)
    unit_env = {**unit.host.env, **launch.env, **unit.spec.env}
    hidden = launch.secrets
    context = {
        "unit": _UnitView(unit),
        "argv": launch.argv,
        "env": sorted(unit_env.items()),
        # What to set on the controller when a secret file is missing on the host.
        "secrets": [*sorted(unit.spec.secret_env), *hidden.sources()],
        "secrets_env": bool(unit.spec.secret_env or hidden.env),
        # secret_args' own files: each must be there; only secret-args.env is sourced.
        "secret_files": [
            n for n, on in ((CONFIG_FILE, hidden.config), (ARGS_FILE, hidden.argv)) if on
        ],
        "version": __version__,
    }
    try:
        template = env.get_template(template_name(unit))
        # Rendered once: the fingerprint is a placeholder, filled in after hashing the script
        # with it empty (the text a render with fingerprint "" gives, so fingerprints do not
        # change).
        out = template.render(fingerprint=_FINGERPRINT, **context)
    except Exception as exc:  # a user's template can fail in any way: said at its own line
        raise TemplateFault.of(exc, env) from None
    if _FINGERPRINT.strip("@") in out.replace(_FINGERPRINT, ""):
        raise TemplateError("`fingerprint` must be used whole (`{{ fingerprint|q }}`), not cut")
    draft = out.replace(_FINGERPRINT, quote(""))
    digest = hashlib.sha256(
        json.dumps(
            {
                "script": draft,
                "files": {f.remote: f.sha256 for f in launch.files},
                "secrets": sorted(unit.spec.secret_env),
                # Only when set: fingerprints of units without stay what they were.
                **({"secret_args": dict(unit.spec.secret_args)} if unit.spec.secret_args else {}),
                # Only when there is one: fingerprints of units without stay what they were.
                **({"environment": unit.env.hash} if unit.env is not None else {}),
                "supervise": policy(unit),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    script = out.replace(_FINGERPRINT, quote(digest))
    return Rendered(unit, script, digest, launch, unit_env)


def render_plan(plan: Plan, override_dirs: list[Path]) -> tuple[list[Rendered], list[Problem]]:
    return render_units(plan.units, override_dirs)


def render_units(
    units: Sequence[Unit], override_dirs: list[Path]
) -> tuple[list[Rendered], list[Problem]]:
    """Render some of a plan's units (pre-flight renders a slice per core)."""
    env = make_environment(override_dirs)
    rendered: list[Rendered] = []
    problems: list[Problem] = []
    # One mistake in a template fails every unit rendered with it: said once per place in the
    # template, naming the first unit and counting the others.
    faults: dict[tuple[str, int, str], list[Unit]] = {}
    first: dict[tuple[str, int, str], TemplateFault] = {}
    for unit in units:
        try:
            result = render_unit(env, unit)
        except TemplateFault as exc:
            if exc.file is None or exc.line is None:
                problems.append(unit.problem(f"template {template_name(unit)}: {exc.text}"))
            else:
                key = (exc.file, exc.line, exc.kind)
                first.setdefault(key, exc)
                faults.setdefault(key, []).append(unit)
            continue
        except TemplateError as exc:
            problems.append(unit.problem(f"template {template_name(unit)}: {exc}"))
            continue
        problems.extend(result.launch.problems)
        rendered.append(result)
    for key, failed in faults.items():
        problems.append(first[key].problem(failed))
    return rendered, problems


class TemplateFault(TemplateError):
    """A launch template that failed to load or render, at its own file and line when the
    traceback (or a syntax error) says where."""

    def __init__(self, text: str, kind: str, file: str | None, line: int | None) -> None:
        super().__init__(text)
        self.text, self.kind, self.file, self.line = text, kind, file, line

    @classmethod
    def of(cls, exc: Exception, env: Environment) -> TemplateFault:
        text = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TemplateNotFound):
            text = f"template {exc.name!r} not found (in {', '.join(_searchpath(env))})"
        file, line = _site(exc, _searchpath(env))
        return cls(text, type(exc).__name__, file, line)

    def problem(self, units: Sequence[Unit]) -> Problem:
        """Said at the template's line, naming the first unit it failed (and its place in its
        playbook) and how many more."""
        unit = units[0]
        at = unit.problem("")
        place = f"{at.file}:{at.line}" if at.line is not None else at.file
        more = f" and {len(units) - 1} more unit(s)" if len(units) > 1 else ""
        text = f"{self.text}; rendering {unit.host.name}/{unit.name} ({place}){more}"
        return Problem(_shown_path(self.file or ""), text, self.line)


def _searchpath(env: Environment) -> list[str]:
    loader = env.loader
    return list(loader.searchpath) if isinstance(loader, FileSystemLoader) else []


def _site(exc: BaseException, roots: list[str]) -> tuple[str | None, int | None]:
    """The template file and line an error happened at: a syntax error says it; otherwise the
    innermost frame of Jinja's rewritten traceback that is a template's."""
    if isinstance(exc, TemplateSyntaxError) and exc.filename and exc.lineno:
        return exc.filename, exc.lineno
    bases = [os.path.normpath(r) + os.sep for r in roots]
    site: tuple[str | None, int | None] = (None, None)
    for frame in traceback.extract_tb(exc.__traceback__):
        if any(os.path.normpath(frame.filename).startswith(b) for b in bases):
            site = (frame.filename, frame.lineno)
    return site


def _shown_path(path: str) -> str:
    """A template's path as the user would type it: relative to here when it is below it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


# What a template is given (render_unit's context), for the message about an undefined name.
CONTEXT = (
    "unit",
    "argv",
    "env",
    "secrets",
    "secrets_env",
    "secret_files",
    "version",
    "fingerprint",
)


class _UnitView:
    """What templates see of a unit: plain values, nothing that could reach the host."""

    # Its fields, named once: also what the message about a field it lacks lists.
    __slots__ = (
        "cuda_visible_devices",
        "dp",
        "engine",
        "env_path",
        "gpus",
        "host",
        "kind",
        "name",
        "nodes",
        "playbook",
        "port",
        "rank",
        "rendezvous",
        "replica",
        "tp",
    )

    def __init__(self, unit: Unit) -> None:
        self.name = unit.name
        self.host = unit.host.name
        self.engine = unit.engine
        self.kind = unit.kind
        self.playbook = unit.playbook.name
        self.tp = unit.tp
        self.dp = unit.dp
        self.port = unit.port if unit.port is not None else "-"
        self.gpus = ",".join(map(str, unit.gpus)) or "-"
        # An empty CUDA_VISIBLE_DEVICES hides every GPU: a CPU-only job cannot grab one by accident.
        self.cuda_visible_devices = ",".join(
            map(str, unit.gpus if unit.sees is None else unit.sees)
        )
        self.replica = unit.replica
        self.env_path = HostPath(unit.env.path) if unit.env is not None else None
        # A part of a multi-node unit: its rank and the nodes, in rank order (else empty).
        self.nodes = list(unit.nodes) if unit.multi_node else []
        self.rank = unit.rank
        self.rendezvous = f"{unit.head}:{unit.dist_port}" if unit.multi_node else ""


UNIT_FIELDS = _UnitView.__slots__
