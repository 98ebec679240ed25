"""The controller's memory of each host (DESIGN "Nothing lost when a node is lost" 4): its node
id, boot id, SSH key fingerprint and when it was seen, in ``STATE/hosts/HOST.json`` (0600; the
state folder is ``.dflashops/`` beside the inventory, project.state_dir). Commands that read
facts compare them with it (changes/identity.py) and remember what they saw.

Several commands may look at once (status, deploy, watch): each file is written whole through a
temporary file and a rename, so a reader sees one look or another, and the last writer wins.
Memory that cannot be read is treated as nothing remembered; memory that cannot be written is
one line in ``problems``, never a failed command.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from dflashops.agent.answers import HostFacts
from dflashops.changes.identity import Known, Verdict, iso, judge, kept
from dflashops.config.providers import state_path
from dflashops.lifecycle.session import HostSession

HOSTS = "hosts"  # under the state folder


class HostMemory:
    """What the controller remembers of its hosts, in the project's state folder beside
    ``inventory`` (project.state_dir; None: nothing is remembered, every host is first-seen);
    the folder is made when first written. ``verdicts``: the looks of this run, by host."""

    def __init__(self, inventory: Path | None) -> None:
        self.state = None if inventory is None else state_path(inventory)
        self.verdicts: dict[str, Verdict] = {}
        self.problems: list[str] = []

    @classmethod
    def at(cls, state: Path | None) -> HostMemory:
        """The memory in the state folder ``state`` itself (what a HostRun's state_dir is)."""
        memory = cls(None)
        memory.state = state
        return memory

    def path(self, host: str) -> Path | None:
        if self.state is None:
            return None
        if not host or "/" in host or host.startswith("."):
            raise ValueError(f"{host!r} is not a host name")  # inventory names never are
        return self.state / HOSTS / f"{host}.json"

    def recall(self, host: str) -> Known | None:
        """What was remembered of ``host``; None: nothing (or nothing readable)."""
        path = self.path(host)
        if path is None:
            return None
        try:
            return Known.from_json(json.loads(path.read_bytes()))
        except (OSError, ValueError):
            return None  # missing, or broken: rewritten by this look

    def remember(self, host: str, known: Known) -> None:
        """``known`` as the memory of ``host``: written whole (a temporary file, 0600, then a
        rename), or OSError."""
        path = self.path(host)
        if path is None:
            return
        for folder in (path.parent.parent, path.parent):  # private: what hosts said is in it
            folder.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(known.as_json(), f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def observe(self, host: str, facts: HostFacts, key: str | None = None) -> Verdict:
        """Compare what facts say of ``host`` with what was remembered, then remember it (see
        identity.kept). Call it only with facts that were read: a failed look says nothing."""
        before = self.recall(host)
        now = Known(facts.node_id, facts.boot_id, key, iso(time.time()))
        verdict = Verdict(host, judge(before, now), before, now, facts.workdir)
        try:
            self.remember(host, kept(before, now))
        except OSError as exc:
            where = self.path(host)
            self.problems.append(
                f"[{host}] what the controller saw of it is not remembered ({where}: {exc}): "
                "make the folder writable, or the next look cannot tell a re-provisioned host"
            )
        self.verdicts[host] = verdict
        return verdict

    def look(self, session: HostSession, facts: HostFacts) -> Verdict:
        """``observe`` for a session's host, with the key its connection was made with."""
        return self.observe(session.host.name, facts, key_of(session))

    def warnings(self, hosts: Iterable[str], now: float | None = None) -> list[tuple[str, str]]:
        """``(label, line)`` per host in ``hosts`` order that rebooted or was re-provisioned
        since it was last seen, then the memory's own problems (label ``warning``); lines are
        host text, to be escaped for rich."""
        clock = time.time() if now is None else now
        out = []
        for host in hosts:
            verdict = self.verdicts.get(host)
            said = verdict.warning(clock) if verdict is not None else None
            if said is not None:
                out.append(said)
        return [*out, *(("warning", p) for p in self.problems)]

    def identity(self, host: str) -> str | None:
        """The host's identity word of this run (None: not looked at)."""
        verdict = self.verdicts.get(host)
        return verdict.identity if verdict is not None else None


def key_of(session: HostSession) -> str | None:
    """The fingerprint of the SSH key ``session``'s connection was made with (None: a local
    host, or not connected)."""
    if session.host.is_local:
        return None
    from dflashops.hosts.hostkeys import fingerprint
    from dflashops.hosts.ssh import SshConnection

    conn = session.conn
    if not isinstance(conn, SshConnection) or conn.fabric.client is None:
        return None
    transport = conn.fabric.client.get_transport()
    if transport is None:
        return None
    return fingerprint(transport.get_remote_server_key())
