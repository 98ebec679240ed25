"""The hand-written Fabric deploy that bench_vs_fabric.py measures dflashops against.

    python bench/handwritten_fabric.py deploy|stop SPEC.json

What a careful engineer writes in an afternoon, with the fewest round trips and none of
dflashops' safety: per host, in parallel, ONE ssh command (a bash script built here) that, for
each unit, renders its launch script, starts it when the script changed or the process is down
(TERM to the old process group first), then waits on the host for /health (curl every 0.1 s)
and checks the TP size in /get_server_info. No pre-flight, no facts, no verified upload, no
identity, no orphans, no GPU check. SPEC.json: {"hosts": [{name, address, port, user, key,
known_hosts, workdir, python, base_port}], "units": N, "tp": T, "model": ..., "env": {...}}.
"""

from __future__ import annotations

import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fabric import Connection


def launch_script(host: dict[str, Any], spec: dict[str, Any], i: int) -> str:
    tp = spec["tp"]
    port = host["base_port"] + i
    gpus = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in spec["env"].items())
    argv = [
        host["python"],
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec["model"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(tp),
    ]
    return (
        f"#!/usr/bin/env bash\nexport CUDA_VISIBLE_DEVICES={gpus}\n{env}exec {shlex.join(argv)}\n"
    )


def deploy_script(host: dict[str, Any], spec: dict[str, Any]) -> str:
    root = shlex.quote(f"{host['workdir']}/fab")
    lines = ["set -u", f"mkdir -p {root}", "started=''"]
    for i in range(spec["units"]):
        d = f"{root}/u{i}"
        lines += [
            f"mkdir -p {d}",
            f"printf %s {shlex.quote(launch_script(host, spec, i))} > {d}/launch.new",
            f"if cmp -s {d}/launch.new {d}/launch.sh && [ -f {d}/pid ] && kill -0 $(cat {d}/pid) 2>/dev/null; then",
            f"  rm -f {d}/launch.new; echo u{i} ok",
            "else",
            f"  if [ -f {d}/pid ]; then kill -TERM -- -$(cat {d}/pid) 2>/dev/null;"
            f" while kill -0 $(cat {d}/pid) 2>/dev/null; do sleep 0.05; done; fi",
            f"  mv {d}/launch.new {d}/launch.sh",
            f"  setsid bash {d}/launch.sh > {d}/log 2>&1 < /dev/null & echo $! > {d}/pid",
            f"  echo u{i} started",
            "fi",
        ]
    for i in range(spec["units"]):
        url = f"http://127.0.0.1:{host['base_port'] + i}"
        lines += [
            "n=0",
            f"until curl -sf -o /dev/null {url}/health; do sleep 0.1; n=$((n+1));"
            f" [ $n -gt 600 ] && {{ echo u{i} not ready; exit 1; }}; done",
            f"curl -sf {url}/get_server_info | grep -q '\"tp_size\": *{spec['tp']}[,}}]'"
            f" || {{ echo u{i} wrong tp; exit 1; }}",
            f"echo u{i} ready",
        ]
    return "\n".join(lines) + "\n"


def stop_script(host: dict[str, Any], spec: dict[str, Any]) -> str:
    root = shlex.quote(f"{host['workdir']}/fab")
    lines = []
    for i in range(spec["units"]):
        d = f"{root}/u{i}"
        lines.append(
            f"if [ -f {d}/pid ]; then kill -TERM -- -$(cat {d}/pid) 2>/dev/null;"
            f" while kill -0 $(cat {d}/pid) 2>/dev/null; do sleep 0.05; done; rm -f {d}/pid; fi"
        )
    return "\n".join(lines) + "\n"


def one(host: dict[str, Any], spec: dict[str, Any], what: str) -> str:
    conn = Connection(
        host["address"],
        user=host["user"],
        port=host["port"],
        connect_kwargs={"key_filename": host["key"], "look_for_keys": False, "allow_agent": False},
    )
    conn.client.load_host_keys(host["known_hosts"])
    script = deploy_script(host, spec) if what == "deploy" else stop_script(host, spec)
    try:
        result = conn.run(f"bash -c {shlex.quote(script)}", hide=True, warn=True, in_stream=False)
    finally:
        conn.close()
    if result.exited != 0:
        raise SystemExit(f"{host['name']}: exit {result.exited}: {result.stdout}{result.stderr}")
    return result.stdout


def main(argv: list[str]) -> int:
    what, path = argv
    with open(path) as f:
        spec = json.load(f)
    with ThreadPoolExecutor(len(spec["hosts"])) as pool:
        for out in pool.map(lambda h: one(h, spec, what), spec["hosts"]):
            if "ready" not in out and what == "deploy":
                raise SystemExit(f"unexpected output: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
