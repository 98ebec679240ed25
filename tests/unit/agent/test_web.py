"""The host agent's HTTP client (``remote/web.py``) against real loopback servers.

Every probe, liveness check, metrics scrape and ``wait`` goes through ``web.request``: a few
lines of HTTP/1.1 over a raw socket, so what it makes of each way a server can answer (or not)
is what the controller is told about a unit. The servers here are raw ``socket`` servers in
threads, so each test decides exactly which bytes go on the wire and when the connection
ends; nothing is mocked. A server that holds its connection open proves the client knew on its
own where the body ended (it would otherwise sit until its timeout).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dflashops.agent.remote import web
from tests.conftest import needs_ipv6

Handler = Callable[["Server", socket.socket], None]
LONG = 5.0  # a timeout no passing test comes near: reaching it means the client waited


class Server:
    """A TCP server on loopback: each connection it accepts is handed to ``handler`` in a
    thread; what clients sent is kept in ``requests``. Handlers that keep a connection open
    wait on ``release``, set when the test ends."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.sock.settimeout(0.05)  # accept() polls, so close() can end the loop
        self.port: int = self.sock.getsockname()[1]
        self.handler = handler
        self.requests: list[bytes] = []
        self.release = threading.Event()
        self.stopped = False
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(LONG * 2)  # a handler never outlives a broken test for long
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        # OSError: the client hung up first (it had read all it wanted)
        with conn, contextlib.suppress(OSError):
            self.handler(self, conn)

    def close(self) -> None:
        self.release.set()
        self.stopped = True
        self.accepter.join(5)
        self.sock.close()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(handler: Handler, host: str = "127.0.0.1") -> Server:
        server = Server(handler, host)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def read_request(conn: socket.socket) -> bytes:
    """One whole request: its head, and its body when it has a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def reply(data: bytes, *, hold: bool = False, trickle: bool = False) -> Handler:
    """Read the request, send ``data`` (``trickle``: one byte per TCP segment), then close, or
    ``hold`` the connection open until the test ends."""

    def handle(server: Server, conn: socket.socket) -> None:
        server.requests.append(read_request(conn))
        if trickle:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(data)):
                conn.sendall(data[i : i + 1])
                time.sleep(0.001)
        else:
            conn.sendall(data)
        if hold:
            server.release.wait(LONG * 2)

    return handle


def silent(server: Server, conn: socket.socket) -> None:
    """Accept, read the request, never answer."""
    server.requests.append(read_request(conn))
    server.release.wait(LONG * 2)


def get(port: int, path: str = "/", **kw: Any) -> tuple[dict[str, Any], float]:
    """``web.request`` to 127.0.0.1 (timeout LONG unless given) and how long it took."""
    kw.setdefault("timeout", LONG)
    started = time.monotonic()
    out = web.request("127.0.0.1", port, path, **kw)
    return out, time.monotonic() - started


def ok(body: bytes) -> dict[str, Any]:
    return {"status": 200, "error": None, "body": body}


def failed(error: str) -> dict[str, Any]:
    return {"status": None, "error": error, "body": None}


def head_of(port: int, host: str = "127.0.0.1") -> bytes:
    return f"Host: {host}:{port}\r\nConnection: close\r\nAccept: application/json\r\n".encode()


# ------------------------------------------------------------------------------ the request


def test_request_bytes_on_the_wire(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    out, _ = get(server.port, "/health?x=1")
    assert out == ok(b"")
    assert server.requests == [b"GET /health?x=1 HTTP/1.1\r\n" + head_of(server.port) + b"\r\n"]


def test_callers_headers_reach_the_server(serve: Callable[..., Server]) -> None:
    """A unit's headers (its API key) are sent, and replace a default of the same name."""
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    headers = {"Authorization": "Bearer sk-test-123", "Accept": "text/plain"}
    out, _ = get(server.port, "/v1/models", headers=headers, limit=10)
    assert out == ok(b"ok")
    assert server.requests == [
        b"GET /v1/models HTTP/1.1\r\n"
        + f"Host: 127.0.0.1:{server.port}\r\nConnection: close\r\nAccept: text/plain\r\n".encode()
        + b"Authorization: Bearer sk-test-123\r\n\r\n"
    ]


