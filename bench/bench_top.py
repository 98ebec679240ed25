"""`dflashops top` in steady state, and how fast a crashed server is back, on real sshd hosts.

    .venv/bin/python bench/bench_top.py [--hosts 16] [--refreshes 10]

1. Controller CPU per host per refresh of `top` (one probe with metrics and nvidia-smi per
   host), with SSH connections kept open between refreshes (what `top` does) against a fresh
   connection per refresh (what a loop of `dflashops status` would cost), same fleet, same run.
   Target: kept-open at least 5x cheaper.
2. Restart latency: a fake SGLang that takes 1.5 s to start, restart_backoff initial 1 s:
   SIGKILL its engine, time until /health answers 200 again, with no dflashops command.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, sshd_unavailable_reason  # noqa: E402
from lifecycle_helpers import engine_pid  # noqa: E402

from dflashops.cli import main as dflashops  # noqa: E402
from dflashops.commands.common import prepare  # noqa: E402
from dflashops.commands.top import Watch  # noqa: E402
from dflashops.output import console  # noqa: E402
from tests.procs import free_ports  # noqa: E402


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def cpu_per_host_refresh(base: Path, hosts: int, refreshes: int, keep: bool) -> float:
    target = prepare(console(), str(base / "inventory.yaml"), None, [str(base / "bench.yaml")])
    watch = Watch(target, forks=hosts, keep=keep)
    try:
        watch.refresh()  # connections up (kept) and caches warm: steady state from here
        start = time.process_time()
        for _ in range(refreshes):
            watch.refresh()
        spent = time.process_time() - start
    finally:
        watch.close()
    assert watch.reached == hosts, {n: v.error for n, v in watch.views.items()}
    return spent / refreshes / hosts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--refreshes", type=int, default=10)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason:
        print(f"cannot run: {reason} (bash dev/ensure-sshd.sh)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "home" / ".ssh").mkdir(parents=True)
        os.environ["HOME"] = str(base / "home")
        with Fleet(base / "fleet", REPO) as fleet:
            names = [f"n{i:02d}" for i in range(args.hosts)]
            for name in names:
                fleet.add(name, gpus=2)
            fleet.start()
            (base / "home" / ".ssh" / "known_hosts").write_text(fleet.known_hosts_path.read_text())
            inv = fleet.inventory(hosts=names, groups={"bench": names})
            for name in names:
                inv["hosts"][name]["vars"] = {"base_port": free_ports(2)}
            (base / "inventory.yaml").write_text(yaml.safe_dump(inv))
            book = {
                "name": "bench",
                "hosts": "bench",
                "services": [
                    {
                        "name": "sglang",
                        "engine": "sglang",
                        "model": "/m",
                        "replicas": 2,
                        "port": "{{ base_port }}",
                        "env": {"DFLASHOPS_STUB_STARTUP_SECONDS": "1.5"},
                        "restart_backoff": {"initial": "1s", "max": "1m"},
                        "ready": {"timeout": "60s", "interval": "0.2s"},
                        "stop_grace": "5s",
                    }
                ],
            }
            (base / "bench.yaml").write_text(yaml.safe_dump(book))
            common = [
                "-i",
                str(base / "inventory.yaml"),
                "-p",
                str(base / "bench.yaml"),
                "--forks",
                "16",
            ]
            assert dflashops(["deploy", *common]) == 0
            try:
                kept = cpu_per_host_refresh(base, args.hosts, args.refreshes, keep=True)
                fresh = cpu_per_host_refresh(base, args.hosts, args.refreshes, keep=False)
                print(
                    f"top, {args.hosts} hosts x 2 servers, {args.refreshes} refreshes: controller CPU per "
                    f"host per refresh: kept-open {kept * 1000:.1f} ms, fresh connection "
                    f"{fresh * 1000:.1f} ms ({fresh / kept:.1f}x)"
                )
                host = fleet[names[0]]
                port = int(inv["hosts"][names[0]]["vars"]["base_port"])
                times = []
                for _ in range(3):
                    victim = engine_pid(host, "sglang-0")
                    killed = time.monotonic()
                    os.kill(victim, signal.SIGKILL)
                    while healthy(port):  # until the kill is seen
                        time.sleep(0.01)
                    while not healthy(port):
                        time.sleep(0.02)
                    times.append(time.monotonic() - killed)
                    time.sleep(5)  # past the backoff's max? no: it doubles; shown as measured
                print(
                    "restart latency (SIGKILL -> /health 200 again; backoff initial 1 s, doubling; "
                    f"engine start 1.5 s): {', '.join(f'{t:.2f}s' for t in times)}"
                )
            finally:
                dflashops(["stop", *common])
    return 0


if __name__ == "__main__":
    sys.exit(main())
