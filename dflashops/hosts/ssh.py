"""SSH connections through Fabric/paramiko, with strict host keys and honest errors.

Fabric gives us ~/.ssh/config (HostName, Port, User, IdentityFile, ProxyJump) and the paramiko
client; we replace its AutoAddPolicy with our own, load the keys the host may present, and run
commands on raw session channels so that stdin bytes, exit codes and timeouts are exact.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config
from fabric import Connection as FabricConnection

from dflashops.config.inventory import Host
from dflashops.errors import HostError
from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import CommandTimeout, Result, Sink, Stream, StreamEnded
from dflashops.hosts.failures import quiet, why_not
from dflashops.hosts.hostkeys import (
    ChangedHostKey,
    KnownKey,
    StrictPolicy,
    changed_message,
    key_name,
    lookup,
)
from dflashops.hosts.untrusted import keep_tail
from dflashops.output import shorten, trace, verbose

CONNECT_TIMEOUT = 15.0
KEEPALIVE = 30
quiet()  # paramiko's tracebacks of expected failures stay off the terminal (but with -v)


SEND_PIECE = 1 << 18


class SshStream(Stream):
    """A command kept running on one channel of the host's connection."""

    def __init__(self, host: str, channel: paramiko.Channel) -> None:
        self.host = host
        self.channel = channel
        self.buffer = bytearray()
        self.scanned = 0  # bytes of buffer known to hold no newline

    def send(self, data: bytes) -> None:
        # paramiko's sendall re-slices what is left after every packet: quadratic in the size
        # (48 MiB took 25 s). Bounded pieces keep each copy small.
        view = memoryview(data)
        try:
            for start in range(0, len(view), SEND_PIECE):
                self.channel.sendall(bytes(view[start : start + SEND_PIECE]))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise StreamEnded(self.host, f"the kept command's channel is gone: {exc}") from None

    def receive(self, wait: float) -> bytes:
        if self.channel.recv_ready():
            return self.channel.recv(1 << 16)
        if self.channel.closed or self.channel.exit_status_ready() or self.channel.eof_received:
            # Its last bytes may have landed between the first look and this one (the transport
            # thread takes data, then the end): read them before saying it ended.
            if self.channel.recv_ready():
                return self.channel.recv(1 << 16)
            raise StreamEnded(self.host, "the kept command ended")
        select.select([self.channel], [], [], min(wait, 0.5))
        return self.channel.recv(1 << 16) if self.channel.recv_ready() else b""

    def kill(self) -> None:
        self.close()

    def ending(self) -> Result:
        code = -1
        # The channel's EOF can come a moment before its exit status: wait for it briefly,
        # or a missing python (127) reads as -1, "the agent failed".
        if self.channel.status_event.wait(2.0):
            code = self.channel.recv_exit_status()
        err = bytearray()
        with contextlib.suppress(Exception):
            while self.channel.recv_stderr_ready():
                keep_tail(err, self.channel.recv_stderr(1 << 16))
        return Result("agent stream", code, bytes(self.buffer), bytes(err))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()
            self.channel.close()


def user_known_hosts(conn: FabricConnection) -> list[Path]:
    files = conn.ssh_config.get("userknownhostsfile")
    names = files.split() if isinstance(files, str) else (files or ["~/.ssh/known_hosts"])
    return [Path(n).expanduser() for n in names]


def _prepare_keys(conn: FabricConnection, host: Host, pinned: str | None) -> list[KnownKey]:
    """Make ``conn`` (and its ProxyJump gateways) check host keys our way; returns the keys
    accepted for the target itself."""
    client: paramiko.SSHClient = conn.client
    name = key_name(conn.host, conn.port)
    known = lookup(name, pinned, user_known_hosts(conn))
    for entry in known:
        client.get_host_keys().add(name, entry.key.get_name(), entry.key)
    client.set_missing_host_key_policy(StrictPolicy(host.name, host.host_key_policy))
    if isinstance(conn.gateway, FabricConnection):
        # Jump hosts are held to the same rule; they have no pin of their own.
        _prepare_keys(conn.gateway, host, None)
    return known


