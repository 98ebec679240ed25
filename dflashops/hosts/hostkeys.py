"""Host identity: strict by default, pinned or known, never silently accepted.

Fabric installs paramiko's AutoAddPolicy and never reads known_hosts, which is how a
re-provisioned node (new port, new key) can be talked to without anyone noticing. Here a host's
key must be pinned in the inventory (`host_key`), or known from the user's known_hosts or
dflashops' own known_hosts file; `accept-new` records a key on first contact only. A changed key
is always refused with both fingerprints and the command that re-trusts it on purpose.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import paramiko

from dflashops.errors import HostError

KNOWN_HOSTS_ENV = "DFLASHOPS_KNOWN_HOSTS"


def own_known_hosts() -> Path:
    """dflashops' own known_hosts ($DFLASHOPS_KNOWN_HOSTS, else ~/.config/dflashops/known_hosts)."""
    env = os.environ.get(KNOWN_HOSTS_ENV)
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "dflashops" / "known_hosts"


def key_name(hostname: str, port: int) -> str:
    """How known_hosts names a host: bare for port 22, `[host]:port` otherwise."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def parse_key_line(line: str) -> paramiko.PKey:
    """'ssh-ed25519 AAAA...' -> key object (validated by the inventory model already)."""
    kind, data = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(data))


@dataclass(frozen=True)
class KnownKey:
    key: paramiko.PKey
    source: str  # where it came from, for messages


def lookup(name: str, pinned: str | None, user_files: list[Path]) -> list[KnownKey]:
    """The keys a host may present. A pin beats everything; otherwise dflashops' own file beats
    the user's known_hosts (so `dflashops trust` after a re-provision takes effect)."""
    if pinned:
        return [KnownKey(parse_key_line(pinned), "the inventory's host_key")]
    for path in [own_known_hosts(), *user_files]:
        if not path.is_file():
            continue
        keys = paramiko.HostKeys()
        try:
            keys.load(str(path))
        except (OSError, paramiko.SSHException) as exc:
            raise HostError(name, f"cannot read known_hosts file {path}: {exc}") from None
        entry = keys.lookup(name)
        if entry:
            return [KnownKey(entry[kind], str(path)) for kind in entry]
    return []


class UnknownHostKey(HostError):
    pass


class ChangedHostKey(HostError):
    pass


def unknown_message(host: str, name: str, key: paramiko.PKey) -> str:
    return (
        f"host key of {name} is unknown: it presents {key.get_name()} {fingerprint(key)}. "
        f"Check that fingerprint out of band, then run `dflashops trust --host {host}` "
        "(or pin `host_key:` in the inventory, or set `host_key_policy: accept-new`). "
        "Nothing was done on this host."
    )


def changed_message(host: str, name: str, presented: paramiko.PKey, expected: KnownKey) -> str:
    return (
        f"host key of {name} CHANGED: it presents {presented.get_name()} {fingerprint(presented)}, "
        f"but {expected.source} has {expected.key.get_name()} {fingerprint(expected.key)}. "
        f"If the node was re-provisioned (new port, new key), verify the new fingerprint and run "
        f"`dflashops trust --host {host}`; otherwise someone may be in the middle. "
        "Nothing was done on this host."
    )


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Reject unknown keys (strict) or record them on first contact (accept-new)."""

    def __init__(self, host: str, policy: Literal["strict", "accept-new"]) -> None:
        self.host = host
        self.policy = policy

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if self.policy != "accept-new":
            raise UnknownHostKey(self.host, unknown_message(self.host, hostname, key))
        record(hostname, key)


def record(name: str, key: paramiko.PKey) -> Path:
    """Put ``name``'s key into dflashops' own known_hosts, replacing any older entry for it.

    First contacts run in parallel (`accept-new`, prewarm, `--forks 64`): each record holds an
    exclusive lock on a file beside known_hosts while it re-reads, merges and writes, so no
    record overwrites another's (without it, 16 parallel records kept 4). Written atomically (a
    temporary file, then a rename): a crash never leaves a half-written file."""
    path = own_known_hosts()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        kept: list[str] = []
        if path.is_file():
            for line in path.read_text().splitlines():
                fields = line.split()
                if fields and not line.startswith("#") and _names_match(fields[0], name):
                    continue
                kept.append(line)
        kept.append(f"{name} {key.get_name()} {key.get_base64()}")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".known_hosts.")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write("\n".join(kept) + "\n")
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` (not on known_hosts itself, which the rename
    replaces: a lock on the old file would not exclude a writer that opened the new one)."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _names_match(field: str, name: str) -> bool:
    for entry in field.split(","):
        if entry.startswith("|1|"):
            salt = entry.split("|")[2]
            if paramiko.HostKeys.hash_host(name, salt) == entry:
                return True
        elif entry == name:
            return True
    return False
