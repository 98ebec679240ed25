"""What happened, said once per unit event, plus a recap per host.

Every step reports through an ``EventLog``: a line on the console in Ansible's shape
(``changed: [b200] sglang-3 restarted (fingerprint ab12 -> cd34)``), a JSON object per line when
``--json FILE`` is given (``--json -``: on stdout, and the lines for people on stderr, so that
stdout stays parseable), and counts for the recap. Secret values are redacted from all of it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from rich.console import Console

from dflashops.output import console as make_console
from dflashops.output import escape, inert

STDOUT = "-"  # --json -: the JSON goes to stdout

Status = Literal["ok", "changed", "failed", "unreachable", "skipped", "info", "orphan", "waiting"]
COLORS = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "red",
    "skipped": "cyan",
    "info": "blue",
    "orphan": "magenta",
    "waiting": "cyan",
}


@dataclass(frozen=True)
class Event:
    host: str
    unit: str | None
    status: Status
    action: str  # plan | ship | start | stop | restart | ready | verify | ...
    message: str
    time: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        who = f"[{self.host}]" + (f" {self.unit}" if self.unit else "")
        return f"{self.status}: {who} {self.message}"


@dataclass
class HostRecap:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    orphans: int = 0
    waiting: int = 0
    reasons: list[str] = field(default_factory=list)


class EventLog:
    """Thread-safe: hosts report from their own worker threads."""

    def __init__(
        self, console: Console, json_path: str | None = None, quiet_ok: bool = False
    ) -> None:
        # --json -: stdout is the JSON's; the lines for people go where ``console`` does
        # unless that is stdout too (then to stderr).
        self.takes_stdout = json_path == STDOUT
        self.console = for_people(console, json_path)
        self.quiet_ok = quiet_ok
        self.events: list[Event] = []
        self.secrets: set[str] = set()
        self._lock = threading.Lock()
        self._json: TextIO | None = None
        if json_path and not self.takes_stdout:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            self._json = open(json_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def redact(self, text: str) -> str:
        for secret in sorted(self.secrets, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "***")
        return text

    def redact_value(self, value: Any) -> Any:
        """``value`` as JSON would carry it (tuples as lists, other objects as their text),
        every string in it redacted, keys included. Not the JSON text: there a secret with a
        quote, a backslash or a newline is escaped and no longer matches."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict):
            return {self.redact(str(k)): self.redact_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.redact_value(v) for v in value]
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return self.redact(str(value))

    def add_secrets(self, values: Iterable[str]) -> None:
        with self._lock:
            # Very short values would redact half the output and protect nothing.
            self.secrets.update(v for v in values if len(v) >= 4)

    def emit(
        self,
        host: str,
        unit: str | None,
        status: Status,
        action: str,
        message: str,
        *,
        show: bool = True,
        **data: Any,
    ) -> Event:
        event = Event(
            host,
            unit,
            status,
            action,
            inert(self.redact(message)),  # host text (log tails, errors) shown as text only
            data=self.redact_value(data),
        )
        with self._lock:
            self.events.append(event)
            # sys.stdout looked up at each event: whatever stdout is now (a test's capture).
            stream = sys.stdout if self.takes_stdout else self._json
            if stream is not None:
                stream.write(json.dumps(asdict(event), default=str) + "\n")
                stream.flush()
            if show and not (self.quiet_ok and status == "ok"):
                color = COLORS[status]
                self.console.print(f"[{color}]{escape(event.line())}[/]")
        return event

    def recap(self, hosts: Iterable[str]) -> dict[str, HostRecap]:
        """Per host, units (and environments and files entries) counted by their worst outcome
        (failed > changed > ok); a host that could not be reached counts once as unreachable."""
        out = {h: HostRecap() for h in hosts}
        worst: dict[tuple[str, str], str] = {}
        rank = {"ok": 0, "changed": 1, "failed": 2}
        for e in self.events:
            r = out.setdefault(e.host, HostRecap())
            if e.status in ("failed", "unreachable"):
                r.reasons.append(f"{e.unit + ': ' if e.unit else ''}{e.message.splitlines()[0]}")
            if e.status == "orphan":
                r.orphans += 1
                continue
            if e.status == "waiting":
                r.waiting += 1
                continue
            subject = e.unit or e.data.get("entry")
            if subject is None:
                if e.status == "unreachable":
                    r.unreachable += 1
                elif e.status == "failed":
                    r.failed += 1
                continue
            if e.status in rank:
                key = (e.host, str(subject))
                if rank[e.status] >= rank.get(worst.get(key, "ok"), 0):
                    worst[key] = e.status
        for (host, _unit), status in worst.items():
            r = out[host]
            setattr(r, status, getattr(r, status) + 1)
        return out

    def print_recap(self, hosts: Iterable[str]) -> bool:
        """Print the recap; True when nothing failed and every host was reached."""
        recap = self.recap(hosts)
        self.console.print("[bold]RECAP[/]")
        width = max((len(h) for h in recap), default=4)
        all_ok = True
        for host, r in recap.items():
            bad = r.failed or r.unreachable
            all_ok = all_ok and not bad
            color = "red" if bad else ("yellow" if r.changed else "green")
            self.console.print(
                f"[{color}]{host:<{width}}[/]  ok={r.ok} changed={r.changed} failed={r.failed} unreachable={r.unreachable}"
                + (f" orphans={r.orphans}" if r.orphans else "")
                + (f" waiting={r.waiting}" if r.waiting else "")
            )
            for reason in r.reasons[:5]:
                self.console.print(f"    [red]{escape(reason)}[/]")
        return all_ok

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None


def for_people(console: Console, json_path: str | None) -> Console:
    """Where the lines for people go: ``console``, or stderr when ``--json -`` takes stdout
    and ``console`` writes there."""
    if json_path == STDOUT and console.file is sys.stdout:
        return make_console(stderr=True)
    return console
