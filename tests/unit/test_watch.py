"""`dflashops watch` without sshd: its settings, what it reads from a deploy's events, the files
it watches, and the loop itself on a `connection: local` host (the real agent, the real deploy):
a unit killed with its supervisor comes back, another actor's deploy lock only lets it report,
and many ticks keep nothing. The decisions, call by call, are data: tests/operations/watch/.
"""

from __future__ import annotations

import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from dflashops.agent import Agent
from dflashops.agent import lock as deploy_lock
from dflashops.changes.watch import (
    SPANS,
    Acted,
    History,
    Looked,
    Settings,
    Step,
    UnitSeen,
    acted,
    plan,
    refusal,
    step,
)
from dflashops.cli import main
from dflashops.commands.watch import Loader, Loop, Sources
from dflashops.config.load import load_inventory
from dflashops.events import Event, EventLog
from dflashops.hosts import connect
from dflashops.lifecycle.watch import Watcher, outcome
from tests.procs import Receiver, alive, wait_for


def test_lost_after_shorter_than_the_interval_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refusal(30.0, 120.0) is None and refusal(30.0, 30.0) is None
    inventory = str(project(tmp_path))
    code = main(["watch", "-i", inventory, "--interval", "1m", "--lost-after", "30s", "--once"])
    err = capsys.readouterr().err
    assert code == 1
    assert "--lost-after 30s is shorter than --interval 1m00s" in err and "nothing was done" in err
    assert not (tmp_path / "w").exists()  # no host was touched
    assert main(["watch", "-i", inventory, "--interval", "soon", "--once"]) == 1
    assert "--interval 'soon': " in capsys.readouterr().err


def test_memory_stays_bounded_over_a_week_of_calls() -> None:
    """20,160 calls (a week at 30s) of answers, blips, a lost spell and a changed key: a
    host's memory is a few numbers and one word per unit, whatever went before."""
    s = Settings(30.0, 120.0)
    units = {
        "web-0": UnitSeen("running"),
        "gen": UnitSeen("running", "job", ("web-0",), keep_every=60.0),
    }
    gone = {**units, "gen": UnitSeen("gone", "job", ("web-0",), keep_every=60.0)}
    h, sizes = History(), set()
    for i in range(20_160):
        if i % 500 in range(10, 20):
            seen = Looked(failure="connection refused")
        elif i % 3000 == 7:
            seen = Looked(failure="host key CHANGED", untrusted=True)
        else:
            seen = Looked(
                node_id="n", boot_id=f"b{i // 5000}", units=gone if i % 97 == 0 else units
            )
        got = step(h, seen, h.due, s)
        h = got.history
        sizes.add((len(h.words), len(h.mirrored), len(repr(h.said)) < 400, len(got.text) < 600))
    assert sizes <= {(2, 0, True, True), (2, 1, True, True)}, sizes


def test_a_part_of_a_unit_over_several_hosts_is_left_to_deploy() -> None:
    """Its other ranks went down with it: one part alone would wait at the rendezvous."""
    units = {
        "big-0": UnitSeen("gone", spans=True),
        "gen": UnitSeen("gone", "job", ("big-0",)),
        "side": UnitSeen("absent", "job"),
    }
    start, deploy, held = plan(units, Settings(30.0, 120.0))
    assert (start, deploy) == (("side",), ("side",))
    assert held == {"big-0": SPANS, "gen": "waits: it needs big-0, which is held back"}


def test_what_a_deploys_events_say_it_did() -> None:
    events = [
        Event("h", "gen", "changed", "restore", "restored 2 file(s)", data={"restored_bytes": 7}),
        Event("h", "gen", "changed", "start", "started (pid 5)"),
        Event("h", "web-0", "ok", "verify", "ready"),
        Event("h", "side", "failed", "start", "start failed: no such file"),
        Event("h", None, "failed", "files", "files x: no space", data={"entry": "x"}),
    ]
    got = outcome(events, Acted())
    assert got.started == ("gen",) and got.restored == {"gen": 7}
    assert got.failed == {"side": "start failed: no such file", "x": "files x: no space"}


def test_a_restore_that_refused_a_copy_or_kept_a_longer_output_is_in_its_notice() -> None:
    """Issue 22's bad input: a kept copy that does not match its record is refused, set aside
    and notified; a longer output on the host wins, and a notice names both sizes."""
    refused = "kept copy of out/a.jsonl refused: its sha256 is not the recorded f212f2273 (9 B)"
    longer = "out/b.jsonl: the host's 12 bytes differ from the kept copy's 9; the host's is longer"
    events = [
        Event("h", "gen", "info", "keep", f"warning: {refused}"),
        Event("h", "gen", "info", "keep", f"warning: {longer}"),
        Event("h", "other", "changed", "restore", "restored 1 file(s)", data={"restored_bytes": 5}),
        Event("h", "gen", "changed", "start", "started (pid 5)"),
    ]
    got = outcome(events, Acted())
    assert got.warnings == {"gen": (refused, longer)} and got.restored == {"other": 5}
    step = acted(Step(History(), "changed", "", deploy=("gen",), seen="1 gone"), got)
    sent = [(n.event, dict(n.details)) for n in step.notices if n.event == "restored"]
    assert sent == [
        ("restored", {"unit": "gen", "bytes": 0, "warnings": [refused, longer]}),
        ("restored", {"unit": "other", "bytes": 5}),
    ]


