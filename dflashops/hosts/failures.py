"""Why an SSH connection could not be made, as one line a person can act on.

paramiko says "Error reading SSH protocol banner" for a port that is not SSH (a RunPod pod's
HTTP port, the most common mistake), "No existing session" for one that sends nothing, and
logs a traceback of its own thread to stderr through Python's last-resort handler before any
of that reaches us. ``why_not`` turns each failure into a ``HostError`` naming the host, the
address and port, and what to do; ``quiet`` keeps the libraries' loggers off the terminal
unless ``-v``.
"""

from __future__ import annotations

import errno
import logging
import socket

import paramiko

from dflashops.errors import HostError
from dflashops.output import console, escape, inert, shorten, verbose

LIBRARIES = ("paramiko", "fabric", "invoke")
PORT_HINT = (
    "Check `port:` for this host in the inventory (a RunPod pod: the public port of its "
    "direct TCP mapping for 22)"
)
REFUSED = (errno.ECONNREFUSED,)


class _VerboseOnly(logging.Handler):
    """The libraries' records on stderr, one line each, with ``-v``; dropped otherwise. Being
    there at all is what keeps Python's last-resort handler (WARNING and up, tracebacks
    included) from printing them."""

    def emit(self, record: logging.LogRecord) -> None:
        if not verbose():
            return
        try:
            text = record.getMessage()
        except Exception:  # a library's bad format string must not end the run
            text = str(record.msg)
        line = f"{record.name}: {inert(text)}"
        console(stderr=True).print(f"[dim]{escape(line)}[/]")


def quiet() -> None:
    """Route paramiko's, Fabric's and Invoke's loggers through ``_VerboseOnly`` (once)."""
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _VerboseOnly) for h in logger.handlers):
            logger.addHandler(_VerboseOnly())


def why_not(
    host: str,
    address: str,
    port: int,
    exc: BaseException,
    transport: paramiko.Transport | None,
    timeout: float,
) -> HostError:
    """The connection to ``address:port`` failed with ``exc`` (``transport``: paramiko's, if
    it got that far): one line that says why and what to do."""
    at = f"{address}:{port}"
    if isinstance(exc, socket.gaierror):
        return HostError(
            host,
            f"cannot resolve {address!r} (DNS: {exc.strerror or exc}) to reach {at}",
            "Check `address:` for this host in the inventory",
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errors = list(exc.errors.values())
        if all(getattr(e, "errno", None) in REFUSED for e in errors):
            return refused(host, at)
        why = "; ".join(sorted({getattr(e, "strerror", None) or str(e) for e in errors}))
        return HostError(
            host,
            f"cannot connect to {at}: {why}",
            "Check `address:` and `port:` for this host in the inventory, and that it is up",
        )
    if isinstance(exc, ConnectionRefusedError):
        return refused(host, at)
    if isinstance(exc, TimeoutError):
        return HostError(
            host,
            f"timed out after {timeout:.0f}s connecting to {at}",
            "The host is down or a firewall drops that port: check `address:` and `port:` for "
            "this host in the inventory",
        )
    if isinstance(exc, (paramiko.SSHException, EOFError)) and not (
        transport is not None and transport.remote_version
    ):
        return HostError(host, _not_ssh(exc, at, timeout), PORT_HINT)
    return HostError(host, f"cannot connect to {at}: {exc or type(exc).__name__}")


def refused(host: str, at: str) -> HostError:
    return HostError(
        host,
        f"connection refused at {at}: is sshd running there and is the port right?",
        "Check `port:` for this host in the inventory (a re-provisioned node often gets a new "
        "SSH port)",
    )


def _not_ssh(exc: BaseException, at: str, timeout: float) -> str:
    """What a port that is not SSH did, from paramiko's words and the error under them."""
    text = str(exc)
    if text.startswith("Indecipherable protocol version"):
        said = shorten(inert(text.partition('"')[2].rstrip('"')), 60)
        return f"no SSH server at {at}: it answered {said!r}, not an SSH banner"
    if isinstance(exc.__context__, TimeoutError) or "No existing session" in text:
        return (
            f"timed out after {timeout:.0f}s waiting for an SSH banner from {at}: not an SSH "
            "server, or a wedged one"
        )
    return f"no SSH server at {at}: it closed the connection without sending an SSH banner"
