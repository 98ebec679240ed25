"""/proc, read once per question: process stat fields, process groups, listening sockets."""

from __future__ import annotations

import os
import socket
import struct

from . import layout
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
    # Only the fields up to the start time are ever read: a scan of /proc does this per process.
    fields = raw[raw.rfind(b")") + 2 :].split(None, START_TIME + 1)
    if len(fields) <= START_TIME:
        return None
    return [x.decode("ascii", "replace") for x in fields[: START_TIME + 1]]


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
    processes we cannot read (or this one) are skipped. File descriptors (the dear part: one
    readlink per fd) are read first in the groups' members, where a unit's sockets are, and
    in the other processes only while some socket's holder is still unknown."""
    groups: dict[int, list[tuple[int, int, int]]] = {g: [] for g in pgids}
    holders: dict[int, list[int]] = {}
    if not pgids and not inodes:
        return groups, holders
    me = os.getpid()
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != me]
    except OSError:
        return groups, holders
    if pgids:
        for pid in pids:
            stat = proc_stat(pid)
            if stat is not None and stat[STATE] not in DEAD and int(stat[PGRP]) in groups:
                groups[int(stat[PGRP])].append((pid, int(stat[SESSION]), int(stat[START_TIME])))
    if inodes:
        members = [m[0] for group in groups.values() for m in group]
        for pid in members:
            _socket_holders(pid, inodes, holders)
        if len(holders) < len(inodes):
            seen = set(members)
            for pid in pids:
                if pid not in seen:
                    _socket_holders(pid, inodes, holders)
    return groups, holders


def _socket_holders(pid: int, inodes: set[int], holders: dict[int, list[int]]) -> None:
    fd_dir = f"/proc/{pid}/fd/"
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
    """Listening TCP sockets: [{address, port, inode, pids: []}] (pids filled in by the caller),
    asked of the kernel over netlink (sock_diag: only listeners, however many connections the
    host has), else read from /proc/net/tcp{,6} (every socket, each formatted as text)."""
    try:
        out = _diag_listeners()
    except (OSError, ValueError, struct.error):
        out = _proc_listeners()
    out.sort(key=lambda x: (x["port"], x["address"]))
    return out


def _diag_listeners() -> list[Json]:
    """sock_diag(7): one dump per address family, filtered to TCP_LISTEN in the kernel."""
    netlink_sock_diag, sock_diag_by_family, done, error = 4, 20, 3, 2
    flags = 0x1 | 0x300  # NLM_F_REQUEST | NLM_F_DUMP
    out: list[Json] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, netlink_sock_diag) as sock:
        sock.settimeout(5.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            # inet_diag_req_v2: family, protocol, ext, pad, states (1 << TCP_LISTEN), sockid
            req = struct.pack("=BBBBI48x", family, socket.IPPROTO_TCP, 0, 0, 1 << 10)
            sock.send(
                struct.pack("=IHHII", 16 + len(req), sock_diag_by_family, flags, seq, 0) + req
            )
            finished = False
            while not finished:
                data = sock.recv(1 << 16)
                if not data:
                    raise ValueError("netlink closed")
                at = 0
                while at + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, at)
                    if length < 16:
                        raise ValueError("bad netlink message")
                    if kind == done:
                        finished = True
                        break
                    if kind == error:
                        raise ValueError("sock_diag refused the dump")
                    # inet_diag_msg: family, state, timer, retrans, sockid(sport, dport, src, ...),
                    # expires, rqueue, wqueue, uid, inode
                    body = at + 16
                    port = struct.unpack_from("!H", data, body + 4)[0]
                    raw = data[body + 8 : body + 8 + (4 if family == socket.AF_INET else 16)]
                    inode = struct.unpack_from("=I", data, body + 68)[0]
                    address = socket.inet_ntop(family, raw)
                    out.append({"address": address, "port": port, "inode": inode, "pids": []})
                    at += (length + 3) & ~3
    return out


def _proc_listeners() -> list[Json]:
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
    return out


# -- who holds a port -----------------------------------------------------------------------

HOLDERS_SHOWN = 3  # a forking server shares its socket with its workers: the first few say it
CMDLINE_SHOWN = 2048  # characters of a holder's command line sent (the controller shortens it)


def describe_holders(
    listening: list[Json], wanted: set[int] | None, ours: set[int], workdir: str
) -> None:
    """For each listener asked about (``wanted``; None: all) that is not all this workdir's
    units' (``ours``; the common case costs nothing): ``holders``, each holder's pid, command
    line and, for a dflashops unit of any workdir, which one; with no holder this user can
    see, ``user``: the socket owner's name."""
    for entry in listening:
        if wanted is not None and entry["port"] not in wanted:
            continue
        pids = entry["pids"]
        if not pids:
            entry["user"] = user_name(socket_uid(entry["inode"]))
        elif not set(pids) <= ours:
            entry["holders"] = [holder(pid, workdir) for pid in pids[:HOLDERS_SHOWN]]


def holder(pid: int, workdir: str) -> Json:
    """A process holding a port: pid, command line, and the dflashops unit it is, if it is one
    (``unit``, ``workdir``, ``this_workdir``). A unit's engine gets DFLASHOPS_WORKDIR and
    DFLASHOPS_UNIT from its launch script, which runs in units/NAME as its supervisor does; an
    engine that cleared its environment is still found by its folder or its group leader's."""
    args: list[str] = []
    size = 0
    for arg in cmdline(pid):
        args.append(arg[: CMDLINE_SHOWN - size])
        size += len(arg) + 1
        if size >= CMDLINE_SHOWN:
            break
    where, unit = _unit_of(pid)
    this = where is not None and _same_path(where, os.path.expanduser(workdir))
    return {"pid": pid, "cmdline": args, "unit": unit, "workdir": where, "this_workdir": this}


def _unit_of(pid: int) -> tuple[str | None, str | None]:
    env = environ_of(pid, ("DFLASHOPS_WORKDIR", "DFLASHOPS_UNIT"))
    if env.get("DFLASHOPS_WORKDIR") and env.get("DFLASHOPS_UNIT"):
        return env["DFLASHOPS_WORKDIR"], env["DFLASHOPS_UNIT"]
    stat = proc_stat(pid)
    for who in (pid, int(stat[PGRP]) if stat else pid):
        try:
            folder = os.readlink(f"/proc/{who}/cwd")
        except OSError:
            continue
        units, name = os.path.split(folder)
        if os.path.basename(units) == layout.UNITS and os.path.isfile(
            os.path.join(folder, layout.UNIT_RECORD)
        ):
            return os.path.dirname(units), name
    return None, None


def environ_of(pid: int, keys: tuple[str, ...]) -> dict[str, str]:
    """The values of ``keys`` in the process's environment (those it has)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(4 * 1024 * 1024)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        name = key.decode("utf-8", "replace")
        if name in keys:
            out[name] = value.decode("utf-8", "replace")
    return out


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def socket_uid(inode: int) -> int | None:
    """The owner of a socket whose holder this user cannot see: /proc/net/tcp{,6} say it
    (read only then: a foreign holder is rare, and the tables can be long)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] == str(inode):
                        return int(cols[7])
        except (OSError, ValueError):
            continue
    return None


def user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"