def test_the_files_watched_are_the_inventory_playbooks_and_templates(tmp_path: Path) -> None:
    inventory = project(tmp_path)
    sources = Sources(inventory, [])
    assert sources.changed() == []
    book = tmp_path / "playbooks" / "p.yaml"
    os.utime(book, ns=(0, book.stat().st_mtime_ns + 1_000_000))
    assert sources.changed() == [str(book)]
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "job.sh.j2").write_text("#!/bin/bash\n")
    assert sources.changed() == [str(tmp_path / "templates" / "job.sh.j2")]
    book.unlink()
    inventory.write_text(inventory.read_text() + "\n")
    assert sources.changed() == sorted([str(book), str(inventory)])
    assert sources.changed() == []


# ------------------------------------------------------------------------------ a local host


def project(tmp_path: Path, **more: Any) -> Path:
    """A `connection: local` host (no SSH; ``more``: its other settings) with one long job:
    its inventory."""
    host: dict[str, Any] = {
        "connection": "local",
        "gpus": 1,
        "workdir": str(tmp_path / "w"),
        "python": "python3",
        **more,
    }
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"local": host}}))
    (tmp_path / "playbooks").mkdir(exist_ok=True)
    book = {
        "name": "p",
        "hosts": "local",
        "jobs": [{"name": "gen", "command": ["sleep", "600"], "stop_grace": "2s"}],
    }
    (tmp_path / "playbooks" / "p.yaml").write_text(yaml.safe_dump(book))
    return tmp_path / "inventory.yaml"


