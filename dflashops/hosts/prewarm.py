"""SSH connections opened while the controller plans: the handshakes cost the hosts' sshd and
the network's time as much as the controller's, so they run in the background from the moment
the targeted hosts are known, while pre-flight renders and checks. A host's run then finds its
connection open.

Only the SSH handshake (host key check, authentication) happens early: no command runs and
nothing is sent to a host before pre-flight passes. Starting the agents early too was measured
slower (their start on the hosts competes with pre-flight for the CPU of a shared machine). A
connection that failed is reported by the host's run (the same error it would have met); one
that no run takes (pre-flight failed, the host was not needed) is closed.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from dflashops.config.inventory import Host
from dflashops.hosts.base import BaseConnection


def _open(host: Host) -> BaseConnection:
    from dflashops.hosts.ssh import SshConnection  # paramiko: only when there is SSH to do

    conn = SshConnection(host)
    try:
        conn.open()
    except BaseException:
        conn.close()
        raise
    return conn


class Prewarm:
    def __init__(self, hosts: list[Host], forks: int) -> None:
        self._lock = threading.Lock()
        self._taken: set[str] = set()
        ssh = [h for h in hosts if not h.is_local]  # a local host has no handshake
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(forks, len(ssh))), thread_name_prefix="prewarm"
        )
        self._futures: dict[str, Future[BaseConnection]] = {
            h.name: self._pool.submit(_open, h) for h in ssh
        }

    def take(self, host: Host) -> BaseConnection | None:
        """The host's open connection (None: not warmed, connect as usual); raises what
        opening it raised."""
        with self._lock:
            future = self._futures.get(host.name)
            if future is None or host.name in self._taken:
                return None
            self._taken.add(host.name)
        return future.result()

    def close(self) -> None:
        """Close what no run took, once it is open (a half-made connection has no other
        owner); what has not started yet never starts."""
        with self._lock:
            left = [f for n, f in self._futures.items() if n not in self._taken]
            self._taken.update(self._futures)
        for future in left:
            future.cancel()
        for future in left:
            if not future.cancelled() and future.exception() is None:
                future.result().close()
        self._pool.shutdown(wait=False)