def test_post_sends_its_body_as_json(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"))
    out, _ = get(server.port, "/notify", method="POST", body=b'{"a": 1}')
    assert out == {"status": 202, "error": None, "body": b""}
    assert server.requests == [
        b"POST /notify HTTP/1.1\r\n"
        + head_of(server.port)
        + b"Content-Type: application/json\r\nContent-Length: 8\r\n\r\n"
        + b'{"a": 1}'
    ]
    # a Content-Type of the caller's own is kept
    out, _ = get(server.port, "/n", method="PUT", body=b"x", headers={"Content-Type": "text/plain"})
    assert out["status"] == 202
    assert b"Content-Type: text/plain\r\nContent-Length: 1\r\n\r\nx" in server.requests[1]
    assert server.requests[1].count(b"Content-Type") == 1


@needs_ipv6
def test_ipv6_host_is_bracketed(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nsix"), host="::1")
    out = web.request("::1", server.port, "/", timeout=LONG, limit=10)
    assert out == ok(b"six")
    assert server.requests[0].startswith(b"GET / HTTP/1.1\r\n" + head_of(server.port, "[::1]"))


# ------------------------------------------------------------------------------ bodies


def test_content_length_body(serve: Callable[..., Server]) -> None:
    """The body ends at its Content-Length even though the server keeps the connection."""
    server = serve(
        reply(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
            b'{"ok":true}',
            hold=True,
        )
    )
    out, took = get(server.port, limit=1000)
    assert out == ok(b'{"ok":true}')
    assert took < LONG / 2


def test_content_length_ignores_what_follows_the_body(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloEXTRA BYTES"))
    assert get(server.port, limit=100)[0] == ok(b"hello")


def test_default_limit_reads_one_byte(serve: Callable[..., Server]) -> None:
    """A health check (limit 0) gets at most limit + 1 = 1 byte of the body."""
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"))
    assert get(server.port)[0] == ok(b"h")


def test_body_over_the_limit_is_cut_at_limit_plus_one(serve: Callable[..., Server]) -> None:
    """limit + 1 bytes come back, so the caller can tell "too big" from "exactly limit"; the
    client stops reading there (the server keeps the connection and has more to say)."""
    body = bytes(range(256)) * 40
    server = serve(
        reply(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body, hold=True)
    )
    out, took = get(server.port, limit=10)
    assert out == ok(body[:11])
    assert took < LONG / 2
    exact = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + body[:10]))
    assert get(exact.port, limit=10)[0] == ok(body[:10])


def test_close_delimited_body(serve: Callable[..., Server]) -> None:
    """No length, not chunked: the body is whatever comes until the server closes."""
    body = b"line one\nline two\n" * 1000
    server = serve(reply(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + body))
    assert get(server.port, limit=1 << 20)[0] == ok(body)


def test_close_delimited_body_over_the_limit(serve: Callable[..., Server]) -> None:
    """Past limit + 1 bytes the client stops reading without waiting for the close."""
    server = serve(reply(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 5000, hold=True))
    out, took = get(server.port, limit=99)
    assert out == ok(b"x" * 100)
    assert took < LONG / 2


def test_empty_body_and_a_bare_status_line(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 204\r\n\r\n"))
    assert get(server.port, limit=10)[0] == {"status": 204, "error": None, "body": b""}


def test_an_error_status_is_not_an_error(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 7\r\n\r\nloading"))
    assert get(server.port, limit=100)[0] == {"status": 503, "error": None, "body": b"loading"}


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n"
    b"1;name=value\r\n \r\n"  # a chunk extension
    b"A\r\n0123456789\r\n"  # hex, upper case
    b"7\r\n0\r\n\r\nab\r\n"  # a chunk whose data looks like the last chunk
    b"0\r\nX-Trailer: done\r\n\r\n"  # the last chunk, and a trailer
)


@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "byte-by-byte"])
def test_chunked_body(serve: Callable[..., Server], trickle: bool) -> None:
    """Chunks are joined; the body ends at the last chunk although the server keeps the
    connection (byte-by-byte: the end is found whatever the reads' boundaries)."""
    server = serve(reply(CHUNKED, hold=True, trickle=trickle))
    out, took = get(server.port, limit=1000)
    assert out == ok(b"hello 01234567890\r\n\r\nab")
    assert took < LONG / 2


