"""Turn inventory and playbook files into validated objects, or one ConfigError listing every
problem as ``file:line:column: field.path: message``."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Tag, ValidationError

from dflashops.config.inventory import GroupSpec, Inventory, InventoryFile, resolve_hosts
from dflashops.config.playbook import PlaybookFile, PlaybookHead, Service
from dflashops.config.yamlsource import Document, PathKey, read_yaml
from dflashops.errors import ConfigError, Problem
from dflashops.output import shorten

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Playbook:
    """A validated playbook and the file it came from (for locations and relative paths)."""

    path: Path
    head: PlaybookHead
    spec: PlaybookFile | None  # None when values use {{ vars }}: validated per host instead
    doc: Document

    @property
    def name(self) -> str:
        return self.head.name


def validate(doc: Document, model: type[M], what: str) -> M:
    """Validate a parsed document against a model; every error located in the file."""
    if doc.data is None:
        raise ConfigError([Problem(doc.file, f"the file is empty; expected a {what} mapping")])
    if not isinstance(doc.data, dict):
        raise ConfigError(
            [doc.problem((), f"expected a {what} mapping at the top level, got {_kind(doc.data)}")]
        )
    try:
        return model.model_validate(doc.data)
    except ValidationError as exc:
        raise ConfigError(in_order(located_problems(doc, model, exc))) from None


def load_inventory(path: Path) -> Inventory:
    doc = read_yaml(path)
    # Cross-references are checked on the raw data too, so they are reported in the same run as
    # type errors instead of only after those are fixed.
    problems = _inventory_references(doc)
    try:
        spec = validate(doc, InventoryFile, "inventory")
    except ConfigError as exc:
        raise ConfigError(in_order(exc.problems + problems)) from None
    problems += _group_var_clashes(doc, spec)
    if problems:
        raise ConfigError(in_order(problems))
    hosts = resolve_hosts(spec, path)
    return Inventory(
        path=path,
        hosts=hosts,
        groups=spec.members(),
        group_vars={g: dict(s.vars) for g, s in spec.groups.items() if isinstance(s, GroupSpec)},
        providers={h.provider.name: h.provider.provider for h in hosts.values() if h.provider},
    )


def in_order(problems: list[Problem]) -> list[Problem]:
    """Problems by file, line and column (a problem without a line first in its file, as it is
    about the whole file); the order found among equals, each once."""
    unique = list(dict.fromkeys(problems))
    return sorted(unique, key=lambda p: (p.file, p.line or 0, p.column or 0))


def _inventory_references(doc: Document) -> list[Problem]:
    data = _mapping(doc.data)
    hosts, defaults, groups = (_mapping(data.get(k)) for k in ("hosts", "defaults", "groups"))
    problems = []
    for name, host in hosts.items():
        if not isinstance(host, dict):
            continue
        connection = host.get("connection", defaults.get("connection", "ssh"))
        pods = [k for k in PROVIDERS if k in host]
        if pods:
            problems += _pod_host(doc, name, host, pods, connection)
        elif connection == "ssh" and not host.get("address"):
            problems.append(
                doc.problem(
                    ("hosts", name), "an ssh host needs `address` (or set `connection: local`)"
                )
            )
        if connection == "local" and host.get("address"):
            problems.append(
                doc.problem(("hosts", name, "address"), "a local host has no address; remove it")
            )
    for group, members in groups.items():
        if group in hosts:
            problems.append(doc.problem(("groups", group), f"{group!r} is already a host name"))
        where: PathKey = ("groups", group)
        if isinstance(members, dict):
            members, where = members.get("hosts"), (*where, "hosts")
        for i, member in enumerate(members if isinstance(members, list) else []):
            if isinstance(member, str) and member not in hosts:
                close = difflib.get_close_matches(member, [str(h) for h in hosts], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(doc.problem((*where, i), f"unknown host {member!r}{hint}"))
    return problems


PROVIDERS = ("runpod", "vast")  # a host's keys that name its pod instead of an address


def _pod_host(
    doc: Document, name: str, host: dict[str, Any], pods: list[str], connection: Any
) -> list[Problem]:
    """A host named by its pod: its provider is declared, and nothing else says where it is."""
    where = ("hosts", name)
    kind = pods[0]
    if len(pods) > 1:
        return [doc.problem((*where, pods[1]), f"a host is one pod: keep `{kind}` or `{pods[1]}`")]
    if connection == "local":
        return [doc.problem((*where, kind), f"a local host has no {kind} pod; remove `{kind}`")]
    problems = [
        doc.problem(
            (*where, key),
            f"a {kind} host's {key} comes from {kind}'s API: remove `{key}` "
            f"(or remove `{kind}` to use a fixed address)",
        )
        for key in ("address", "port")
        if key in host
    ]
    declared = _mapping(_mapping(doc.data).get("providers"))
    if kind not in declared:
        problems.append(
            doc.problem(
                (*where, kind),
                f"a {kind} host needs `providers: {{{kind}: {{api_key: env:NAME}}}}` in the "
                "inventory",
            )
        )
    return problems


def _group_var_clashes(doc: Document, spec: InventoryFile) -> list[Problem]:
    """Two groups of one host that set one variable to different values, where the host does
    not set it itself: which one wins would be an accident of the file's order."""
    clashes: dict[tuple[str, str, str], list[str]] = {}
    values: dict[tuple[str, str, str], tuple[Any, Any]] = {}
    for host, spec_host in spec.hosts.items():
        first: dict[str, tuple[str, Any]] = {}
        for group, g in spec.groups.items():
            if not isinstance(g, GroupSpec) or host not in g.hosts:
                continue
            for var, value in g.vars.items():
                if var in spec_host.vars:
                    continue
                earlier = first.setdefault(var, (group, value))
                if earlier[1] != value:
                    key = (earlier[0], group, var)
                    clashes.setdefault(key, []).append(host)
                    values[key] = (earlier[1], value)
    problems = []
    for (one, other, var), hosts in clashes.items():
        a, b = values[(one, other, var)]
        problems.append(
            doc.problem(
                ("groups", other, "vars", var),
                f"groups {one} and {other} both set `{var}` for {_hosts(hosts)} "
                f"({_shown(a)} and {_shown(b)}): set it in the host's own vars (they win) "
                "or in one group only",
            )
        )
    return problems


