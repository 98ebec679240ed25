"""Rollback on one host: back to a kept revision's scripts, verified like a deploy.

Under the host's deploy lock (``HostRun.take_lock``): the facts, the host's history, the
revision (``changes.history.pick``: the one asked, else the one before the newest; a revision
whose scripts were pruned is refused with the kept ones named), the units whose kept script
differs from what their folder holds, then ``HostRun.put_back``: stop, the kept files put back
on the host (copied there, sha256 checked), start, readiness and identity against the kept
fingerprint. The rollback is itself a revision (command ``rollback``), and the units it put
back are ``rolled back`` in ``status`` until a deploy changes them again.
"""

from __future__ import annotations

from dataclasses import replace

from dflashops.agent import history_actions
from dflashops.changes.history import pick, to_restart
from dflashops.changes.units import Change
from dflashops.errors import HostError
from dflashops.lifecycle.deploy import HostRun


def rollback(run: HostRun, to: int | None, names: list[str] | None) -> None:
    run.take_lock("rollback")
    facts = run.gather()
    revisions = history_actions.listing(run.agent, run.workdir).revisions
    target = pick(revisions, to, run.host.name)
    if isinstance(target, str):
        refused = HostError(run.host.name, f"{target}; nothing was done")
        refused.reached = True  # the host answered: failed, not unreachable
        raise refused
    going = to_restart(target, {n: u.script_sha256 for n, u in facts.units.items()}, names)
    if not going:
        run.emit(
            None,
            "ok",
            "rollback",
            f"every unit already has revision {target.revision}'s script: nothing to do",
        )
        return
    shown = history_actions.show(run.agent, run.workdir, target.revision)
    changes = []
    for name in going:
        r = run.by_name.get(name)
        script = shown.launch.get(name)
        if r is None:
            # Readiness (port, health, timeouts) comes from the playbook that defines it.
            run.fail(
                name,
                "rollback",
                f"no playbook defines {name} for this host now: not rolled back "
                "(deploy the playbook that has it, or `dflashops stop --unit` it)",
            )
            continue
        if script is None:
            run.fail(name, "rollback", f"revision {target.revision} kept no script of {name}")
            continue
        kept = target.kept[name]
        old = replace(r, script=script, fingerprint=kept.fingerprint or r.fingerprint)
        uf = facts.unit(name)
        changes.append(
            Change(
                old,
                "restart" if uf is not None and uf.running else "start",
                f"rollback to revision {target.revision}",
                old_fingerprint=uf.fingerprint if uf is not None else None,
            )
        )

    def restore(names: list[str]) -> None:
        history_actions.restore(run.agent, run.workdir, target.revision, names)

    try:
        run.put_back(changes, restore)
    finally:
        run.record("rollback", rollback_to=target.revision)