# AES-GCM first: paramiko's default order puts CTR first, and GCM moved 2x the bytes per
# second over loopback here (385 against 196 MB/s); hosts without it still negotiate CTR.
_DEFAULT_CIPHERS: tuple[str, ...] = getattr(paramiko.Transport, "_preferred_ciphers", ())
GCM_FIRST = tuple(sorted(_DEFAULT_CIPHERS, key=lambda c: "gcm" not in c))  # stable: order kept


def no_delay(transport: paramiko.Transport) -> None:
    """TCP_NODELAY on the connection's socket. Paramiko leaves Nagle on, and a command's small
    writes (exec request, stdin, EOF) then wait for the server's delayed ACK: 40 ms added to
    every command on Linux (measured: `true` 47.6 ms -> 5.1 ms; bench/bench_vs_fabric.py).
    Through a ProxyJump the "socket" is a channel: nothing to set."""
    sock = getattr(transport, "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def transport_factory(*args: Any, **kwargs: Any) -> paramiko.Transport:
    transport = paramiko.Transport(*args, **kwargs)
    if GCM_FIRST:
        transport.get_security_options().ciphers = GCM_FIRST
    return transport


def fabric_connection(host: Host, timeout: float = CONNECT_TIMEOUT) -> FabricConnection:
    assert host.address is not None  # the inventory loader guarantees it for ssh hosts
    # A port that accepts TCP but never speaks SSH must fail in `timeout`, not paramiko's 15 s+.
    connect_kwargs: dict[str, Any] = {
        "banner_timeout": timeout,
        "auth_timeout": timeout,
        "transport_factory": transport_factory,
    }
    if host.key_file:
        connect_kwargs["key_filename"] = [str(Path(host.key_file).expanduser())]
    return FabricConnection(
        host.address,
        user=host.user,
        port=host.port,
        config=Config(),
        connect_timeout=int(timeout),
        connect_kwargs=connect_kwargs,
    )


class SshConnection(BaseConnection):
    def __init__(self, host: Host, timeout: float = CONNECT_TIMEOUT) -> None:
        self.host = host.name
        self.spec = host
        self.timeout = timeout
        self.fabric = fabric_connection(host, timeout)

    @property
    def where(self) -> str:
        return f"{self.fabric.user}@{self.fabric.host}:{self.fabric.port}"

    def open(self) -> None:
        if self.fabric.is_connected:
            return
        started = time.monotonic()
        known = _prepare_keys(self.fabric, self.spec, self.spec.host_key)
        try:
            self.fabric.open()
        except Exception as exc:
            failure = self._refusal(exc, known)
            # paramiko's thread would wait out its banner timeout (and log) after we report
            with contextlib.suppress(Exception):
                self.fabric.client.close()
            if failure is None:
                raise  # not a connection failure: a bug, shown as one
            raise failure from None
        transport = self.fabric.client.get_transport()
        if transport is not None:
            transport.set_keepalive(KEEPALIVE)
            no_delay(transport)
        if verbose():
            trace(self.host, f"connect {self.where}", time.monotonic() - started)

    def _refusal(self, exc: Exception, known: list[KnownKey]) -> HostError | None:
        """``exc`` from opening the connection as one line: the host, where, what to do (None:
        not a failure to connect)."""
        if isinstance(exc, paramiko.BadHostKeyException):
            expected = next((k for k in known if k.key.get_name() == exc.key.get_name()), None)
            expected = expected or KnownKey(exc.expected_key, "known_hosts")
            name = key_name(self.fabric.host, self.fabric.port)
            return ChangedHostKey(self.host, changed_message(self.host, name, exc.key, expected))
        if isinstance(exc, HostError):  # the host key policy's own refusal
            return exc
        if isinstance(exc, paramiko.AuthenticationException):
            keys = self.fabric.connect_kwargs.get("key_filename") or [
                "(none given: agent and ~/.ssh defaults)"
            ]
            said = str(exc).rstrip(".") or type(exc).__name__
            return HostError(
                self.host,
                f"authentication failed for {self.where} with key(s) {', '.join(map(str, keys))}: {said}",
                "Check `user` and `key_file` in the inventory and that the public key is in the host's authorized_keys.",
            )
        if not isinstance(exc, (paramiko.SSHException, OSError, EOFError)):
            return None
        transport = self.fabric.client.get_transport()
        return why_not(self.host, self.fabric.host, self.fabric.port, exc, transport, self.timeout)

    def execute(
        self, shell: str, input: Iterable[bytes], timeout: float | None, sink: Sink | None
    ) -> tuple[int, bytes, bytes]:
        self.open()
        transport = self.fabric.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostError(self.host, f"connection to {self.where} is closed")
        self.commands += 1
        channel: paramiko.Channel | None = None
        try:
            channel = transport.open_session(timeout=self.timeout)
            channel.exec_command(shell)
            self._send(channel, input)
            out, err = self._collect(channel, shell, timeout, sink)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostError(
                self.host,
                f"connection to {self.where} lost while running {shown(shell)}: {exc or type(exc).__name__}",
            ) from None
        except BaseException:  # the sink refused what came (too large, unwritable): end it now
            if channel is not None:
                channel.close()
            raise
        code = channel.recv_exit_status()
        channel.close()
        if code == -1:
            raise HostError(
                self.host,
                f"connection to {self.where} lost: no exit status for {shown(shell)}",
            )
        return code, out, err

    def _send(self, channel: paramiko.Channel, data: Iterable[bytes]) -> None:
        """Send stdin (all of it before reading output: the agent answers only at its end).
        A command that exits early (a full disk, a failed check) closes the channel under us:
        its exit status and stderr are its answer, not a lost connection. (As with a local
        pipe, input it never read is simply dropped.)"""
        try:
            for chunk in data:
                sent = 0
                while sent < len(chunk):
                    sent += channel.send(chunk[sent : sent + (1 << 16)])
            channel.shutdown_write()
        except OSError:
            if not channel.exit_status_ready() and not channel.closed:
                raise

    def _collect(
        self, channel: paramiko.Channel, shell: str, timeout: float | None, sink: Sink | None
    ) -> tuple[bytes, bytes]:
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = False
            while channel.recv_ready():
                data = channel.recv(1 << 16)
                if sink is None:
                    out += data
                else:
                    sink(data)
                got = True
            while channel.recv_stderr_ready():
                keep_tail(err, channel.recv_stderr(1 << 16))
                got = True
            if (
                channel.exit_status_ready()
                and not channel.recv_ready()
                and not channel.recv_stderr_ready()
            ):
                return bytes(out), bytes(err)
            if channel.closed and not got:
                return bytes(out), bytes(err)
            if deadline is not None and time.monotonic() > deadline:
                channel.close()
                raise CommandTimeout(
                    self.host,
                    f"command timed out after {timeout:.0f}s (it may still be running on the host): {shorten(shell, 200)}",
                )
            if not got:
                select.select([channel], [], [], 0.05)

    def keep(self, shell: str) -> SshStream:
        self.open()
        transport = self.fabric.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostError(self.host, f"connection to {self.where} is closed")
        self.commands += 1
        try:
            channel = transport.open_session(timeout=self.timeout)
            channel.exec_command(shell)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise StreamEnded(self.host, f"connection to {self.where} lost: {exc}") from None
        return SshStream(self.host, channel)

    def host_key(self) -> paramiko.PKey:
        """The key the server presents (no authentication, nothing recorded): for `trust`."""
        sock: Any
        at = (self.fabric.host, self.fabric.port)
        if isinstance(self.fabric.gateway, FabricConnection):
            _prepare_keys(self.fabric.gateway, self.spec, None)
            sock = self.fabric.open_gateway()
        else:
            try:
                sock = socket.create_connection(at, timeout=self.timeout)
            except OSError as exc:
                raise why_not(self.host, *at, exc, None, self.timeout) from None
        transport = paramiko.Transport(sock)
        try:
            transport.start_client(timeout=self.timeout)
            return transport.get_remote_server_key()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise why_not(self.host, *at, exc, transport, self.timeout) from None
        finally:
            transport.close()

    def key_name(self) -> str:
        return key_name(self.fabric.host, self.fabric.port)

    def close(self) -> None:
        self.fabric.close()


def shown(shell: str) -> str:
    """A command in a message: the agent's bootstrap (a page of Python) by name, anything else
    quoted and shortened."""
    return "the dflashops agent" if "<dflashops-agent>" in shell else repr(shorten(shell, 120))
