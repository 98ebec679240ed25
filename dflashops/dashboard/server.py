"""The dashboard's HTTP server: the stdlib's ThreadingHTTPServer, a handful of routes.

- ``/``: the page (static/index.html); ``/static/NAME``: its script and style;
- ``/api/state?window=1h[&host=H&unit=U]``: the page's document (page.py), with that unit's
  log end when asked;
- ``/metrics``: the fleet's own series (prom.py).

Who may ask: bound to loopback (127.0.0.0/8, ::1) and no token, anyone on this machine. With a
token (``--token env:NAME``; required beyond loopback), every request must carry it, as
``Authorization: Bearer T``, as the cookie that ``?token=T`` sets (HttpOnly, SameSite=Strict;
the page is then reloaded without the token in its address), or as ``?token=T`` itself
(Prometheus' ``params``). Anything else is 401. Requests are not logged unless ``-v``, and
then with any token in them replaced by ``***``: a token in a URL never reaches a log.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import socket
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dflashops.dashboard import page, prom
from dflashops.dashboard.sampler import Sampler
from dflashops.errors import DflashopsError
from dflashops.output import err

COOKIE = "dflashops_dashboard"
TOKEN_IN_TEXT = re.compile(r"(token=)[^&\s\"]*", re.IGNORECASE)
POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def parse_listen(value: str) -> tuple[str, int]:
    """``127.0.0.1:8765``, ``[::1]:8765``, ``0.0.0.0:80``, ``localhost:8765``, ``:8765``."""
    text = value.strip()
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]*):(\d+)", text)
    if match is None:
        raise DflashopsError(
            f"--listen {value!r}: give ADDRESS:PORT (127.0.0.1:8765, [::1]:8765, 0.0.0.0:8765)"
        )
    host = match.group(1) or match.group(3) or "127.0.0.1"
    port = int(match.group(2) or match.group(4))
    if not 0 <= port <= 65535:
        raise DflashopsError(f"--listen {value!r}: port {port} is not between 0 and 65535")
    return host, port


def loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a[4][0]).is_loopback for a in found)


def redact(text: str) -> str:
    return TOKEN_IN_TEXT.sub(r"\1***", text)


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        sampler: Sampler,
        token: str | None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sampler = sampler
        self.token = token
        # What the cookie holds: derived from the token, so the token itself is not stored.
        self.cookie = (
            hmac.new(token.encode(), b"dflashops dashboard cookie", hashlib.sha256).hexdigest()
            if token
            else None
        )
        self.log = log
        self.lock = threading.Lock()
        self.documents: dict[str, tuple[int, dict[str, Any]]] = {}  # window -> (sample, doc)
        super().__init__(address, Handler)

    def document(self, window: str) -> dict[str, Any]:
        """The page's document for ``window``, made once per sample however many pages ask
        (a week of plots is a few hundred ms of the controller's CPU)."""
        window = window if window in page.WINDOWS else page.DEFAULT_WINDOW
        with self.lock:
            kept = self.documents.get(window)
            if kept is None or kept[0] != self.sampler.samples:
                kept = (self.sampler.samples, page.document(self.sampler, window))
                self.documents[window] = kept
        return dict(kept[1])

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}/"

    def handle_error(self, request: Any, client_address: Any) -> None:
        kind, exc = sys.exc_info()[:2]
        if kind is not None and issubclass(kind, (BrokenPipeError, ConnectionResetError)):
            return  # the browser went away mid-answer
        # A bug of ours: one line, always (the page shows the request failed; serving goes on).
        line = (
            f"dashboard: internal error answering a request: {kind.__name__ if kind else ''}: {exc}"
        )
        (self.log or err)(redact(line))


class Handler(BaseHTTPRequestHandler):
    server: Dashboard
    server_version = "dflashops-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(redact(f"dashboard: {self.address_string()} {format % args}"))

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        cookie = self.allowed(query)
        if cookie is None:
            self.answer(
                HTTPStatus.UNAUTHORIZED,
                b"401: this dashboard needs its token: send 'Authorization: Bearer TOKEN', or "
                b"open it once as /?token=TOKEN\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Bearer realm="dflashops"'},
            )
            return
        extra = {"Set-Cookie": cookie} if cookie else {}
        if cookie and url.path == "/":
            # The token leaves the address bar (and the history): the cookie carries it now.
            self.answer(HTTPStatus.SEE_OTHER, b"", "text/plain", {**extra, "Location": "/"})
            return
        self.route(url.path, query, extra)

    def allowed(self, query: dict[str, list[str]]) -> str | None:
        """None: refused; "": allowed; else allowed by ?token=, and the cookie to set."""
        token = self.server.token
        if token is None:
            return ""
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and same(given[7:].strip(), token):
            return ""
        jar = SimpleCookie(self.headers.get("Cookie", ""))
        if COOKIE in jar and self.server.cookie and same(jar[COOKIE].value, self.server.cookie):
            return ""
        if any(same(t, token) for t in query.get("token", [])):
            return f"{COOKIE}={self.server.cookie}; Path=/; HttpOnly; SameSite=Strict"
        return None

    def route(self, path: str, query: dict[str, list[str]], extra: dict[str, str]) -> None:
        if path in ("/", "/index.html"):
            path = "/static/index.html"
        if path.startswith("/static/"):
            found = page.static(path[len("/static/") :])
            if found is not None:
                self.answer(HTTPStatus.OK, found[0], found[1], extra)
                return
        elif path == "/api/state":
            doc = self.server.document(first(query, "window") or page.DEFAULT_WINDOW)
            host, unit = first(query, "host"), first(query, "unit")
            if host and unit:
                doc["log"] = self.log_of(host, unit)
            body = json.dumps(doc).encode()
            self.answer(HTTPStatus.OK, body, "application/json", extra)
            return
        elif path == "/metrics":
            body = prom.exposition(lambda: self.server.sampler.latest)
            self.answer(HTTPStatus.OK, body, prom.CONTENT_TYPE, extra)
            return
        self.answer(
            HTTPStatus.NOT_FOUND, b"404: not a page of this dashboard\n", "text/plain", extra
        )

    def log_of(self, host: str, unit: str) -> dict[str, Any]:
        """A unit's log end (None until fetched); only of a unit the last look saw."""
        sampler = self.server.sampler
        latest = sampler.latest
        if latest is None or latest.unit(host, unit) is None:
            return {"host": host, "unit": unit, "text": None, "error": "no such unit here"}
        return {"host": host, "unit": unit, "text": sampler.tail(host, unit), "error": None}

    def answer(
        self, status: HTTPStatus, body: bytes, kind: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", POLICY)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def same(given: str, wanted: str) -> bool:
    return hmac.compare_digest(given.encode(), wanted.encode())


def first(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None
