"""``receive``: files streamed in on stdin land under ``dest``, each verified and atomic.

Request: ``dest``, ``files: [{rel, size, sha256, offset, mode}]`` (their bytes from ``offset``
follow the request on stdin, in that order), ``delete: [rel]``, ``need_bytes``. Answer:
``{ok, written [rel], failed {rel: why}, deleted [rel], digest, error}``.

Each file is written to ``.<name>.dflashops-part.<sha16>`` beside its target (appended to when
``offset`` says a partial transfer is there), hashed as it arrives, and renamed over the target
only when the whole file has the sent sha256. A dropped connection keeps the partial file (the
next deploy resumes it: the final hash covers the resumed bytes too); a hash mismatch removes it.
A transfer that completes removes every other partial file under dest: content that changed
before its transfer finished is never resumed, and its partial file would stay forever.
Free space is checked before anything is written. The manifest of ``dest`` is kept in
``WORKDIR/files/``, so facts can tell whether dest holds what it should without reading it.
"""

from __future__ import annotations

import hashlib
import os
import time

from . import bounded, tree
from .common import BadRequest, Json, describe, host_path, integer, remove
from .verified import CHUNK, Signals, copy_in, mismatch

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import BinaryIO


class Interrupted(Exception):
    pass


def check(request: Json) -> None:
    host_path(request, "dest")
    for i, f in enumerate(request.setdefault("files", [])):
        f["rel"] = tree.check_rel(f.get("rel"))
        for key in ("size", "offset", "mode"):
            integer(f.get(key, 0 if key == "offset" else None), f"files[{i}].{key}")
        if not isinstance(f.get("sha256"), str) or len(f["sha256"]) != 64:
            raise BadRequest(f"files[{i}].sha256 must be a sha256 in hex")
    request["delete"] = [tree.check_rel(r) for r in request.get("delete", [])]
    integer(request.setdefault("need_bytes", 0), "need_bytes")


def skip(src: BinaryIO, count: int) -> bool:
    while count:
        chunk = src.read(min(count, CHUNK))
        if not chunk:
            return False
        count -= len(chunk)
    return True


class Folders:
    """Folders already made and checked to be inside dest: ten thousand small files mostly
    share a few folders, and each check costs a walk of the path."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.ok: set[str] = set()
        self.umask = os.umask(0o022)  # read it (there is no other way), then put it back
        os.umask(self.umask)

    def target(self, rel: str) -> str:
        folder = os.path.dirname(rel)
        if folder not in self.ok:
            path = tree.target(self.root, rel)  # refuses what would land outside dest
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.ok.add(folder)
        return os.path.join(self.root, rel) if rel else self.root


def receive_one(folders: Folders, f: Json, src: BinaryIO) -> str | None:
    """Write one file from the stream; None when it is in place, else why not. Raises
    Interrupted (partial kept) when the stream ends early."""
    path = folders.target(f["rel"])
    part = tree.part_name(path, f["sha256"])
    left = f["size"] - f["offset"]
    have = 0
    if f["offset"]:  # a resume: the partial file must be exactly what the controller thinks
        try:
            have = os.stat(part).st_size
        except FileNotFoundError:
            have = 0
    if have != f["offset"]:
        # The partial file is not what the controller expected: drop it; it resends in full.
        remove(part)
        if not skip(src, left):
            raise Interrupted(f"input ended in {f['rel'] or path}")
        return f"the partial transfer was {have} bytes, not {f['offset']}: sent again next time"
    digest = hashlib.sha256()
    if have:
        tree.hash_file(part, digest)
    # From scratch, O_TRUNC drops any stale partial of this content without a look first.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC)
    fd = os.open(part, flags, f["mode"])
    try:
        missing = copy_in(src, lambda chunk: os.write(fd, chunk), left, digest)
        if missing:
            raise Interrupted(f"input ended {missing} bytes early in {f['rel'] or path}")
        if f["mode"] & folders.umask:
            os.fchmod(fd, f["mode"])  # the umask narrowed it
    finally:
        os.close(fd)
    why = mismatch(digest, f["sha256"])
    if why:
        remove(part)
        return why
    os.replace(part, path)
    return None


def run(request: Json, stdin: BinaryIO) -> Json:
    with Signals(Interrupted) as signals:
        return receive_all(request, stdin, signals)


def receive_all(request: Json, stdin: BinaryIO, signals: Signals) -> Json:
    started = time.monotonic()
    root = request["dest"]
    out: Json = {"ok": False, "written": [], "failed": {}, "deleted": [], "digest": None}
    out["error"] = None
    space = tree.free_bytes(root)
    if space["free_bytes"] < request["need_bytes"]:
        out["error"] = (
            f"{request['need_bytes']} bytes to write to {root} but only {space['free_bytes']} "
            f"free at {space['path']}: nothing written"
        )
        return out
    cache = tree.cache_path(request["workdir"], "dest", root)
    folders = Folders(root)
    try:
        for f in request["files"]:
            why = receive_one(folders, f, stdin)
            if why:
                out["failed"][f["rel"]] = why
            else:
                out["written"].append(f["rel"])
        for rel in request["delete"]:
            path = tree.target(root, rel)
            if os.path.isfile(path) or os.path.islink(path):
                os.unlink(path)
                out["deleted"].append(rel)
        # Complete: no partial file under dest is wanted any more (one left from content that
        # changed since would otherwise stay forever).
        bounded.drop_parts(root)
    except Interrupted as exc:
        out["error"] = f"{exc}; what arrived is kept for the next deploy to resume"
    except (OSError, BadRequest) as exc:
        out["error"] = f"writing under {root} failed (disk full?): {describe(exc)}"
    finally:
        signals.quiet()
        # What arrived was hashed on the way in: the manifest learns it without reading it
        # (the next facts walks dest for real, and sees anything else that is there).
        sha = {f["rel"]: f["sha256"] for f in request["files"]}
        written = {r: sha[r] for r in out["written"]}
        out["digest"] = tree.remember(cache, root, written, out["deleted"])
    out["ok"] = out["error"] is None and not out["failed"]
    out["elapsed_s"] = round(time.monotonic() - started, 3)
    return out
