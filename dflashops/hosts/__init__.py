"""Talking to hosts, transport only: connections (ssh, local) and host keys."""

from __future__ import annotations

from dflashops.config.inventory import Host
from dflashops.hosts.base import BaseConnection


def connect(host: Host) -> BaseConnection:
    """A connection of the host's kind; SSH connects lazily on the first command."""
    if host.is_local:
        from dflashops.hosts.local import LocalConnection

        return LocalConnection(host.name, host.env)  # not the controller's environment
    from dflashops.hosts.ssh import SshConnection

    return SshConnection(host)
