"""``keep``: a job's kept outputs, streamed off the node (DESIGN "Nothing lost when a node is
lost" 1-2). The controller keeps a copy of each file and a record of it; the host decides, per
file and from that record alone, what the copy lacks, and sends only that:

- ``same``: the recorded (size, mtime, inode) still hold, or the content proves equal (the
  tail digest for a file of at most TAIL bytes, else the whole file's sha256);
- ``append``: the file is longer and the TAIL bytes before the recorded size still hash to the
  recorded tail: only [recorded size, end) is sent. An append-only file (the generator's JSONL
  shards) costs its new bytes and one TAIL read, never a read of what was kept already;
- ``whole``: anything else (not recorded, changed, shrunk while its job runs): the whole file;
- ``behind`` (modes protect and look, and mirror when the request's ``job`` is not running):
  shorter than the copy; nothing is sent, the controller restores it (the longer one wins). A
  running job may cut its own file (the generator drops a torn last line when it resumes); a
  file that shrank with no job running lost something.

Request: ``paths: [{name, path, records: {rel: {size, sha256, tail, stat}}}]`` (``path``
absolute, or relative to the workdir), ``job`` (the unit writing them, or null), ``mode``
(mirror | protect | look: decide only),
``limit`` (bytes per second, or null), ``budget`` (bytes: no file is begun past it; those left
are ``later``, so the controller can bound the call's time). Output: for each file sent a header line ``{rel:
NAME[/REL], size, offset, kind, sha256 (of [offset, size)), stat}`` and its bytes [offset,
size), where size is the file's size when it was opened (bytes appended meanwhile go next
time); then the answer line: ``{roots {name: path}, files {key: [size, mtime_ns, inode]},
decisions {key: kind}, errors {key: why}, sent_bytes, running}``. Nothing on the host is written.
"""

from __future__ import annotations

import json
import os
import sys
import time

from . import scan, tree
from .common import BadRequest, Json, describe, integer, unit_name

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any, BinaryIO

TAIL = 64 << 10  # bytes before the recorded size that prove a file grew by appending
CHUNK = 1 << 20
MODES = ("mirror", "protect", "look")


def check(request: Json) -> None:
    if request.setdefault("mode", "mirror") not in MODES:
        raise BadRequest(f"mode must be one of {', '.join(MODES)}")
    if request.setdefault("limit", None) is not None:
        integer(request["limit"], "limit", 1)
    integer(request.setdefault("budget", 1 << 62), "budget")
    if request.setdefault("job", None) is not None:
        unit_name(request["job"], "job")
    paths = request.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, dict) for p in paths):
        raise BadRequest("paths must be a list of objects")
    for i, p in enumerate(paths):
        name, path = p.get("name"), p.get("path")
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise BadRequest(f"paths[{i}].name must be one plain file name")
        if not isinstance(path, str) or not path or "\0" in path:
            raise BadRequest(f"paths[{i}].path must be a path")
        expanded = os.path.expanduser(path)
        p["root"] = os.path.normpath(
            expanded if os.path.isabs(expanded) else os.path.join(request["workdir"], path)
        )
        records = p.setdefault("records", {})
        if not isinstance(records, dict):
            raise BadRequest(f"paths[{i}].records must be an object")
        for rel, rec in records.items():
            tree.check_rel(rel)
            if not isinstance(rec, dict):
                raise BadRequest(f"paths[{i}].records[{rel!r}] must be an object")
            integer(rec.get("size"), f"paths[{i}].records[{rel!r}].size")


def sha_range(f: BinaryIO, start: int, end: int) -> str | None:
    """sha256 of bytes [start, end) of ``f``; None when the file ends before ``end``."""
    h = hash_range(f, start, end)
    return None if h is None else h.hexdigest()


