"""Test helpers every kind of test uses, written once: /proc reads, free loopback ports, waiting.

Importable as ``tests.procs`` from unit and integration tests alike (the repo root is on
sys.path because tests/ is a package).
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

# /proc/PID/stat fields after the command name: index i is field i + 3 of proc(5).
STATE, PPID, PGRP, SESSION, START_TIME = 0, 1, 2, 3, 19


def stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def alive(pid: int) -> bool:
    st = stat(pid)
    return st is not None and st[STATE] not in ("Z", "X")


def start_time(pid: int) -> int:
    st = stat(pid)
    assert st is not None, f"pid {pid} is gone"
    return int(st[START_TIME])


def pgid_of(pid: int) -> int | None:
    st = stat(pid)
    return None if st is None else int(st[PGRP])


def all_pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def group_members(pgid: int, since: int = 0, session: bool = False) -> list[int]:
    """Live members of process group ``pgid`` started at or after ``since`` (with
    ``session``: only those in session ``pgid`` too, as a dflashops unit's are)."""
    out = []
    for pid in all_pids():
        st = stat(pid)
        if (
            st is not None
            and st[STATE] not in ("Z", "X")
            and int(st[PGRP]) == pgid
            and (not session or int(st[SESSION]) == pgid)
            and int(st[START_TIME]) >= since
        ):
            out.append(pid)
    return sorted(out)


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 20.0, every: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


# ---------------------------------------------------------------------------------- ports

# Below the kernel's ephemeral range (32768+), where sshd and client sockets take their ports,
# and below the engines' default ports (30000+) that other tests may use as they are.
_PORT_LOW, _PORT_HIGH = 20000, 29900
_PORT_LOCK = threading.Lock()
_PORTS_TAKEN: set[int] = set()


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` on any address (a wildcard bind fails if any address has it:
    all fleet hosts share one network namespace)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.bind((address, port))
        except OSError:
            if family == socket.AF_INET6:
                continue  # no IPv6 here: the IPv4 check stands
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive free ports, never handed out twice in this process
    (xdist workers draw from different random sequences)."""
    with _PORT_LOCK:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(500):
            base = rng.randrange(_PORT_LOW, _PORT_HIGH - count)
            ports = range(base, base + count)
            if any(p in _PORTS_TAKEN for p in ports):
                continue
            if all(port_free(p) for p in ports):
                _PORTS_TAKEN.update(ports)
                return base
    raise RuntimeError("no free port range found")


def free_port() -> int:
    return free_ports(1)


def http_status(port: int, path: str, key: str | None = None, timeout: float = 5.0) -> int:
    """The HTTP status of GET 127.0.0.1:PORT/PATH (with a Bearer ``key`` if given)."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def mode(path: Path) -> int:
    """The permission bits of ``path`` itself (a link is not followed)."""
    import stat as modes  # this module's own stat() reads /proc

    return modes.S_IMODE(path.lstat().st_mode)


class Receiver:
    """A local webhook: every POST body, parsed. Its URL ends in ``token``, a secret that no
    output may show."""

    def __init__(self, token: str = "T0K3N-abc") -> None:
        self.notices: list[dict[str, Any]] = []
        notices = self.notices

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                notices.append(json.loads(self.rfile.read(size)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/{token}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def events(self, unit: str | None = None) -> list[str]:
        return [n["event"] for n in self.notices if unit is None or n["unit"] == unit]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
