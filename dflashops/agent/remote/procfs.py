"""/proc, read once per question: process stat fields, process groups, listening sockets."""

from __future__ import annotations

import os
import socket
import struct

from .common import Json, first_line

# Index i in proc_stat's list is field i + 3 of proc(5).
STATE, PPID, PGRP, SESSION, START_TIME = 0, 1, 2, 3, 19
DEAD = ("Z", "X")


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) <= START_TIME:
        return None
    return [x.decode("ascii", "replace") for x in fields]


def boot_id() -> str | None:
    return first_line("/proc/sys/kernel/random/boot_id")


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(65536)
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def has_env(pid: int, key: str, value: str) -> bool:
    """Whether the process was started with KEY=VALUE in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(4 * 1024 * 1024)
    except OSError:
        return False
    return f"\0{key}={value}\0".encode() in b"\0" + env + b"\0"


def scan(
    pgids: set[int], inodes: set[int]
) -> tuple[dict[int, list[tuple[int, int, int]]], dict[int, list[int]]]:
    """One pass over /proc: pgid -> [(pid, sid, start_time)] of live members of the groups
    asked for, and socket inode -> pids holding it. Either half is skipped when not asked for;
    processes we cannot read (or this one) are skipped."""
    groups: dict[int, list[tuple[int, int, int]]] = {g: [] for g in pgids}
    holders: dict[int, list[int]] = {}
    if not pgids and not inodes:
        return groups, holders
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return groups, holders
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        if pgids:
            stat = proc_stat(pid)
            if stat is not None and stat[STATE] not in DEAD and int(stat[PGRP]) in groups:
                groups[int(stat[PGRP])].append((pid, int(stat[SESSION]), int(stat[START_TIME])))
        if inodes:
            _socket_holders(name, pid, inodes, holders)
    return groups, holders


def _socket_holders(name: str, pid: int, inodes: set[int], holders: dict[int, list[int]]) -> None:
    fd_dir = f"/proc/{name}/fd/"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(fd_dir + fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in inodes:
                pids = holders.setdefault(inode, [])
                if pid not in pids:
                    pids.append(pid)


def decode_address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} prints addresses as native-endian 32-bit words in hex."""
    raw = b"".join(
        struct.pack("=I", int(hex_addr[i : i + 8], 16)) for i in range(0, len(hex_addr), 8)
    )
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listeners() -> list[Json]:
    """Listening TCP sockets: [{address, port, inode, pids: []}] (pids filled in by the caller)."""
    out: list[Json] = []
    seen = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                continue
            addr, _, port = cols[1].partition(":")
            key = (addr, port, int(cols[9]))
            if key in seen:
                continue
            seen.add(key)
            out.append(
                {
                    "address": decode_address(addr),
                    "port": int(port, 16),
                    "inode": key[2],
                    "pids": [],
                }
            )
    out.sort(key=lambda x: (x["port"], x["address"]))
    return out
