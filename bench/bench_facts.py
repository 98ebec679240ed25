"""Facts from 1, 4 and 16 real sshd hosts: wall time and SSH commands per host.

    .venv/bin/python bench/bench_facts.py [--hosts 1,4,16] [--rounds 5]

Starts a throwaway fleet of OpenSSH hosts on loopback (tests/integration/fleet.py), then for each
fleet size measures a cold gather (connect + auth + one facts command per host, in parallel with
--forks 16) and a warm one (connections already open). Prints one line per size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, sshd_unavailable_reason  # noqa: E402

from dflashops.agent import Agent  # noqa: E402
from dflashops.config.inventory import Host  # noqa: E402
from dflashops.config.load import load_inventory  # noqa: E402
from dflashops.hosts.ssh import SshConnection  # noqa: E402
from dflashops.lifecycle.fleet import on_hosts  # noqa: E402


def gather_all(hosts: list[Host], conns: dict[str, SshConnection]) -> float:
    start = time.perf_counter()
    outcomes = on_hosts(hosts, lambda h: Agent(conns[h.name], h.python).facts(h.workdir), forks=16)
    elapsed = time.perf_counter() - start
    failed = [o.error for o in outcomes.values() if not o.ok]
    if failed:
        raise SystemExit(f"facts failed: {failed}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason:
        print(f"cannot run: {reason} (bash dev/ensure-sshd.sh)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.hosts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "home" / ".ssh").mkdir(parents=True)
        os.environ["HOME"] = str(base / "home")
        os.environ["DFLASHOPS_KNOWN_HOSTS"] = str(base / "fleet" / "known_hosts")
        with Fleet(base / "fleet", REPO) as fleet:
            for i in range(max(sizes)):
                fleet.add(f"n{i:02d}")
            fleet.start()
            (base / "inventory.yaml").write_text(yaml.safe_dump(fleet.inventory()))
            inventory = load_inventory(base / "inventory.yaml")
            all_hosts = list(inventory.hosts.values())
            for size in sizes:
                hosts = all_hosts[:size]
                cold, warm, commands = [], [], []
                for _ in range(args.rounds):
                    conns = {h.name: SshConnection(h) for h in hosts}
                    cold.append(gather_all(hosts, conns))
                    warm.append(gather_all(hosts, conns))
                    commands.append(max(c.commands for c in conns.values()) / 2)
                    for c in conns.values():
                        c.close()
                print(
                    f"hosts={size} cold_median_s={statistics.median(cold):.3f} "
                    f"warm_median_s={statistics.median(warm):.3f} ssh_commands_per_host={int(max(commands))} "
                    f"rounds={args.rounds}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
