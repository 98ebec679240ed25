"""Shared test helpers: paths to the repo and a way to write small config trees."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from dflashops.cli import main

REPO = Path(__file__).resolve().parent.parent

WriteTree = Callable[[dict[str, str]], Path]


def unless(available: bool, reason: str) -> pytest.MarkDecorator:
    """Skip when a capability of this machine is missing, but never under CI=true: there the
    test runs and fails, so CI cannot pass by skipping it."""
    in_ci = os.environ.get("CI", "").lower() == "true"
    return pytest.mark.skipif(not available and not in_ci, reason=reason)


def missing(reason: str) -> NoReturn:
    """What `unless` does, decided inside a test or fixture: skip here, fail under CI=true."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


IPV6 = _ipv6_loopback()
needs_ipv6 = unless(IPV6, "no IPv6 loopback here")
SYSTEM_PYTHON = "/usr/bin/python3"


def interpreters() -> list[Any]:
    """The controller's Python and the host's system one, as pytest params (a new list:
    callers may add more)."""
    return [
        pytest.param(sys.executable, id="venv-python"),
        pytest.param(
            SYSTEM_PYTHON,
            id="system-python",
            marks=unless(os.path.exists(SYSTEM_PYTHON), "no /usr/bin/python3"),
        ),
    ]


@pytest.fixture
def write_tree(tmp_path: Path) -> WriteTree:
    """Write {relative path: text} under tmp_path (text is dedented) and return tmp_path."""

    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return tmp_path

    return write


def run_cli(args: list[str], cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`dflashops ARGS` run from ``cwd`` (where a user would stand): exit code and output."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(args)
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test has its own dflashops cache folder: no result kept by one test (a pre-flight
    pass, a file tree) can decide another's, and the user's own cache is never touched."""
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("DFLASHOPS_CACHE", str(folder))
    return folder


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test leaves a process behind: at the end of the session (after every other fixture,
    the sshd fleets included, is torn down) anything still running with its working directory
    in this session's tmp folders (every unit dflashops starts runs in its unit folder there)
    is a leak. It is killed, and the session fails naming it."""
    import signal

    from tests.procs import all_pids

    base = str(tmp_path_factory.getbasetemp())
    yield
    leaks = []
    for pid in all_pids():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        if pid != os.getpid() and (cwd == base or cwd.startswith(base + os.sep)):
            leaks.append(f"pid {pid} in {cwd}: {cmd}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert not leaks, "processes left behind by the tests (now killed):\n  " + "\n  ".join(leaks)
