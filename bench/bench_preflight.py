"""Pre-flight at fleet scale: 1,000 hosts x 8 units, cold cache and warm.

    .venv/bin/python bench/bench_preflight.py [--hosts 1000] [--units 8] [--rounds 2]

Writes an inventory of N 8-GPU hosts (ssh entries on loopback; pre-flight never connects) and a
playbook with an SGLang service of `--units` replicas on each, then times `dflashops preflight`
as a command: cold (an empty cache folder: load, plan, then render and check a slice of units
per core) and warm (the same again: no input changed, so the whole run's kept result is the
answer, preflight/runcache.py). Prints the best of the rounds and every round's time, and the
summary's longest line, which must name only a handful of hosts however many there are.
Targets (issue 12): cold < 3 s, warm < 1 s, on 2 cores.
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

BIN = Path(sys.executable).parent


def write_project(base: Path, hosts: int, units: int) -> None:
    inventory = {
        "hosts": {
            f"gpu{i:04d}": {
                "address": "127.0.0.1",
                "port": 20000 + i,
                "user": "root",
                "gpus": 8,
                "workdir": "/root/dflashops",
            }
            for i in range(hosts)
        },
        "groups": {"fleet": [f"gpu{i:04d}" for i in range(hosts)]},
    }
    playbook = {
        "name": "fleet",
        "hosts": "fleet",
        "services": [
            {
                "name": "sglang",
                "engine": "sglang",
                "model": "/dev/shm/Qwen3.6-27B",
                "replicas": units,
                "tp": 8 // units if units <= 8 else 1,
                "gpus": "auto" if units <= 8 else [],
                "port": 30000,
                "args": {"mem-fraction-static": 0.88, "context-length": 40960},
            }
        ],
    }
    (base / "playbooks").mkdir(parents=True, exist_ok=True)
    (base / "inventory.yaml").write_text(yaml.safe_dump(inventory, sort_keys=False))
    (base / "playbooks" / "fleet.yaml").write_text(yaml.safe_dump(playbook, sort_keys=False))


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pre-flight failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return took, done.stdout + done.stderr


def _rounds(times: list[float]) -> str:
    return " ".join(f"{t:.2f}" for t in times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        base = Path(tmp)
        write_project(base, args.hosts, args.units)
        cache = base / "cache"
        env = {**os.environ, "DFLASHOPS_CACHE": str(cache), "COLUMNS": "120"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # start as a user's install does: from bytecode
        argv = [str(BIN / "dflashops"), "preflight", "-i", str(base / "inventory.yaml")]
        cold: list[float] = []
        warm: list[float] = []
        out = ""
        load = os.getloadavg()[0]  # a shared machine: say how busy it was
        for _ in range(args.rounds):
            shutil.rmtree(cache, ignore_errors=True)
            took, out = timed(argv, env)
            cold.append(took)
            took, again = timed(argv, env)
            warm.append(took)
            if again != out:  # the kept result must read exactly as the full run did
                raise SystemExit(f"warm output differs from cold:\n{out}\n---\n{again}")
        longest = max(out.splitlines(), key=len)
        units = args.hosts * args.units
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(
            f"hosts={args.hosts} units={units} (best of {args.rounds}; {cores} cores; "
            f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after)"
        )
        print(f"cold: {min(cold):5.2f}s  (target < 3 s)  rounds: {_rounds(cold)}")
        print(f"warm: {min(warm):5.2f}s  (target < 1 s)  rounds: {_rounds(warm)}")
        print(f"longest output line: {len(longest)} chars: {longest[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
