"""dflashops ray_cluster: wait until a Ray cluster shows every node with its GPUs, then exec a
command (``vllm serve ... --distributed-executor-backend ray``) in this same process.

    python ray_cluster.py --address HEAD:PORT --node IP [--node IP ...] --gpus G --timeout S \
        -- COMMAND [ARGS ...]

Shipped to the head node of a vLLM service with ``backend: ray`` and run with the unit's own
Python (the one with ``ray`` installed), through Ray's public API (``ray.init``, ``ray.nodes``).
vLLM itself does not wait for nodes: started early, it fails ("The number of required GPUs
exceeds the total number of available GPUs") or waits on a placement group that never fits.

Every change in the cluster is logged (``[dflashops] ray cluster: 1 of 2 nodes, 2 of 4 GPUs;
waiting for 10.0.0.2``); when ``--timeout`` runs out first it says which nodes never came and
exits 1, so deploy reports it with this log instead of waiting out the ready timeout again.
Python 3.9+.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

POLL_SECONDS = 1.0
SAY_EVERY = 30.0


def say(line: str) -> None:
    sys.stdout.write(f"[dflashops] ray cluster: {line}\n")
    sys.stdout.flush()


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("ray_cluster: usage: ... -- COMMAND [ARGS ...] (no command after --)")
    at = argv.index("--")
    parser = argparse.ArgumentParser(prog="ray_cluster")
    parser.add_argument("--address", required=True, help="the head's HOST:PORT")
    parser.add_argument("--node", action="append", required=True, help="a node's address")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the cluster must have")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait")
    args = parser.parse_args(argv[:at])
    command = argv[at + 1 :]
    if not command:
        parser.error("no command after --")
    return args, command


def census(ray: object, expected: list[str]) -> tuple[dict[str, float], list[str]]:
    """GPUs of each expected node that is alive, and the expected nodes not (yet) in."""
    gpus: dict[str, float] = {}
    for node in ray.nodes():  # type: ignore[attr-defined]
        address = node.get("NodeManagerAddress")
        if node.get("Alive") and address in expected:
            gpus[address] = gpus.get(address, 0.0) + float(node.get("Resources", {}).get("GPU", 0))
    return gpus, [a for a in expected if a not in gpus]


def wait(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError as exc:
        say(
            f"cannot import ray with {sys.executable} ({exc}): install ray in the unit's environment"
        )
        return 1
    deadline = time.monotonic() + args.timeout
    connected = False
    last, said = "", 0.0
    while True:
        now = time.monotonic()
        if not connected:
            try:
                ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
                connected = True
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                state = f"the head at {args.address} does not answer yet ({type(exc).__name__})"
        if connected:
            gpus, missing = census(ray, args.node)
            total = sum(gpus.values())
            state = f"{len(gpus)} of {len(args.node)} nodes, {total:g} of {args.gpus} GPUs"
            if not missing and total >= args.gpus:
                say(f"{state}: complete")
                ray.shutdown()  # the command joins the cluster itself
                return 0
            if missing:
                state += f"; waiting for {', '.join(missing)}"
        if state != last or now - said >= SAY_EVERY:
            say(state)
            last, said = state, now
        if now >= deadline:
            say(
                f"not complete after {args.timeout:g}s: {state}. Is `ray start` running on "
                "those nodes, and can they reach the head's port?"
            )
            return 1
        time.sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    code = wait(args)
    if code:
        return code
    sys.stdout.flush()
    os.execvp(command[0], command)  # same pid, same log: the unit is still this process
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
