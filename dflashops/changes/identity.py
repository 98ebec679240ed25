"""Is a host still the machine the controller last saw? (DESIGN "Nothing lost when a node is
lost" 4.) Pure: what was remembered (lifecycle/memory.py) and what facts say now give

- ``first-seen``: nothing remembered;
- ``re-provisioned``: the node id remembered is gone (the workdir was emptied, or another
  machine answers under the same name) or is another one;
- ``rebooted``: the same node id (or none known yet), another boot id: its processes and
  /dev/shm are gone;
- ``same``: otherwise (a boot id that is not known on one side proves nothing).

``kept`` is what to remember after a look: a host whose node id is gone stays re-provisioned
until a deploy gives it a new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

Identity = Literal["same", "rebooted", "re-provisioned", "first-seen"]
IDENTITIES: tuple[Identity, ...] = ("same", "rebooted", "re-provisioned", "first-seen")
ISO = "%Y-%m-%dT%H:%M:%SZ"
FIELDS = ("node_id", "boot_id", "key", "seen_at")


@dataclass(frozen=True)
class Known:
    """What the controller knows of a host from one look."""

    node_id: str | None  # WORKDIR/node.json's id (None: the workdir has none)
    boot_id: str | None
    key: str | None = None  # the SSH host key's fingerprint (SHA256:...); None: local, unknown
    seen_at: str | None = None  # ISO 8601 UTC, the controller's clock

    def as_json(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_json(cls, data: Any) -> Known:
        """ValueError when ``data`` is not what ``as_json`` wrote."""
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object (got {type(data).__name__})")
        values = {name: data.get(name) for name in FIELDS}
        wrong = [n for n, v in values.items() if v is not None and not isinstance(v, str)]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: not a string")
        return cls(**values)


def judge(before: Known | None, now: Known) -> Identity:
    if before is None:
        return "first-seen"
    if before.node_id is not None and now.node_id != before.node_id:
        return "re-provisioned"
    if before.boot_id and now.boot_id and before.boot_id != now.boot_id:
        return "rebooted"
    return "same"


def kept(before: Known | None, now: Known) -> Known:
    """What to remember after a look: ``now``, unless the node id remembered is gone from the
    host; then what was remembered, whole (when it was last seen with its id, its boot), so
    that every look says re-provisioned until a deploy writes a new id."""
    if before is not None and before.node_id is not None and now.node_id is None:
        return before
    return now


@dataclass(frozen=True)
class Verdict:
    """One look at a host: what it is, against what the controller remembered."""

    host: str
    identity: Identity
    before: Known | None
    now: Known
    workdir: str = ""  # the host's, for the message

    @property
    def key_changed(self) -> bool:
        """The host presents another SSH key than when last seen (both known)."""
        was, key = (self.before.key if self.before else None), self.now.key
        return was is not None and key is not None and was != key

    def warning(self, now: float) -> tuple[str, str] | None:
        """``(identity, line)`` to show under the status table (None: nothing to say); the
        line is host text, to be escaped for rich. ``now``: the controller's clock (s)."""
        before = self.before
        if before is None or self.identity in ("same", "first-seen"):
            return None
        since = short_time(before.seen_at, now)
        if self.identity == "rebooted":
            return self.identity, (
                f"[{self.host}] boot id changed since {since} (processes and /dev/shm are gone): "
                "`dflashops deploy` starts what is down"
            )
        node_file = f"{self.workdir.rstrip('/')}/node.json" if self.workdir else "node.json"
        if self.now.node_id is None:
            return self.identity, (
                f"[{self.host}] the workdir's node id is gone ({node_file}, there when last seen "
                f"at {since}): the workdir was emptied or this is another machine; run deploy"
            )
        return self.identity, (
            f"[{self.host}] the workdir holds another node id than when last seen at {since} "
            f"({short_id(self.now.node_id)}, was {short_id(before.node_id)}): another machine "
            "or a new workdir; run deploy"
        )


def short_id(node_id: str | None) -> str:
    return (node_id or "none")[:8]


def short_time(iso: str | None, now: float) -> str:
    """``12:03Z`` on the day of ``now`` (UTC), else ``2026-05-01 12:03Z``; ``an unknown time``."""
    try:
        then = datetime.strptime(iso or "", ISO).replace(tzinfo=timezone.utc)
    except ValueError:
        return "an unknown time"
    today = datetime.fromtimestamp(now, timezone.utc).date()
    return then.strftime("%H:%MZ" if then.date() == today else "%Y-%m-%d %H:%MZ")


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime(ISO)
