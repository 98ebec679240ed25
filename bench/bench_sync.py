"""File sync against `rsync -e ssh`, side by side in one run, on a real sshd host over loopback.

    .venv/bin/python bench/bench_sync.py [--big-mib 2048] [--files 10000] [--tree-mib 100]

Two entries, as a playbook declares them (`files:` with a controller source): one large file
and a tree of many small files. For each: the first transfer into an empty dest, then a re-sync
with nothing changed. dflashops runs the real `dflashops deploy -p PLAYBOOK` (pre-flight, facts,
the transfer, its verification); rsync runs `rsync -a -e ssh` with the same key and a pinned host
key. Printed: seconds, MB/s, the throughput ratio (target: dflashops >= 0.8x rsync on the first
transfer), and the remote commands of each no-change re-sync (target: no more than a no-op
deploy's, and no bytes sent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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


def make_data(root: Path, big_mib: int, files: int, tree_mib: int) -> tuple[Path, Path]:
    block = os.urandom(1 << 20)
    root.mkdir(parents=True, exist_ok=True)
    big = root / "big.bin"
    with big.open("wb") as f:
        for i in range(big_mib):
            f.write(block[i % 7 :] + block[: i % 7])  # every MiB differs a little
    tree = root / "tree"
    each = tree_mib * (1 << 20) // files
    for i in range(files):
        path = tree / f"d{i % 100:02d}" / f"f{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(each))
    return big, tree


def deploy(ctl: Path, playbook: str) -> tuple[float, int, int]:
    """(seconds, remote commands, bytes sent) of `dflashops deploy -p playbooks/NAME.yaml`."""
    os.sync()  # what an earlier step left dirty is not flushed on this one's time
    events = ctl / f"events-{playbook}.jsonl"
    events.unlink(missing_ok=True)
    argv = [
        "deploy",
        "-i",
        str(ctl / "inventory.yaml"),
        "-p",
        str(ctl / "playbooks" / f"{playbook}.yaml"),
    ]
    start = time.perf_counter()
    code = dflashops([*argv, "--json", str(events)])
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert code == 0, rows
    commands = sum(int(r["data"]["commands"]) for r in rows if r["action"] == "stats")
    sent = sum(int(r["data"].get("bytes", 0)) for r in rows if r["action"] == "files")
    return elapsed, commands, sent


def rsync(src: Path, dest: str, ssh: list[str]) -> float:
    os.sync()
    start = time.perf_counter()
    subprocess.run(
        [
            "rsync",
            "-a",
            "--delete",
            "-e",
            " ".join(ssh),
            f"{src}{'/' if src.is_dir() else ''}",
            dest,
        ],
        check=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big-mib", type=int, default=2048)
    parser.add_argument("--files", type=int, default=10000)
    parser.add_argument("--tree-mib", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason or shutil.which("rsync") is None:
        sys.exit(f"cannot run: {reason or 'rsync is not installed'} (bash dev/ensure-sshd.sh)")
    base = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    fleet = Fleet(base / "fleet", REPO)
    try:
        host = fleet.add("sync", gpus=0)
        fleet.start()
        ctl = base / "ctl"
        (ctl / "home" / ".ssh").mkdir(parents=True)
        os.environ["HOME"] = str(ctl / "home")
        os.environ["DFLASHOPS_CACHE"] = str(ctl / "cache")
        shutil.copy(fleet.known_hosts_path, ctl / "home" / ".ssh" / "known_hosts")
        fleet.write_inventory(ctl / "inventory.yaml")
        big, tree = make_data(base / "data", args.big_mib, args.files, args.tree_mib)
        (ctl / "playbooks").mkdir()
        dest = host.dir / "dest"
        ssh = [
            "ssh",
            "-p",
            str(host.port),
            "-i",
            str(fleet.client_key_path),
            "-o",
            f"UserKnownHostsFile={fleet.known_hosts_path}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
        ]
        print(f"data: one {args.big_mib} MiB file; {args.files} files, {args.tree_mib} MiB in all")
        print(
            f"first transfers: best of {args.rounds} into fresh dests, the tools' order alternating"
        )
        print(
            f"{'what':<28} {'dflashops':>12} {'rsync -e ssh':>14} {'ratio':>7}  dflashops commands / bytes sent"
        )
        for name, src, size in (
            ("big", big, big.stat().st_size),
            ("tree", tree, args.tree_mib << 20),
        ):
            firsts: dict[str, list[float]] = {"dflashops": [], "rsync": []}
            d_cmds = d_sent = 0
            target = ""
            for round_ in range(args.rounds):
                entry = {"src": str(src), "dest": str(dest / "dflashops" / f"{name}-{round_}")}
                book = {"name": name, "hosts": "sync", "files": [entry]}
                (ctl / "playbooks" / f"{name}.yaml").write_text(yaml.safe_dump(book))
                (dest / "rsync").mkdir(parents=True, exist_ok=True)
                target = f"root@{host.address}:{dest / 'rsync' / f'{name}-{round_}'}"
                for tool in ("dflashops", "rsync") if round_ % 2 == 0 else ("rsync", "dflashops"):
                    if tool == "dflashops":
                        seconds, d_cmds, d_sent = deploy(ctl, name)
                    else:
                        seconds = rsync(src, target, ssh)
                    firsts[tool].append(seconds)
            d_again, d_cmds2, d_sent2 = deploy(ctl, name)
            r_again = rsync(src, target, ssh)
            d_first, r_first = min(firsts["dflashops"]), min(firsts["rsync"])

            def mbps(seconds: float, size: int = size) -> float:
                return size / seconds / 1e6

            print(
                f"{name + ' first transfer':<28} {d_first:>7.2f}s {mbps(d_first):>4.0f}MB/s"
                f" {r_first:>6.2f}s {mbps(r_first):>4.0f}MB/s {r_first / d_first:>6.2f}x  {d_cmds} / {d_sent}"
            )
            print(
                f"{name + ' no-change re-sync':<28} {d_again:>11.2f}s {r_again:>13.2f}s {'':>7}  {d_cmds2} / {d_sent2}"
            )
            shutil.rmtree(dest, ignore_errors=True)
        print(
            "(ratio: dflashops' throughput over rsync's; a no-op deploy costs 1 command per host)"
        )
    finally:
        fleet.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
