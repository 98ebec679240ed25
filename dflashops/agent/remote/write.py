"""``write``: several files in one round trip, each verified on the host, all or none renamed.

Request: ``files: [{path, size, sha256, mode}]``; the files' bytes follow the request on stdin,
concatenated in that order. Each lands in a temporary file in its own folder (the rename is then
atomic); only when all arrived with the right sha256 are they renamed into place, keeping the
previous version as NAME.prev. If stdin ends early (a dropped connection), a hash differs or a
write fails (a full disk), nothing is renamed and no temporary file is left.
Answer: ``{ok, written: [paths], error}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile

from .common import TMP_MARK, BadRequest, Json, integer, make_private_dirs, private_dir
from .verified import CHUNK, Signals, copy_in, mismatch

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import BinaryIO


class Failed(Exception):
    pass


def check(request: Json) -> None:
    files = request.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise BadRequest("files must be a list of objects")
    for i, f in enumerate(files):
        if not isinstance(f.get("path"), str) or not os.path.isabs(f["path"]):
            raise BadRequest(f"files[{i}].path must be an absolute path")
        integer(f.get("size"), f"files[{i}].size")
        integer(f.get("mode"), f"files[{i}].mode")
        if not isinstance(f.get("sha256"), str) or len(f["sha256"]) != 64:
            raise BadRequest(f"files[{i}].sha256 must be a sha256 in hex")


class Counted:
    """stdin, counting what was read (to skip the rest of a failed write's data)."""

    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self.read_bytes = 0
        self.ended = False

    def read(self, n: int) -> bytes:
        data = self.src.read(n)
        self.read_bytes += len(data)
        self.ended = self.ended or not data
        return data

    def drain(self, total: int) -> None:
        while not self.ended and self.read_bytes < total:
            self.read(min(CHUNK, total - self.read_bytes))


def receive(entry: Json, src: Counted, tmps: list[str]) -> str:
    path = entry["path"]
    folder = os.path.dirname(path)
    try:
        make_private_dirs(folder)  # a unit's folder, units/, payloads/: 0700
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{TMP_MARK}", dir=folder)
    except OSError as exc:
        raise Failed(f"cannot write in {folder}: {exc}") from None
    tmps.append(tmp)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            left = copy_in(src, out.write, int(entry["size"]), digest)
            if left:
                raise Failed(f"input ended {left} bytes early in {path} (connection lost?)")
        os.chmod(tmp, int(entry["mode"]))
    except OSError as exc:
        raise Failed(f"writing {path} failed (disk full?): {exc}") from None
    why = mismatch(digest, entry["sha256"], f" for {path}")
    if why:
        raise Failed(why)
    return tmp


def install(path: str, tmp: str) -> None:
    try:
        if os.path.exists(path):
            prev = path + ".prev"
            if os.path.lexists(prev):
                os.unlink(prev)
            os.link(path, prev)  # a hard link: no copy
        os.replace(tmp, path)
    except OSError as exc:
        raise Failed(f"installing {path} failed: {exc}") from None


def run(request: Json, stdin: BinaryIO) -> Json:
    with Signals(Failed) as signals:
        return write_all(request, Counted(stdin), signals)


def write_all(request: Json, source: Counted, signals: Signals) -> Json:
    files = request["files"]
    tmps: list[str] = []
    try:
        try:
            private_dir(request["workdir"])  # a deploy writes: the workdir becomes 0700
        except OSError as exc:
            raise Failed(f"cannot make the workdir {request['workdir']} private: {exc}") from None
        received = [receive(entry, source, tmps) for entry in files]
        for entry, tmp in zip(files, received):
            install(entry["path"], tmp)
            tmps.remove(tmp)
        return {"ok": True, "written": [f["path"] for f in files], "error": None}
    except Failed as exc:
        if signals.fired is not None:  # a signal: answer, and a session ends after it (main.serve)
            return {"ok": False, "written": [], "error": str(exc), "interrupted": True}
        # In a session the next request follows the data: read what was sent but not taken.
        source.drain(sum(int(f["size"]) for f in files))
        return {"ok": False, "written": [], "error": str(exc)}
    finally:
        signals.quiet()  # from here on, signals no longer raise
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
