"""`dflashops dashboard`: what sampling costs the controller, how fast the page draws with a
week of samples, and how big the samples file grows.

    .venv/bin/python bench/bench_dashboard.py [--hosts 8] [--samples 10] [--store-hosts 8]

1. Controller CPU per sample per host: N sshd hosts (default 8; --hosts 64 for the issue's
   fleet) with two stub servers each, sampled every 2 s (one probe per host over kept sessions,
   the sample built and written to SQLite), against `top`'s refresh over the same kept sessions
   in the same run. Target: no more than `top`'s.
2. The samples file: one day at 2 s written through Store.add (full resolution, and the minute
   and quarter-hour copies made as it goes) for --store-hosts hosts of two servers and a job,
   then six more days of the coarse copies (what a week leaves: full resolution is kept for a
   day); its size per host-day.
3. Page render time in the browser (Debian's chromium, selenium) with that week in the store:
   from navigation to the page first whole, for the 1h, 24h and 7d windows; and the server's
   share (building the document). Target: under 1 s. Skipped without chromium.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "integration"))

from browser import headless_chromium  # noqa: E402
from fleet import Fleet, sshd_unavailable_reason  # noqa: E402

from dflashops.cli import main as dflashops  # noqa: E402
from dflashops.commands.common import prepare  # noqa: E402
from dflashops.dashboard import page  # noqa: E402
from dflashops.dashboard.fleet import Watch  # noqa: E402
from dflashops.dashboard.sample import HostSample, Sample, UnitSample  # noqa: E402
from dflashops.dashboard.sampler import Sampler  # noqa: E402
from dflashops.dashboard.server import Dashboard  # noqa: E402
from dflashops.dashboard.store import LEVELS, Store  # noqa: E402
from dflashops.output import console  # noqa: E402
from tests.procs import free_ports  # noqa: E402

DAY = 86400
EVERY = 2.0


def cpu_per_host(base: Path, hosts: int, samples: int, dashboard: bool) -> float:
    """Controller CPU (s) per host per look: `top`'s refresh, or the dashboard's sample."""
    target = prepare(console(), str(base / "inventory.yaml"), None, [str(base / "bench.yaml")])
    watch = Watch(target, forks=hosts)
    store = Store(base / f"samples-{time.monotonic_ns()}.sqlite") if dashboard else None
    sampler = Sampler(watch, store, EVERY, print)
    look = sampler.step if dashboard else watch.refresh
    try:
        look()  # connections up, caches warm: steady state from here
        spent = 0.0
        for _ in range(samples):
            began = time.monotonic()
            cpu = time.process_time()
            look()
            spent += time.process_time() - cpu
            time.sleep(max(0.0, EVERY - (time.monotonic() - began)))
    finally:
        watch.close()
        if store is not None:
            store.close()
    assert watch.reached == hosts, {n: v.error for n, v in watch.views.items()}
    return spent / samples / hosts


def sampling(args: argparse.Namespace) -> None:
    reason = sshd_unavailable_reason()
    if reason:
        print(f"sampling: not measured: {reason} (bash dev/ensure-sshd.sh)")
        return
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
                        "engine": "stub",
                        "model": "/m",
                        "replicas": 2,
                        "port": "{{ base_port }}",
                        "ready": {"timeout": "60s", "interval": "0.2s"},
                        "stop_grace": "5s",
                    }
                ],
            }
            (base / "bench.yaml").write_text(yaml.safe_dump(book))
            common = ["-i", str(base / "inventory.yaml"), "-p", str(base / "bench.yaml")]
            assert dflashops(["deploy", *common, "--forks", "16"]) == 0
            try:
                top = cpu_per_host(base, args.hosts, args.samples, dashboard=False)
                dash = cpu_per_host(base, args.hosts, args.samples, dashboard=True)
            finally:
                dflashops(["stop", *common, "--forks", "16"])
    print(
        f"sampling, {args.hosts} hosts x 2 servers, every {EVERY:g}s, {args.samples} looks: "
        f"controller CPU per host per look: dashboard sample {dash * 1000:.2f} ms, "
        f"top refresh {top * 1000:.2f} ms ({dash / top:.2f}x)"
    )


def week(store: Store, hosts: int) -> Sample:
    """A week of samples for ``hosts`` hosts (two servers and a job each): the last day at
    full resolution through Store.add, the six before it as the coarse copies a week leaves.
    Returns the last sample."""
    end = time.time()
    start = end - DAY
    names = [f"n{i:02d}" for i in range(hosts)]
    last = Sample(start)
    for k in range(int(DAY / EVERY)):
        t = start + k * EVERY
        units = []
        for i, h in enumerate(names):
            wave = (k + 37 * i) % 1800 / 1800
            for j in range(2):
                units.append(
                    UnitSample(
                        h,
                        f"sglang-{j}",
                        "service",
                        "sglang",
                        "ready",
                        i % 3,
                        tok_s=900 + 300 * wave + 17 * j,
                        running=4 + j,
                        queued=k % 3,
                        kv=0.2 + 0.5 * wave,
                        gpu=60 + 30 * wave,
                        gpu_mem=71234.0,
                    )
                )
            units.append(
                UnitSample(
                    h,
                    "generate",
                    "job",
                    "job",
                    "running",
                    0,
                    done=float(k),
                    total=DAY / EVERY * 2,
                    rate=0.5,
                    eta=(DAY / EVERY * 2 - k) * EVERY,
                )
            )
        last = Sample(t, [HostSample(h, "ok") for h in names], units)
        if k % 30 == 0:
            store.pruned = 0.0  # a simulated minute went by: roll up as the dashboard would
        store.add(last)
    with store.batch() as db:
        for table, _, _, brief in LEVELS:
            for d in range(1, 7) if not brief else ():
                db.execute(
                    f"INSERT OR REPLACE INTO {table} SELECT t - ?, series, state, restarts, "
                    f"tok_s, running, queued, kv, gpu, gpu_mem, done, total, rate, eta FROM {table} "
                    "WHERE t >= ?",
                    (d * DAY * 1000, int(start * 1000)),
                )
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return last


def rendering(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "samples.sqlite")
        began = time.monotonic()
        last = week(store, args.store_hosts)
        made = time.monotonic() - began
        size = store.size()
        per = size / args.store_hosts / 7
        print(
            f"samples file, {args.store_hosts} hosts x (2 servers + 1 job), a week at {EVERY:g}s "
            f"(full resolution for the last day): {size / 2**20:.1f} MiB, "
            f"{per / 2**20:.2f} MiB per host-day; the full-resolution day alone "
            f"~{raw_share(store) / args.store_hosts / 2**20:.2f} MiB per host (made in {made:.0f}s)"
        )
        sampler = Sampler(SimpleNamespace(tails=None), store, EVERY, print)  # type: ignore[arg-type]
        sampler.latest = last
        for window in ("1h", "24h", "7d"):
            t0 = time.perf_counter()
            page.document(sampler, window)
            print(
                f"  document for the {window} window: {(time.perf_counter() - t0) * 1000:.0f} ms (server)"
            )
        driver = headless_chromium(Path(tmp) / "profile")
        if isinstance(driver, str):
            print(f"page render in the browser: not measured ({driver})")
            return
        server = Dashboard(("127.0.0.1", 0), sampler, None)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            for window in ("1h", "24h", "7d", "1h"):
                driver.get(f"{server.url}?window={window}")
                deadline = time.monotonic() + 30
                placed = None
                while placed is None and time.monotonic() < deadline:
                    placed = driver.execute_script("return document.body.dataset.placedAt || null")
                    time.sleep(0.02)
                print(
                    f"  page render in chromium, {window} window: {float(placed or 'nan'):.0f} ms from navigation to the page whole"
                )
        finally:
            driver.quit()
            server.shutdown()
            server.server_close()


def raw_share(store: Store) -> float:
    """Bytes of the full-resolution table (dbstat when SQLite has it, else its share of rows)."""
    try:
        return float(
            store.db.execute("SELECT sum(pgsize) FROM dbstat WHERE name = 'points'").fetchone()[0]
        )
    except Exception:
        rows = {
            t: store.db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("points", "m1", "m15")
        }
        return store.size() * rows["points"] / max(1, sum(rows.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--store-hosts", type=int, default=8)
    parser.add_argument("--skip-sampling", action="store_true")
    args = parser.parse_args()
    if not args.skip_sampling:
        sampling(args)
    rendering(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
