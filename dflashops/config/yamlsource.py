"""YAML loading that remembers where every value came from.

PyYAML's composed node tree carries line and column marks; we build plain Python data from it and
keep a map from each value's path (``("hosts", "b200", "port")``) to its position, so validation
errors can say ``inventory.yaml:7:11: hosts.b200.port: ...``. Duplicate keys, which PyYAML would
silently collapse to the last one, are errors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflashops.config import reads, yamlfaults
from dflashops.errors import ConfigError, Problem

PathKey = tuple[str | int, ...]

# Bounds a document built from aliases ("billion laughs"): real configs are a few hundred nodes.
MAX_NODES = 200_000


@dataclass
class Document:
    """A loaded YAML file: its data and where each value sits in the file."""

    file: str
    data: Any
    positions: dict[PathKey, tuple[int, int]] = field(default_factory=dict)

    def locate(self, path: PathKey) -> tuple[int | None, int | None]:
        """Line and column (1-based) of the deepest part of ``path`` that exists in the file."""
        for n in range(len(path), -1, -1):
            pos = self.positions.get(tuple(path[:n]))
            if pos is not None:
                return pos
        return None, None

    def problem(self, path: PathKey, message: str) -> Problem:
        line, column = self.locate(path)
        return Problem(self.file, message, line, column, format_path(path))


def format_path(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Builder:
    def __init__(self, file: str) -> None:
        self.file = file
        self.positions: dict[PathKey, tuple[int, int]] = {}
        self.problems: list[Problem] = []
        self.nodes = 0
        self._constructor = yaml.SafeLoader("")

    def build(self, node: yaml.Node, path: PathKey) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _TooBig
        self.positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        return self._constructor.construct_object(node, deep=True)

    def _mapping(self, node: yaml.MappingNode, path: PathKey) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                self._problem(
                    key_node, path, "YAML merge keys (<<) are not supported; write the keys out"
                )
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self._problem(key_node, path, _not_plain(node, key_node))
                continue
            key = self._constructor.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                # YAML turns `yes:`/`on:`/`1.5:` into non-string keys; say so instead of guessing.
                key = str(key_node.value)
            if key in out:
                self._problem(
                    key_node, (*path, key), f"duplicate key {key!r} (an earlier one would be lost)"
                )
                continue
            child = (*path, key)
            self.positions[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            out[key] = self.build(value_node, child)
        return out

    def _problem(self, node: yaml.Node, path: PathKey, message: str) -> None:
        self.problems.append(
            Problem(
                self.file,
                message,
                node.start_mark.line + 1,
                node.start_mark.column + 1,
                format_path(path),
            )
        )


def _not_plain(mapping: yaml.MappingNode, key: yaml.Node) -> str:
    # `model: {{ model }}` is YAML for a mapping whose key is a mapping: a template value left
    # unquoted, by far the usual way to get here.
    if (
        mapping.flow_style
        and isinstance(key, yaml.MappingNode)
        and key.flow_style
        and mapping.start_mark.line == key.start_mark.line
        and key.start_mark.column == mapping.start_mark.column + 1
    ):
        return 'a value that starts with `{{` must be quoted: write it as "{{ name }}"'
    return "a mapping key must be a plain value"


class _TooBig(Exception):
    pass


# libyaml's composer when PyYAML has it (its wheels do): 5-10x faster on a 1,000-host inventory,
# and it refuses nesting past 1,000 levels itself. Nodes and marks are the same either way.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str, file: str) -> Document:
    """Parse one YAML document; raise ConfigError naming file, line and column on any problem."""
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except RecursionError:
        raise ConfigError([Problem(file, "invalid YAML: nested too deeply")]) from None
    except UnicodeEncodeError as exc:  # libyaml takes UTF-8: a lone surrogate cannot be one
        row = text.count("\n", 0, exc.start) + 1
        col = exc.start - text.rfind("\n", 0, exc.start)
        problem = f"invalid YAML: character {text[exc.start]!r} is not valid Unicode"
        raise ConfigError([Problem(file, problem, row, col)]) from None
    except yaml.MarkedYAMLError as exc:
        fault = yamlfaults.explain(exc, text)
        if fault is None:
            reason = f"{exc.problem} ({exc.context})" if exc.context else exc.problem or str(exc)
            raise ConfigError([Problem(file, f"invalid YAML: {reason}")]) from None
        located = Problem(file, f"invalid YAML: {fault.reason}", fault.line, fault.column)
        raise ConfigError([located]) from None
    except yaml.YAMLError as exc:  # e.g. multiple documents
        raise ConfigError([Problem(file, f"invalid YAML: {exc}")]) from None
    if node is None:
        return Document(file, None)
    builder = _Builder(file)
    try:
        data = builder.build(node, ())
    except RecursionError:
        raise ConfigError([Problem(file, "invalid YAML: nested too deeply")]) from None
    except _TooBig:
        raise ConfigError(
            [Problem(file, f"document expands to more than {MAX_NODES} values (alias bomb?)")]
        ) from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
        # Constructor failures on odd scalars (bad timestamps, unknown tags) land here.
        raise ConfigError([Problem(file, f"invalid YAML value: {exc}")]) from None
    if builder.problems:
        raise ConfigError(builder.problems)
    return Document(file, data, builder.positions)


def read_yaml(path: Path) -> Document:
    """Read and parse a YAML file; a missing or unreadable file is a ConfigError too."""
    reads.look(path)  # a recording run (pre-flight's result cache) depends on this content
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem(str(path), "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(str(path), f"cannot read: {exc}")]) from None
    return parse_yaml(text, str(path))
