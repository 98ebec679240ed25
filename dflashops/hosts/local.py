"""Run on this machine: the embedded default host (`connection: local`), no SSH involved."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
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
    StreamEnded,
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

    def stream(self, command: Command) -> LocalStream:
        self.commands += 1
        # A file, not a pipe: nothing to drain while it runs; LocalStream.close closes it.
        err = tempfile.TemporaryFile()  # noqa: SIM115
        proc = subprocess.Popen(
            ["bash", "-c", as_shell(command)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
        return LocalStream(self.host, proc, err)


class LocalStream:
    def __init__(self, host: str, proc: subprocess.Popen[bytes], err: IO[bytes]) -> None:
        self.host = host
        self.proc = proc
        self.err = err
        self.buffer = b""

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise StreamEnded(self.host, f"the kept command ended: {exc}") from None

    def readline(self, timeout: float) -> bytes:
        import os
        import select
        import time

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimeout(self.host, f"no answer within {timeout:.0f}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    raise StreamEnded(self.host, "the kept command ended")
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"

    def ending(self) -> Result:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = -1
        self.err.seek(0)
        return Result("agent stream", code, self.buffer, self.err.read()[-65536:])

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


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
