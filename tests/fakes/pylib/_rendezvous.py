"""The fakes' multi-node rendezvous over TCP, a stand-in for torch.distributed's (stdlib only).

Used by the fake SGLang (``sglang.launch_server --nnodes N``) and the fake ``torchrun``. Node 0,
the head, listens on HOST:PORT; every node R in 1..N-1 connects (retrying every
``RETRY_SECONDS`` until the head listens) and sends ``rank R of N\\n``. The head answers a
malformed line, a rank out of range or already in, another N, or any connection once all ranks
are in, with ``error REASON\\n`` and closes it; a connection that closes before sending a line
(a reachability check) is dropped without a word. A rank whose connection drops before the
others are in may join again. Once all of 1..N-1 are in, the head answers ``ok\\n`` to each of
them; the connections then stay open, and each fake decides what a dropped one means (see
``NCCL_LOST``). A node whose hello is refused or whose head hangs up before ``ok`` gets a
``DistNetworkError``. Neither side ever times out waiting: only SIGTERM/SIGINT (``Stop``) ends
the wait.
"""

from __future__ import annotations

import contextlib
import errno
import re
import select
import signal
import socket
import time
from typing import Any, Callable

RETRY_SECONDS = 0.2  # a node dials the head this often until it listens
POLL_SECONDS = 0.2  # how often a waiting node checks for SIGTERM/SIGINT
NCCL_LOST = (
    "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a "
    "network error"
)
_HELLO = re.compile(r"^rank (\d+) of (\d+)$")
_MAX_HELLO = 256  # bytes: a longer first line is not a rank's


class DistNetworkError(Exception):
    """The rendezvous failed; str() is the text after ``torch.distributed.DistNetworkError: ``."""


class Stop:
    """SIGTERM/SIGINT while a node waits: remembered (signal numbers), the loops check it."""

    def __init__(self) -> None:
        self.received: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)

    @property
    def name(self) -> str:
        """The first signal's name (``SIGTERM``); only once one was received."""
        return signal.Signals(self.received[0]).name


def nccl_lost(lost: str) -> str:
    """The line a node prints when the connection to ``lost`` (a description) dropped."""
    return f"{NCCL_LOST}: lost {lost}"


def hangup(sock: socket.socket) -> bool:
    """Read what the peer sent (ignored) and tell whether its connection is gone."""
    try:
        return not sock.recv(4096)
    except OSError:
        return True


def _first_line(sock: socket.socket, pending: dict[socket.socket, bytes]) -> str | None:
    """Read on into ``pending[sock]``: the first line once complete, and sock leaves ``pending``.

    None while the line is incomplete, and when the peer left without one (sock is closed then).
    """
    try:
        data = sock.recv(_MAX_HELLO)
    except OSError:
        data = b""
    buffered = pending[sock] + data
    if data and b"\n" not in buffered and len(buffered) <= _MAX_HELLO:
        pending[sock] = buffered
        return None
    del pending[sock]
    if not data and b"\n" not in buffered:
        sock.close()
        return None
    return buffered.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


