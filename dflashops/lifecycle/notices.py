"""Notices from the controller (DESIGN "Nothing lost when a node is lost" 5): what happened to a
host, POSTed as JSON to the webhook its ``notify:`` names, the one the host's supervisors post
restarts to (agent/remote/supervisor.py), in the same shape: ``host``, ``unit`` (None for the
host as a whole), ``event``, ``time`` (ISO 8601 UTC; ``at`` too, the supervisor's name for it),
then the event's details. ``gave_up`` stays the supervisor's own notice.

The URL is a secret (lifecycle/secrets.py): no message shows it. A post has a short timeout and
never raises: a failed one is one warning line through ``emit``. ``once(key)`` lets a caller
send each transition once (``again(key)`` when the state it names ends), never a storm.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dflashops.agent.remote import web
from dflashops.changes.identity import iso
from dflashops.config.inventory import Host
from dflashops.lifecycle.secrets import resolve
from dflashops.output import inert, shorten
from dflashops.plan.nodestate import NodeState

TIMEOUT = 5.0  # s per post: a watch tick must not wait on a slow receiver for long
EVENTS = (  # what the controller sends (the host's supervisors send restarted, gave_up, ...)
    *("host_lost", "host_back", "reprovisioned", "restored", "redeployed", "key_changed"),
    "job_done",
)
REDACTED = "***"  # as EventLog redacts


def body(host: str, event: str, details: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The JSON posted: host, unit, event, time (and at), then ``details`` (which cannot
    replace those); anything JSON cannot carry becomes its text."""
    when = iso(now)
    head: dict[str, Any] = {"host": host, "unit": details.get("unit"), "event": event}
    out = {**head, "time": when, "at": when}
    out.update((k, v) for k, v in details.items() if k not in out)
    safe: dict[str, Any] = json.loads(json.dumps(out, default=str))
    return safe


class Notices:
    """Posts a host's notices to ``webhook_url`` (None: no ``notify``, nothing is sent);
    ``emit`` gets each warning line (plain text: host text made inert, the URL redacted)."""

    def __init__(
        self, webhook_url: str | None, emit: Callable[[str], None], timeout: float = TIMEOUT
    ) -> None:
        self.url = webhook_url
        self.emit = emit
        self.timeout = timeout
        self.sent_keys: set[str] = set()
        self.lock = threading.Lock()

    @classmethod
    def of(
        cls,
        host: Host,
        emit: Callable[[str], None],
        environ: Mapping[str, str] | None = None,
    ) -> Notices:
        """The notices of ``host``, to its ``notify`` webhook (``env:NAME`` read from
        ``environ``, the controller's environment by default); one warning when NAME is unset."""
        got = resolve(host, (), NodeState(), os.environ if environ is None else environ)
        if got.webhook_unset is not None:
            emit(
                f"[{host.name}] notify: {got.webhook_unset} is not set on the controller, so "
                "its notices are not sent: set it (or remove notify)"
            )
        return cls(got.webhook, emit)

    def send(self, host: str, event: str, **details: Any) -> bool:
        """POST one notice; True when the webhook took it (HTTP 2xx), False when there is no
        webhook or it failed (then one warning line). Never raises."""
        if not self.url:
            return False
        try:
            got = web.post_json(self.url, body(host, event, details, time.time()), self.timeout)
        except Exception as exc:  # a bug must not take a watch down with it
            got = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        status = got.get("status")
        if isinstance(status, int) and 200 <= status < 300:
            return True
        why = str(got.get("error") or f"HTTP {status}").replace(self.url, REDACTED)
        self.emit(
            inert(
                f"[{host}] notice {event} not delivered: {shorten(why, 200)} "
                "(the webhook of its notify: check the receiver)"
            )
        )
        return False

    def once(self, key: str) -> bool:
        """True the first time ``key`` is asked (send then), False until ``again(key)``."""
        with self.lock:
            if key in self.sent_keys:
                return False
            self.sent_keys.add(key)
            return True

    def again(self, key: str) -> None:
        """The state ``key`` named is over: its next transition is sent again."""
        with self.lock:
            self.sent_keys.discard(key)
