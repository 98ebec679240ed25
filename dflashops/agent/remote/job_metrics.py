"""``job_metrics``: the newest numbers each job reports for plotting, read cheaply.

Request: ``units: [{name, log (a regex with named groups) | file (a JSON-lines path, relative
to the unit's folder)}]``, ``max_bytes`` (the end of each file read, 64 KiB). Answer:
``{units: {name: {values {metric: number}, skipped (lines in that end that were not JSON
objects), error}}}``. Only the end of the log or the file is read: the newest value of each
metric is the last one there; a metric absent from it is not reported.
"""

from __future__ import annotations

import json
import math
import os
import re

from . import layout, logs
from .common import BadRequest, Json, describe, integer, unit_name

MAX_BYTES = 64 * 1024


def check(request: Json) -> None:
    units = request.get("units")
    if not isinstance(units, list) or not all(isinstance(u, dict) for u in units):
        raise BadRequest("units must be a list of objects")
    for u in units:
        u["name"] = unit_name(u.get("name"), "units[].name")
        if (u.get("log") is None) == (u.get("file") is None):
            raise BadRequest(f"{u['name']}: exactly one of log or file")
        if not isinstance(u.get("log") or u.get("file"), str):
            raise BadRequest(f"{u['name']}: log and file are strings")
    request["max_bytes"] = integer(request.get("max_bytes", MAX_BYTES), "max_bytes", 1)


def run(request: Json) -> Json:
    out: Json = {}
    for u in request["units"]:
        unit_dir = layout.unit_dir(request["workdir"], u["name"])
        try:
            if u.get("log") is not None:
                _, path = logs.current(unit_dir)
                text = end_of(path, request["max_bytes"]) if path else ""
                out[u["name"]] = {"values": from_log(text, u["log"]), "skipped": 0, "error": None}
            else:
                path = os.path.join(unit_dir, os.path.expanduser(u["file"]))
                values, skipped = from_lines(end_of(path, request["max_bytes"]))
                out[u["name"]] = {"values": values, "skipped": skipped, "error": None}
        except (OSError, re.error) as exc:
            out[u["name"]] = {"values": {}, "skipped": 0, "error": describe(exc)}
    return {"units": out}


def end_of(path: str, limit: int) -> str:
    """The last ``limit`` bytes of ``path`` from its first whole line ("" when it is absent)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except FileNotFoundError:
        return ""
    if size > limit:
        data = data[data.find(b"\n") + 1 :]  # a cut first line is not a line
    return data.decode("utf-8", "replace")


def number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        got = float(value)
    elif isinstance(value, str):
        try:
            got = float(value)
        except ValueError:
            return None
    else:
        return None
    return got if math.isfinite(got) else None


def from_log(text: str, pattern: str) -> Json:
    """The newest number each named group of ``pattern`` matched in ``text``'s lines."""
    regex = re.compile(pattern)
    values: Json = {}
    for line in reversed(text.splitlines()):
        for match in regex.finditer(line):
            for name, raw in match.groupdict().items():
                got = number(raw)
                if got is not None and name not in values:
                    values[name] = got
        if len(values) == len(regex.groupindex):
            break
    return values


def from_lines(text: str) -> tuple[Json, int]:
    """The newest number of each key in ``text``'s JSON lines, and how many lines were not
    JSON objects (skipped; blank lines are not counted)."""
    values: Json = {}
    skipped = 0
    for line in reversed(text.splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            skipped += 1
            continue
        for key, raw in obj.items():
            got = number(raw)
            if got is not None and key not in values:
                values[key] = got
    return values, skipped
