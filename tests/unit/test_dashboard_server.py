"""Who may ask the dashboard, and what it logs (dflashops/dashboard/server.py), on a real
server on loopback; and `dflashops dashboard` refusing to start beyond loopback without a
token, in one line, before anything is loaded."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dflashops.dashboard.sample import HostSample, Sample, UnitSample
from dflashops.dashboard.sampler import Sampler
from dflashops.dashboard.server import Dashboard, loopback, parse_listen, redact
from dflashops.errors import DflashopsError
from tests.conftest import run_cli

TOKEN = "s3cret-token-for-tests"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def serve(token: str | None, log: list[str] | None = None) -> Iterator[str]:
    sampler = Sampler(SimpleNamespace(tails=None), None, 2.0, print)  # type: ignore[arg-type]
    sampler.latest = Sample(
        1_800_000_000.0,
        [HostSample("h1", "ok")],
        [UnitSample("h1", "sg-0", "service", "sglang", "ready", restarts=2)],
    )
    server = Dashboard(
        ("127.0.0.1", 0), sampler, token, log=log.append if log is not None else None
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def open_dashboard() -> Iterator[str]:
    yield from serve(None)


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def locked_dashboard(log: list[str]) -> Iterator[str]:
    yield from serve(TOKEN, log)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_on_loopback_without_a_token_it_is_open(open_dashboard: str) -> None:
    code, headers, body = get(open_dashboard)
    assert code == 200 and "<title>dflashops dashboard</title>" in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]  # no CDN, no inline script
    code, headers, body = get(open_dashboard + "api/state?window=15m")
    assert code == 200 and '"unit": "sg-0"' in body and headers["Cache-Control"] == "no-store"
    assert get(open_dashboard + "static/app.js")[0] == 200
    assert get(open_dashboard + "static/../store.py")[0] == 404
    assert get(open_dashboard + "nothing")[0] == 404


def test_with_a_token_every_request_needs_it(locked_dashboard: str) -> None:
    for path in ("", "api/state", "metrics", "static/style.css", "nothing"):
        code, headers, body = get(locked_dashboard + path)
        assert code == 401, path
        assert headers["WWW-Authenticate"].startswith("Bearer") and "token" in body
    assert get(locked_dashboard + "api/state", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(locked_dashboard + "api/state?token=wrong")[0] == 401
    code, _, body = get(locked_dashboard + "api/state", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200 and "sg-0" in body
    code, _, body = get(locked_dashboard + f"metrics?token={TOKEN}")
    assert code == 200 and "dflashops_unit_restarts_total" in body


def test_the_token_in_a_url_becomes_a_strict_cookie_and_leaves_the_address(
    locked_dashboard: str,
) -> None:
    code, headers, _ = get(locked_dashboard + f"?token={TOKEN}")
    assert code == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert TOKEN not in cookie  # derived from the token, not the token
    jar = cookie.split(";")[0]
    assert get(locked_dashboard, {"Cookie": jar})[0] == 200
    assert get(locked_dashboard + "api/state", {"Cookie": jar})[0] == 200
    assert get(locked_dashboard, {"Cookie": jar[:-2] + "00"})[0] == 401


def test_a_token_in_a_url_is_never_logged(locked_dashboard: str, log: list[str]) -> None:
    get(locked_dashboard + f"metrics?token={TOKEN}")
    get(locked_dashboard + f"?window=1h&token={TOKEN}")
    assert log and all(TOKEN not in line for line in log)
    assert any("/metrics?token=***" in line for line in log)
    assert redact("GET /?a=1&token=abc&b=2") == "GET /?a=1&token=***&b=2"


def test_listen_addresses_and_what_is_loopback() -> None:
    assert parse_listen("127.0.0.1:8765") == ("127.0.0.1", 8765)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    assert parse_listen(":8080") == ("127.0.0.1", 8080)
    with pytest.raises(DflashopsError, match="ADDRESS:PORT"):
        parse_listen("8765")
    assert loopback("127.0.0.1") and loopback("127.3.2.1") and loopback("::1")
    assert loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("::") and not loopback("10.1.2.3")


def test_beyond_loopback_without_a_token_it_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli(["dashboard", "--listen", "0.0.0.0:8765"], tmp_path, capsys)
    assert code == 1
    assert out.strip().count("\n") == 0, out
    assert "0.0.0.0:8765 is reachable from other machines" in out and "--token env:NAME" in out


def test_a_token_comes_from_the_environment_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = run_cli(["dashboard", "--token", "hunter2"], tmp_path, capsys)
    assert code == 1 and "give env:NAME" in out and "ps" in out
    monkeypatch.delenv("DASH_TOKEN_UNSET", raising=False)
    code, out = run_cli(["dashboard", "--token", "env:DASH_TOKEN_UNSET"], tmp_path, capsys)
    assert code == 1 and "DASH_TOKEN_UNSET is not set" in out
    code, out = run_cli(["dashboard", "--keep", "forever"], tmp_path, capsys)
    assert code == 1 and "--keep 'forever'" in out


def test_the_dashboard_never_loads_the_deploy_executor() -> None:
    """It only looks (STYLE.md, standing limits): a fresh interpreter, its modules imported."""
    import json
    import subprocess
    import sys

    from tests.unit.test_lifecycle_imports import EXECUTOR, REPO

    code = (
        "import json, sys\n"
        "import dflashops.commands.dashboard, dflashops.commands.prometheus\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dflashops'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = set(json.loads(proc.stdout))
    assert "dflashops.dashboard.server" in loaded
    assert not loaded & set(EXECUTOR), sorted(loaded & set(EXECUTOR))
