"""Fake ``python -m vllm.entrypoints.cli.main serve MODEL FLAGS`` for the dflashops test fleet.

1. Every flag must be in dflashops/data/vllm-flags.txt (vLLM 0.33.0's ``serve`` flags, short
   aliases such as ``-tp``/``-dp`` included; ``--no-X`` for a listed ``--X`` and dotted
   ``--X.field`` forms are accepted as vLLM generates them). Anything else:
   ``vllm: error: unrecognized arguments: ...`` on stderr, exit status 2.
2. It prints a vLLM-like banner: ``vLLM API server version 0.33.0`` and ``non-default args:
   {...}``. Unlike real vLLM, tensor_parallel_size and data_parallel_size are always listed,
   and the api key is redacted. The key is ``--api-key``, else ``VLLM_API_KEY`` (vLLM's rule);
   ``--config FILE`` (YAML in JSON form) puts its flags before the command line's.
3. The DP rule (INCIDENTS.md #2): with data_parallel_size > 1, the fake crashes when
   CUDA_VISIBLE_DEVICES is set at all, or when fewer than tp * dp * pp GPUs are visible.
   Real vLLM offsets each DP rank's device index by ``dp_rank * tp * pp`` itself; a device
   list narrowed per rank on top of that is what broke, and dflashops always narrows
   CUDA_VISIBLE_DEVICES in its launch scripts. After ~1 s it prints EngineCore_DP1's
   ``AssertionError: DP adjusted local rank N is out of bounds.`` (vLLM's gpu_worker wording),
   then the API server's ``BrokenPipeError: [Errno 32] Broken pipe``, and exits 1.
4. Otherwise it needs tp * dp * pp visible GPUs (else a CUDA-like error, exit 1), registers
   gpu_memory_utilization (default 0.9) x the GPU's memory on each for the fake nvidia-smi,
   and serves the stub engine with vLLM's endpoints (/health, /version, /v1/*, /metrics with
   vLLM's names such as vllm:generation_tokens_total; the api key protects /v1 only). The default host is 127.0.0.1, not vLLM's 0.0.0.0: a test
   double should not listen on every interface.
5. vLLM's native multi-node mode: ``--nnodes N`` (default 1), ``--node-rank R`` (default 0),
   ``--master-addr HOST`` (default 127.0.0.1), ``--master-port PORT`` (default 29501) and
   ``--headless`` for every node but the first. R outside 0 <= R < N, ``--headless`` on rank 0,
   or a rank R > 0 without ``--headless``: ``vllm: error: ...`` on stderr, exit status 2. The
   parallel sizes count every node: each node needs tp * dp * pp / N GPUs (the rule of 3 and 4
   applies to that share); when that does not divide, a ``ValueError`` and exit status 1. The
   non-default args line then also shows nnodes, node_rank, headless, master_addr/master_port.
   The nodes meet over TCP at HOST:PORT (pylib/_rendezvous.py's protocol, shared with the fake
   SGLang and torchrun; GPU memory is registered before it):

   - rank 0, the API server node, logs ``Waiting for N-1 headless node(s) to join ...``,
     listens on exactly HOST:PORT (taken: torch's ``DistNetworkError``, exit status 1) and
     serves no HTTP until every rank 1..N-1 has joined; then ``All N nodes joined ...`` and it
     serves as in 4. A missing rank leaves it waiting for ever.
   - rank R > 0, headless, logs ``Launching vLLM in headless mode ...``, joins the head
     (retrying until it listens; refused or hung up on: a ``DistNetworkError``, exit status 1),
     logs ``Headless node_rank R joined ...`` and holds its connection, serving no HTTP.
   - once all are in, a connection that drops (a node died, or the head stopped) makes the other
     end print ``torch.distributed.DistBackendError: NCCL error: remote process exited or there
     was a network error: lost ...`` on stderr and exit with status 1.
   - SIGTERM/SIGINT end a waiting head or a waiting/holding headless node with exit status 0;
     the fake GPU memory is unregistered on every exit but SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _fakegpu
import _rendezvous
from _fakeengine import cuda_invalid_ordinal, load_flags, load_stub, say, timestamp, unrecognized

import vllm

DP_CRASH_DELAY = 1.0
PG_WAIT_TIMEOUT = 60  # vLLM's own, for a placement group that does not fit
RAY_WATCH_SECONDS = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--api-key")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--reasoning-parser")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    p.add_argument(
        "--distributed-executor-backend", choices=["ray", "mp", "uni", "external_launcher"]
    )
    return p


NODE_DEFAULTS = {
    "nnodes": 1,
    "node_rank": 0,
    "headless": False,
    "master_addr": "127.0.0.1",
    "master_port": 29501,
    "distributed_executor_backend": None,
}


def _log(
    level: str, where: str, message: str, who: str | None = "APIServer", err: bool = False
) -> None:
    prefix = f"({who} pid={os.getpid()}) " if who else ""
    say(f"{prefix}{level} {timestamp()} [{where}] {message}", sys.stderr if err else sys.stdout)


def _usage_error(message: str) -> int:
    say("usage: vllm serve [model_tag] [options]", sys.stderr)
    say(f"vllm: error: {message}", sys.stderr)
    return 2


def _node_error(args: argparse.Namespace) -> str | None:
    """What is wrong with --nnodes/--node-rank/--master-port/--headless, if anything."""
    n, r = args.nnodes, args.node_rank
    if n < 1:
        return f"argument --nnodes: must be at least 1, got {n}"
    if not 0 <= r < n:
        return (
            f"argument --node-rank: {r} is out of range for --nnodes {n} (0 <= node_rank < nnodes)"
        )
    if not 0 < args.master_port < 65536:
        return f"argument --master-port: {args.master_port} is not a TCP port"
    if args.headless and r == 0:
        return (
            "argument --headless: node_rank 0 runs the API server and cannot be headless; "
            "pass --headless only on the other nodes (--node-rank 1..N-1)"
        )
    if r > 0 and not args.headless:
        return (
            f"argument --node-rank: node_rank {r} > 0 needs --headless (only node_rank 0 runs "
            "the API server)"
        )
    return None


def _dp_crash(local_rank: int, dp_rank: int) -> int:
    time.sleep(DP_CRASH_DELAY)
    who = f"EngineCore_DP{dp_rank}"
    lines = [
        f"ERROR {timestamp()} [core.py:843] EngineCore failed to start.",
        "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", '
        "line 243, in init_device",
        "    assert self.local_rank < torch.accelerator.device_count(), (",
        f"AssertionError: DP adjusted local rank {local_rank} is out of bounds. ",
    ]
    for line in lines:
        say(f"({who} pid={os.getpid() + 1 + dp_rank}) {line}", sys.stderr)
    for line in (
        "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", '
        "line 901, in wait_for_engine_startup",
        "BrokenPipeError: [Errno 32] Broken pipe",
    ):
        say(f"(APIServer pid={os.getpid()}) {line}", sys.stderr)
    return 1


class _Stop(_rendezvous.Stop):
    """SIGTERM/SIGINT while a node waits or holds: remember it, the loops check it."""

    def exit(self, node_rank: int, who: str | None) -> int:
        _log(
            "INFO",
            "launcher.py:112",
            f"node_rank {node_rank}: received {self.name}, shutting down cleanly",
            who,
        )
        return 0


def _nccl_error(lost: str, who: str | None) -> None:
    where = "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py"
    lines = (
        "Traceback (most recent call last):",
        f'  File "{where}", line 583, in worker_busy_loop',
        "    output = func(*args, **kwargs)",
        _rendezvous.nccl_lost(lost),
    )
    for line in lines:
        _log("ERROR", "multiproc_executor.py:590", line, who, err=True)


def _dist_network_error(message: str) -> int:
    say(f"torch.distributed.DistNetworkError: {message}", sys.stderr)
    return 1


def _not_divisible(tp: int, dp: int, pp: int, nnodes: int) -> int:
    say("Traceback (most recent call last):", sys.stderr)
    say(
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/config/parallel.py", '
        "line 512, in __post_init__",
        sys.stderr,
    )
    say(
        f"ValueError: world size {tp * dp * pp} (tensor_parallel_size {tp} x "
        f"data_parallel_size {dp} x pipeline_parallel_size {pp}) is not divisible by "
        f"nnodes {nnodes}: every node must run the same number of GPUs",
        sys.stderr,
    )
    return 1


# --------------------------------------------------------------------------- node_rank 0


def _lost(lost: str, gpu_entry: Path | None) -> None:
    """A worker gone while the head serves: its error, and the whole process goes (like
    NCCL's watchdog: the HTTP server and all)."""
    _nccl_error(lost, "EngineCore_DP0")
    _fakegpu.unregister(gpu_entry)
    os._exit(1)


def _refused(why: str) -> None:
    """A misconfigured rank; other callers (dflashops' own reachability check) leave no log."""
    _log("WARNING", "multiproc_executor.py:131", f"rendezvous: refused a rank: {why}", err=True)


def _head(stub: Any, settings: dict[str, Any], args: argparse.Namespace, gpu: Path | None) -> int:
    stop = _Stop()
    n, addr = args.nnodes, f"{args.master_addr}:{args.master_port}"
    _log(
        "INFO",
        "multiproc_executor.py:124",
        f"Waiting for {n - 1} headless node(s) to join: nnodes={n}, node_rank=0, master {addr}",
    )
    try:
        listener = _rendezvous.listen(args.master_addr, args.master_port)
    except _rendezvous.DistNetworkError as exc:
        return _dist_network_error(str(exc))
    pending: dict[socket.socket, bytes] = {}
    joined = _rendezvous.gather(listener, n, stop, pending, _refused)
    if joined is None:
        listener.close()
        return stop.exit(0, "APIServer")
    _log("INFO", "multiproc_executor.py:139", f"All {n} nodes joined (nnodes={n}, master {addr})")
    closing = threading.Event()
    watcher = threading.Thread(
        target=_rendezvous.watch,
        args=(listener, joined, pending, n, closing, lambda lost: _lost(lost, gpu)),
        name="fake-nccl-watch",
        daemon=True,
    )
    watcher.start()
    try:
        return _run_api_server(stub, settings)
    finally:
        closing.set()  # the headless nodes see the connections close when this process exits


# --------------------------------------------------------------------------- node_rank > 0


def _headless(args: argparse.Namespace) -> int:
    stop = _Stop()
    rank, n = args.node_rank, args.nnodes
    addr = f"{args.master_addr}:{args.master_port}"
    _log(
        "INFO",
        "api_server.py:1790",
        f"Launching vLLM in headless mode: node_rank {rank} of nnodes {n}, master {addr}",
        None,
    )
    try:
        sock = _rendezvous.join(args.master_addr, args.master_port, rank, n, stop, addr)
    except _rendezvous.DistNetworkError as exc:
        return _dist_network_error(str(exc))
    if sock is None:
        return stop.exit(rank, None)
    try:
        _log(
            "INFO",
            "multiproc_executor.py:139",
            f"Headless node_rank {rank} joined the head at {addr}; serving no HTTP",
            None,
        )
        while not stop.received:
            ready = select.select([sock], [], [], _rendezvous.POLL_SECONDS)[0]
            if ready and _rendezvous.hangup(sock):
                _nccl_error(f"node_rank 0 (the head at {addr}; its connection closed)", None)
                return 1
        return stop.exit(rank, None)
    finally:
        sock.close()


# --------------------------------------------------------------------------- serve


def _run_api_server(stub: Any, settings: dict[str, Any]) -> int:
    _log(
        "INFO",
        "launcher.py:37",
        f"Starting vLLM API server 0 on http://{settings['host']}:{settings['port']}",
    )
    return int(stub.run_server(settings, "vllm"))


def serve(argv: list[str]) -> int:
    argv = load_stub().with_config(argv)  # vLLM's --config FILE: its flags before the others
    bad = unrecognized(argv, load_flags("vllm-flags.txt"), negatable=True)
    if bad:
        say("usage: vllm serve [model_tag] [options]", sys.stderr)
        say(f"vllm: error: unrecognized arguments: {' '.join(bad)}", sys.stderr)
        return 2
    args, _ignored = build_parser().parse_known_args(argv)
    # vLLM's own rule: --api-key, else VLLM_API_KEY; either makes /v1 demand the Bearer key.
    args.api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    model = args.model_tag or args.model
    if not model:
        say("vllm: error: the following arguments are required: model_tag", sys.stderr)
        return 2
    tp, dp, pp = args.tensor_parallel_size, args.data_parallel_size, args.pipeline_parallel_size
    problem = _node_error(args)
    if problem:
        return _usage_error(problem)

    _log("INFO", "api_server.py:1885", f"vLLM API server version {vllm.__version__}")
    shown = {"model_tag": model}
    for key in ("host", "port", "served_model_name", "api_key", "max_model_len"):
        value = getattr(args, key)
        if value is not None and not (key == "port" and value == 8000):
            shown[key] = "<redacted>" if key == "api_key" else value
    shown.update(tensor_parallel_size=tp, data_parallel_size=dp)
    if pp != 1:
        shown["pipeline_parallel_size"] = pp
    if args.gpu_memory_utilization != 0.9:
        shown["gpu_memory_utilization"] = args.gpu_memory_utilization
    for key, default in NODE_DEFAULTS.items():
        if getattr(args, key) != default:
            shown[key] = getattr(args, key)
    _log("INFO", "utils.py:233", f"non-default args: {shown}")
    say("[fake vllm: dflashops test double, CPU only]")

    if args.distributed_executor_backend == "ray":
        return _on_ray(args, model, tp * dp * pp)
    cfg = _fakegpu.load_config()
    visible = _fakegpu.visible_gpus(cfg)
    if (tp * dp * pp) % args.nnodes:
        return _not_divisible(tp, dp, pp, args.nnodes)
    need = tp * dp * pp // args.nnodes  # this node's share
    if dp > 1 and "CUDA_VISIBLE_DEVICES" in os.environ:
        return _dp_crash(local_rank=tp * pp, dp_rank=1)
    if dp > 1 and len(visible) < need:
        return _dp_crash(local_rank=len(visible), dp_rank=len(visible) // (tp * pp))
    if len(visible) < need:
        return cuda_invalid_ordinal("/usr/local/lib/python3.12/dist-packages/vllm/worker.py")

    gpu = _fakegpu.register(
        int(args.gpu_memory_utilization * cfg["memory_total_mib"]), visible[:need]
    )
    if args.headless:
        return _headless(args)
    stub = load_stub()
    settings = {
        "model_path": model,
        "host": args.host or "127.0.0.1",
        "port": args.port,
        "tp_size": tp,
        "dp_size": dp,
        "pipeline_parallel_size": pp,
        "served_model_name": (args.served_model_name or [model])[0],
        "api_key": args.api_key,
        "context_length": args.max_model_len or 32768,
        "reasoning_parser": args.reasoning_parser,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    if args.nnodes > 1:
        return _head(stub, settings, args, gpu)
    return _run_api_server(stub, settings)


# --------------------------------------------------------------------------- Ray


def _on_ray(args: argparse.Namespace, model: str, world: int) -> int:
    """vLLM's Ray executor, on a real Ray cluster: join it at RAY_ADDRESS (ray.init), refuse a
    cluster with fewer GPUs than tp * pp * dp, reserve them as a placement group (one GPU a
    bundle, as vLLM does; no actor is started), serve, and exit 1 when a node that holds part
    of the group dies (vLLM's Ray workers die with their node)."""
    address = os.environ.get("RAY_ADDRESS") or "auto"
    _log("INFO", "ray_utils.py:334", f"Connecting to existing Ray cluster at address: {address}.")
    try:
        import ray
        from ray.util.placement_group import placement_group
    except ImportError as exc:
        _log("ERROR", "ray_utils.py:51", f"Failed to import Ray: {exc!r}", err=True)
        return 1
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        say(f"ConnectionError: {exc}", sys.stderr)
        return 1
    gpus = ray.cluster_resources().get("GPU", 0)
    if world > gpus:
        say(
            "ValueError: The number of required GPUs exceeds the total number of available "
            f"GPUs in the placement group. (required {world}, the cluster has {gpus:g})",
            sys.stderr,
        )
        return 1
    group = placement_group([{"GPU": 1.0}] * world, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PG_WAIT_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        say(
            f"ValueError: Cannot provide a placement group of placement_group_specs="
            f"{[{'GPU': 1.0}] * world} within {PG_WAIT_TIMEOUT} seconds. See `ray status` and "
            "`ray list nodes` to make sure the cluster has enough resources.",
            sys.stderr,
        )
        return 1
    nodes = set(ray.util.placement_group_table(group).get("bundles_to_node_id", {}).values())
    _log("INFO", "ray_distributed_executor.py:180", f"{world} Ray workers on {len(nodes)} node(s)")
    threading.Thread(target=_watch_ray, args=(ray, nodes), daemon=True).start()
    settings = {
        "model_path": model,
        "host": args.host or "127.0.0.1",
        "port": args.port,
        "tp_size": args.tensor_parallel_size,
        "dp_size": args.data_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "served_model_name": (args.served_model_name or [model])[0],
        "api_key": args.api_key,
        "context_length": args.max_model_len or 32768,
        "reasoning_parser": args.reasoning_parser,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    return _run_api_server(load_stub(), settings)


def _watch_ray(ray: Any, nodes: set[str]) -> None:
    while True:
        time.sleep(RAY_WATCH_SECONDS)
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception as exc:  # the GCS itself is gone: so is the cluster
            lost = f"the Ray cluster is gone ({type(exc).__name__})"
        else:
            if nodes <= alive:
                continue
            lost = f"node(s) {', '.join(sorted(nodes - alive))} died"
        say(f"ray.exceptions.ActorDiedError: The actor died unexpectedly: {lost}", sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-v"]):
        say(vllm.__version__)
        return 0
    if argv[:1] != ["serve"]:
        say("usage: vllm [-h] [-v] {serve} ...", sys.stderr)
        given = argv[0] if argv else ""
        say(f"vllm: error: argument subparser: invalid choice: '{given}'", sys.stderr)
        return 2
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
