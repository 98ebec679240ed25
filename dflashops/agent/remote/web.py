"""Plain HTTP/1.1 on the host: probes, liveness checks, metrics, webhook notices. Never raises."""

from __future__ import annotations

from .common import Json, describe

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any


BODY_CAP = 64 << 20  # a chunked body is read whole (to its end) up to this


def request(
    host: str,
    port: int,
    path: str,
    *,
    timeout: float,
    limit: int = 0,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: bytes | None = None,
) -> Json:
    """{status, error, body (bytes, at most ``limit`` + 1, None unless a status came back)}.

    HTTP/1.1 over a plain socket, ``Connection: close``: http.client would cost every probe
    ~20 ms of imports (email.*), paid on each host at every call. ``timeout`` bounds the whole
    request, not each read: a server that trickles bytes cannot hold a probe past it."""
    import socket
    import time

    out: Json = {"status": None, "error": None, "body": None}
    timeout = max(0.05, timeout)
    name = f"[{host}]" if ":" in host else host
    hdrs = {"Host": f"{name}:{port}", "Connection": "close", "Accept": "application/json"}
    hdrs.update(headers or {})
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(head.encode("latin-1") + b"\r\n" + (body or b""))
            status, body_out = _response(sock, limit, deadline)
        out["status"], out["body"] = status, body_out
    except ConnectionRefusedError:
        out["error"] = "connection refused"
    except (socket.timeout, TimeoutError):
        out["error"] = "timed out"
    except socket.gaierror as exc:
        out["error"] = f"cannot resolve {host}: {exc}"
    except ConnectionResetError:
        out["error"] = "connection reset"
    except (OSError, ValueError, UnicodeError) as exc:
        out["error"] = describe(exc)
    return out


def _recv(sock: Any, deadline: float) -> bytes:
    import socket
    import time

    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    sock.settimeout(left)
    return bytes(sock.recv(65536))


def _response(sock: Any, limit: int, deadline: float) -> tuple[int, bytes]:
    """Status and body (at most ``limit`` + 1 bytes) of the answer on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = _recv(sock, deadline)
        if not chunk:
            if not data:
                raise ValueError("connection closed without a response")
            raise ValueError("connection closed in the response headers")
        data += chunk
        if len(data) > 1 << 20:
            raise ValueError("response headers larger than 1 MiB")
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
    fields = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
    want = limit + 1
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    length = fields.get("content-length", "")
    total = int(length) if length.isdigit() and not chunked else None
    while (total is None or len(rest) < total) and (chunked or len(rest) < want):
        if chunked and _chunks_done(rest):
            break
        chunk = _recv(sock, deadline)
        if not chunk:
            break  # Connection: close: the body ends with the connection
        rest += chunk
        if len(rest) > BODY_CAP:
            raise ValueError(f"response body larger than {BODY_CAP >> 20} MiB")
    if chunked:
        rest = _dechunk(rest)
    if total is not None:
        rest = rest[:total]
    return int(parts[1]), rest[:want]


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _chunk_size(line: bytes) -> int | None:
    """The size on a chunk-size line (extensions after ``;`` ignored); None unless it is plain
    hex digits (int() would take "-6", "+6", "0x6" or "6_0": a negative size loops forever)."""
    digits = line.split(b";")[0].strip()
    if not digits or not _HEX.issuperset(digits):
        return None
    return int(digits, 16)


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked answer: every chunk up to the last one or to the first line that
    is not a chunk size (garbage: what made sense before it is kept)."""
    out, at = b"", 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return out
        size = _chunk_size(data[at:end])
        if not size:
            return out
        out += data[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


def _chunks_done(data: bytes) -> bool:
    """Whether a chunked body has reached its last (empty) chunk, or garbage."""
    at = 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return False
        size = _chunk_size(data[at:end])
        if not size:
            return True  # the last chunk (0), or garbage: stop reading
        at = end + 2 + size + 2
        if at > len(data):
            return False


def post_json(url: str, body: Json, timeout: float) -> Json:
    """POST ``body`` as JSON to ``url`` (http or https): {status, error}. Never raises."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return {"status": resp.status, "error": None}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": f"HTTP {exc.code}"}
    except urllib.error.URLError as exc:
        return {
            "status": None,
            "error": describe(exc.reason)
            if isinstance(exc.reason, BaseException)
            else str(exc.reason),
        }
    except (OSError, ValueError) as exc:
        return {"status": None, "error": describe(exc)}
