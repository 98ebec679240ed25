"""Small helpers every action uses: errors as text, JSON files read and written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time

TYPE_CHECKING = False  # typing costs the host ~5 ms per call; annotations need no import
if TYPE_CHECKING:
    from typing import Any

    Json = dict[str, Any]
else:
    Json = dict


SMALL_FILE_MAX = 1024 * 1024  # unit.json, pid, exit, stopped: anything bigger is not ours
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
TMP_MARK = ".dflashops-tmp."  # in the name of every temporary file the agent writes


class BadRequest(ValueError):
    """The request itself is malformed: the agent exits 2 and does nothing."""


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_json_object(path: str, limit: int = SMALL_FILE_MAX) -> Json | None:
    """The JSON object in ``path``; None when the file does not exist; ValueError when broken."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    if len(data) > limit:
        raise ValueError(f"larger than {limit // 1024} KiB")
    try:
        value = json.loads(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (got {type(value).__name__})")
    return value


def write_atomic(path: str, data: bytes, mode: int = 0o644) -> None:
    """``data`` at ``path`` or nothing: a temporary file beside it, then a rename."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}{TMP_MARK}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # the umask may have narrowed it
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def make_private_dirs(path: str) -> None:
    """``path`` and every missing folder above it, each created 0700 (not chmod'ed after)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)


def private_dir(path: str) -> None:
    """``path``, a folder only its owner enters (DESIGN trust 4): made 0700, or tightened when
    it exists with more, as older versions left workdirs. A folder that is not ours, or shared
    on purpose (sticky, like /tmp), is left as it is."""
    import stat

    make_private_dirs(path)
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        os.chmod(path, 0o700)


def write_json_atomic(path: str, obj: Json, mode: int = 0o600) -> None:
    """Unit records (pid, exit, stopped, supervisor state) are the host user's alone."""
    write_atomic(path, json.dumps(obj).encode(), mode)


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sha256_file(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def which(name: str) -> str | None:
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def number(value: Any, what: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise BadRequest(f"{what} must be a number >= {minimum:g}")
    return float(value)


def integer(value: Any, what: str, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        raise BadRequest(f"{what} must be an integer >= {minimum}")
    return int(value)


def unit_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise BadRequest(f"{what} must be a unit name ([a-z0-9][a-z0-9-]*), got {value!r}")
    return value


def host_path(request: Json, key: str, optional: bool = False) -> str | None:
    """``request[key]`` as an absolute path here (``~`` expanded); BadRequest otherwise."""
    value = request.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not os.path.isabs(os.path.expanduser(value)):
        raise BadRequest(f"{key} must be an absolute path")
    request[key] = os.path.abspath(os.path.expanduser(value))
    return str(request[key])


def unit_list(request: Json) -> list[Json]:
    """``request["units"]``: objects with distinct valid names."""
    units = request.get("units")
    if not isinstance(units, list) or not all(isinstance(u, dict) for u in units):
        raise BadRequest("units must be a list of objects")
    seen = set()
    for i, u in enumerate(units):
        name = unit_name(u.get("name"), f"units[{i}].name")
        if name in seen:
            raise BadRequest(f"unit {name} is listed twice")
        seen.add(name)
    return units
