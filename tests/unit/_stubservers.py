"""Helpers for tests that run dflashops' stub engine and payload scripts as subprocesses.

Stubs listen on free loopback ports only and are always terminated (by pid) in teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAYLOADS = REPO / "dflashops" / "builtins"
STUB_ENGINE = PAYLOADS / "stub_engine.py"
GENERATE = PAYLOADS / "generate_completions.py"
MODEL_PATH = "/dev/shm/Qwen3.6-27B"


def free_port() -> int:
    """A loopback port that was free a moment ago (bind to port 0, then release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stub:
    """One stub_engine.py subprocess on 127.0.0.1."""

    def __init__(
        self,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"stub-{self.port}.log"
        full_env = dict(os.environ)
        full_env["DFLASHOPS_STUB_STARTUP_SECONDS"] = "0.05"
        full_env.update(env or {})
        cmd = [
            sys.executable,
            str(STUB_ENGINE),
            "--model-path",
            MODEL_PATH,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def wait_healthy(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stub exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"stub {self.url} not healthy after {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def stub_servers(
    log_dir: Path,
    n: int = 1,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    envs: Sequence[Mapping[str, str] | None] | None = None,
) -> Iterator[list[Stub]]:
    """n running, healthy stubs (``envs`` gives each its own extra environment)."""
    stubs: list[Stub] = []
    try:
        for i in range(n):
            e = dict(env or {})
            if envs is not None and envs[i]:
                e.update(envs[i] or {})
            stubs.append(Stub(log_dir, e, args))
        for s in stubs:
            s.wait_healthy()
        yield stubs
    finally:
        for s in stubs:
            s.stop()


def write_prompts(path: Path, n: int, start: int = 0, text_every: int = 5) -> list[str]:
    """n prompts with ids p00000...; every text_every-th one is a text prompt. -> ids."""
    ids = []
    with open(path, "w") as f:
        for i in range(start, start + n):
            pid = f"p{i:05d}"
            ids.append(pid)
            if text_every and i % text_every == 0:
                rec: dict[str, Any] = {"id": pid, "prompt": f"Continue the story number {i}"}
            else:
                rec = {"id": pid, "messages": [{"role": "user", "content": f"question {i}?"}]}
            f.write(json.dumps(rec) + "\n")
    return ids


def shard_files(out: Path) -> list[Path]:
    return sorted(out.glob("completions-*.jsonl"))


def read_records(out: Path) -> list[dict[str, Any]]:
    """Every complete record line in the output shards (a torn last line is not a record)."""
    recs = []
    for p in shard_files(out):
        data = p.read_bytes()
        for line in data.split(b"\n")[:-1]:  # the part after the last newline is not whole
            recs.append(json.loads(line))
    return recs


def output_ids(out: Path) -> list[str]:
    return [str(r["id"]) for r in read_records(out)]


def gc_cmd(
    prompts: Path,
    servers: Sequence[str],
    out: Path,
    *extra: str,
    python: str | None = None,
) -> list[str]:
    return [
        python or sys.executable,
        str(GENERATE),
        "--prompts",
        str(prompts),
        "--servers",
        *servers,
        "--output-dir",
        str(out),
        "--max-output-tokens",
        "64",
        *extra,
    ]


def run_gc(
    prompts: Path,
    servers: Sequence[str],
    out: Path,
    *extra: str,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    **popen: Any,
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        gc_cmd(prompts, servers, out, *extra, python=python),
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        **popen,
    )


def start_gc(
    prompts: Path, servers: Sequence[str], out: Path, *extra: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        gc_cmd(prompts, servers, out, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