@pytest.mark.parametrize("size", [b"-6", b"+5", b"0x5", b"5_0", b"zz", b" "])
def test_a_chunk_size_that_is_not_plain_hex_ends_the_body(
    serve: Callable[..., Server], size: bytes
) -> None:
    """What came before it is kept; int() would accept "-6" (and then read the same line
    forever: a CPU loop no socket timeout ends) or "0x5"."""
    body = b"5\r\nhello\r\n" + size + b"\r\nworld\r\n0\r\n\r\n"
    server = serve(
        reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body, hold=True)
    )
    out, took = get(server.port, limit=100)
    assert out == ok(b"hello") and took < LONG / 2


def trickling(server: Server, conn: socket.socket) -> None:
    """A status line, then one header byte every 0.05 s, for ever (until the test ends)."""
    server.requests.append(read_request(conn))
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not server.release.wait(0.05):
        conn.sendall(b"x")


def test_the_timeout_bounds_the_whole_request_not_each_read(serve: Callable[..., Server]) -> None:
    server = serve(trickling)
    out, took = get(server.port, timeout=0.3)
    assert out == failed("timed out") and took < 1.0


def test_chunked_header_any_case(serve: Callable[..., Server]) -> None:
    server = serve(
        reply(b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    )
    assert get(server.port, limit=10)[0] == ok(b"abc")


def test_chunked_wins_over_content_length(serve: Callable[..., Server]) -> None:
    server = serve(
        reply(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nabcd\r\n0\r\n\r\n"
        )
    )
    assert get(server.port, limit=10)[0] == ok(b"abcd")


def test_chunked_body_over_the_limit(serve: Callable[..., Server]) -> None:
    """A chunked body is read to its end, then cut at limit + 1."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (100, bytes([65 + i]) * 100) for i in range(20))
    server = serve(
        reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    )
    assert get(server.port, limit=150)[0] == ok(b"A" * 100 + b"B" * 51)


def test_chunked_body_over_the_cap(
    serve: Callable[..., Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked body that does not end is not read forever: past BODY_CAP it is an error."""
    monkeypatch.setattr(web, "BODY_CAP", 1 << 20)
    chunk = b"10000\r\n" + b"z" * 0x10000 + b"\r\n"

    def endless(server: Server, conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(64):  # 4 MiB at most, never the last chunk
            conn.sendall(chunk)
        server.release.wait(LONG * 2)

    server = serve(endless)
    out, took = get(server.port, limit=10)
    assert out == failed("ValueError: response body larger than 1 MiB")
    assert took < LONG / 2


# ------------------------------------------------------------------------------ no answer


def test_nothing_listening_is_refused() -> None:
    """A port bound by nobody listening (held, so no one else takes it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        out, took = get(held.getsockname()[1])
    assert out == failed("connection refused")
    assert took < LONG / 2


@pytest.mark.parametrize("timeout", [0.3, 0.0], ids=["0.3s", "zero"])
def test_silent_server_times_out(serve: Callable[..., Server], timeout: float) -> None:
    """Accepted, never answered: "timed out" after about the timeout (a zero timeout is
    raised to 50 ms, not turned into a non-blocking socket)."""
    server = serve(silent)
    out, took = get(server.port, timeout=timeout)
    assert out == failed("timed out")
    assert max(timeout, 0.05) * 0.9 <= took < max(timeout, 0.05) + 1.0
    assert len(server.requests) == 1


def test_stall_in_the_headers_times_out(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Le", hold=True))
    out, took = get(server.port, timeout=0.3)
    assert out == failed("timed out")
    assert took < 1.3


def test_stall_in_the_body_times_out(serve: Callable[..., Server]) -> None:
    """Three of ten bytes then silence: no status is reported, not a short body."""
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", hold=True))
    out, took = get(server.port, timeout=0.3, limit=100)
    assert out == failed("timed out")
    assert took < 1.3


def test_closed_without_response(serve: Callable[..., Server]) -> None:
    """The server closes its side as soon as it accepts (and drains the request, so the
    close is a FIN, not a reset)."""

    def hang_up(server: Server, conn: socket.socket) -> None:
        conn.shutdown(socket.SHUT_WR)
        server.requests.append(read_request(conn))

    server = serve(hang_up)
    out, _ = get(server.port)
    assert out == failed("ValueError: connection closed without a response")


def test_connection_reset(serve: Callable[..., Server]) -> None:
    def reset(server: Server, conn: socket.socket) -> None:
        server.requests.append(read_request(conn))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    server = serve(reset)
    out, _ = get(server.port)
    assert out == failed("connection reset")


def test_closed_in_the_headers(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nContent-"))
    assert get(server.port)[0] == failed("ValueError: connection closed in the response headers")


def test_unresolvable_host() -> None:
    out = web.request("no-such-host.invalid", 80, "/", timeout=LONG)
    assert out["status"] is None and out["body"] is None
    assert str(out["error"]).startswith("cannot resolve no-such-host.invalid: ")


# ------------------------------------------------------------------------------ not HTTP


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        (
            b"SSH-2.0-OpenSSH_9.2p1\r\n\r\n",
            "ValueError: not an HTTP response: 'SSH-2.0-OpenSSH_9.2p1'",
        ),
        (b"HTTP/1.1 abc OK\r\n\r\n", "ValueError: not an HTTP response: 'HTTP/1.1 abc OK'"),
        (b"HTTP/1.1\r\n\r\n", "ValueError: not an HTTP response: 'HTTP/1.1'"),
        (b"\r\n\r\n", "ValueError: not an HTTP response: ''"),
        (
            b"<html>" + b"y" * 200 + b"\r\n\r\n",
            "ValueError: not an HTTP response: " + repr("<html>" + "y" * 74),
        ),
        # an SSH server's banner, then it hangs up on our "bad identification string"
        (b"SSH-2.0-OpenSSH_9.2p1\r\n", "ValueError: connection closed in the response headers"),
        # a TLS server's alert to a plaintext client
        (b"\x15\x03\x01\x00\x02\x02\x46", "ValueError: connection closed in the response headers"),
    ],
    ids=["ssh-banner", "status-not-a-number", "no-status", "empty", "long-line", "ssh", "tls"],
)
def test_garbage_is_not_http(serve: Callable[..., Server], sent: bytes, error: str) -> None:
    server = serve(reply(sent))
    assert get(server.port, limit=100)[0] == failed(error)


def test_headers_over_a_mebibyte(serve: Callable[..., Server]) -> None:
    server = serve(reply(b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * (1 << 20) + b"\r\n", hold=True))
    out, took = get(server.port)
    assert out == failed("ValueError: response headers larger than 1 MiB")
    assert took < LONG / 2


def test_header_not_latin1_is_an_error_not_a_raise(serve: Callable[..., Server]) -> None:
    server = serve(silent)
    out, _ = get(server.port, headers={"X-Name": "日本"})
    assert out["status"] is None and str(out["error"]).startswith("UnicodeEncodeError: ")
    assert all(r == b"" for r in server.requests)  # connected, but nothing was sent
