"""What `watch` decides for one host, call by call. Pure: what the host's last call said (or
why it failed), what watch remembers of the host and the clock in; the host's new memory, the
units to start, the notices to send and the words of its line out (lifecycle/watch.py calls the
host and acts; DESIGN.md "Nothing lost when a node is lost" 3, 5 and 7).

Rules:

- Never act on a failed call. A host is ``lost`` only once ``--lost-after`` has gone by since
  the first failed call in a row and the call made then fails too. Meanwhile it is called with
  backoff (the interval, then twice that, four times, eight times at most), and at once when
  ``--lost-after`` is up. A blip restarts nothing: units are judged on the host's own records
  when it answers again.
- A changed (or unknown) host key stops everything on that host (``untrusted``) and notifies
  ``key_changed`` once, until the key is trusted: the next call that connects ends it.
- A unit is started again when it should run and does not, and nobody decided so: gone with
  its supervisor (killed with it, a reboot: its supervisor's record still says it runs), or
  not on the host (a host back empty, a unit never started). One its supervisor gave up on
  (``crashed``) is reported, and started only with ``--heal crashed``. Watch never stops nor
  restarts a running unit (one that runs an older rendering is reported: deploy restarts it),
  never starts a unit `stop` stopped, nor a job that ended (done or failed) by itself.
- Each notice is sent once, on its transition: host_lost, host_back, reprovisioned,
  key_changed, redeployed, restored, job_done.
- Memory is bounded: a host's memory is a few numbers and one word per unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from dflashops.agent.answers import HostFacts, UnitFacts
from dflashops.changes.identity import Known, judge
from dflashops.config.playbook import Job
from dflashops.engines.render import Rendered
from dflashops.output import duration

HostState = Literal["new", "up", "failing", "lost", "untrusted"]
Word = Literal[
    "running",  # alive, as rendered
    "restarting",  # its supervisor is bringing it back (backoff, waiting for GPUs)
    "outdated",  # alive, but not what the playbooks render now
    "gone",  # not alive, and its supervisor did not end it: killed with it, or a reboot
    "absent",  # not on the host (never started there, or the host came back empty)
    "crashed",  # its supervisor gave up (restart_limit)
    "stopped",  # `dflashops stop` stopped it
    "done",  # a job that ended with exit 0
    "failed",  # a job that ended otherwise, by itself
    "exited",  # a service that ended by itself, and its restart policy let it
]
BACKOFF_CAP = 8  # a failing host is called at most every interval x 8
DOWN: frozenset[str] = frozenset({"gone", "absent"})  # started again by watch
USABLE: frozenset[str] = frozenset({"running", "done"})  # a need that lets a unit start
HEALS = ("crashed",)  # --heal choices


@dataclass(frozen=True)
class Settings:
    interval: float  # s between calls to a host that answers
    lost_after: float  # s of failed calls in a row before a host is lost
    heal: frozenset[str] = frozenset()  # "crashed": start crashed units too


def refusal(interval: float, lost_after: float) -> str | None:
    """Why these settings are refused (None: they are fine)."""
    if lost_after < interval:
        return (
            f"--lost-after {duration(lost_after)} is shorter than --interval {duration(interval)}: "
            "a host would be lost before a second call could reach it; give --lost-after at "
            "least the interval (default 2m)"
        )
    return None


# ------------------------------------------------------------------------------- one call


@dataclass(frozen=True)
class UnitSeen:
    word: Word
    kind: str = "service"  # service | job
    needs: tuple[str, ...] = ()  # units of this host it needs
    detail: str = ""  # exit code, pid: for the line
    keep_every: float | None = None  # a job with keep: its outputs are mirrored this often
    spans: bool = False  # a part of a unit over several hosts


@dataclass(frozen=True)
class Looked:
    """One call to a host: what it said, or why it said nothing."""

    failure: str | None = None  # the call failed: why (None: the host answered)
    untrusted: bool = False  # ... because its host key changed or is unknown
    node_id: str | None = None
    boot_id: str | None = None
    units: Mapping[str, UnitSeen] = field(default_factory=dict)  # in start order


def unit_word(r: Rendered | None, uf: UnitFacts | None) -> Word:
    """The unit's state for watch, from its records on the host (``r``: what the playbooks
    render for it; None: a unit only the host records)."""
    if uf is None or (uf.pid is None and uf.exit is None and uf.unit is None):
        return "absent"
    if uf.running:
        if r is not None and uf.fingerprint != r.fingerprint:
            return "outdated"
        if uf.supervisor is not None and uf.supervisor.restarting:
            return "restarting"
        return "running"
    supervised = uf.supervisor.state if uf.supervisor is not None else None
    if uf.stopped is None and (uf.crashed is not None or supervised == "crashed"):
        return "crashed"
    if uf.stopped is not None:
        return "stopped"
    job = (r.unit.kind if r is not None else (uf.unit.kind if uf.unit else None)) == "job"
    code = uf.exit.code if uf.exit is not None else None
    if job and code == 0:
        return "done"
    # Its supervisor ended by itself (its policy), or, with no supervisor record, the unit
    # left its exit behind: it ended, nobody killed it.
    ended = supervised == "ended" or (supervised is None and code is not None)
    if ended:
        return "failed" if job else "exited"
    if supervised is None and uf.pid is None:
        return "absent"  # its files are there, it never started
    return "gone"


def detail_of(uf: UnitFacts | None) -> str:
    if uf is None:
        return ""
    if uf.running and uf.process.pid is not None:
        return f"pid {uf.process.pid}"
    if uf.exit is not None and uf.exit.code is not None:
        return f"exit {uf.exit.code}"
    return ""


def looked_at(rendered: Sequence[Rendered], facts: HostFacts, recorded: bool = False) -> Looked:
    """A host's answer, judged: each unit the playbooks put there by its word, and with
    ``recorded`` (a playbook does not load) every other unit the host records too."""
    units: dict[str, UnitSeen] = {}
    names = {r.unit.name for r in rendered}
    for r in rendered:
        uf = facts.unit(r.unit.name)
        needs = tuple(n for n in r.unit.needs if n in names)
        keep = r.unit.spec.keep if isinstance(r.unit.spec, Job) else None
        every = keep.every if keep is not None else None
        word = unit_word(r, uf)
        spans = r.unit.multi_node or bool(r.unit.cluster)
        units[r.unit.name] = UnitSeen(word, r.unit.kind, needs, detail_of(uf), every, spans)
    if recorded:
        for name, uf in sorted(facts.units.items()):
            if name not in names:
                kind = (uf.unit.kind if uf.unit else None) or "service"
                units[name] = UnitSeen(unit_word(None, uf), kind, (), detail_of(uf))
    return Looked(node_id=facts.node_id, boot_id=facts.boot_id, units=units)


# ------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class History:
    """What watch remembers of a host between calls (bounded: one word per unit)."""

    state: HostState = "new"
    due: float = 0.0  # when to call it next (the caller's clock)
    failed_calls: int = 0  # in a row
    failing_since: float | None = None  # the first failed call in a row
    node_id: str | None = None  # as last seen (or remembered by lifecycle/memory.py)
    boot_id: str | None = None
    words: Mapping[str, Word] = field(default_factory=dict)
    back: str | None = None  # "re-provisioned" | "rebooted": redeployed notice still owed
    mirrored: Mapping[str, float] = field(default_factory=dict)  # kept job -> its last mirror
    said: tuple[object, ...] = ()  # what its last line said (a line is printed on a change)


@dataclass(frozen=True)
class Notice:
    event: str  # host_lost | host_back | reprovisioned | key_changed | redeployed | restored | job_done
    details: Mapping[str, object] = field(default_factory=dict)


Status = Literal["ok", "changed", "failed", "unreachable", "waiting"]


@dataclass(frozen=True)
class Step:
    history: History
    status: Status
    text: str  # the host's line: what it saw (and what it does about it)
    notices: tuple[Notice, ...] = ()
    start: tuple[str, ...] = ()  # units to start, in start order
    deploy: tuple[str, ...] = ()  # what the deploy is given: ``start`` and what they need
    why: str = "drift"  # drift | rebooted | re-provisioned | crashed
    seen: str = ""  # ``text`` without what it is about to do
    mirror: tuple[str, ...] = ()  # kept jobs whose outputs are to be mirrored now
    warnings: tuple[str, ...] = ()  # what the mirrors warned of

    @property
    def changed(self) -> bool:
        """Whether its line says something the last one did not (or it acts, or notifies)."""
        return bool(self.start or self.notices) or self.history.said != self.key

    @property
    def key(self) -> tuple[object, ...]:
        h = self.history
        return (h.state, self.status, tuple(sorted(h.words.items())), self.start)


def backoff(failed_calls: int, settings: Settings) -> float:
    """The wait before the next call after ``failed_calls`` failed ones in a row."""
    return settings.interval * min(BACKOFF_CAP, 1 << max(0, min(failed_calls - 1, 8)))


def step(h: History, seen: Looked, now: float, s: Settings, converge: str | None = None) -> Step:
    """The host's next memory, line, notices and units to start after one call (``now``: the
    caller's clock, in seconds). ``converge``: why units are not to be started (a playbook
    that does not load); None: they are."""
    if seen.untrusted:
        return _untrusted(h, seen, now, s)
    if seen.failure is not None:
        return _failed(h, seen.failure, now, s)
    return _answered(h, seen, now, s, converge)


def _untrusted(h: History, seen: Looked, now: float, s: Settings) -> Step:
    notices = () if h.state == "untrusted" else (Notice("key_changed", {"why": seen.failure}),)
    mem = replace(h, state="untrusted", due=now + s.interval, failed_calls=0, failing_since=None)
    text = (
        f"{seen.failure} Watch does nothing on this host until its key is trusted; it sees the "
        "new trust at its next call."
    )
    return Step(mem, "failed", text, notices)


def _failed(h: History, why: str, now: float, s: Settings) -> Step:
    since = now if h.failing_since is None else h.failing_since
    calls = h.failed_calls + 1
    down = now - since
    lost = h.state == "lost" or down >= s.lost_after
    if lost:
        due = now + s.interval * BACKOFF_CAP
    else:
        due = min(now + backoff(calls, s), since + s.lost_after)
    state: HostState = "lost" if lost else "failing"
    mem = replace(h, state=state, due=due, failed_calls=calls, failing_since=since)
    notices: tuple[Notice, ...] = ()
    if lost and h.state != "lost":
        notices = (Notice("host_lost", {"down_s": round(down, 1), "calls": calls, "why": why}),)
    what = "lost" if lost else ("no answer" if calls == 1 else f"no answer for {duration(down)}")
    until = "" if lost else f"; lost if none answers within {duration(s.lost_after)} of the first"
    text = (
        f"{what} ({calls} failed call(s); the last: {why}): nothing done{until}; "
        f"next call in {duration(due - now)}"
    )
    return Step(mem, "unreachable", text, notices)


def identity(h: History, seen: Looked) -> tuple[str | None, tuple[Notice, ...]]:
    """``re-provisioned`` (the node id last seen is gone, or another: changes/identity.py's
    rule, as status judges it), ``rebooted`` (another boot id), or None; and its notice."""
    if h.node_id is None and h.boot_id is None:
        return None, ()
    said = judge(Known(h.node_id, h.boot_id), Known(seen.node_id, seen.boot_id))
    if said == "re-provisioned":
        return said, (Notice("reprovisioned", {"node_id": seen.node_id, "was": h.node_id}),)
    return (said, ()) if said == "rebooted" else (None, ())


def _answered(h: History, seen: Looked, now: float, s: Settings, converge: str | None) -> Step:
    notices: list[Notice] = []
    if h.state == "lost" and h.failing_since is not None:
        notices.append(Notice("host_back", {"down_s": round(now - h.failing_since, 1)}))
    back, found = identity(h, seen)
    notices.extend(found)
    for name, u in seen.units.items():
        if u.kind == "job" and u.word == "done" and h.words.get(name, "done") != "done":
            notices.append(Notice("job_done", {"unit": name}))
    words = {n: u.word for n, u in seen.units.items()}
    start, deploy, held = plan(seen.units, s)
    phrases = notes(seen.units, s, held)
    if start and converge is not None:
        phrases.append(f"not starting {', '.join(start)}: {converge}")
        start, deploy = (), ()
    mirror = () if start else mirrors(h, seen.units, now)
    # A deploy mirrors (or restores) the kept jobs it is given: that counts as their mirror.
    deployed = [n for n in deploy if seen.units[n].keep_every is not None]
    last = {**h.mirrored, **dict.fromkeys([*mirror, *deployed], now)}
    mem = History(
        state="up",
        due=now + s.interval,
        # What it is now: a re-provisioned host's next id (its deploy writes one) is no news.
        node_id=seen.node_id,
        boot_id=seen.boot_id,
        words=words,
        # Owed until a deploy starts what it lost (kept while one cannot: a broken playbook).
        back=(back or h.back) if start or converge is not None else None,
        mirrored={k: t for k, t in last.items() if k in words},  # bounded: kept jobs now
        said=h.said,
    )
    first = [f"{back} since watch last saw it"] if back else []
    said = "; ".join([*first, summary(seen.units), *phrases])
    if not (start or phrases or set(words.values()) - NAMED):
        said += "; nothing to do"
    # The line of --once says what it saw and did: acted() puts what it did after ``said``.
    text = f"{said}: starting {', '.join(start)} again" if start else said
    status: Status = "changed" if start else ("waiting" if held else "ok")
    crashed = all(words[n] == "crashed" for n in start)
    why = mem.back or ("crashed" if start and crashed else "drift")
    return Step(mem, status, text, tuple(notices), start, deploy, why, said, mirror)


def mirrors(h: History, units: Mapping[str, UnitSeen], now: float) -> tuple[str, ...]:
    """Kept jobs to mirror now: running ones at most every ``keep.every``, and one that has
    just ended, once more (all it wrote). A deploy mirrors on its own: none while one runs."""
    out = []
    for name, u in units.items():
        if u.keep_every is None:
            continue
        last = h.mirrored.get(name)
        ended = u.word in ("done", "failed") and h.words.get(name) == "running"
        if ended or (u.word == "running" and (last is None or now - last >= u.keep_every)):
            out.append(name)
    return tuple(out)


def plan(
    units: Mapping[str, UnitSeen], s: Settings
) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """The units to start (down, or crashed with --heal crashed), what the deploy is given
    (those and the units they need, which run or are done: deploy leaves them as they are),
    and the units held back with why (a need that is neither usable nor started with them)."""
    wanted = [n for n, u in units.items() if u.word in DOWN or u.word in s.heal]
    # A part of a unit over several hosts is started with its other parts, by deploy: the
    # engine's other ranks went down with it.
    held = {n: SPANS for n in wanted if units[n].spans}
    changed = True
    while changed:  # a held unit holds what needs it
        changed = False
        for name in wanted:
            if name in held:
                continue
            for need in units[name].needs:
                if units[need].word in USABLE or (need in wanted and need not in held):
                    continue
                state = "held back" if need in held else units[need].word
                held[name] = f"waits: it needs {need}, which is {state}"
                changed = True
                break
    start = [n for n in wanted if n not in held]
    needed: set[str] = set()
    todo = list(start)
    while todo:
        for need in units[todo.pop()].needs:
            if need not in needed:
                needed.add(need)
                todo.append(need)
    deploy = [n for n in units if n in start or n in needed]
    return tuple(start), tuple(deploy), held


SPANS = "is part of a unit over several hosts: `dflashops deploy` starts its parts together"
LABELS: dict[str, str] = {  # a word as the line says it
    "gone": "gone with its supervisor",
    "absent": "not on the host",
    "outdated": "on an older rendering",
    "restarting": "restarting (its supervisor is on it)",
    "exited": "exited by itself",
}
NAMED = frozenset({"running", "done", "restarting"})  # counted, not named


def summary(units: Mapping[str, UnitSeen]) -> str:
    """``2 running, 1 gone with its supervisor (gen)``; ``no units``."""
    names: dict[str, list[str]] = {}
    for name, u in units.items():
        names.setdefault(u.word, []).append(f"{name}: {u.detail}" if u.detail else name)
    parts = []
    for word, these in names.items():
        named = "" if word in NAMED else f" ({', '.join(these)})"
        parts.append(f"{len(these)} {LABELS.get(word, word)}{named}")
    return ", ".join(parts) or "no units"


def notes(units: Mapping[str, UnitSeen], s: Settings, held: Mapping[str, str]) -> list[str]:
    """What the line adds to the counts: what watch leaves to whom, what waits for what."""
    words = {u.word for u in units.values()}
    out = [f"{name} {why}" for name, why in held.items()]
    if "crashed" in words and "crashed" not in s.heal:
        out.append("a crashed unit is not restarted (`--heal crashed` restarts it)")
    if "outdated" in words:
        out.append("`dflashops deploy` restarts what runs an older rendering")
    return out


# ------------------------------------------------------------------------------- acting


@dataclass(frozen=True)
class Acted:
    """What the deploy of ``Step.deploy`` did on the host."""

    started: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)  # unit -> why
    busy: str | None = None  # another actor holds the host's deploy lock: who
    error: str | None = None  # the deploy failed on the host as a whole: why
    restored: Mapping[str, int] = field(default_factory=dict)  # kept job -> bytes restored
    # kept job -> what its restore warned of (a copy refused and set aside, a longer output
    # on the host kept): in its `restored` notice, so a person hears of it
    warnings: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def restored(job: str, result: Acted) -> Notice:
    """A kept job's `restored` notice: bytes put back, and what the restore warned of (a copy
    refused and set aside; a longer output on the host, kept, with both sizes)."""
    warned = {"warnings": list(w)} if (w := result.warnings.get(job)) else {}
    return Notice("restored", {"unit": job, "bytes": result.restored.get(job, 0), **warned})


def acted(done: Step, result: Acted) -> Step:
    """The step after its deploy: the line says what it did; its notices are the deploy's
    (the look's were sent with the look): ``restored`` per job, ``redeployed`` when something
    started (with why: drift, rebooted, re-provisioned)."""
    h = done.history
    notices = [restored(j, result) for j in sorted({*result.restored, *result.warnings})]
    if result.busy is not None:
        text = f"{done.seen}: not started, {result.busy}; watch tries again at its next call"
        return replace(done, status="waiting", text=text, notices=())
    parts = []
    if result.started:
        parts.append(f"started {', '.join(result.started)} again")
        notices.append(Notice("redeployed", {"units": list(result.started), "why": done.why}))
    parts += [f"{n} did not start: {why}" for n, why in result.failed.items()]
    if result.error is not None:
        parts.append(f"the deploy failed: {result.error}")
    ok = not result.failed and result.error is None
    mem = replace(h, back=None) if ok else h
    status: Status = "changed" if ok else "failed"
    text = f"{done.seen}: " + "; ".join(parts or ["nothing started"])
    return replace(done, history=mem, status=status, text=text, notices=tuple(notices))


@dataclass(frozen=True)
class Kept:
    """One kept job's mirror: what it took (``said``: its words for the line), or why not."""

    job: str
    ok: bool
    said: str = ""
    warnings: tuple[str, ...] = ()


def kept(done: Step, results: Sequence[Kept]) -> Step:
    """The step after its mirrors: a failed one fails the host's line (--once exits non-zero),
    warnings are said; a mirror that went well adds its words. No notices: the look's were
    sent with the look."""
    warnings = tuple(f"keep of {r.job}: {w}" for r in results for w in r.warnings)
    parts = [r.said for r in results if r.ok and r.said]
    parts += [f"keep of {r.job} failed: {r.said}" for r in results if not r.ok]
    if not parts and not warnings:
        return replace(done, notices=())
    failed = any(not r.ok for r in results)
    status: Status = "failed" if failed else done.status
    text = "; ".join([done.text, *parts, *warnings])
    return replace(done, status=status, text=text, warnings=warnings, notices=())