def hash_range(f: BinaryIO, start: int, end: int, into: Any = None) -> Any:
    """A sha256 state over bytes [start, end) of ``f`` (``into`` continues one); None when
    the file ends before ``end``. The controller hashes its copy with it too: one rule."""
    import hashlib

    h = into if into is not None else hashlib.sha256()
    f.seek(start)
    left = end - start
    while left:
        chunk = f.read(min(left, CHUNK))
        if not chunk:
            return None
        h.update(chunk)
        left -= len(chunk)
    return h


def decide(f: BinaryIO, st: os.stat_result, rec: Json | None, mode: str) -> str:
    """same | append | whole | behind, for the open file ``f`` against the copy's record."""
    if rec is None:
        return "whole"
    size, kept = st.st_size, rec["size"]
    if rec.get("stat") == [size, st.st_mtime_ns, st.st_ino]:
        return "same"
    if size < kept:
        return "whole" if mode == "mirror" else "behind"
    if sha_range(f, max(0, kept - TAIL), kept) != rec.get("tail"):
        return "whole"
    if size > kept:
        return "append"
    if kept <= TAIL:  # the tail is the whole file
        return "same"
    return "same" if sha_range(f, 0, size) == rec.get("sha256") else "whole"


class Pacer:
    """At most ``limit`` bytes per second over the call (None: as fast as the link goes)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.started = time.monotonic()
        self.sent = 0

    def sent_now(self, count: int) -> None:
        self.sent += count
        if self.limit:
            ahead = self.sent / self.limit - (time.monotonic() - self.started)
            if ahead > 0:
                time.sleep(ahead)


def send_file(out: Any, f: BinaryIO, key: str, kind: str, rec: Json | None, pacer: Pacer) -> int:
    """The header and bytes [offset, size) of ``f`` as it is now; the bytes sent."""
    st = os.fstat(f.fileno())
    offset = rec["size"] if kind == "append" and rec is not None else 0
    digest = sha_range(f, offset, st.st_size)
    if digest is None:
        raise OSError(f"{key} shrank while it was read: sent next time")
    header = {
        "rel": key,
        "size": st.st_size,
        "offset": offset,
        "kind": kind,
        "sha256": digest,
        "stat": [st.st_size, st.st_mtime_ns, st.st_ino],
    }
    out.write(json.dumps(header).encode() + b"\n")
    f.seek(offset)
    left = st.st_size - offset
    while left:
        chunk = f.read(min(left, CHUNK))
        if not chunk:  # shrank after hashing: pad; the receiver's hash refuses it
            chunk = b"\0" * min(left, CHUNK)
        out.write(chunk)
        left -= len(chunk)
        pacer.sent_now(len(chunk))
    return st.st_size - offset


def run(request: Json) -> Json:
    out = sys.stdout.buffer
    pacer = Pacer(request["limit"])
    answer: Json = {"roots": {}, "files": {}, "decisions": {}, "errors": {}, "sent_bytes": 0}
    mode = request["mode"]
    if request["job"] is not None:
        answer["running"] = scan.job_state(request["workdir"], request["job"])["state"] == "running"
        if mode == "mirror" and not answer["running"]:
            mode = "protect"
    for p in request["paths"]:
        answer["roots"][p["name"]] = p["root"]
        stats, _ = tree.walk(p["root"])
        for rel, st in sorted(stats.items()):
            key = f"{p['name']}/{rel}" if rel else p["name"]
            answer["files"][key] = [st.st_size, st.st_mtime_ns, st.st_ino]
            rec = p["records"].get(rel)
            try:
                with open(os.path.join(p["root"], rel) if rel else p["root"], "rb") as f:
                    kind = decide(f, os.fstat(f.fileno()), rec, mode)
                    if kind in ("append", "whole") and mode != "look":
                        if answer["sent_bytes"] >= request["budget"]:
                            kind = "later"
                        else:
                            answer["sent_bytes"] += send_file(out, f, key, kind, rec, pacer)
                    answer["decisions"][key] = kind
            except OSError as exc:
                answer["errors"][key] = describe(exc)
    out.flush()
    return answer
