"""Test-side helpers for driving the stub engine and the fakes as real subprocesses.

Import from a test with ``sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))``
(tests/ has no packages). Stdlib only; loopback only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "fakes"
PYLIB = FAKES / "pylib"
NVIDIA_SMI = FAKES / "bin" / "nvidia-smi"
LAUNCH_VLLM = FAKES / "launch_vllm.py"
STUB = REPO / "dflashops" / "builtins" / "stub_engine.py"
SGLANG_FLAGS = REPO / "dflashops" / "data" / "sglang-flags.txt"
VLLM_FLAGS = REPO / "dflashops" / "data" / "vllm-flags.txt"
SYSTEM_PYTHON = "/usr/bin/python3"
# The test hosts' interpreter: a bare system python without third-party packages.
HOST_PYTHON = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_env(gpu_state: Path | None = None, **extra: str) -> dict[str, str]:
    """A minimal environment like a fake GPU host's ssh session (no DFLASHOPS_STUB_* leaks)."""
    env = {
        "PATH": f"{FAKES / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(PYLIB),
        "LANG": "C.UTF-8",
    }
    if gpu_state is not None:
        env["FAKE_GPU_STATE"] = str(gpu_state)
    env.update(extra)
    return env


class Response:
    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None
        hdrs = dict(headers or {})
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, data, hdrs)
        resp = conn.getresponse()
        return Response(resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()})
    finally:
        conn.close()


class Proc:
    """A subprocess whose stdout+stderr lines are collected by a reader thread."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=str(cwd or REPO),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not seen in output of {self.argv}:\n{self.output}")

    def wait_http(self, port: int, path: str = "/health", timeout: float = 10.0) -> list[int]:
        """Poll until ``path`` answers 200; returns every status seen (refusals not included)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.argv} exited {self.popen.returncode}:\n{self.output}")
            try:
                status = request(port, "GET", path, timeout=2.0).status
            except OSError:
                time.sleep(0.02)
                continue
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.02)
        raise AssertionError(f"{path} never answered 200 (saw {seen}):\n{self.output}")

    def wait(self, timeout: float = 10.0) -> int:
        code = self.popen.wait(timeout)
        self._reader.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.wait(timeout)


def scrape(port: int, headers: dict[str, str] | None = None) -> dict[str, tuple[str, dict, float]]:
    """GET /metrics parsed by prometheus_client: sample name -> (family type, labels, value).

    prometheus_client is imported here, not at the top: the rest of this module is stdlib only.
    """
    from prometheus_client.parser import text_string_to_metric_families

    resp = request(port, "GET", "/metrics", headers=headers)
    assert resp.status == 200, resp.body
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, tuple[str, dict, float]] = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        for sample in family.samples:
            assert sample.name not in out, f"{sample.name} sampled twice"
            out[sample.name] = (family.type, dict(sample.labels), float(sample.value))
    return out


def run(argv: list[str], env: dict[str, str], timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout, check=False
    )
