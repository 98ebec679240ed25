"""``tail``: the last lines of a unit's current log, or (with ``offset``) what was added since.

Request: ``unit``, ``lines`` (100), ``offset`` and ``log`` (as this call returned them last
time). Answer: ``{log, size, text, offset, rotated, truncated}``. When current.log points at a
newer log than ``log``, that one is read from its start (``rotated``).
"""

from __future__ import annotations

import os

from . import layout, logs
from .common import BadRequest, Json, integer, unit_name


def check(request: Json) -> None:
    request["unit"] = unit_name(request.get("unit"), "unit")
    request["lines"] = integer(request.get("lines", 100), "lines")
    if request.get("offset") is not None:
        request["offset"] = integer(request["offset"], "offset")
    if request.get("log") is not None and not isinstance(request["log"], str):
        raise BadRequest("log must be a string or null")


def run(request: Json) -> Json:
    offset, seen = request.get("offset"), request.get("log")
    out: Json = {"log": None, "size": 0, "text": "", "offset": 0, "rotated": False}
    out["truncated"] = False
    log, path = logs.current(layout.unit_dir(request["workdir"], request["unit"]))
    if log is None or path is None:
        return out
    out["log"] = log
    try:
        if offset is None:
            data, size = logs.tail_bytes(path, request["lines"])
            kept = logs.complete_utf8(data)
            out.update(size=size, offset=size - (len(data) - len(kept)))
            out["text"] = kept.decode("utf-8", "replace")
            return out
        if seen is not None and os.path.basename(seen) != os.path.basename(log):
            out["rotated"], offset = True, 0
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if offset > size:
                out["truncated"], offset = True, 0
            f.seek(offset)
            data = logs.complete_utf8(f.read(logs.TAIL_MAX))
    except FileNotFoundError:
        return out
    out.update(size=size, offset=offset + len(data))
    out["text"] = data.decode("utf-8", "replace")
    return out
