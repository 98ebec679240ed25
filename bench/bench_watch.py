"""`dflashops watch` with nothing to do, on real sshd hosts: what a tick costs the controller.

    .venv/bin/python bench/bench_watch.py [--hosts 8] [--ticks 1000]

N hosts x 4 units (jobs that sleep), deployed, then:
1. A tick (one facts call per host over its kept session, the decisions, nothing to start):
   controller CPU per host per tick and wall time per tick, over 20 ticks in steady state;
   against one plain `dflashops status` run over the same hosts (in this process: no
   interpreter start counted), per host and wall. Target (issue 22): under 20 ms of CPU per
   host per tick, a tick of 64 hosts within 2 s on 2 cores.
2. The controller's RSS at tick 10 and at tick ``--ticks`` (the loop's own tick, every host
   called each time): flat over days means the same two numbers.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, sshd_unavailable_reason  # noqa: E402

from dflashops.changes.watch import Settings  # noqa: E402
from dflashops.cli import main as dflashops  # noqa: E402
from dflashops.commands.watch import Loader, Loop, Sources  # noqa: E402
from dflashops.events import EventLog  # noqa: E402
from dflashops.lifecycle.watch import Watcher  # noqa: E402

UNITS = 4


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def project(base: Path, fleet: Fleet, names: list[str]) -> list[str]:
    (base / "home" / ".ssh").mkdir(parents=True)
    os.environ["HOME"] = str(base / "home")
    (base / "home" / ".ssh" / "known_hosts").write_text(fleet.known_hosts_path.read_text())
    inv = fleet.inventory(hosts=names, groups={"bench": names})
    (base / "inventory.yaml").write_text(yaml.safe_dump(inv))
    (base / "playbooks").mkdir()
    jobs = [
        {"name": f"job{i}", "command": ["sleep", "86400"], "stop_grace": "2s"} for i in range(UNITS)
    ]
    book = {"name": "bench", "hosts": "bench", "jobs": jobs}
    (base / "playbooks" / "bench.yaml").write_text(yaml.safe_dump(book))
    return ["-i", str(base / "inventory.yaml"), "--forks", "64"]


def ticks(base: Path, hosts: int, total: int) -> None:
    sink = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the process ends soon
    inventory = base / "inventory.yaml"
    loader = Loader(sink, inventory, None, None)
    events = EventLog(sink)
    watcher = Watcher(loader.load(), Settings(0.001, 1.0), 64, events)
    loop = Loop(events, watcher, Sources(inventory, []), loader)
    try:
        for _ in range(10):
            loop.tick()
        at10 = rss_mib()
        cpu, wall = time.process_time(), time.monotonic()
        for _ in range(20):
            loop.tick()
        cpu, wall = (time.process_time() - cpu) / 20, (time.monotonic() - wall) / 20
        starts = sum(h.words.get("job0") != "running" for h in watcher.histories.values())
        for _ in range(total - 30):
            loop.tick()
        at_end = rss_mib()
    finally:
        watcher.close()
    print(
        f"watch tick, {hosts} hosts x {UNITS} units, nothing to do: controller CPU "
        f"{cpu / hosts * 1000:.2f} ms per host per tick, wall {wall * 1000:.0f} ms per tick "
        f"({starts} host(s) not settled)"
    )
    print(f"watch RSS: tick 10 {at10:.1f} MiB, tick {total} {at_end:.1f} MiB")


def status_run(common: list[str], hosts: int) -> None:
    out = io.StringIO()
    cpu, wall = time.process_time(), time.monotonic()
    sys.stdout, saved = out, sys.stdout
    try:
        code = dflashops(["status", *common])
    finally:
        sys.stdout = saved
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    print(
        f"status, {hosts} hosts x {UNITS} units (exit {code}): controller CPU "
        f"{cpu / hosts * 1000:.2f} ms per host, wall {wall * 1000:.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=1000)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason:
        print(f"cannot run: {reason} (bash dev/ensure-sshd.sh)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        with Fleet(base / "fleet", REPO) as fleet:
            names = [f"n{i:02d}" for i in range(args.hosts)]
            for name in names:
                fleet.add(name, gpus=2)
            fleet.start()
            common = project(base, fleet, names)
            quiet = io.StringIO()
            sys.stdout, saved = quiet, sys.stdout
            try:
                deployed = dflashops(["deploy", *common])
            finally:
                sys.stdout = saved
            if deployed != 0:
                print(quiet.getvalue(), file=sys.stderr)
                return 1
            try:
                status_run(common, args.hosts)  # warm: imports and first connections paid
                status_run(common, args.hosts)
                ticks(base, args.hosts, max(args.ticks, 31))
            finally:
                sys.stdout, saved = io.StringIO(), sys.stdout
                try:
                    dflashops(["stop", *common])
                finally:
                    sys.stdout = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
