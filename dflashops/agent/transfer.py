"""Moving trees between the controller and hosts, verified and resumable: ``upload`` (a
controller tree into a host's dest, only what differs) and ``pull`` (a host's tree into a
controller folder: `dflashops fetch`, and the first leg of a relay between hosts).

Both sides describe trees the same way (agent/remote/tree.py: rel -> size, sha256). A file is
written beside its target as ``.<name>.dflashops-part.<sha16>`` and renamed only once its
whole content has the sha256 the source reported; a dropped connection leaves the partial file,
and the next run sends only what is missing from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dflashops.agent import Agent
from dflashops.agent.answers import FileState, ReceiveResult
from dflashops.agent.reading import Frames
from dflashops.agent.remote import tree
from dflashops.errors import TransferError
from dflashops.hosts.untrusted import HostileHost, check_listing

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


class _Landing:
    """Where one file from a host lands: ``name`` in the folder ``parts`` below ``root``.
    Every folder below ``root`` is made by us or checked to be a real folder, and opened
    without following a link (O_NOFOLLOW at each step, relative to the one above), so no
    link at the destination, old or planted meanwhile, leads a write outside it."""

    def __init__(self, root: Path, rel: str) -> None:
        if rel:
            self.root, (*self.parts, self.name) = root, rel.split("/")
        else:  # a single file: the destination itself (its folder is the operator's)
            self.root, self.parts, self.name = root.parent, [], root.name
        self.path = root / rel if rel else root

    @contextlib.contextmanager
    def folder(self, make: bool = False) -> Iterator[int]:
        if make:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in self.parts:
                if make:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                try:
                    inner = os.open(name, _FOLDER, dir_fd=fd)
                except OSError as exc:
                    raise TransferError(
                        "controller",
                        f"{self.path}: a part of it is a symbolic link or not a folder "
                        f"({exc.strerror}): refusing to write through it",
                    ) from None
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def landing_problem(local: Path, rel: str) -> str | None:
    """Why writing ``rel`` under ``local`` would go through a link or a non-folder, or end
    outside ``local`` (None: safe). Checked for every file before the first byte is written."""
    if not rel:
        return None
    path = local
    for name in rel.split("/")[:-1]:
        path = path / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            break  # what is missing from here on, we make
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a folder"
    if os.path.isdir(local / rel) and not os.path.islink(local / rel):
        return f"{local / rel} is a folder"
    base = os.path.realpath(local)
    if not os.path.realpath(local / rel).startswith(base + os.sep):
        return f"{local / rel} resolves outside {local}"
    return None


class _Part:
    """One file arriving from a host: appended to its partial file, hashed as it comes."""

    def __init__(self, landing: _Landing, sha: str, offset: int) -> None:
        self.landing = landing
        self.path = landing.path
        self.sha = sha
        self.name = f".{landing.name}{tree.PART_MARK}{sha[:16]}"
        self.part = self.path.parent / self.name
        self.digest = hashlib.sha256()
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with landing.folder(make=True) as folder:
            try:
                if offset:
                    self._hash_existing(folder)
                fd = os.open(
                    self.name, flags | (os.O_APPEND if offset else os.O_TRUNC), 0o644, dir_fd=folder
                )
            except OSError as exc:
                raise TransferError(
                    "controller",
                    f"{self.part}: {exc.strerror} (a symbolic link is never written through)",
                ) from None
        self.out: BinaryIO = os.fdopen(fd, "wb")
        self.done = False

    def _hash_existing(self, folder: int) -> None:
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError:
            raise TransferError("controller", f"{self.part} vanished while resuming") from None
        with os.fdopen(fd, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                self.digest.update(chunk)

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.digest.update(data)

    def close(self) -> None:
        self.out.close()
        self.done = True

    def finish(self) -> str | None:
        """Put the verified file in place (None), or remove it and say why not."""
        with self.landing.folder() as folder:
            got = self.digest.hexdigest()
            if got != self.sha:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.name, dir_fd=folder)
                return f"sha256 mismatch: got {got}, the host has {self.sha}"
            # A rename replaces a link at the destination; it never writes through one.
            os.replace(self.name, self.landing.name, src_dir_fd=folder, dst_dir_fd=folder)
        return None


class _Skipped:
    """The bytes of a file that is not what was asked for: read past, never written."""

    done = True

    def write(self, data: bytes) -> None:
        return None

    def close(self) -> None:
        return None


def pull(
    agent: Agent, workdir: str, root: str, src: Listing, local: Path, *, timeout: float
) -> tuple[list[str], dict[str, str]]:
    """Make ``local`` hold the host's ``root`` (files listed in ``src``): (fetched rels,
    {rel: why} for files that did not verify). Partial files resume. The host's list is
    checked whole before anything is written (HostileHost for an unsafe path), and so is
    where each file lands (TransferError for a link or a non-folder on the way)."""
    check_listing(agent.host, src)
    have = tree.scan(str(local))
    plan = diff(src, listing(have["files"]), have["parts"], delete=False)
    if plan.empty:
        return [], {}
    for rel, *_ in plan.send:
        if (why := landing_problem(local, rel)) is not None:
            raise TransferError(
                agent.host,
                f"{why}: refusing to write through it; nothing from {agent.host} was written",
            )
    asked = {rel: (size, sha, offset) for rel, size, sha, offset in plan.send}
    parts: dict[str, _Part | _Skipped] = {}
    failed: dict[str, str] = {}

    def open_file(header: dict[str, Any]) -> _Part | _Skipped:
        rel = header["rel"]
        if rel not in asked or rel in parts:
            raise HostileHost(agent.host, f"the host sent {rel!r}, which was not asked for")
        size, sha, offset = asked[rel]
        if (header["size"], header["offset"]) != (size, min(offset, size)):
            failed[rel] = (
                f"changed on the host while fetched ({header['size']} bytes, listed with "
                f"{size}): run again"
            )
            parts[rel] = _Skipped()
        else:
            parts[rel] = _Part(_Landing(local, rel), sha, header["offset"])
        return parts[rel]

    budget = 600.0 + plan.bytes / 20e6
    result = agent.send(
        workdir,
        root,
        [(rel, offset) for rel, _, _, offset in plan.send],
        Frames(open_file, agent.host),
        timeout=budget,
    )
    fetched = []
    failed.update({rel: f"{root}/{rel} is gone on the host" for rel in result.missing})
    for rel, part in parts.items():
        if isinstance(part, _Skipped):
            continue
        if not part.done:
            failed[rel] = "the stream ended early: what arrived is kept to resume"
        elif (why := part.finish()) is not None:
            failed[rel] = why
        else:
            fetched.append(rel)
    return fetched, failed
