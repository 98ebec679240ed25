"""Moving trees between the controller and hosts, verified and resumable: ``upload`` (a
controller tree into a host's dest, only what differs) and ``pull`` (a host's tree into a
controller folder: `dflashops fetch`, and the first leg of a relay between hosts).

Both sides describe trees the same way (agent/remote/tree.py: rel -> size, sha256). A file is
written beside its target as ``.<name>.dflashops-part.<sha16>`` and renamed only once its
whole content has the sha256 the source reported; a dropped connection leaves the partial file,
and the next run sends only what is missing from it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dflashops.agent import Agent
from dflashops.agent.answers import FileState, ReceiveResult
from dflashops.agent.client import Frames
from dflashops.agent.remote import tree
from dflashops.errors import HostError, TransferError

CHUNK = 1 << 20
Listing = dict[str, tuple[int, str | None]]


@dataclass
class Transfer:
    """What to do to make a dest hold a source: files to send (rel, size, sha256, offset),
    files to delete, and the bytes still to write."""

    send: list[tuple[str, int, str, int]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size - offset for _, size, _, offset in self.send)

    @property
    def empty(self) -> bool:
        return not self.send and not self.delete


def listing(raw: dict[str, Any] | None) -> Listing:
    return {rel: (int(v[0]), v[1]) for rel, v in (raw or {}).items()}


def diff(src: Listing, dest: Listing, parts: dict[str, dict[str, int]], delete: bool) -> Transfer:
    """Pure: what moves. A partial transfer of the same content resumes where it stopped."""
    out = Transfer()
    for rel, (size, sha) in sorted(src.items()):
        if sha is None:
            raise ValueError(f"{rel}: the source could not be hashed")
        if dest.get(rel) == (size, sha):
            continue
        offset = parts.get(rel, {}).get(sha[:16], 0)
        out.send.append((rel, size, sha, offset if offset < size else 0))
    if delete:
        out.delete = sorted(set(dest) - set(src))
    return out


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def space_problem(need: int, state: FileState, dest: str) -> str | None:
    if need <= state.free.free_bytes:
        return None
    return (
        f"{human(need)} to write to {dest} but only {human(state.free.free_bytes)} free at "
        f"{state.free.path}: make room (or a larger RAM disk) and deploy again; nothing written"
    )


def _chunks(root: Path, plan: Transfer) -> Iterator[bytes]:
    """The files' bytes in order, in pieces of about CHUNK: ten thousand small files become a
    hundred sends, not ten thousand (each costs the SSH layer a packet and a lock)."""
    pending = bytearray()
    for rel, _, _, offset in plan.send:
        path = root / rel if rel else root
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                chunk = f.read(CHUNK)
                if not chunk:
                    break
                pending += chunk
                if len(pending) >= CHUNK:
                    yield bytes(pending)
                    pending.clear()
    if pending:
        yield bytes(pending)


def upload(
    agent: Agent,
    workdir: str,
    dest: str,
    local: Path,
    plan: Transfer,
    mode: int | None,
) -> ReceiveResult:
    """Send ``plan``'s files from ``local`` (a folder, or a single file for rel "")."""
    files = []
    for rel, size, sha, offset in plan.send:
        path = local / rel if rel else local
        bits = mode if mode is not None else os.stat(path).st_mode & 0o777
        files.append({"rel": rel, "size": size, "sha256": sha, "offset": offset, "mode": bits})
    return agent.receive(
        workdir,
        dest,
        files,
        _chunks(local, plan),
        delete=plan.delete,
        need_bytes=plan.bytes,
    )


class _Part:
    """One file arriving from a host: appended to its partial file, hashed as it comes."""

    def __init__(self, path: Path, sha: str, offset: int) -> None:
        self.path = path
        self.sha = sha
        self.part = path.parent / f".{path.name}{tree.PART_MARK}{sha[:16]}"
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self.digest = hashlib.sha256()
        if offset and self.part.exists():
            tree.hash_file(str(self.part), self.digest)
        elif offset:
            raise TransferError("controller", f"{self.part} vanished while resuming")
        self.out: BinaryIO = open(self.part, "ab" if offset else "wb")  # noqa: SIM115 - closed by close()
        self.done = False

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.digest.update(data)

    def close(self) -> None:
        self.out.close()
        self.done = True


def pull(
    agent: Agent, workdir: str, root: str, src: Listing, local: Path, *, timeout: float
) -> tuple[list[str], dict[str, str]]:
    """Make ``local`` hold the host's ``root`` (files listed in ``src``): (fetched rels,
    {rel: why} for files that did not verify). Partial files resume."""
    have = tree.scan(str(local))
    plan = diff(src, listing(have["files"]), have["parts"], delete=False)
    if plan.empty:
        return [], {}
    shas = {rel: sha for rel, _, sha, _ in plan.send}
    parts: dict[str, _Part] = {}

    def open_file(header: dict[str, Any]) -> _Part:
        rel = str(header["rel"])
        if rel not in shas:
            raise HostError(agent.host, f"the host sent {rel!r}, which was not asked for")
        parts[rel] = _Part(local / rel if rel else local, shas[rel], int(header["offset"]))
        return parts[rel]

    budget = 600.0 + plan.bytes / 20e6
    result = agent.send(
        workdir,
        root,
        [(rel, offset) for rel, _, _, offset in plan.send],
        Frames(open_file),
        timeout=budget,
    )
    fetched, failed = [], {rel: f"{root}/{rel} is gone on the host" for rel in result.missing}
    for rel, part in parts.items():
        if not part.done:
            failed[rel] = "the stream ended early: what arrived is kept to resume"
        elif part.digest.hexdigest() != part.sha:
            part.part.unlink(missing_ok=True)
            failed[rel] = f"sha256 mismatch: got {part.digest.hexdigest()}, the host has {part.sha}"
        else:
            os.replace(part.part, part.path)
            fetched.append(rel)
    return fetched, failed
