"""Run on this machine: the embedded default host (`connection: local`), no SSH involved."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping
from typing import IO

from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import CommandTimeout, Result, Sink, Stream, StreamEnded
from dflashops.hosts.untrusted import keep_tail
from dflashops.output import shorten

# What runs on a local host (the agent, and so every unit it starts) gets of the controller's
# environment (DESIGN trust 5): the operator's shell may hold cloud keys, tokens and webhook
# URLs that a host over SSH never sees, and neither should a unit here. PATH, HOME and LANG, as
# sshd gives a session; LC_ALL, a locale only, so a unit decodes text as the operator's shell
# does; USER, LOGNAME and SHELL, who the session is, as sshd sets them. Not TERM: units have no
# terminal. Anything else is declared: the host's `env` (which its agent gets too: a proxy a
# local build needs), the unit's `env`, `secret_env`, `secret_args`.
KEPT_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "USER", "LOGNAME", "SHELL")


class LocalConnection(BaseConnection):
    def __init__(
        self, host: str, env: Mapping[str, str] | None = None, passes: Iterable[str] = ()
    ) -> None:
        """``env``: variables declared for this host; ``passes``: names of the controller's
        variables passed on as well, read at each command (a test's fake GPU state)."""
        self.host = host
        self.env = dict(env or {})
        self.passes = tuple(passes)

    def environment(self) -> dict[str, str]:
        names = (*KEPT_VARIABLES, *self.passes)
        return {**{k: os.environ[k] for k in names if k in os.environ}, **self.env}

    def execute(
        self, shell: str, input: Iterable[bytes], timeout: float | None, sink: Sink | None
    ) -> tuple[int, bytes, bytes]:
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
            env=self.environment(),
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out, err = bytearray(), bytearray()
        # A sink that fails (an answer too large, a file that cannot be written) ends the
        # command at once: nobody would drain its stdout, and it would block until the timeout.
        failed: list[BaseException] = []
        threads = [
            threading.Thread(target=_feed, args=(proc.stdin, input), daemon=True),
            threading.Thread(
                target=_drain, args=(proc, proc.stdout, sink or out.extend, failed), daemon=True
            ),
            threading.Thread(
                target=_drain,
                args=(proc, proc.stderr, lambda b: keep_tail(err, b), failed),
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise CommandTimeout(
                self.host, f"command timed out after {timeout:.0f}s: {shorten(shell, 200)}"
            ) from None
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        return code, bytes(out), bytes(err)

    def close(self) -> None:
        return None

    def keep(self, shell: str) -> LocalStream:
        self.commands += 1
        # A file, not a pipe: nothing to drain while it runs; LocalStream.close closes it.
        err = tempfile.TemporaryFile()  # noqa: SIM115
        proc = subprocess.Popen(
            ["bash", "-c", shell],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            env=self.environment(),
        )
        return LocalStream(self.host, proc, err)


class LocalStream(Stream):
    def __init__(self, host: str, proc: subprocess.Popen[bytes], err: IO[bytes]) -> None:
        self.host = host
        self.proc = proc
        self.err = err
        self.buffer = bytearray()
        self.scanned = 0  # bytes of buffer known to hold no newline

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise StreamEnded(self.host, f"the kept command ended: {exc}") from None

    def receive(self, wait: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            return b""
        data = os.read(fd, 1 << 16)
        if not data:
            raise StreamEnded(self.host, "the kept command ended")
        return data

    def kill(self) -> None:
        self.proc.kill()

    def ending(self) -> Result:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = -1
        self.err.seek(0, os.SEEK_END)
        self.err.seek(max(0, self.err.tell() - 65536))  # its end says why; all of it may be huge
        return Result("agent stream", code, bytes(self.buffer), self.err.read())

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


def _feed(pipe: IO[bytes], data: Iterable[bytes]) -> None:
    try:
        for chunk in data:
            pipe.write(chunk)
    except (BrokenPipeError, OSError):
        pass  # the command ended without reading it all: its exit status says why
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _drain(
    proc: subprocess.Popen[bytes], pipe: IO[bytes], sink: Sink, failed: list[BaseException]
) -> None:
    try:
        while True:
            data = pipe.read1(1 << 16) if hasattr(pipe, "read1") else pipe.read(1 << 16)
            if not data:
                return
            sink(data)
    except BaseException as exc:  # handed to run(), which raises it once the command is gone
        failed.append(exc)
        with contextlib.suppress(OSError):
            proc.kill()
