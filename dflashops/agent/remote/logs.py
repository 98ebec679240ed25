"""Unit logs: a new timestamped file per start, current.log pointing at it, rotation, tails,
and the two lines read back from a log's head (dflashops' banner, vLLM's own arguments)."""

from __future__ import annotations

import os
import re
import time

from . import layout
from .common import TMP_MARK, Json, remove

LOG_RE = re.compile(r"^(\d{8}T\d{6}Z)(?:-(\d+))?\.log$")
TAIL_MAX = 1024 * 1024  # bytes of log per tail
BANNER_PREFIX = "[dflashops] unit="
BANNER_LINES = 64
SERVER_ARGS_MARKER = "non-default args: "  # vLLM logs what it parsed: its own report of TP/DP


def _key(name: str) -> tuple[str, int] | None:
    m = LOG_RE.fullmatch(name)
    return None if m is None else (m.group(1), int(m.group(2) or 0))


def open_new(log_dir: str) -> tuple[str, int]:
    """Create ``logs/<UTC time>[-N].log`` (never an existing file); (name, fd)."""
    # The host user's alone (DESIGN trust 4): a unit's log may hold what it was given.
    os.makedirs(log_dir, 0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    # After the newest of this second, never a name freed by rotation: names sort in time order
    # (logs rotated by size come several a second).
    same = [key[1] for key in map(_key, os.listdir(log_dir)) if key and key[0] == stamp]
    n = max(same) + 1 if same else 0
    while True:
        name = f"{stamp}.log" if n == 0 else f"{stamp}-{n}.log"
        try:
            return name, os.open(os.path.join(log_dir, name), flags, 0o600)
        except FileExistsError:
            n += 1


def point_current(log_dir: str, name: str) -> None:
    """current.log -> name, atomically. A regular file in its place (not ours) is kept aside."""
    current = os.path.join(log_dir, layout.CURRENT_LOG)
    if os.path.lexists(current) and not os.path.islink(current):
        os.replace(current, os.path.join(log_dir, f"{layout.CURRENT_LOG}.{int(time.time())}.kept"))
    tmp = os.path.join(log_dir, f".{layout.CURRENT_LOG}{TMP_MARK}{os.getpid()}")
    remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, current)


def rotate(log_dir: str, keep: int, current: str) -> list[str]:
    """Delete the oldest timestamped logs beyond ``keep`` (never ``current``); names deleted."""
    logs = []
    for name in os.listdir(log_dir):
        key = _key(name)
        if key is not None and name != current and os.path.isfile(os.path.join(log_dir, name)):
            logs.append((key, name))
    logs.sort()
    deleted = []
    for _, name in logs[: max(0, len(logs) + 1 - keep)]:  # + the new current, which stays
        try:
            os.unlink(os.path.join(log_dir, name))
            deleted.append(name)
        except OSError:
            pass
    return deleted


def new_log(unit_dir: str, keep: int) -> tuple[str, int]:
    """A fresh log for a start, pointed at by current.log, old ones rotated: (name, fd)."""
    log_dir = os.path.join(unit_dir, layout.LOGS)
    name, fd = open_new(log_dir)
    try:
        point_current(log_dir, name)
        rotate(log_dir, keep, name)
    except BaseException:
        os.close(fd)
        raise
    return name, fd


def current(unit_dir: str) -> tuple[str | None, str | None]:
    """('logs/<name>', absolute path) of what current.log points at, or (None, None)."""
    log_dir = os.path.join(unit_dir, layout.LOGS)
    link = os.path.join(log_dir, layout.CURRENT_LOG)
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None, None
    except OSError:  # not a symlink: a plain file under that name
        return (
            (f"{layout.LOGS}/{layout.CURRENT_LOG}", link) if os.path.isfile(link) else (None, None)
        )
    name = os.path.basename(target)
    return f"{layout.LOGS}/{name}", os.path.join(log_dir, name)


def summary(unit_dir: str) -> Json:
    """{count, current, current_size, current_mtime} for facts."""
    out: Json = {"count": 0, "current": None, "current_size": None, "current_mtime": None}
    try:
        entries = list(os.scandir(os.path.join(unit_dir, layout.LOGS)))
    except OSError:
        return out
    for entry in entries:
        if entry.name == layout.CURRENT_LOG:
            try:
                out["current"] = os.readlink(entry.path) if entry.is_symlink() else entry.name
                st = os.stat(entry.path)
                out["current_size"], out["current_mtime"] = st.st_size, st.st_mtime
            except OSError:
                pass
        elif entry.name.endswith(".log") and entry.is_file(follow_symlinks=False):
            out["count"] += 1
    return out


def head_lines(path: str, count: int, limit: int = 64 * 1024) -> list[str]:
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", "replace").splitlines()[:count]


def tail_bytes(path: str, count: int, limit: int = TAIL_MAX) -> tuple[bytes, int]:
    """The bytes of the last ``count`` lines (at most ``limit``) and the file size read."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if count <= 0:
            return b"", size
        pos = size
        data = b""
        while pos > 0 and len(data) < limit:
            step = min(64 * 1024, pos, limit - len(data))
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
            if data.count(b"\n") > count:  # count + 1: the last line may lack its newline
                break
    return b"".join(data.splitlines(keepends=True)[-count:]), size


def tail_lines(unit_dir: str, count: int) -> list[str] | None:
    _, path = current(unit_dir)
    if path is None:
        return None
    try:
        data, _ = tail_bytes(path, count)
    except OSError:
        return None
    return data.decode("utf-8", "replace").splitlines()


def complete_utf8(data: bytes) -> bytes:
    """``data`` without a trailing, incomplete UTF-8 sequence (it comes whole next time)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


def parse_banner(line: str) -> Json:
    """``[dflashops] unit=NAME fingerprint=HEX engine=E tp=N dp=N port=P gpus=G started=ISO``."""
    out: Json = {"line": line}
    for token in line[len("[dflashops] ") :].split():
        key, eq, value = token.partition("=")
        if eq:
            out[key] = value
    for key in ("tp", "dp", "port", "rank", "nnodes"):
        if key in out:
            out[key] = int(out[key]) if out[key].isdigit() else None
    if "gpus" in out:
        out["gpus"] = [int(p) for p in out["gpus"].split(",") if p.strip().isdigit()]
    return out


def read_banner(path: str) -> Json | None:
    for line in head_lines(path, BANNER_LINES):
        if line.startswith(BANNER_PREFIX):
            return parse_banner(line.rstrip())
    return None


def read_server_args(path: str) -> str | None:
    """The text after vLLM's `non-default args: ` in the head of the log, if any."""
    for line in head_lines(path, 400, 256 * 1024):
        at = line.find(SERVER_ARGS_MARKER)
        if at >= 0:
            return line[at + len(SERVER_ARGS_MARKER) :].strip()[:16384]
    return None
