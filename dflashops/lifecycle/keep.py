"""``keep:``: a job's outputs mirrored off the node, and restored before it starts on a host that
lost them (DESIGN "Nothing lost when a node is lost" 1-2).

The copy is the project's: ``STATE/keep/HOST/JOB/NAME/...`` beside the inventory (STATE is its
``.dflashops/``), a plain mirror of each kept path NAME, with its record beside it
(agent/keep_actions.py). ``to: HOST:/path`` puts the same files on another inventory host too
(``PATH/HOST/JOB/NAME/...``), relayed from the controller's copy with the verified upload; a
target that cannot be reached keeps the copy on the controller meanwhile, and is caught up
next time.

- ``mirror``: one keep call per kept job. Append-only files send only their new bytes, others
  by manifest; a file the copy has and the host does not is never deleted from the copy, and
  one that is shorter on the host replaces the copy only while its job runs (the job cut it).
- ``restore``: before a kept job starts (deploy; watch): the same call in protect mode (a file
  shorter on the host than in the copy is not sent, it is restored), then every file the host
  lacks or has shorter goes back, verified (transfer.py's upload), from a copy checked against
  its record first: a copy that does not match is set aside and not restored. The longer one
  always wins: a longer file on the host is never overwritten.
- One mirror or restore at a time per host, whatever process asks (a lock file per host).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflashops.agent.keep_actions import KeptCopy, Pulled, pull_kept
from dflashops.agent.transfer import Transfer, human, upload
from dflashops.changes.units import Change
from dflashops.config.playbook import Job, Keep, keep_name, keep_target_problem
from dflashops.errors import DflashopsError, HostError
from dflashops.lifecycle.ready import Readiness
from dflashops.lifecycle.session import HostSession
from dflashops.output import inert
from dflashops.plan.model import Unit
from dflashops.project import state_dir as state_dir  # where the copy lives (callers' import)

LOCK_WAIT = 600.0  # s a mirror waits for another one of the same host (another process's)


@dataclass
class KeepResult:
    """What one mirror (or restore) of one kept job did."""

    host: str
    job: str
    bytes_sent: int = 0  # what the host sent to the copy
    files: int = 0  # files the copy took (new, grown or changed)
    ok: bool = True
    error: str | None = None
    restored_bytes: int = 0
    restored_files: int = 0
    kept_bytes: int = 0  # the copy's size after it
    warnings: list[str] = field(default_factory=list)
    where: str = ""  # the copy's folder
    config: bool = False  # the error is the playbook's (file:line), not the host's


def keep_of(unit: Unit) -> Keep | None:
    return unit.spec.keep if isinstance(unit.spec, Job) else None


def kept(units: Iterable[Unit]) -> list[Unit]:
    return [u for u in units if keep_of(u) is not None]


@contextlib.contextmanager
def host_lock(keep_dir: Path, host: str, wait: float = LOCK_WAIT) -> Iterator[None]:
    """One mirror at a time per host, across processes (deploy, stop and watch)."""
    folder = keep_dir / host
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HostError(
                        host,
                        f"another dflashops has been mirroring {host}'s kept outputs for "
                        f"{wait:.0f}s ({folder / '.lock'}): not mirrored this time",
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _paths(keep: Keep) -> list[tuple[str, str]]:
    return [(keep_name(p), p.rstrip("/") or p) for p in keep.paths]


def mirror(session: HostSession, units: Iterable[Unit], state: Path) -> list[KeepResult]:
    """Mirror each kept job of ``units`` on ``session``'s host: one keep call per job (no
    facts needed; a kept session's agent is used as it is)."""
    return [_one(session, u, state, restore=False) for u in kept(units)]


def restore(
    session: HostSession, units: Iterable[Unit], state: Path, *, check: bool = False
) -> list[KeepResult]:
    """Before kept jobs start: mirror what the host has beyond the copy, then put back what
    it lacks or has shorter (``check``: only say what would be restored)."""
    return [_one(session, u, state, restore=True, check=check) for u in kept(units)]


def _one(
    session: HostSession, unit: Unit, state: Path, *, restore: bool, check: bool = False
) -> KeepResult:
    keep = keep_of(unit)
    assert keep is not None
    host = session.host.name
    result = KeepResult(host, unit.name)
    problem = keep_target_problem(keep, host, session.peers)
    if problem is not None:  # a playbook mistake (pre-flight cannot see the inventory's hosts)
        where = unit.playbook.doc.problem((*unit.source, "keep", "to"), problem)
        result.ok, result.error, result.config = False, str(where), True
        return result
    keep_dir = state / "keep"
    copy = KeptCopy(keep_dir, host, unit.name)
    result.where = str(copy.root)
    try:
        with host_lock(keep_dir, host):
            copy.load()
            mode = ("look" if check else "protect") if restore else "mirror"
            paths = _paths(keep)
            pulled = pull_kept(
                session.agent,
                session.workdir,
                copy,
                paths,
                mode=mode,
                job=unit.name,
                limit=keep.limit,
            )
            _count(result, pulled, fatal=not restore)
            if restore:
                try:
                    _put_back(session, copy, pulled, result, check)
                finally:
                    if not check:
                        copy.save()  # copies set aside are forgotten
            if not check:
                result.warnings += _relay(session, unit.name, keep, copy)
    except DflashopsError as exc:
        result.ok = False
        result.error = exc.message_for(host) if isinstance(exc, HostError) else str(exc)
    result.warnings += copy.notes
    result.kept_bytes = copy.total()
    return result