@pytest.fixture
def deployed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Path]:
    """The project, deployed (its job runs); stopped after the test."""
    inventory = project(tmp_path)
    assert main(["deploy", "-i", str(inventory)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    try:
        yield inventory
    finally:
        assert main(["stop", "-i", str(inventory)]) == 0


def supervisor(tmp_path: Path) -> int:
    return int(json.loads((tmp_path / "w" / "units" / "gen" / "pid").read_text())["pid"])


def kill_with_supervisor(tmp_path: Path) -> int:
    pid = supervisor(tmp_path)
    os.killpg(pid, signal.SIGKILL)
    wait_for("the supervisor gone", lambda: not alive(pid), 10)
    return pid


def once(inventory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["watch", "-i", str(inventory), "--once"])
    return code, [x for x in capsys.readouterr().out.splitlines() if "[local]" in x]


def test_once_starts_a_unit_killed_with_its_supervisor_unless_another_holds_the_lock(
    deployed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert once(deployed, capsys) == (0, ["ok: [local] 1 running; nothing to do"])
    old = kill_with_supervisor(tmp_path)
    assert once(deployed, capsys) == (
        0,
        ["changed: [local] 1 gone with its supervisor (gen): started gen again"],
    )
    assert supervisor(tmp_path) != old and alive(supervisor(tmp_path))

    # Another actor holds the deploy lock: this watch says so and starts nothing.
    old = kill_with_supervisor(tmp_path)
    spec = load_inventory(deployed).hosts["local"]
    other = Agent(connect(spec), spec.python, keep=True)
    theirs = {"who": "bob@ci", "command": "dflashops deploy", "controller_pid": os.getpid()}
    try:
        assert deploy_lock.acquire(other, str(tmp_path / "w"), theirs).ok
        code, lines = once(deployed, capsys)
    finally:
        other.close()
        other.conn.close()
    assert code == 0 and len(lines) == 1, lines
    assert lines[0].startswith(
        "waiting: [local] 1 gone with its supervisor (gen): not started, host local is locked "
        "by bob@ci (dflashops deploy"
    ), lines
    assert supervisor(tmp_path) == old and not alive(old)
    assert once(deployed, capsys)[1][0].endswith("started gen again")


def test_many_ticks_keep_nothing(deployed: Path, tmp_path: Path) -> None:
    """The loop's own tick, 250 times over the kept session: no Python object is left per
    tick (events printed are dropped, a host's memory is replaced, not grown)."""
    out = Console(file=io.StringIO())
    loader = Loader(out, deployed, None, None)
    events = EventLog(out)
    watcher = Watcher(loader.load(), Settings(0.001, 1.0), 4, events)
    loop = Loop(events, watcher, Sources(deployed, []), loader)
    try:
        for _ in range(50):
            loop.tick()
        session = watcher.sessions["local"]
        gc.collect()
        before = len(gc.get_objects())
        started = time.monotonic()
        for _ in range(200):
            loop.tick()
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert watcher.sessions == {"local": session}  # one session kept all along
        assert session.agent.round_trips == 250  # one call per tick, each a request line
    finally:
        watcher.close()
    assert loop.ticks == 250 and events.events == []
    assert grown < 100, f"{grown} objects more after 200 ticks"
    assert time.monotonic() - started < 60
    assert "[local] 1 running; nothing to do" in out.file.getvalue()  # type: ignore[attr-defined]


def test_a_playbook_that_does_not_load_stops_the_starting_not_the_looking(
    deployed: Path, tmp_path: Path
) -> None:
    out = Console(file=io.StringIO(), width=400)
    loader = Loader(out, deployed, None, None)
    events = EventLog(out)
    watcher = Watcher(loader.load(), Settings(0.001, 1.0), 4, events)
    loop = Loop(events, watcher, Sources(deployed, []), loader)
    book = tmp_path / "playbooks" / "p.yaml"
    good = book.read_text()

    def said() -> str:
        text: str = out.file.getvalue()  # type: ignore[attr-defined]
        out.file.truncate(0)  # type: ignore[attr-defined]
        out.file.seek(0)  # type: ignore[attr-defined]
        return text

    try:
        loop.tick()
        assert "ok: [local] 1 running; nothing to do" in said()
        book.write_text("name: p\nhosts: local\njobs: [{name: gen\n")
        old = kill_with_supervisor(tmp_path)
        loop.tick()
        text = said()
        assert "watch: p.yaml changed on disk: loading again" in text, text
        assert "p.yaml:3: does not load" in text and "looking only" in text, text
        assert "[local] 1 gone with its supervisor (gen); not starting gen: " in text, text
        assert not watcher.acting and not alive(old)

        book.write_text(good)
        loop.tick()
        text = said()
        assert "watch: loaded: 1 host(s), 1 unit(s)\n" in text, text
        assert "[local] 1 gone with its supervisor (gen): starting gen again" in text, text
        done = wait_for("the deploy", lambda: watcher.finished().get("local"), 30)
        assert done.text.endswith("started gen again") and alive(supervisor(tmp_path))
    finally:
        watcher.close()


def test_notices_go_to_the_hosts_webhook_and_its_url_is_never_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Receiver("T0K3N-w4tch")
    monkeypatch.setenv("WATCH_HOOK", hook.url)
    inventory = project(tmp_path, notify={"webhook": "env:WATCH_HOOK"})
    events = tmp_path / "events.jsonl"
    try:
        assert main(["deploy", "-i", str(inventory)]) == 0
        kill_with_supervisor(tmp_path)
        assert main(["watch", "-i", str(inventory), "--once", "--json", str(events)]) == 0
    finally:
        main(["stop", "-i", str(inventory)])
        hook.close()
    (notice,) = [n for n in hook.notices if n["event"] == "redeployed"]
    assert (notice["host"], notice["units"], notice["why"]) == ("local", ["gen"], "drift")
    assert notice["time"].endswith("Z")
    shown = capsys.readouterr().out + events.read_text()
    assert "started gen again" in shown and "T0K3N-w4tch" not in shown


def test_watch_keeps_samples_for_the_dashboard(
    deployed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Samples are written by `dashboard` and by `watch` (DESIGN "The fleet on one page"):
    each tick's facts become one sample in .dflashops/samples.sqlite, the dashboard's file."""
    from dflashops.dashboard.store import FILE, Store

    assert once(deployed, capsys)[0] == 0
    kill_with_supervisor(tmp_path)
    assert once(deployed, capsys)[0] == 0  # it saw gen gone (and started it again)
    store = Store(tmp_path / ".dflashops" / FILE)
    try:
        rows = store.db.execute(
            "SELECT s.kind, p.state, p.restarts FROM points AS p JOIN series AS s"
            " ON s.id = p.series WHERE s.host = 'local' AND s.unit = 'gen' ORDER BY p.t"
        ).fetchall()
    finally:
        store.close()
    assert [tuple(r) for r in rows] == [("job", "running", 0), ("job", "dead", 0)], rows


def test_sigterm_ends_watch_as_ctrl_c_does(tmp_path: Path) -> None:
    """Under nohup or a service manager SIGINT is often ignored: TERM must end it cleanly."""
    inventory = project(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli", "watch", "-i", str(inventory), "--interval", "1s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("watch: 1 host(s)"), first
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "watch stopped" in rest, rest
