"""Deploy and no-op redeploy on 1, 4 and 16 real sshd hosts with 4 units each.

    .venv/bin/python bench/bench_deploy.py [--hosts 1,4,16]

Each host runs 3 stub replicas and one job that needs them (the stub starts in 0.2 s, so the
time is dflashops' own: SSH, shipping, starting, probing). Prints, per fleet size, the wall time
of a deploy from nothing, of a second deploy with nothing changed (guarantee 4: one facts call
plus probes per host, nothing restarted), and the remote commands per host for each, read from
the --json events.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, sshd_unavailable_reason  # noqa: E402

from dflashops.cli import main as dflashops  # noqa: E402

PLAYBOOK = {
    "name": "bench",
    "hosts": "bench",
    "services": [
        {
            "name": "stub",
            "engine": "stub",
            "model": "bench/model",
            "replicas": 3,
            "port": "{{ base_port }}",
            "env": {"DFLASHOPS_STUB_STARTUP_SECONDS": "0.2"},
            "ready": {"timeout": "60s", "interval": "0.2s"},
            "stop_grace": "5s",
        }
    ],
    "jobs": [{"name": "idle", "command": ["sleep", "3600"], "needs": ["stub"], "stop_grace": "2s"}],
}


def run(args: list[str], events: Path) -> tuple[float, int, list[dict[str, object]]]:
    events.unlink(missing_ok=True)
    start = time.perf_counter()
    code = dflashops([*args, "--json", str(events)])
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    return elapsed, code, rows


def commands_per_host(rows: list[dict[str, object]]) -> int:
    counts = [r["data"]["commands"] for r in rows if r["action"] == "stats"]  # type: ignore[index]
    return max(counts) if counts else -1  # type: ignore[return-value,type-var]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="1,4,16")
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
        with Fleet(base / "fleet", REPO) as fleet:
            for i in range(max(sizes)):
                fleet.add(f"n{i:02d}")
            fleet.start()
            (base / "home" / ".ssh" / "known_hosts").write_text(fleet.known_hosts_path.read_text())
            for size in sizes:
                names = [f"n{i:02d}" for i in range(size)]
                inv = fleet.inventory(hosts=names, groups={"bench": names})
                for i, name in enumerate(names):
                    inv["hosts"][name]["vars"] = {"base_port": 32000 + 10 * i}
                (base / "inventory.yaml").write_text(yaml.safe_dump(inv))
                (base / "bench.yaml").write_text(yaml.safe_dump(PLAYBOOK))
                common = [
                    "-i",
                    str(base / "inventory.yaml"),
                    "-p",
                    str(base / "bench.yaml"),
                    "--forks",
                    "16",
                ]
                events = base / "events.jsonl"
                cold, code1, rows1 = run(["deploy", *common], events)
                warm, code2, rows2 = run(["deploy", *common], events)
                restarted = [r for r in rows2 if r["action"] in ("start", "restart", "stop")]
                _, code3, _ = run(["stop", *common], events)
                print(
                    f"hosts={size} units_per_host=4 deploy_s={cold:.2f} commands_per_host={commands_per_host(rows1)} "
                    f"noop_redeploy_s={warm:.2f} noop_commands_per_host={commands_per_host(rows2)} "
                    f"noop_restarts={len(restarted)} exit_codes={code1},{code2},{code3}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
