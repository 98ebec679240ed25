"""YAML syntax errors said at the line that is wrong, in words, with that line's text.

PyYAML's ``problem_mark`` is where the parser gave up, which is often the line *after* the
mistake: a key without its ``:`` swallows the next line into a multi-line plain value and only
that line's ``:`` is refused; an unclosed quote or bracket is noticed at the end of the file.
The parser's own marks (``context_mark``: where the quote, bracket or simple key began) and, for
a refused ``:``, the scalar scanned just before it, name the line the person has to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

# YAML's line breaks (str.splitlines knows more, which would shift the count).
_BREAKS = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
# A shown line is cut to this many characters, at a word's end.
SHOWN = 80


@dataclass(frozen=True)
class Fault:
    line: int  # 1-based
    column: int  # 1-based
    reason: str


def explain(exc: yaml.MarkedYAMLError, text: str) -> Fault | None:
    """Where the mistake behind ``exc`` is and what it is; None when PyYAML gave no place."""
    problem = exc.problem_mark
    if problem is None:
        return None
    lines = _BREAKS.split(text)
    where = (problem.line, problem.column)  # 0-based, PyYAML's
    context = exc.context_mark
    said = exc.problem or ""
    during = exc.context or ""
    reason: str
    if during == "while scanning a simple key" and context is not None:
        where = (context.line, context.column)
        reason = f"missing `:` after `{_text(lines, context.line)}` (write `key: value`)"
    elif during == "while scanning a quoted scalar" and context is not None:
        where = (context.line, context.column)
        quote = _char(lines, context.line, context.column) or "quote"
        reason = f"the `{quote}` opened here is never closed"
    elif during.startswith("while parsing a flow") and context is not None:
        reason = _flow(lines, problem, context, said)
        if context.line != problem.line:
            where = (context.line, context.column)
    elif "mapping values are not allowed" in said:
        where, reason = _refused_colon(text, lines, problem)
    elif "tab" in said or _char(lines, problem.line, problem.column) == "\t":
        reason = "a tab in the indentation: YAML indents with spaces only"
    elif "cannot start any token" in said:
        char = _char(lines, problem.line, problem.column)
        reason = f"{char!r} cannot start a plain value: quote the value"
    elif "undefined alias" in said:
        name = _word(lines, problem.line, problem.column)
        reason = f"`{name}` names no anchor (`&{name[1:]}`): quote a value that starts with `*`"
    elif "another document" in said:
        reason = "a second YAML document (`---`) begins here: a dflashops file holds one"
    elif during.startswith(("while parsing a block mapping", "while parsing a block collection")):
        reason = _block(lines, problem, context)
    else:
        reason = f"{said} ({during})" if during else said
    line, column = where
    shown = _text(lines, line)
    if shown and f"`{shown}`" not in reason:
        reason = f"{reason}; line {line + 1} reads: {shown}"
    return Fault(line + 1, column + 1, reason)


def _refused_colon(text: str, lines: list[str], problem: yaml.Mark) -> tuple[tuple[int, int], str]:
    """A ``:`` where no mapping may start. When the value before it began on an earlier line,
    that value ran on into this line: either its own line lacks a ``:`` (the mistake is there)
    or this line is indented under a value, deeper than its key (the mistake is here)."""
    scalar, before, key = _scalar_before(text, problem)
    row = lines[problem.line] if problem.line < len(lines) else ""
    here = (problem.line, len(row) - len(row.lstrip(" ")))
    if scalar is None or scalar.start_mark.line == problem.line:
        return (
            (problem.line, problem.column),
            "a value with `: ` in it must be quoted (or a `key:` is indented too deep)",
        )
    start = scalar.start_mark
    if isinstance(before, yaml.ValueToken) and before.start_mark.line == start.line:
        return (
            here,
            f"this line is indented deeper than `{key or 'the key'}:` above it "
            f"(line {start.line + 1}): "
            "align it with that key, or quote a value that holds `: `",
        )
    return (
        (start.line, start.column),
        f"missing `:` after `{_text(lines, start.line)}` (write `key: value`)",
    )


def _scalar_before(
    text: str, problem: yaml.Mark
) -> tuple[yaml.Token | None, yaml.Token | None, str | None]:
    """The last scalar token scanned before the failure, the token before it and, when that is a
    `:`, the key it follows (the pure-Python scanner: its tokens up to the error are what
    libyaml saw too)."""
    tokens: list[yaml.Token] = []
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            tokens.append(token)
    except yaml.YAMLError:
        pass
    for i in range(len(tokens) - 1, -1, -1):
        token = tokens[i]
        if isinstance(token, yaml.ScalarToken) and token.start_mark.line <= problem.line:
            before = tokens[i - 1] if i else None
            key = tokens[i - 2] if i >= 2 else None
            return token, before, key.value if isinstance(key, yaml.ScalarToken) else None
    return None, None, None


def _flow(lines: list[str], problem: yaml.Mark, context: yaml.Mark, said: str) -> str:
    opener = _char(lines, context.line, context.column) or "bracket"
    closer = {"[": "]", "{": "}"}.get(opener, "the closing bracket")
    if not "".join(lines[problem.line :]).strip():
        return f"the `{opener}` opened here is never closed with `{closer}`"
    if context.line != problem.line:
        return (
            f"the `{opener}` opened here is not closed with `{closer}` before line "
            f"{problem.line + 1}"
        )
    return f"expected `,` or `{closer}` at column {problem.column + 1} ({said})"


def _block(lines: list[str], problem: yaml.Mark, context: yaml.Mark | None) -> str:
    char = _char(lines, problem.line, problem.column)
    row = lines[problem.line] if problem.line < len(lines) else ""
    first = len(row) - len(row.lstrip(" "))
    if char == "-" and problem.column == first:
        return "a list item (`- `) where a `key:` was expected: check the indentation"
    if problem.column == first:
        opened = f" (the mapping above begins on line {context.line + 1})" if context else ""
        return f"the indentation lines up with no key above it{opened}"
    return f"unexpected {char!r} after a value: quote the whole value"


def _char(lines: list[str], line: int, column: int) -> str:
    row = lines[line] if 0 <= line < len(lines) else ""
    return row[column] if 0 <= column < len(row) else ""


def _word(lines: list[str], line: int, column: int) -> str:
    row = lines[line] if 0 <= line < len(lines) else ""
    return row[column:].split(None, 1)[0] if row[column:].strip() else ""


def _text(lines: list[str], line: int) -> str:
    """The line as a person would quote it: tabs visible, cut at a word's end."""
    row = lines[line] if 0 <= line < len(lines) else ""
    shown = row.strip(" \r").replace("\t", "\\t")
    if len(shown) <= SHOWN:
        return shown
    cut = shown[:SHOWN].rsplit(" ", 1)[0]
    return f"{cut}..."
