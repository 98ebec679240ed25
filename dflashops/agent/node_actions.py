"""The actions on a host's node state (trees, environments, copies) and a multi-node unit's
rendezvous."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dflashops.agent.answers import (
    BuildResult,
    CopyResult,
    Dialled,
    Listening,
    ReceiveResult,
    ScanResult,
    SendResult,
)
from dflashops.agent.bundle import bundle, command
from dflashops.agent.calling import SLACK, AgentError, Caller
from dflashops.agent.reading import Frames
from dflashops.hosts.connection import Input, Result, StreamEnded
from dflashops.hosts.untrusted import TooDeep, loads


class NodeActions(Caller):
    # -- a multi-node unit's rendezvous, before any GPU is touched -----------------------------

    @contextlib.contextmanager
    def listening(
        self, workdir: str, address: str, port: int, expect: int, timeout: float
    ) -> Iterator[tuple[Listening, Callable[[], Listening]]]:
        """The head listens on ``address``:``port`` for ``expect`` peers. Yields what it said as
        it started (listening, or why not) and a function that waits for its final answer."""
        request = {
            "action": "rendezvous",
            "workdir": workdir,
            "role": "listen",
            "address": address,
            "port": port,
            "expect": expect,
            "timeout": timeout,
        }
        self.round_trips += 1
        stream = self.conn.stream(command(self.python))
        try:
            stream.send(bundle() + json.dumps(request).encode() + b"\n")
            first = self._rendezvous_line(stream, timeout=30.0)
            if not first.listening:
                yield first, lambda: first
                return

            def finish() -> Listening:
                return self._rendezvous_line(stream, timeout=timeout + SLACK)

            yield first, finish
        finally:
            stream.close()

    def _rendezvous_line(self, stream: Any, timeout: float) -> Listening:
        try:
            raw = stream.readline(timeout)
        except StreamEnded:
            self.answer("rendezvous", stream.ending())  # raises, saying why
            raise AgentError(self.host, "the rendezvous check ended without an answer") from None
        if raw.startswith(b'{"listening"'):  # the head's "I am listening" line
            try:
                return self.validate(Listening, loads(raw), "rendezvous")
            except (ValueError, TooDeep) as exc:
                raise AgentError(
                    self.host, f"the rendezvous line is not an answer: {exc}"
                ) from None
        data = self.answer("rendezvous", Result("agent rendezvous", 0, raw, b""))
        return self.validate(Listening, data, "rendezvous")

    def dial(self, workdir: str, address: str, port: int, name: str, timeout: float) -> Dialled:
        """Connect to the head's rendezvous as a worker rank would."""
        request = {
            "workdir": workdir,
            "role": "dial",
            "address": address,
            "port": port,
            "name": name,
            "timeout": timeout,
        }
        data = self.call("rendezvous", request, timeout=timeout + SLACK)
        return self.validate(Dialled, data, "rendezvous")

    # -- node state ---------------------------------------------------------------------------

    def scan(
        self,
        workdir: str,
        root: str | None,
        *,
        cache: str = "src",
        job: str | None = None,
        listing: bool = True,
        timeout: float = 3600.0,
    ) -> ScanResult:
        """A tree's manifest on the host (hashing only what changed since the last scan)."""
        request = {"workdir": workdir, "root": root, "cache": cache, "job": job, "listing": listing}
        return self.validate(ScanResult, self.call("scan", request, timeout=timeout), "scan")

    def receive(
        self,
        workdir: str,
        dest: str,
        files: Sequence[dict[str, Any]],
        data: Input,
        *,
        delete: Sequence[str] = (),
        need_bytes: int = 0,
        timeout: float | None = None,
    ) -> ReceiveResult:
        """Stream ``files`` ([{rel, size, sha256, offset, mode}], their bytes from offset in
        ``data``) into ``dest``; each verified and renamed on arrival."""
        request = {
            "workdir": workdir,
            "dest": dest,
            "files": list(files),
            "delete": list(delete),
            "need_bytes": need_bytes,
        }
        budget = timeout if timeout is not None else 600.0 + need_bytes / 20e6  # >= 20 MB/s
        data_answer = self.call("receive", request, data=data, timeout=budget)
        return self.validate(ReceiveResult, data_answer, "receive")

    def send(
        self,
        workdir: str,
        root: str,
        files: Sequence[tuple[str, int]],
        frames: Frames,
        *,
        timeout: float,
    ) -> SendResult:
        """Stream files (rel, offset) out of ``root`` on the host into ``frames``."""
        request = {
            "workdir": workdir,
            "root": root,
            "files": [{"rel": r, "offset": o} for r, o in files],
        }
        return self.validate(
            SendResult, self.call("send", request, timeout=timeout, frames=frames), "send"
        )

    def copy(
        self,
        workdir: str,
        dest: str,
        *,
        src: str | None = None,
        hub: dict[str, Any] | None = None,
        secrets: dict[str, str] | None = None,
        delete: bool = False,
        mode: int | None = None,
        timeout: float = 6 * 3600.0,
    ) -> CopyResult:
        """Make ``dest`` hold what a host path (or a hub repo at a revision) holds."""
        request = {
            "workdir": workdir,
            "dest": dest,
            "src": src,
            "hub": hub,
            "secrets": secrets or {},
            "delete": delete,
            "mode": mode,
            "hub_timeout": max(1.0, timeout - 60.0),
        }
        return self.validate(CopyResult, self.call("copy", request, timeout=timeout), "copy")

    def build(
        self, workdir: str, envs: Sequence[dict[str, Any]], *, timeout: float = 3600.0
    ) -> dict[str, BuildResult]:
        """Build environments (each once per content, switched in only when complete)."""
        if not envs:
            return {}
        request = {"workdir": workdir, "envs": list(envs), "timeout": timeout}
        data = self.call("build", request, timeout=timeout * len(envs) + SLACK)
        built = data.get("envs")
        if not isinstance(built, dict):
            raise AgentError(self.host, "the build answer has no envs")
        out = {name: self.validate(BuildResult, value, "build") for name, value in built.items()}
        missing = [str(e["name"]) for e in envs if e["name"] not in out]
        if missing:
            raise AgentError(self.host, f"the build answer misses {', '.join(missing)}")
        return out