def _hosts(names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"host{'s' if len(names) > 1 else ''} {shown}"


def load_playbook(path: Path) -> Playbook:
    doc = read_yaml(path)
    if "{{" in repr(doc.data):
        head = validate(doc, PlaybookHead, "playbook")
        return Playbook(path=path, head=head, spec=None, doc=doc)
    spec = validate(doc, PlaybookFile, "playbook")
    return Playbook(path=path, head=spec, spec=spec, doc=doc)


def _mapping(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _kind(value: Any) -> str:
    return {
        list: "a list",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
    }.get(type(value), type(value).__name__)


def located_problems(doc: Document, model: type[BaseModel], exc: ValidationError) -> list[Problem]:
    """Map pydantic errors onto file positions. Errors from the branches of one union land on the
    same value; they are merged into one message so a bad value is reported once."""
    merged: dict[PathKey, list[str]] = {}
    raw: dict[PathKey, list[Any]] = {}
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path = _data_path(doc.data, loc)
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            path = (*path, "engine")
        raw.setdefault(path, []).append(err)
        message = _message(err, model, loc, doc, path)
        bucket = merged.setdefault(path, [])
        if message not in bucket:
            bucket.append(message)
    problems = []
    for path, messages in merged.items():
        text = _choice_or_type(raw[path]) if len(messages) > 1 else messages[0]
        if text is None:
            text = "invalid value: " + "; or ".join(messages[:4])
        problems.append(doc.problem(path, text))
    return problems


_TYPE_NAMES = {
    "list_type": "a list",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "dict_type": "a mapping",
}


def _choice_or_type(errors: list[Any]) -> str | None:
    """A union of fixed choices and a type (`gpus: auto | [0, 1]`) said as one sentence:
    "must be one of auto or a list (got 'nope')"; None for any other mix."""
    literals = [e for e in errors if e["type"] == "literal_error"]
    types = [_TYPE_NAMES.get(e["type"]) for e in errors if e["type"] != "literal_error"]
    if not literals or not types or None in types:
        return None
    choices = ", ".join(
        str(e["ctx"]["expected"]).replace(" or ", ", ").replace("'", "") for e in literals
    )
    return f"must be one of {choices} or {' or '.join(dict.fromkeys(t for t in types if t))} (got {_shown(errors[0].get('input'))})"


def _data_path(data: Any, loc: tuple[Any, ...]) -> PathKey:
    """The part of a pydantic location that names real places in the data (drops union tags and
    validator names such as 'sglang' or 'function-after[...]')."""
    path: list[str | int] = []
    node = data
    after_index = False
    for part in loc:
        if (
            after_index
            and isinstance(node, dict)
            and part in ENGINES
            and node.get("engine") == part
        ):
            # The discriminated union's tag (a service's engine), not a key: `command` is both.
            after_index = False
            continue
        after_index = isinstance(part, int)
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            path.append(part)
            node = node[part]
        elif (
            isinstance(node, dict)
            and isinstance(part, str)
            and part not in ("[key]",)
            and not _is_tag(part)
        ):
            # A missing or unknown key: name it, positioned at its parent mapping.
            path.append(part)
            break
    return tuple(path)


def _service_models() -> list[type[BaseModel]]:
    union = typing.get_args(Service)[0]
    return list(typing.get_args(union))


ENGINES = {typing.get_args(m.model_fields["engine"].annotation)[0]: m for m in _service_models()}


def _engines_with_field(key: str) -> list[str]:
    return sorted(engine for engine, m in ENGINES.items() if key in m.model_fields)


def _is_tag(part: str) -> bool:
    return part in ENGINES or "[" in part or part.startswith("function-")


def _message(
    err: Any, model: type[BaseModel], loc: tuple[Any, ...], doc: Document, path: PathKey
) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        key = str(loc[-1])
        elsewhere = _engines_with_field(key)
        if len(loc) >= 2 and loc[-2] in ENGINES and elsewhere:
            return f"unknown key {key!r} for engine {loc[-2]}: it is only valid for engine {' and '.join(elsewhere)}"
        hint = ""
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        elif allowed:
            hint = f"; allowed here: {', '.join(sorted(allowed))}"
        return f"unknown key {key!r}{hint}"
    if kind == "missing":
        return f"required field `{loc[-1]}` is missing"
    if kind == "union_tag_invalid":
        return f"`engine` must be one of {', '.join(ENGINES)} (got {_shown(err['ctx']['tag'])})"
    if kind == "union_tag_not_found":
        return f"required field `engine` is missing: one of {', '.join(ENGINES)}"
    if kind == "literal_error":
        choices = str(err["ctx"]["expected"]).replace(" or ", ", ").replace("'", "")
        return f"must be one of {choices} (got {_shown(err.get('input'))})"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        return msg[len("Value error, ") :]
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)):
        msg = f"{msg}, got {_shown(value)} ({_kind(value)})"
    return msg


def _shown(value: Any) -> str:
    text = repr(value)
    return shorten(text, 60)


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model found at ``loc`` (following pydantic's location parts)."""
    current: Any = model
    for part in loc:
        current = _step(current, part)
        if current is None:
            return []
    models = _models_in(current)
    return sorted({name for m in models for name in m.model_fields}) if len(models) == 1 else []


def _step(annotation: Any, part: Any) -> Any:
    for m in _models_in(annotation):
        if isinstance(part, str) and part in m.model_fields:
            return m.model_fields[part].annotation
    # Containers and union tags: descend into the element type or pick the tagged branch.
    for m in _models_in(annotation):
        engine = m.model_fields.get("engine")
        if engine is not None and part in typing.get_args(engine.annotation):
            return m
    origin = typing.get_origin(annotation)
    if origin in (list, dict):
        return typing.get_args(annotation)[-1]
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):  # a tagged branch (groups' two forms)
            if any(isinstance(m, Tag) and m.tag == part for m in getattr(arg, "__metadata__", ())):
                return typing.get_args(arg)[0]
        for arg in typing.get_args(annotation):
            found = _step(arg, part)
            if found is not None:
                return found
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []
