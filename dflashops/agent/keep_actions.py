"""The controller's side of ``keep`` (agent/remote/keep.py): the copy of a job's kept outputs,
``KEEP/HOST/JOB/NAME/...``, its record ``KEEP/HOST/JOB.json``, and the one streamed call that
brings what the copy lacks.

A file's record: ``size``, ``sha256`` of the copy's whole content, ``tail`` (the sha256 of the
TAIL bytes before size: what the host checks to prove a file only grew), ``stat`` on the host
when it was sent, ``relayed`` (the sha256 last put on a ``to: HOST:/path`` target). The record
is what the copy is: written atomically after the bytes it describes.

An append is written after the recorded size (the copy is cut back to it first: bytes of an
append that was cut short are never kept), checked against the sha256 the host sent for those
bytes, and the whole file's sha256 is carried on from a hash state kept in memory for the life
of the process (else recomputed from the copy, which checks the copy too). A whole file lands
beside its target and is renamed over it only once verified (transfer.py's partial files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashops.agent import Agent
from dflashops.agent.answers import FactsModel
from dflashops.agent.reading import Frames
from dflashops.agent.remote.common import write_atomic
from dflashops.agent.remote.keep import TAIL, hash_range
from dflashops.agent.transfer import _Landing, _Part, landing_problem
from dflashops.errors import TransferError
from dflashops.hosts.untrusted import HostileHost, check_listing, path_problem

SHA_HEX = frozenset("0123456789abcdef")
# Hash states of copies this process wrote: local path -> (size, sha256, state). An append
# carries the whole file's sha256 on without reading what was kept already (watch, for days).
_STATES: dict[str, tuple[int, str, Any]] = {}
_STATES_LOCK = threading.Lock()


@dataclass
class Record:
    size: int
    sha256: str
    tail: str
    stat: list[int] | None = None
    relayed: str | None = None


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def sha_of(path: Path, start: int, end: int, into: Any = None) -> Any | None:
    """A sha256 state over bytes [start, end) of ``path`` (``into`` continues one); None when
    the file is missing or shorter."""
    try:
        with open(path, "rb") as f:
            return hash_range(f, start, end, into)
    except OSError:
        return None


class KeptCopy:
    """One job's copy on the controller and its record."""

    def __init__(self, keep_dir: Path, host: str, job: str) -> None:
        self.root = keep_dir / host / job
        self.index = keep_dir / host / f"{job}.json"
        self.aside_root = keep_dir / host / f"{job}.aside"
        self.records: dict[str, Record] = {}
        self.roots: dict[str, str] = {}  # kept name -> its path on the host
        self.notes: list[str] = []  # what went wrong with the copy itself (set aside, ...)

    def load(self) -> KeptCopy:
        try:
            data = json.loads(self.index.read_text())
            self.roots = {str(k): str(v) for k, v in data.get("roots", {}).items()}
            records = {k: Record(**v) for k, v in data.get("files", {}).items()}
            # A copy deleted or cut by hand is not what its record says: sent again whole.
            self.records = {k: r for k, r in records.items() if self._present(k, r)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            aside = self.index.with_name(f"{self.index.name}.broken-{utc_stamp()}")
            with contextlib.suppress(OSError):
                self.index.rename(aside)
            self.notes.append(
                f"the kept copy's record {self.index} did not read ({exc}): moved to {aside.name}; "
                "the copy is sent again whole"
            )
            self.records = {}
        return self

    def _present(self, key: str, rec: Record) -> bool:
        try:
            st = os.lstat(self.path(key))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size >= rec.size

    def save(self) -> None:
        self.index.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "version": 1,
            "roots": self.roots,
            "files": {k: asdict(r) for k, r in sorted(self.records.items())},
        }
        write_atomic(str(self.index), json.dumps(body, indent=1).encode() + b"\n", 0o600)

    def path(self, key: str) -> Path:
        return self.root / key

    def for_host(self, name: str) -> dict[str, dict[str, Any]]:
        """The records of kept path ``name``, by its own relative paths (the request's)."""
        out = {}
        for key, rec in self.records.items():
            if key == name or key.startswith(f"{name}/"):
                out[key[len(name) + 1 :]] = {
                    "size": rec.size,
                    "sha256": rec.sha256,
                    "tail": rec.tail,
                    "stat": rec.stat,
                }
        return out

    def state(self, key: str, rec: Record) -> Any | None:
        """The sha256 state of the copy at ``rec.size``, proven to be ``rec.sha256`` (the
        copy cut back to that size first); None when the copy does not match its record."""
        path = self.path(key)
        with _STATES_LOCK:
            cached = _STATES.get(str(path))
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                return None
            if st.st_size > rec.size:
                os.truncate(path, rec.size)  # an append cut short: not part of the copy
        except OSError:
            return None
        if cached is not None and cached[:2] == (rec.size, rec.sha256):
            return cached[2].copy()
        h = sha_of(path, 0, rec.size)
        return h if h is not None and h.hexdigest() == rec.sha256 else None

    def remember(self, key: str, rec: Record, state: Any) -> None:
        self.records[key] = rec
        with _STATES_LOCK:
            _STATES[str(self.path(key))] = (rec.size, rec.sha256, state.copy())

    def verify(self, key: str) -> str | None:
        """Why the copy of ``key`` is not what its record says (None: it is, read in full)."""
        rec = self.records[key]
        with _STATES_LOCK:
            _STATES.pop(str(self.path(key)), None)  # read it for real
        if self.state(key, rec) is None:
            return f"its sha256 is not the recorded {rec.sha256[:12]} ({rec.size} bytes)"
        return None

    def set_aside(self, key: str, why: str) -> str:
        """Move the copy of ``key`` out of the mirror (kept, never restored) and forget it."""
        self.records.pop(key, None)
        aside = self.aside_root / utc_stamp() / key
        try:
            aside.parent.mkdir(parents=True, exist_ok=True)
            self.path(key).rename(aside)
            where = f"moved to {aside}"
        except OSError as exc:
            where = f"could not be moved aside ({exc.strerror})"
        note = f"kept copy of {key} refused: {why}; {where}"
        self.notes.append(note)
        return note

    def total(self) -> int:
        return sum(r.size for r in self.records.values())


def tail_of(path: Path, size: int) -> str:
    h = sha_of(path, max(0, size - TAIL), size)
    if h is None:
        raise TransferError("controller", f"{path} shrank while it was kept")
    return str(h.hexdigest())


class _Whole:
    """A whole file from the host: a partial file beside the copy, renamed once verified."""

    def __init__(self, copy: KeptCopy, key: str, header: dict[str, Any]) -> None:
        self.copy, self.key, self.header = copy, key, header
        self.part = _Part(_Landing(copy.root, key), header["sha256"], 0)
        self.left = header["size"]

    def write(self, data: bytes) -> None:
        self.part.write(data)
        self.left -= len(data)

    def close(self) -> str | None:
        self.part.close()
        if self.left:
            return "the stream ended early"
        why = self.part.finish()
        if why is None:
            size, path = self.header["size"], self.copy.path(self.key)
            rec = Record(size, self.header["sha256"], tail_of(path, size), self.header["stat"])
            self.copy.remember(self.key, rec, self.part.digest)
        return why


class _Append:
    """New bytes of a file the copy has: written after the recorded size, checked by their
    own sha256; the whole file's sha256 carried on."""

    def __init__(self, copy: KeptCopy, key: str, rec: Record, header: dict[str, Any]) -> None:
        self.copy, self.key, self.rec, self.header = copy, key, rec, header
        self.whole: Any = copy.state(key, rec)
        self.delta = hashlib.sha256()
        self.left = header["size"] - header["offset"]
        self.fd: int | None = None
        if self.whole is not None:
            try:
                self.fd = os.open(copy.path(key), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # a link planted there, or gone: never written through
                self.whole = None
            else:
                os.lseek(self.fd, rec.size, os.SEEK_SET)

    def write(self, data: bytes) -> None:
        self.left -= len(data)
        if self.fd is None:
            return  # a copy that does not match its record takes nothing more
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.delta.update(data)
        self.whole.update(data)

    def close(self) -> str | None:
        if self.fd is None:
            return self.copy.set_aside(self.key, "it does not match its record")
        try:
            why = None
            if self.left:
                why = "the stream ended early"
            elif self.delta.hexdigest() != self.header["sha256"]:
                why = f"sha256 mismatch of the appended bytes: got {self.delta.hexdigest()}"
            if why is not None:
                os.ftruncate(self.fd, self.rec.size)
                return why
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        size = self.header["size"]
        sha = self.whole.hexdigest()
        rec = Record(size, sha, tail_of(self.copy.path(self.key), size), self.header["stat"])
        self.copy.remember(self.key, rec, self.whole)
        return None


class KeepAnswer(FactsModel):
    roots: dict[str, str]
    files: dict[str, list[int]]
    decisions: dict[str, str]
    errors: dict[str, str]
    sent_bytes: int
    running: bool | None = None  # the job writing them (None: not asked)


@dataclass
class Pulled:
    """What one keep call did: the host's files (key -> size) and its decisions, the files
    written to the copy, those that failed (key -> why), the bytes that came."""

    answer: KeepAnswer
    written: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    warnings: list[str] = field(default_factory=list)

    def size_on_host(self, key: str) -> int | None:
        found = self.answer.files.get(key)
        return found[0] if found else None


class _Receiver:
    """Checks each header the host sends before a byte of it is written (a rented node may
    send anything: HostileHost), and closes each file as its last byte arrives."""

    def __init__(self, host: str, copy: KeptCopy, names: set[str], pulled: Pulled) -> None:
        self.host, self.copy, self.names, self.pulled = host, copy, names, pulled
        self.seen: set[str] = set()

    def open_file(self, header: dict[str, Any]) -> Any:
        key = header["rel"]
        why = path_problem(key)
        kind, sha, seen = header.get("kind"), header.get("sha256"), header.get("stat")
        rec = self.copy.records.get(key)
        if why is None and (key in self.seen or key.split("/")[0] not in self.names):
            why = "it is not under a kept path" if key not in self.seen else "it came twice"
        if why is None and not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= SHA_HEX):
            why = "its sha256 is not one"
        if why is None and not (
            isinstance(seen, list) and len(seen) == 3 and all(type(v) is int for v in seen)
        ):
            why = "its stat is not [size, mtime_ns, inode]"
        if why is None and kind == "append":
            if rec is None or header["offset"] != rec.size:
                why = "it is an append to a file the copy does not have at that size"
        elif why is None and (kind != "whole" or header["offset"] != 0):
            why = f"kind {kind!r} at offset {header['offset']} is not a whole file"
        if why is not None:
            raise HostileHost(self.host, f"host {self.host} sent {key!r} for keep: {why}")
        if (problem := landing_problem(self.copy.root, key)) is not None:
            raise TransferError(self.host, f"{problem}: refusing to write the kept copy through it")
        self.seen.add(key)
        self._warn(key, str(kind), rec, header["size"])
        sink = _Append(self.copy, key, rec, header) if rec and kind == "append" else None
        return _Closing(self, key, sink or _Whole(self.copy, key, header), header)

    def _warn(self, key: str, kind: str, rec: Record | None, size: int) -> None:
        """A big file whose copy is replaced by a different one: both sizes, once."""
        if kind == "whole" and rec is not None and rec.size > TAIL:
            how = "is longer, and kept" if size >= rec.size else "is shorter, and replaces it"
            self.pulled.warnings.append(
                f"{key}: the host's {size} bytes differ from the kept copy's {rec.size}; "
                f"the host's {how}"
            )


class _Closing:
    """A sink whose close (its last byte, or the stream's end) settles the file at once."""

    def __init__(self, receiver: _Receiver, key: str, sink: Any, header: dict[str, Any]) -> None:
        self.receiver, self.key, self.sink = receiver, key, sink
        self.size = header["size"] - header["offset"]

    def write(self, data: bytes) -> None:
        self.sink.write(data)

    def close(self) -> None:
        pulled = self.receiver.pulled
        why = self.sink.close()
        if why is None:
            pulled.written.append(self.key)
            pulled.bytes += self.size
        else:
            pulled.failed[self.key] = why


def pull_kept(
    agent: Agent,
    workdir: str,
    copy: KeptCopy,
    paths: list[tuple[str, str]],
    *,
    mode: str = "mirror",
    job: str | None = None,
    limit: int | None = None,
    budget: int = 8 << 30,
) -> Pulled:
    """One keep call: the copy gets what it lacks of ``paths`` ([(name, host path)]) and its
    record is saved, whatever happens on the way (what arrived whole is kept). With ``job``,
    a file that shrank is taken only while that job runs."""
    request = {
        "workdir": workdir,
        "job": job,
        "mode": mode,
        "limit": limit,
        "budget": budget,
        "paths": [{"name": n, "path": p, "records": copy.for_host(n)} for n, p in paths],
    }
    pulled = Pulled(KeepAnswer(roots={}, files={}, decisions={}, errors={}, sent_bytes=0))
    receiver = _Receiver(agent.host, copy, {n for n, _ in paths}, pulled)
    rate = min(limit or 20e6, 20e6)  # at least 20 MB/s, or the limit asked for
    try:
        data = agent.call(
            "keep",
            request,
            timeout=600.0 + budget / rate,
            frames=Frames(receiver.open_file, agent.host),
        )
        pulled.answer = agent.validate(KeepAnswer, data, "keep")
        check_listing(agent.host, pulled.answer.files, "its kept files")
        copy.roots.update(pulled.answer.roots)
    finally:
        if mode != "look":  # deploy --check changes nothing, here neither
            copy.save()
    return pulled
