"""The controller's side of a host's deploy lock (DESIGN "Trust boundary" 3: one actor per host).

``deploy``, ``restart-servers`` and ``stop`` take it first on each host, through the agent
session they keep for the whole run (the host side is ``remote/lock.py``), and hold it until
that session ends: the host's kernel releases it however the controller ends. A second actor is
refused at once with the holder named, or waits with ``--lock-wait``. Read-only commands never
come here.
"""

from __future__ import annotations

import getpass
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dflashops.agent.client import SLACK, Agent
from dflashops.agent.lock_answers import LockAnswer, LockHolder
from dflashops.errors import HostBusy, HostError
from dflashops.output import duration

CHUNK = 5.0  # s the host retries per call: a Ctrl-C on the controller is heard between calls


def acquire(agent: Agent, workdir: str, holder: dict[str, Any], wait: float = 0.0) -> LockAnswer:
    """Take the host's deploy lock in ``agent``'s kept session (held until it ends, released
    by the host's kernel however it ends); ``wait``: seconds the host retries while another
    holds it. Refused: ``ok`` false and ``holder`` names them."""
    request = kept_request(agent, workdir, holder, wait)
    got = agent.validate(LockAnswer, agent.call("lock", request, timeout=wait + SLACK), "lock")
    if got.ok:
        agent.locked = request  # taken again by a new session if this one ends mid-run
    return got


def acquire_ahead(
    agent: Agent, workdir: str, holder: dict[str, Any], refused: Callable[[LockAnswer], None]
) -> None:
    """``acquire`` with no wait, its request riding with the session's next call (a no-op
    deploy stays one round trip); ``refused`` gets the answer when it is not taken, and raises."""
    request = kept_request(agent, workdir, holder, 0.0)

    def then(data: dict[str, Any]) -> None:
        got = agent.validate(LockAnswer, data, "lock")
        if not got.ok:
            refused(got)
        agent.locked = request

    agent.kept().send_ahead("lock", request, then)


def kept_request(agent: Agent, workdir: str, holder: dict[str, Any], wait: float) -> dict[str, Any]:
    if not agent.keep:
        raise ValueError("the deploy lock is held by a kept session: Agent(keep=True)")
    return {"workdir": workdir, "op": "acquire", "holder": holder, "wait": wait}


def state(agent: Agent, workdir: str, release: tuple[int, int] | None = None) -> LockAnswer:
    """The deploy lock's holder record and state (holding nothing); with ``release`` (agent
    pid, start time as shown): end that holding agent first, as the host checks it may."""
    request: dict[str, Any] = {"workdir": workdir, "op": "show"}
    if release is not None:
        request.update(op="release", pid=release[0], start_time=release[1])
    return agent.validate(LockAnswer, agent.call("lock", request, timeout=2 * SLACK), "lock")


def holder(command: str) -> dict[str, object]:
    """Who takes the lock: user@machine of this controller, the command, this process."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a bare container): the record still names the machine
        user = f"uid{os.getuid()}"
    return {
        "who": f"{user}@{socket.gethostname()}",
        "command": f"dflashops {command}",
        "controller_pid": os.getpid(),
    }


def refusal(host: str, found: LockHolder | None, waited: float) -> str:
    """``host h1 is locked by alice@laptop (dflashops deploy, since ..., pid 1234): ...``"""
    who = found.describe() if found is not None else "another actor (no holder record)"
    after = f" after waiting {duration(waited)}" if waited > 0 else ""
    return (
        f"host {host} is locked by {who}{after}: wait with --lock-wait 5m, or release a stuck "
        f"lock with `dflashops unlock --host {host}`"
    )


def take(
    agent: Agent,
    workdir: str,
    command: str,
    wait: float,
    abort: threading.Event,
    waiting: Callable[[str], None],
) -> None:
    """Hold the host's deploy lock in ``agent``'s session, waiting up to ``wait`` s for it;
    ``waiting(text)`` is told once who it waits for. HostError when it is not free in time.
    With no wait, the request rides with the session's next call (no round trip of its own):
    a refusal is raised by that call, before anything else happens on the host."""
    me = holder(command)
    if wait <= 0:

        def refused(got: LockAnswer) -> None:
            if got.error is not None:
                raise HostError(agent.host, f"cannot take the deploy lock: {got.error}")
            raise HostBusy(agent.host, refusal(agent.host, got.holder, 0.0))

        acquire_ahead(agent, workdir, me, refused)
        return
    started = time.monotonic()
    told = False
    while True:
        left = wait - (time.monotonic() - started)
        got = acquire(agent, workdir, me, max(0.0, min(left, CHUNK)))
        if got.ok:
            return
        if got.error is not None:
            raise HostError(agent.host, f"cannot take the deploy lock: {got.error}")
        waited = time.monotonic() - started
        if abort.is_set():
            raise HostError(agent.host, "interrupted (Ctrl-C) while waiting for the deploy lock")
        if waited >= wait:
            raise HostBusy(agent.host, refusal(agent.host, got.holder, waited if wait else 0.0))
        if not told:
            who = got.holder.describe() if got.holder is not None else "another actor"
            waiting(f"locked by {who}: waiting up to {duration(wait)} (--lock-wait)")
            told = True