def _count(result: KeepResult, pulled: Pulled, fatal: bool) -> None:
    """What the copy took; files that did not come fail a mirror (``fatal``), and are said
    before a restore (what the host has, it keeps: the job may start)."""
    result.bytes_sent, result.files = pulled.bytes, len(pulled.written)
    result.warnings += pulled.warnings
    problems = {**pulled.answer.errors, **pulled.failed}
    if problems:
        key, why = sorted(problems.items())[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        said = f"{key}: {inert(why)}{more}; mirrored again next time"
        if fatal:
            result.ok, result.error = False, said
        else:
            result.warnings.append(f"not mirrored: {said}")


def _put_back(
    session: HostSession, copy: KeptCopy, pulled: Pulled, result: KeepResult, check: bool
) -> None:
    """Upload, per kept path, every file the host lacks or has shorter than the copy."""
    plans: dict[str, Transfer] = {}
    for key, rec in sorted(copy.records.items()):
        on_host = pulled.size_on_host(key)
        if on_host is not None and on_host >= rec.size:
            continue  # the same, or the host's is longer: it wins (and was mirrored)
        if not check and (why := copy.verify(key)) is not None:
            copy.set_aside(key, why)  # its note joins the warnings once, with the copy's others
            continue
        name, _, rel = key.partition("/")
        plans.setdefault(name, Transfer()).send.append((rel, rec.size, rec.sha256, 0))
    for name, plan in plans.items():
        result.restored_files += len(plan.send)
        result.restored_bytes += plan.bytes
        if check:
            continue
        root = pulled.answer.roots.get(name) or copy.roots.get(name)
        if root is None:
            raise HostError(session.host.name, f"the host did not say where {name} is kept")
        got = upload(session.agent, session.workdir, root, copy.root / name, plan, None)
        if not got.ok:
            why = got.error or "; ".join(f"{r}: {w}" for r, w in sorted(got.failed.items()))
            raise HostError(session.host.name, f"restoring {name} to {root} failed: {inert(why)}")


def _relay(session: HostSession, job: str, keep: Keep, copy: KeptCopy) -> list[str]:
    """``to: HOST:/path``: the copy's changed files, verified on that host too; one warning
    when it cannot be reached (the copy is on the controller meanwhile; caught up next time)."""
    target = keep.target
    if target is None:
        return []
    other, base = target
    try:
        agent = session.peer(other)
        for name, _ in _paths(keep):
            keys = [k for k in copy.records if k == name or k.startswith(f"{name}/")]
            stale = [k for k in keys if copy.records[k].relayed != copy.records[k].sha256]
            if not stale:
                continue
            plan = Transfer()
            for key in stale:
                rec = copy.records[key]
                plan.send.append((key[len(name) + 1 :], rec.size, rec.sha256, 0))
            dest = f"{base}/{session.host.name}/{job}/{name}"
            got = upload(agent, session.peer_workdir(other), dest, copy.root / name, plan, None)
            for key in stale:
                if key[len(name) + 1 :] in got.written:
                    copy.records[key].relayed = copy.records[key].sha256
            if not got.ok:
                raise HostError(other, got.error or f"{len(got.failed)} file(s) did not verify")
    except HostError as exc:
        return [f"keep.to {other}: {exc.message_for(other)}: kept on the controller meanwhile"]
    finally:
        copy.save()
    return []


# -- the spots in a deploy and a stop ---------------------------------------------------------


def said(run: Readiness, r: KeepResult) -> None:
    """One line per kept job: what its copy took (and what went back), its warnings."""
    for w in r.warnings:
        run.emit(r.job, "info", "keep", f"warning: {w}")
    if not r.ok:
        run.fail(r.job, "keep", f"keep: {r.error}")
        return
    if r.restored_files:
        verb = "would restore" if run.opts.check else "restored"
        run.emit(
            r.job,
            "changed",
            "restore",
            f"{verb} {r.restored_files} file(s) ({human(r.restored_bytes)}) from the kept copy "
            f"in {r.where}",
            restored_bytes=r.restored_bytes,
            restored_files=r.restored_files,
        )
    if run.opts.check:
        return
    if not r.files and (not r.kept_bytes or r.restored_files):
        return  # nothing new to say
    took = f"{r.files} file(s), {human(r.bytes_sent)}" if r.files else "nothing new"
    # "ok": a mirror changes the controller's copy, not the host.
    run.emit(
        r.job,
        "ok",
        "keep",
        f"kept {took}; copy {human(r.kept_bytes)} in {r.where}",
        bytes_sent=r.bytes_sent,
        files=r.files,
        kept_bytes=r.kept_bytes,
    )


def before_start(run: Readiness, state: Path | None, changes: list[Change]) -> list[Change]:
    """Kept jobs about to start: their outputs put back first. A job whose restore failed is
    not started (its next mirror would replace the copy with what it writes from scratch)."""
    units = [c.rendered.unit for c in changes if keep_of(c.rendered.unit) is not None]
    if not units or state is None:
        return changes
    for r in restore(run, units, state, check=run.opts.check):
        if r.ok or run.opts.check:
            said(run, r)
        else:
            for w in r.warnings:
                run.emit(r.job, "info", "keep", f"warning: {w}")
            why = r.error if r.config else f"its kept outputs were not restored: {r.error}"
            run.fail(r.job, "start", f"not started: {why}")
    return [c for c in changes if c.name not in run.failed]


def after(run: Readiness, state: Path | None, units: Iterable[Unit]) -> None:
    """The one mirror of a deploy or a stop, for the kept jobs not restored in it already."""
    if state is not None:
        for r in mirror(run, units, state):
            said(run, r)
