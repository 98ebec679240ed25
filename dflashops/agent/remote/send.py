"""``send``: files under ``root`` streamed out on stdout, for a relay or ``dflashops fetch``.

Request: ``root``, ``files: [{rel, offset}]``. Output: per file a header line
``{"rel", "size", "offset"}`` and then its bytes from ``offset``; the answer line (``{sent,
missing}``) comes last. The receiver verifies every file against the sha256 it knows.
"""

from __future__ import annotations

import json
import os
import sys

from . import tree
from .common import Json, host_path, integer

CHUNK = 1 << 20


def check(request: Json) -> None:
    host_path(request, "root")
    for i, f in enumerate(request.setdefault("files", [])):
        f["rel"] = tree.check_rel(f.get("rel"))
        integer(f.setdefault("offset", 0), f"files[{i}].offset")


def run(request: Json) -> Json:
    out = sys.stdout.buffer
    sent, missing = [], []
    for f in request["files"]:
        path = tree.target(request["root"], f["rel"])
        if not os.path.isfile(path):
            missing.append(f["rel"])
            continue
        with open(path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            offset = min(f["offset"], size)
            header = {"rel": f["rel"], "size": size, "offset": offset}
            out.write(json.dumps(header).encode() + b"\n")
            src.seek(offset)
            left = size - offset
            while left:
                chunk = src.read(min(left, CHUNK))
                if not chunk:  # shrank while we read: pad, and the receiver's hash says so
                    chunk = b"\0" * left
                out.write(chunk)
                left -= len(chunk)
        sent.append(f["rel"])
    out.flush()
    return {"sent": sent, "missing": missing}
