"""unlock: show who holds a host's deploy lock, and release one whose holder is stuck.

The lock is held by the holder's agent session on the host (agent/remote/lock.py), so a holder
that ended (even by kill -9) has released it already: nothing to do. What is left is a holder
alive but hung (a controller stopped with Ctrl-Z, a laptop asleep with its link still up): its
agent is ended on the host, by the pid in the holder record, and only after the host checked
that this pid still is that agent and holds that lock file. Asks on a terminal; --yes for
scripts (as trust does).
"""

from __future__ import annotations

from rich.console import Console

from dflashops.agent import Agent, lock
from dflashops.agent.lock_answers import LockAnswer
from dflashops.commands.named import Confirm, OnNamed
from dflashops.config.inventory import Host
from dflashops.errors import DflashopsError
from dflashops.hosts import connect
from dflashops.output import confirm as ask_terminal
from dflashops.output import escape


def _unlock_one(out: Console, host: Host, yes: bool, confirm: Confirm | None) -> bool:
    """The holder record and whether its agent is alive; release a held lock after
    confirmation. True when the host's lock is free at the end."""
    conn = connect(host)
    try:
        agent = Agent(conn, host.python)
        state = lock.state(agent, host.workdir)
        if not _show(out, host.name, state):
            return state.held is False
        holder = state.holder
        assert holder is not None and holder.agent_pid is not None
        if not yes and not (
            confirm or (lambda q: ask_terminal(q, "pass --yes to release the lock"))
        )(f"End that agent (pid {holder.agent_pid} on {host.name}) to release the lock? [y/N] "):
            out.print(f"\\[{host.name}] not released")
            return False
        pid, started = holder.agent_pid, holder.agent_start_time or 0
        done = lock.state(agent, host.workdir, release=(pid, started))
    finally:
        conn.close()
    if not done.ok:
        out.print(
            f"\\[{host.name}] [red]not released:[/] {escape(done.error or 'no reason given')}"
        )
        return False
    how = f"agent pid {pid} ended by {done.signalled}" if done.signalled else "its holder ended"
    out.print(
        f"\\[{host.name}] deploy lock released ({how}); the holder's run fails on this host: "
        "`dflashops status` shows where it left the units"
    )
    return True


def _show(out: Console, name: str, state: LockAnswer) -> bool:
    """Say who holds the lock; True when it is held by a live agent that may be ended."""
    holder = state.holder
    who = escape(holder.describe()) if holder is not None else "nobody on record"
    if state.error is not None:
        raise DflashopsError(f"[{name}] cannot read the deploy lock: {state.error}")
    if not state.held:
        last = f" (last held by {who})" if holder is not None else ""
        out.print(f"\\[{name}] deploy lock is free{last}")
        return False
    if not state.holder_alive or holder is None or holder.agent_pid is None:
        pids = ", ".join(map(str, state.pids)) or "a process this user cannot see"
        out.print(
            f"\\[{name}] [red]deploy lock held by {pids}, not by the agent its record names[/] "
            f"(record: {who}): not released, as nothing but a recorded dflashops agent is ever "
            "signalled; look at those processes on the host"
        )
        return False
    out.print(
        f"\\[{name}] deploy lock held by {who}; its agent on the host (pid {holder.agent_pid}) "
        "is alive"
    )
    return True


unlock = OnNamed("unlock needs --host NAMES: say which hosts' deploy locks to release", _unlock_one)
