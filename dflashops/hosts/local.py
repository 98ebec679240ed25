"""Run on this machine: the embedded default host (`connection: local`), no SSH involved."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from typing import IO

from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import (
    Command,
    CommandError,
    CommandTimeout,
    Input,
    Result,
    Sink,
    as_shell,
    chunks,
)


class LocalConnection(BaseConnection):
    def __init__(self, host: str) -> None:
        self.host = host

    def run(
        self,
        command: Command,
        *,
        input: Input = None,
        timeout: float | None = 60.0,
        check: bool = True,
        stdout: Sink | None = None,
    ) -> Result:
        shell = as_shell(command)
        self.commands += 1
        # bash -c like sshd's session shell would; start_new_session keeps our terminal's
        # Ctrl-C from reaching what the command starts. stdin is fed and stdout/stderr are
        # drained by threads, so a large input or output never sits whole in memory.
        proc = subprocess.Popen(
            ["bash", "-c", shell],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out, err = bytearray(), bytearray()
        threads = [
            threading.Thread(target=_feed, args=(proc.stdin, input), daemon=True),
            threading.Thread(target=_drain, args=(proc.stdout, stdout or out.extend), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, err.extend), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise CommandTimeout(
                self.host, f"command timed out after {timeout:.0f}s: {shell[:200]}"
            ) from None
        for t in threads:
            t.join()
        result = Result(shell, code, bytes(out), bytes(err))
        if check and result.exit_code != 0:
            raise CommandError(self.host, result)
        return result

    def close(self) -> None:
        return None


def _feed(pipe: IO[bytes], data: Input) -> None:
    try:
        for chunk in chunks(data):
            pipe.write(chunk)
    except (BrokenPipeError, OSError):
        pass  # the command ended without reading it all: its exit status says why
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _drain(pipe: IO[bytes], sink: Sink) -> None:
    while True:
        data = pipe.read1(1 << 16) if hasattr(pipe, "read1") else pipe.read(1 << 16)
        if not data:
            return
        sink(data)
