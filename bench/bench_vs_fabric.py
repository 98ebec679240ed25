"""dflashops against a hand-written Fabric script doing the same job, same fleet, same run.

    .venv/bin/python bench/bench_vs_fabric.py [--hosts 16] [--units 4] [--rounds 2]

The job (issue 12): N real sshd hosts (fake 8-GPU nodes), 4 SGLang units each (the fake SGLang
of tests/fakes, TP=2, healthy 1 s after start): render a launch script per unit, start what
changed or is down, wait for health, check TP. Both tools run as commands (their start-up is
part of the bill): `dflashops deploy` with the playbook's default readiness settings, and
bench/handwritten_fabric.py (one ssh command per host, no safety checks). Each round runs both,
alternating which goes first: full deploy from nothing, then a no-op redeploy, then a stop. It
prints the best time of each and the ratio dflashops / Fabric (target <= 1.2), and dflashops'
round trips and remote commands per host (from its --json stats).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import HOST_PYTHON, Fleet, sshd_unavailable_reason  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "/models/bench-27b"
ENV = {"DFLASHOPS_STUB_STARTUP_SECONDS": "1.0"}
TP = 2


def playbook(units: int) -> dict[str, object]:
    return {
        "name": "bench",
        "hosts": "bench",
        "services": [
            {
                "name": "sglang",
                "engine": "sglang",
                "model": MODEL,
                "replicas": units,
                "tp": TP,
                "port": "{{ base_port }}",
                "env": ENV,
            }
        ],
    }


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return elapsed


def per_host(events: Path) -> str:
    """Round trips and remote commands per host (the most any host needed), from --json."""
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    stats = [r["data"] for r in rows if r["action"] == "stats"]
    trips = max((s.get("round_trips", -1) for s in stats), default=-1)
    commands = max((s["commands"] for s in stats), default=-1)
    return f"{trips} round trips, {commands} commands"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason:
        print(f"cannot run: {reason} (bash dev/ensure-sshd.sh)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-fabric-") as tmp:
        base = Path(tmp)
        home = base / "home"
        (home / ".ssh").mkdir(parents=True)
        env = {**os.environ, "HOME": str(home), "DFLASHOPS_CACHE": str(base / "cache")}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # both tools start as users' do: from bytecode
        with Fleet(base / "fleet", REPO) as fleet:
            names = [f"n{i:02d}" for i in range(args.hosts)]
            for name in names:
                fleet.add(name, gpus=TP * args.units)
            fleet.start()
            (home / ".ssh" / "known_hosts").write_text(fleet.known_hosts_path.read_text())
            ports = {name: 32000 + 10 * i for i, name in enumerate(names)}
            inv = fleet.inventory(hosts=names, groups={"bench": names})
            for name in names:
                inv["hosts"][name]["vars"] = {"base_port": ports[name]}
            (base / "inventory.yaml").write_text(yaml.safe_dump(inv))
            (base / "bench.yaml").write_text(yaml.safe_dump(playbook(args.units)))
            spec = {
                "units": args.units,
                "tp": TP,
                "model": MODEL,
                "env": ENV,
                "hosts": [
                    {
                        "name": h.name,
                        "address": h.address,
                        "port": h.port,
                        "user": "root",
                        "key": str(fleet.client_key_path),
                        "known_hosts": str(fleet.known_hosts_path),
                        "workdir": str(h.workdir),
                        "python": HOST_PYTHON,
                        "base_port": ports[h.name] + 5,  # beside dflashops' ports
                    }
                    for h in fleet
                ],
            }
            (base / "spec.json").write_text(json.dumps(spec))
            events = base / "events.jsonl"
            ops = ["-i", str(base / "inventory.yaml"), "-p", str(base / "bench.yaml")]
            tools = {
                "fabric": lambda what: [
                    str(BIN / "python"),
                    str(REPO / "bench" / "handwritten_fabric.py"),
                    what,
                    str(base / "spec.json"),
                ],
                "dflashops": lambda what: [
                    str(BIN / "dflashops"),
                    what,
                    *ops,
                    "--forks",
                    str(args.hosts),
                    "--json",
                    str(events),
                ],
            }
            best: dict[tuple[str, str], float] = {}
            commands: dict[str, str] = {}
            for rnd in range(args.rounds):
                order = ["fabric", "dflashops"] if rnd % 2 == 0 else ["dflashops", "fabric"]
                for tool in order:
                    for phase in ("full", "noop"):
                        events.unlink(missing_ok=True)  # --json appends
                        took = timed(tools[tool]("deploy"), env)
                        best[tool, phase] = min(took, best.get((tool, phase), took))
                        if tool == "dflashops":
                            commands[phase] = per_host(events)
                        print(f"round {rnd + 1}: {tool:9} {phase:4} {took:6.2f}s", flush=True)
                    timed(tools[tool]("stop"), env)
            print(f"\nhosts={args.hosts} units_per_host={args.units} (best of {args.rounds})")
            for phase in ("full", "noop"):
                fab, dfl = best["fabric", phase], best["dflashops", phase]
                print(
                    f"{phase:4}: fabric {fab:5.2f}s  dflashops {dfl:5.2f}s  ratio {dfl / fab:4.2f}x"
                    f"  (target <= 1.20)  dflashops per host: {commands[phase]}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
