"""An empty node to ready: environments and files entries at once, not one after the other.

    .venv/bin/python bench/bench_empty_node.py [--model-mib 2048] [--rounds 2]

On fresh sshd hosts (each deploy gets a host of its own, so nothing is cached on it), three
deploys of one playbook: only an environment built from a wheel (``env``), only a model staged
from the host's disk to another folder (``files``, the RAM disk of a real node), and both
(``both``). Each ends with one stub server ready. The issue's target: ``both`` within 10% of
max(env, files), not env + files (the stub's own start is in all three). Prints numbers only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from fleet import Fleet, FleetHost, sshd_unavailable_reason  # noqa: E402

from tests.wheels import build_wheel  # noqa: E402

BIN = Path(sys.executable).parent


def book(host: FleetHost, port: int, wheels: Path, env: bool, files: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": "empty",
        "hosts": host.name,
        "services": [
            {
                "name": "web",
                "engine": "stub",
                "model": "/m",
                "port": port,
                "env": {"DFLASHOPS_STUB_STARTUP_SECONDS": "0.5"},
            }
        ],
    }
    if env:
        out["environments"] = {
            "tools": {
                "path": str(host.dir / "venv-tools"),
                "packages": ["dfobench==1.0"],
                "wheels": str(wheels),
            }
        }
    if files:
        src, dest = host.dir / "disk" / "model", host.dir / "shm" / "model"
        out["files"] = [{"src": f"host:{src}", "dest": str(dest)}]
    return out


def model(host: FleetHost, mib: int) -> None:
    root = host.dir / "disk" / "model"
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with open(root / "model-00001.safetensors", "wb") as f:
        for _ in range(mib):
            f.write(block)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if reason := sshd_unavailable_reason():
        print(f"cannot run: {reason} (bash dev/ensure-sshd.sh)", file=sys.stderr)
        return 2
    kinds = {"env": (True, False), "files": (False, True), "both": (True, True)}
    with tempfile.TemporaryDirectory(prefix="bench-empty-") as tmp:
        base = Path(tmp)
        wheels = base / "wheels"
        build_wheel(wheels, "dfobench", "1.0")
        env = {**os.environ, "HOME": str(base / "home"), "DFLASHOPS_CACHE": str(base / "cache")}
        (base / "home" / ".ssh").mkdir(parents=True)
        names = [f"{k}{r}" for r in range(args.rounds) for k in kinds]
        with Fleet(base / "fleet", REPO) as fleet:
            for name in names:
                fleet.add(name, gpus=1)
            fleet.start()
            (base / "home" / ".ssh" / "known_hosts").write_text(fleet.known_hosts_path.read_text())
            (base / "inventory.yaml").write_text(yaml.safe_dump(fleet.inventory(hosts=names)))
            took: dict[str, list[float]] = {k: [] for k in kinds}
            for i, name in enumerate(names):
                kind = name.rstrip("0123456789")
                host = fleet[name]
                if kinds[kind][1]:
                    model(host, args.model_mib)
                playbook = base / f"{name}.yaml"
                data = book(host, 33000 + i, wheels, *kinds[kind])
                playbook.write_text(yaml.safe_dump(data))
                argv = [str(BIN / "dflashops"), "deploy", "-i", str(base / "inventory.yaml")]
                began = time.perf_counter()
                done = subprocess.run(
                    [*argv, "-p", str(playbook), "--host", name],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                took[kind].append(time.perf_counter() - began)
                if done.returncode != 0:
                    print(done.stdout, done.stderr, file=sys.stderr)
                    return 1
                stop = [str(BIN / "dflashops"), "stop", "-i", str(base / "inventory.yaml")]
                subprocess.run(
                    [*stop, "-p", str(playbook), "--host", name],
                    env=env,
                    capture_output=True,
                    check=False,
                )
            best = {k: min(v) for k, v in took.items()}
            print(f"model {args.model_mib} MiB, best of {args.rounds} (deploy to ready, seconds)")
            for kind, seconds in best.items():
                print(f"  {kind:5} {seconds:6.2f}s   all: {[round(s, 2) for s in took[kind]]}")
            both, one, other = best["both"], best["env"], best["files"]
            print(
                f"  both / max(env, files) = {both / max(one, other):.2f} (target <= 1.10); "
                f"both / (env + files) = {both / (one + other):.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