def _reject(sock: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(f"error {reason}\n".encode())
    sock.close()


# --------------------------------------------------------------------------- the head


def listen(host: str, port: int) -> socket.socket:
    """The head's listening socket on exactly host:port; DistNetworkError when it cannot be."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(64)
    except OSError as exc:
        listener.close()
        code = exc.errno or 0
        name = errno.errorcode.get(code, type(exc).__name__)
        message = (exc.strerror or str(exc)).lower()
        raise DistNetworkError(
            "The server socket has failed to listen on any local network address. "
            f"host: {host}, port: {port}, useIpv6: false, "
            f"code: {-code}, name: {name}, message: {message}"
        ) from None
    return listener


def _hello(line: str, nnodes: int, joined: dict[int, socket.socket]) -> tuple[int, str]:
    """The rank a node's first line announces, or (-1, why it is refused)."""
    m = _HELLO.match(line)
    if not m:
        return -1, f"expected 'rank R of N', got {line[:80]!r}"
    rank, n = int(m.group(1)), int(m.group(2))
    if n != nnodes:
        return -1, f"nnodes mismatch: the head has --nnodes {nnodes}, rank {rank} says {n}"
    if not 0 < rank < nnodes:
        return -1, f"rank {rank} is out of range: workers are ranks 1..{nnodes - 1}"
    if rank in joined:
        return -1, f"duplicate rank {rank}: it has already joined"
    return rank, ""


def gather(
    listener: socket.socket,
    nnodes: int,
    stop: Stop,
    pending: dict[socket.socket, bytes],
    refused: Callable[[str], None],
) -> dict[int, socket.socket] | None:
    """Every node's connection by rank once all of 1..nnodes-1 are in; None on SIGTERM/SIGINT.

    ``refused(why)`` is called for each refused rank (a well-formed ``rank R of N`` that cannot
    be admitted; other callers are answered but not reported). ``pending`` collects the
    connections whose first line is not complete yet; those left at the end are for
    ``serve_late`` to refuse.
    """
    joined: dict[int, socket.socket] = {}
    while len(joined) < nnodes - 1:
        if stop.received:
            for sock in [*pending, *joined.values()]:
                sock.close()
            return None
        watched = [listener, *pending, *joined.values()]
        for sock in select.select(watched, [], [], POLL_SECONDS)[0]:
            if sock is listener:
                with contextlib.suppress(OSError):
                    pending[listener.accept()[0]] = b""
            elif sock in pending:
                line = _first_line(sock, pending)
                if line is None:
                    continue
                rank, why = _hello(line, nnodes, joined)
                if rank < 0:
                    if _HELLO.match(line):
                        refused(why)
                    _reject(sock, why)
                else:
                    joined[rank] = sock
            elif hangup(sock):  # a node left before the others were in: it may come back
                rank = next(r for r, s in joined.items() if s is sock)
                del joined[rank]
                sock.close()
    for sock in joined.values():
        with contextlib.suppress(OSError):
            sock.sendall(b"ok\n")
    return joined


def serve_late(
    sock: socket.socket, listener: socket.socket, pending: dict[socket.socket, bytes]
) -> bool:
    """After the rendezvous: if ``sock`` (readable) is the listener or a late caller, handle it.

    A late caller is answered ``error rendezvous complete: ...`` once its line is read (so it
    gets the answer, not a reset). False when ``sock`` is neither (one of the joined nodes').
    """
    if sock is listener:
        with contextlib.suppress(OSError):
            pending[listener.accept()[0]] = b""
        return True
    if sock in pending:
        if _first_line(sock, pending) is not None:
            _reject(sock, "rendezvous complete: every rank has joined")
        return True
    return False


# --------------------------------------------------------------------------- the other nodes


def read_line(sock: socket.socket, stop: Stop) -> str | None:
    """The peer's next line ('' when it closed the connection); None on SIGTERM/SIGINT."""
    buffered = b""
    while b"\n" not in buffered:
        if stop.received:
            return None
        if not select.select([sock], [], [], POLL_SECONDS)[0]:
            continue
        try:
            data = sock.recv(_MAX_HELLO)
        except OSError:
            data = b""
        if not data:
            return ""
        buffered += data
    return buffered.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


def join(
    host: str, port: int, rank: int, nnodes: int, stop: Stop, addr: str | None = None
) -> socket.socket | None:
    """Node ``rank``'s connection to the head once everyone is in; None on SIGTERM/SIGINT.

    Dials host:port every RETRY_SECONDS until the head listens. DistNetworkError when the head
    refuses the rank or hangs up first; its message names the head as ``addr`` (HOST:PORT).
    """
    addr = addr or f"{host}:{port}"
    sock = None
    while sock is None:
        if stop.received:
            return None
        try:
            sock = socket.create_connection((host, port), timeout=2.0)
        except OSError:
            time.sleep(RETRY_SECONDS)  # a signal cuts it short only by running its handler
    try:
        sock.settimeout(None)
        with contextlib.suppress(OSError):  # the head hung up: the reply says so
            sock.sendall(f"rank {rank} of {nnodes}\n".encode())
        reply = read_line(sock, stop)
    except BaseException:
        sock.close()
        raise
    if reply == "ok":
        return sock
    sock.close()
    if reply is None:
        return None
    if reply.startswith("error "):
        raise DistNetworkError(
            f"rank {rank} of {nnodes}: the rendezvous at {addr} refused it: {reply[6:]}"
        )
    raise DistNetworkError(
        f"rank {rank} of {nnodes}: the head at {addr} closed the connection before every rank "
        "had joined"
    )


def watch(
    listener: socket.socket,
    joined: dict[int, socket.socket],
    pending: dict[socket.socket, bytes],
    nnodes: int,
    closing: Any,
    on_lost: Callable[[str], None],
) -> None:
    """While the head serves (a thread): refuse late ranks; a lost worker calls ``on_lost``
    with its description (the fake prints its error and ends the process). Ends when
    ``closing`` (a threading.Event) is set or the sockets are closed under it."""
    ranks = {sock: rank for rank, sock in joined.items()}
    while not closing.is_set():
        try:
            readable = select.select([listener, *pending, *ranks], [], [], 0.5)[0]
        except (OSError, ValueError):  # closed under us: the head is exiting
            return
        for sock in readable:
            if serve_late(sock, listener, pending):
                continue
            if hangup(sock) and not closing.is_set():
                on_lost(f"node_rank {ranks[sock]} of nnodes {nnodes} (its connection closed)")
