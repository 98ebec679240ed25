"""`keep:` on a real sshd host over loopback: what an append-only output costs per mirror, and
how long restoring it takes beside `rsync -e ssh`, in one run.

    .venv/bin/python bench/bench_keep.py [--size 256] [--grow 10] [--intervals 5]

An append-only file of --size MiB (the generator's JSONL shard, 1 GiB in the issue: --size
1024) is mirrored once whole, then grows by --grow MiB before each of --intervals mirrors
(lifecycle/keep.py's ``mirror``, as deploy, stop and watch call it). Printed per interval: the
bytes appended, the bytes the host streamed (file headers and the answer line included), their
ratio (target: within 5% of the appended bytes), and the controller CPU. Then the host loses
the file, and its restore (``restore``: the keep call, the copy checked against its record, the
verified upload) is timed against `rsync -a -e ssh` of the same copy into an empty folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, sshd_unavailable_reason  # noqa: E402
from rich.console import Console  # noqa: E402

from dflashops.agent import keep_actions  # noqa: E402
from dflashops.agent.bundle import bundle  # noqa: E402
from dflashops.config.load import load_inventory, load_playbook  # noqa: E402
from dflashops.events import EventLog  # noqa: E402
from dflashops.lifecycle.keep import mirror, restore, state_dir  # noqa: E402
from dflashops.lifecycle.session import HostSession  # noqa: E402
from dflashops.plan import build_plan  # noqa: E402

MiB = 1 << 20


class Counted(keep_actions.Frames):
    """The keep call's stdout as it arrives: every byte the host streamed."""

    total = 0

    def feed(self, data: bytes) -> None:
        Counted.total += len(data)
        super().feed(data)


def grow(path: Path, mib: int) -> None:
    block = os.urandom(MiB)
    with path.open("ab") as f:
        for i in range(mib):
            f.write(block[i % 11 :] + block[: i % 11])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MiB kept before the intervals")
    parser.add_argument("--grow", type=int, default=10, help="MiB appended per interval")
    parser.add_argument("--intervals", type=int, default=5)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason or shutil.which("rsync") is None:
        sys.exit(f"cannot run: {reason or 'rsync is not installed'} (bash dev/ensure-sshd.sh)")
    keep_actions.Frames = Counted  # type: ignore[misc]
    base = Path(tempfile.mkdtemp(prefix="bench-keep-"))
    fleet = Fleet(base / "fleet", REPO)
    try:
        host = fleet.add("node", gpus=0)
        fleet.start()
        ctl = base / "ctl"
        (ctl / "home" / ".ssh").mkdir(parents=True)
        (ctl / "playbooks").mkdir()
        os.environ["HOME"] = str(ctl / "home")
        os.environ["DFLASHOPS_CACHE"] = str(ctl / "cache")
        shutil.copy(fleet.known_hosts_path, ctl / "home" / ".ssh" / "known_hosts")
        fleet.write_inventory(ctl / "inventory.yaml")
        out = host.dir / "out"
        out.mkdir()
        shard = out / "completions-run-0001.jsonl"
        grow(shard, args.size)
        job = {"name": "gen", "command": ["true"], "keep": {"paths": [str(out)]}}
        book = {"name": "b", "hosts": "node", "jobs": [job]}
        (ctl / "playbooks" / "b.yaml").write_text(yaml.safe_dump(book))
        inventory = load_inventory(ctl / "inventory.yaml")
        units = build_plan(inventory, [load_playbook(ctl / "playbooks" / "b.yaml")]).units
        session = HostSession(inventory.hosts["node"], [], EventLog(Console(quiet=True)))
        state = state_dir(ctl / "inventory.yaml")
        try:
            run(args, session, units, state, shard, fleet, host, base)
        finally:
            session.close()
    finally:
        fleet.stop()
        shutil.rmtree(base, ignore_errors=True)


def once(session: HostSession, units: list, state: Path) -> tuple[int, int, float, float]:
    """(payload bytes, bytes streamed, wall s, controller CPU s) of one mirror."""
    Counted.total = 0
    cpu, wall = time.process_time(), time.perf_counter()
    (r,) = mirror(session, units, state)
    assert r.ok, r
    return r.bytes_sent, Counted.total, time.perf_counter() - wall, time.process_time() - cpu


def run(args, session, units, state, shard, fleet, host, base) -> None:  # type: ignore[no-untyped-def]
    sent, streamed, wall, cpu = once(session, units, state)
    print(f"first mirror: {args.size} MiB whole: {streamed / MiB:.1f} MiB streamed in {wall:.2f}s")
    print(
        f"bundle sent to the host per mirror: {len(bundle()) / 1024:.0f} KiB "
        "(the agent's code, one call per kept job)"
    )
    print(
        f"{'interval':>8} {'appended':>10} {'streamed':>12} {'ratio':>7} {'wall':>7} {'ctl CPU':>8}"
    )
    for i in range(1, args.intervals + 1):
        grow(shard, args.grow)
        sent, streamed, wall, cpu = once(session, units, state)
        appended = args.grow * MiB
        assert sent == appended, (sent, appended)
        print(
            f"{i:>8} {appended / MiB:>8.1f}MiB {streamed / MiB:>10.3f}MiB "
            f"{streamed / appended:>7.4f} {wall:>6.2f}s {cpu:>7.2f}s"
        )
    size = shard.stat().st_size
    shard.unlink()
    started = time.perf_counter()
    (r,) = restore(session, units, state)
    restored = time.perf_counter() - started
    assert r.ok and r.restored_bytes == size, r
    copy = state / "keep" / "node" / "gen" / "out"
    dest = host.dir / "rsync-dest"
    dest.mkdir()
    ssh = [
        *("ssh", "-p", str(host.port), "-i", str(fleet.client_key_path)),
        *("-o", f"UserKnownHostsFile={fleet.known_hosts_path}"),
        *("-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"),
    ]
    os.sync()
    started = time.perf_counter()
    subprocess.run(
        ["rsync", "-a", "-e", " ".join(ssh), f"{copy}/", f"root@{host.address}:{dest}"],
        check=True,
    )
    by_rsync = time.perf_counter() - started
    mb = size / 1e6
    print(
        f"restore of {size / MiB:.0f} MiB: dflashops {restored:.2f}s ({mb / restored:.0f} MB/s, "
        f"the copy's sha256 checked first), rsync -e ssh {by_rsync:.2f}s ({mb / by_rsync:.0f} MB/s)"
    )


if __name__ == "__main__":
    main()
