"""Trees of files, described the same way everywhere (the controller imports this module too):
a manifest maps each file's path relative to the root ("" for a single-file root) to its size
and sha256, and a tree's digest is the sha256 of its sorted manifest.

Hashing is what costs, so ``scan`` keeps a cache beside the data it describes: rel -> [size,
mtime_ns, inode, sha256]. A file whose size, mtime and inode match its cache entry is not read
again; anything else is hashed (up to a byte budget: past it, a file's sha256 is None, which
never equals a real one). The cache of a destination written by dflashops is its manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat

from .common import TMP_MARK, BadRequest, Json, write_atomic

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

    Entry = list[Any]  # [size, mtime_ns, inode, sha256 or None]

PART_MARK = ".dflashops-part."  # .<name>.dflashops-part.<sha16>: a transfer to be resumed
CHUNK = 1 << 20


def digest(files: dict[str, tuple[int, str | None]]) -> str | None:
    """The tree's digest from rel -> (size, sha256); None when a sha256 is unknown."""
    import hashlib  # not at import: facts loads this module, and hashlib costs 6 ms

    h = hashlib.sha256()
    for rel in sorted(files):
        size, sha = files[rel]
        if sha is None:
            return None
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def check_rel(rel: Any) -> str:
    """A relative path from a request: no absolute paths, no '..', no NUL; '' is the root."""
    if not isinstance(rel, str) or "\0" in rel or rel.startswith("/"):
        raise BadRequest(f"{rel!r} is not a relative path")
    if rel and any(part in ("", ".", "..") for part in rel.split("/")):
        raise BadRequest(f"{rel!r} is not a plain relative path")
    return rel


def target(root: str, rel: str) -> str:
    """The file ``rel`` names under ``root``, refusing anything that would land outside it
    (a symlinked folder inside dest pointing elsewhere)."""
    path = os.path.join(root, rel) if rel else root
    parent = os.path.realpath(os.path.dirname(path) if rel else os.path.dirname(root))
    base = os.path.realpath(root) if rel else os.path.realpath(os.path.dirname(root))
    if parent != base and not parent.startswith(base + os.sep):
        raise BadRequest(f"{rel!r} resolves outside {root}")
    return path


def part_name(path: str, sha: str) -> str:
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{PART_MARK}{sha[:16]}")


def hash_file(path: str, into: Any = None) -> str:
    import hashlib

    h = hashlib.sha256() if into is None else into
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def walk(root: str) -> tuple[dict[str, os.stat_result], dict[str, dict[str, int]]]:
    """(rel -> stat of each regular file, rel -> {sha16 of its target: bytes} of partial
    transfers).
    A root that is a file is the single entry "". Symlinks to files count as their target;
    our temporary and partial files are not content."""
    files: dict[str, os.stat_result] = {}
    parts: dict[str, dict[str, int]] = {}
    try:
        st = os.stat(root)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode):
        files[""] = st
    if st is None or files:
        # A single file's partial transfer sits beside it.
        folder, name = os.path.split(root)
        try:
            for other in os.listdir(folder or "."):
                if other.startswith(f".{name}{PART_MARK}"):
                    sha16 = other.split(PART_MARK, 1)[1]
                    parts.setdefault("", {})[sha16] = os.stat(os.path.join(folder, other)).st_size
        except OSError:
            pass
        return files, parts
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if TMP_MARK in name:
                continue
            if PART_MARK in name:
                real, sha16 = name[1:].split(PART_MARK, 1)
                key = real if rel_dir == "." else f"{rel_dir}/{real}"
                with contextlib.suppress(OSError):
                    parts.setdefault(key, {})[sha16] = os.stat(os.path.join(dirpath, name)).st_size
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files[rel] = st
    return files, parts


def load_cache(path: str | None) -> dict[str, Entry]:
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def save_cache(path: str, root: str, entries: dict[str, Entry], extra: Json | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = {"root": root, "files": entries, **(extra or {})}
    write_atomic(path, json.dumps(body, separators=(",", ":")).encode())


def scan(root: str, cache: str | None = None, budget: int | None = None) -> Json:
    """{exists, kind, files {rel: [size, sha256|None]}, parts {rel: {sha16: size}}, digest,
    hashed_bytes}. Files unchanged since the cache was written are not read; at most
    ``budget`` bytes are hashed (None: no limit). The cache is rewritten when it changed."""
    stats, parts = walk(root)
    known = load_cache(cache)
    entries: dict[str, Entry] = {}
    hashed = 0
    for rel, st in sorted(stats.items()):
        old = known.get(rel)
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        if isinstance(old, list) and len(old) == 4 and old[:3] == key and old[3]:
            entries[rel] = old
            continue
        sha = None
        if budget is None or hashed + st.st_size <= budget:
            try:
                sha = hash_file(os.path.join(root, rel) if rel else root)
                hashed += st.st_size
            except OSError:
                sha = None
        entries[rel] = [*key, sha]
    if cache is not None and entries != known and stats:
        # A read-only place: the next scan hashes again, nothing is wrong.
        with contextlib.suppress(OSError):
            save_cache(cache, root, entries)
    files = {rel: (e[0], e[3]) for rel, e in entries.items()}
    return {
        "exists": bool(stats) or os.path.isdir(root),
        "kind": "file" if "" in stats else "tree",
        "files": {rel: [size, sha] for rel, (size, sha) in files.items()},
        "parts": parts,
        "digest": digest(files) if stats else digest({}),
        "hashed_bytes": hashed,
    }


def remember(cache: str, root: str, written: dict[str, str], deleted: list[str]) -> str | None:
    """Put files just written (rel -> sha256 they were verified to have) into the cache, so
    the next scan does not read them again; forget deleted ones. The digest of what the cache
    now describes."""
    entries = load_cache(cache)
    for rel in deleted:
        entries.pop(rel, None)
    for rel, sha in written.items():
        try:
            st = os.stat(os.path.join(root, rel) if rel else root)
        except OSError:
            continue
        entries[rel] = [st.st_size, st.st_mtime_ns, st.st_ino, sha]
    save_cache(cache, root, entries)
    return digest({rel: (e[0], e[3]) for rel, e in entries.items()})


def free_bytes(path: str) -> Json:
    """{path, free_bytes, total_bytes} of the filesystem where ``path`` is (or would be): its
    nearest existing ancestor's."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    st = os.statvfs(probe)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return {"path": probe, "free_bytes": free, "total_bytes": total}


def cache_path(workdir: str, kind: str, root: str) -> str:
    """WORKDIR/files/<kind>-<sha16 of root>.json: a manifest (``dest``) or a source's cache."""
    import hashlib

    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    return os.path.join(workdir, "files", f"{kind}-{key}.json")
