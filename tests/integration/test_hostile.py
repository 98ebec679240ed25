"""A hostile host on the sshd fleet (issue 19 "Bad input", DESIGN.md "Trust boundary" 1-2): its
`python` runs the real agent and rewrites what it answers (tests/hostile.py). Paths it names
never write outside the destination, its floods and deep nesting fail that host with one clear
line while the other hosts carry on, and its escape sequences never reach the terminal unless
`logs --raw` asks for them."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, job, unit_dir

from dflashops.cache import cache_dir
from tests.hostile import hostile_python
from tests.procs import wait_for

ESC = re.compile(r"[\x1b\x9b\x9d\x07]")
REPO = Path(__file__).resolve().parents[2]


def results(host: FleetHost) -> Path:
    root = host.dir / "results"
    (root / "ab").mkdir(parents=True, exist_ok=True)
    (root / "ab" / "x").write_text("what a host wants written outside\n")
    (root / "keep.txt").write_text("an honest file\n")
    return root


def lying(host: FleetHost, rel: str, lie: str) -> str:
    """The host's python: names ``rel`` as ``lie`` in its file lists and file headers, and
    asks the real agent for ``rel`` when the controller asks for ``lie``."""
    return hostile_python(
        host.bin_dir, replace_out=[(f'"{rel}"', f'"{lie}"')], replace_in=[(f'"{lie}"', f'"{rel}"')]
    )


def fetch(ctl: Ops, host: str, remote: Path, local: Path) -> Any:
    return ctl.run(
        "fetch", str(remote), str(local), "--host", host, playbooks=[], json_events=False
    )


def test_fetch_refuses_a_traversal_name_and_an_absolute_path_and_writes_nothing(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    fleet = fleet_factory(dots={"gpus": 0}, slash={"gpus": 0}, good={"gpus": 0})
    absolute = tmp_path / "planted"
    ctl = ops(
        fleet,
        hosts={
            "dots": {"python": lying(fleet["dots"], "ab/x", "../x")},  # same length
            "slash": {"python": lying(fleet["slash"], "ab/x", str(absolute))},
            "good": {},
        },
    )
    for name in ("dots", "slash", "good"):
        results(fleet[name])
    local = ctl.base / "fetched" / "dest"

    res = fetch(ctl, "dots", fleet["dots"].dir / "results", local)
    assert res.code == 1, res.out
    assert "host dots sent an unsafe path '../x' in its file list" in res.out, res.out
    assert "refusing to write anything from it" in res.out
    assert not (local.parent / "x").exists() and not local.exists()

    res = fetch(ctl, "slash", fleet["slash"].dir / "results", local)
    assert res.code == 1 and f"unsafe path '{absolute}'" in res.out, res.out
    assert not absolute.exists() and not local.exists()

    # The other hosts are not affected: an honest host's tree comes home.
    res = fetch(ctl, "good", fleet["good"].dir / "results", local)
    assert res.code == 0 and "2 file(s)" in res.out, res.out
    assert (local / "ab" / "x").read_text() == "what a host wants written outside\n"


def test_fetch_never_writes_through_a_symlink_at_the_destination(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(f={"gpus": 0})
    ctl = ops(fleet)
    remote = results(fleet["f"])
    outside = ctl.base / "outside"
    outside.mkdir()
    local = ctl.base / "dest"
    local.mkdir()
    (local / "ab").symlink_to(outside)
    res = fetch(ctl, "f", remote, local)
    assert res.code == 1, res.out
    assert f"{local / 'ab'} is a symbolic link: refusing to write through it" in res.out, res.out
    assert list(outside.iterdir()) == [] and not (local / "keep.txt").exists()


def test_a_relay_from_a_hostile_host_writes_nothing_and_an_honest_relay_still_arrives(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(evil={"gpus": 0}, good={"gpus": 0}, t={"gpus": 0})
    evil, good, target = fleet["evil"], fleet["good"], fleet["t"]
    ctl = ops(fleet, hosts={"evil": {"python": lying(evil, "ab/x", "../x")}, "good": {}, "t": {}})
    results(evil)
    results(good)
    ctl.playbook(
        "p",
        {
            "hosts": "t",
            "files": [
                {"src": f"evil:{evil.dir / 'results'}", "dest": str(target.dir / "from-evil")},
                {"src": f"good:{good.dir / 'results'}", "dest": str(target.dir / "from-good")},
            ],
        },
    )
    check = ctl.run("deploy", "--check")
    (would,) = [e for e in check.events if f"-> {target.dir / 'from-good'}:" in e["message"]]
    assert "would relay 2 file(s), " in would["message"], check.explain()
    assert would["message"].endswith(" from good through the controller"), check.explain()
    relay = cache_dir() / "relay"
    assert not relay.exists() or not list(relay.iterdir())  # --check pulls nothing

    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    hostile, honest = (
        [
            e
            for e in res.events
            if e["action"] == "files" and f"-> {target.dir / d}:" in e["message"]
        ]
        for d in ("from-evil", "from-good")
    )
    assert [e["status"] for e in hostile] == ["failed"], res.explain()
    assert "host evil sent an unsafe path '../x' in its file list" in hostile[0]["message"]
    assert [e["status"] for e in honest] == ["changed"], res.explain()
    assert (target.dir / "from-good" / "ab" / "x").exists()
    assert not (target.dir / "from-evil").exists()

    assert not (relay / "x").exists() and not list(ctl.base.rglob("x"))[1:], list(
        ctl.base.rglob("x")
    )
    assert stat.S_IMODE(relay.stat().st_mode) == 0o700
    # The honest relay's copy went once the host verified it; the refused one holds nothing.
    assert not [p for p in relay.iterdir() if p.name.startswith("good-")]
    assert not [f for p in relay.iterdir() for f in p.rglob("*") if f.is_file()]


PEAK = """
import resource, sys, time
from dflashops.cli import main
began = time.monotonic()
code = main(sys.argv[1:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.stderr.write(f"PEAK_RSS_KIB={peak} SECONDS={time.monotonic() - began:.1f}\\n")
sys.exit(code)
"""


def two_hosts(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], **rules: Any
) -> tuple[Ops, FleetHost]:
    fleet = fleet_factory(evil={"gpus": 0}, good={"gpus": 0})
    evil = fleet["evil"]
    ctl = ops(fleet, hosts={"evil": {"python": hostile_python(evil.bin_dir, **rules)}, "good": {}})
    ctl.playbook("p", {"hosts": ["evil", "good"], "jobs": [job("idle", "true")]})
    return ctl, evil


def test_a_flood_of_200_mb_fails_that_host_with_one_line_and_little_memory(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    ctl, evil = two_hosts(fleet_factory, ops, on="facts", flood=200 << 20)
    argv = ctl.argv("status", None)
    try:
        run = subprocess.run(
            [sys.executable, "-c", PEAK, *argv],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        hostile_python(evil.bin_dir)  # honest again, for the teardown's stop
    print(run.stdout, run.stderr)
    assert run.returncode == 2, run.stdout + run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.split()}
    assert "unreachable" in rows["evil"] and "passed 64 MiB" in run.stdout, run.stdout
    assert "absent" in rows["good"], run.stdout
    peak = re.search(r"PEAK_RSS_KIB=(\d+) SECONDS=([\d.]+)", run.stderr)
    assert peak is not None, run.stderr
    assert int(peak.group(1)) < 512 * 1024, f"peak RSS {int(peak.group(1)) >> 10} MiB"


def test_json_nested_200000_deep_fails_that_host_with_a_clear_error(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    ctl, evil = two_hosts(fleet_factory, ops, on="facts", nest=200_000)
    try:
        res = ctl.run("status")
    finally:
        hostile_python(evil.bin_dir)
    assert res.code == 2, res.explain()
    rows = {line.split()[0]: line for line in res.out.splitlines() if line.split()}
    assert "unreachable" in rows["evil"], res.out
    # How deep it says depends on how much had arrived when the reader gave up: past 100.
    deep = re.search(r"answered with JSON nested (\d+) deep \(at most 100\)", res.out)
    assert deep is not None and int(deep.group(1)) > 100, res.out
    assert "internal error" not in res.out and "absent" in rows["good"], res.out


def test_escape_sequences_from_a_host_reach_the_terminal_only_with_logs_raw(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(u={"gpus": 0}, loud={"gpus": 0})
    noisy = "\\033]0;pwned\\007\\033[31mRED-LINE\\033[0m \\033[2Jcleared"
    loud = hostile_python(
        fleet["loud"].bin_dir, on="facts", stderr="\x1b]0;pwned\x07boom\x1b[2J agent died\n"
    )
    ctl = ops(fleet, hosts={"u": {}, "loud": {"python": loud}})
    ctl.playbook("p", {"hosts": "u", "jobs": [job("esc", f"printf '{noisy}\\n'; exit 1")]})
    assert ctl.run("deploy").code == 0
    wait_for("the job to end", lambda: (unit_dir(fleet["u"], "esc") / "exit").exists())

    status = ctl.run("status")
    assert "RED-LINE cleared" in status.out and not ESC.search(status.out), repr(status.out)
    logs = ctl.run("logs", "esc")
    assert "RED-LINE cleared" in logs.out and not ESC.search(logs.out), repr(logs.out)
    raw = ctl.run("logs", "esc", "--raw")
    assert "\x1b]0;pwned" in raw.out and "\x1b[31mRED-LINE" in raw.out, repr(raw.out)

    # An error message from a host (its agent's stderr) is shown inert too.
    failed = ctl.run("logs", "anything", "--host", "loud", playbooks=[])
    assert failed.code == 1 and "boom agent died" in failed.out, failed.out
    assert not ESC.search(failed.out), repr(failed.out)
