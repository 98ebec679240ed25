"""Throughput of dflashops/payloads/generate_completions.py against local stub servers.

    .venv/bin/python bench/bench_generate_completions.py [--quick] [--profile]

Scenarios (3 stub_engine.py servers on loopback ports, --concurrency 48):
  (a) zero latency, 3000 prompts: how fast can the client go, and its CPU cost per request
      (resource.getrusage(RUSAGE_CHILDREN) around the client subprocess);
  (b) 40 ms per request, 6000 prompts: requests/s against the ideal 48 / 0.04 = 1200 req/s.

It prints a table: wall-clock and generation-phase requests/s (the client's own progress.json
figure, without python start-up and input reading), client CPU, and the stubs' CPU (from
/proc/PID/stat), which tells whether the client or the stubs are the bottleneck. --profile runs
the client of scenario (b) under cProfile and prints its top functions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # tests.procs, shared by the test helpers
sys.path.insert(0, str(REPO / "tests" / "unit"))

from _stubservers import GENERATE, read_records, stub_servers, write_prompts  # noqa: E402

CONCURRENCY = 48

# Runs the client in-process with a cProfile per thread (cProfile alone sees only the main
# thread, and the script's own __main__ leaves through os._exit), then prints the merged stats.
_PROFILE_DRIVER = """
import cProfile, importlib.util, pstats, sys, threading
profiles = []
def _start(*_args):
    sys.setprofile(None)
    p = cProfile.Profile()
    profiles.append(p)
    p.enable()
threading.setprofile(_start)
spec = importlib.util.spec_from_file_location("gc_payload", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
main_prof = cProfile.Profile()
main_prof.enable()
code = mod.main(sys.argv[2:])
main_prof.disable()
stats = pstats.Stats(main_prof)
for p in profiles:
    stats.add(p)
stats.sort_stats("tottime").print_stats(22)
sys.stdout.flush()
import os
os._exit(code)
"""


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a running process, in seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def scenario(
    name: str, n_prompts: int, latency: float, workdir: Path, profile: bool = False
) -> dict[str, float | str]:
    env = {"DFLASHOPS_STUB_LATENCY": str(latency)} if latency else {}
    sub = workdir / name
    sub.mkdir()
    prompts = sub / "prompts.jsonl"
    write_prompts(prompts, n_prompts, text_every=0)
    out = sub / "out"
    with stub_servers(sub, 3, env=env) as stubs:
        stub_cpu0 = sum(_proc_cpu_seconds(s.proc.pid) for s in stubs)
        cmd = [sys.executable]
        cmd += ["-c", _PROFILE_DRIVER, str(GENERATE)] if profile else [str(GENERATE)]
        cmd += [
            "--prompts",
            str(prompts),
            "--servers",
            *(s.url for s in stubs),
            "--output-dir",
            str(out),
            "--concurrency",
            str(CONCURRENCY),
            "--max-output-tokens",
            "4096",
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        stub_cpu = sum(_proc_cpu_seconds(s.proc.pid) for s in stubs) - stub_cpu0
    if proc.returncode != 0:
        raise SystemExit(f"client failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    if profile:
        lines = proc.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if "Ordered by" in line)
        print(f"client profile, {name}, all threads (time spent inside each function):")
        print("\n".join(lines[start : start + 28]))
    info = json.loads((out / "progress.json").read_text())
    assert info["done"] == n_prompts, info
    latencies = [r["latency_s"] for r in read_records(out)]
    assert len(latencies) == n_prompts
    client_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "scenario": name,
        "prompts": n_prompts,
        "wall_s": wall,
        "req_s_wall": n_prompts / wall,
        "req_s_gen": info["requests_per_s"],
        "client_cpu_s": client_cpu,
        "client_cpu_ms_per_req": 1000 * client_cpu / n_prompts,
        "stub_cpu_s": stub_cpu,
        "stub_cpu_ms_per_req": 1000 * stub_cpu / n_prompts,
        # Time per request inside client.request (send, stub, receive) vs the whole cycle of a
        # worker (concurrency / rate): the difference is the client's own per-request work.
        "latency_ms": 1000 * sum(latencies) / len(latencies),
        "cycle_ms": 1000 * CONCURRENCY / info["requests_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the prompts")
    ap.add_argument("--profile", action="store_true", help="cProfile the client in (b)")
    args = ap.parse_args()
    scale = 10 if args.quick else 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gc-") as d:
        work = Path(d)
        rows.append(scenario("a_zero_latency", 3000 // scale, 0.0, work))
        rows.append(scenario("b_latency_40ms", 6000 // scale, 0.04, work, profile=args.profile))
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}, concurrency {CONCURRENCY}")
    head = (
        f"{'scenario':<16}{'prompts':>8}{'wall s':>8}{'req/s':>8}{'req/s gen':>10}"
        f"{'client CPU s':>13}{'ms/req':>8}{'stubs CPU s':>12}{'ms/req':>8}"
        f"{'latency ms':>11}{'cycle ms':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['scenario']:<16}{r['prompts']:>8}{r['wall_s']:>8.2f}{r['req_s_wall']:>8.0f}"
            f"{r['req_s_gen']:>10.0f}{r['client_cpu_s']:>13.2f}{r['client_cpu_ms_per_req']:>8.3f}"
            f"{r['stub_cpu_s']:>12.2f}{r['stub_cpu_ms_per_req']:>8.3f}"
            f"{r['latency_ms']:>11.2f}{r['cycle_ms']:>9.2f}"
        )
    b = rows[1]
    ideal = CONCURRENCY / 0.04
    print(
        f"(b) vs ideal {ideal:.0f} req/s: {b['req_s_gen'] / ideal:.0%} (generation phase), "
        f"{b['req_s_wall'] / ideal:.0%} (wall clock, with start-up)"
    )
    print(
        "latency: mean time inside one request as the client sees it (stub latency + HTTP + "
        "GIL waits); cycle: concurrency / req/s, so cycle - latency = the client's own time "
        "per request (parse, hand to the writer, pick a server)."
    )


if __name__ == "__main__":
    main()
