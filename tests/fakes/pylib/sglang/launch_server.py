"""Fake ``python -m sglang.launch_server FLAGS`` for the dflashops test fleet (CPU only).

1. Every ``--flag`` (``--a=b`` counts as ``--a``) must be in dflashops/data/sglang-flags.txt, the
   flag list of SGLang 0.5.23. Anything else fails like argparse does: usage, then
   ``launch_server.py: error: unrecognized arguments: --tp 2`` on stderr, exit status 2.
2. The core flags are parsed with the stub engine's parser; other real SGLang flags are accepted
   and ignored. ``--model-path`` is required (exit 2 without it).
3. Multi-node: ``--nnodes N`` (default 1), ``--node-rank R`` (default 0), ``--dist-init-addr
   HOST:PORT`` (IPv4 host or name; required when N > 1). A missing --dist-init-addr, R outside
   0 <= R < N or a bad HOST:PORT fail like argparse does (exit status 2). tp_size and dp_size
   count every node, as in SGLang: each node runs tp_size * dp_size / N GPUs; when that does not
   divide, an ``AssertionError: tp_size must be divisible by number of nodes`` traceback and
   exit status 1. /server_info reports ``nnodes``, ``node_rank`` and ``dist_init_addr``.
4. GPUs: the node needs its tp_size * dp_size / N of the visible GPUs (CUDA_VISIBLE_DEVICES as
   physical indices, else all of $FAKE_GPU_STATE's), starting at --base-gpu-id. Too few: a
   CUDA-like ``RuntimeError: CUDA error: invalid device ordinal`` and exit status 1. Otherwise it
   registers mem_fraction_static (default 0.8) x the GPU's memory on each of them for the fake
   nvidia-smi (before the rendezvous of 5; removed again at every exit but SIGKILL).
5. With N > 1 every rank prints SGLang's ``Init torch distributed begin.``, then meets the others
   over TCP at HOST:PORT (a rendezvous standing in for torch.distributed + NCCL; the protocol is
   pylib/_rendezvous.py's, shared with the fake torchrun):

   - rank 0, the head, listens on exactly HOST:PORT (taken: torch's ``DistNetworkError: ...
     address already in use``, exit status 1) and waits, serving no HTTP, until every rank
     1..N-1 has connected and sent ``rank R of N\\n``. A malformed line, a rank out of range or
     already in, another N, or any connection once all ranks are in, is answered
     ``error REASON\\n`` and closed; only refused ranks are logged (on stderr), so a stray caller
     such as dflashops' own reachability check leaves the log alone. A rank whose connection
     drops before the others are in may join again. A missing rank leaves the head waiting for
     ever: its last line stays ``Init torch distributed begin.``.
   - rank R > 0, a worker, connects to HOST:PORT (retrying every 0.2 s until the head listens),
     sends ``rank R of N\\n`` and waits for the head's answer. ``error REASON`` or a closed
     connection: a ``DistNetworkError`` and exit status 1.
   - once all are in, the head answers ``ok\\n`` to every worker and every rank prints ``Init
     torch distributed ends.``. The head then goes on to 6; a worker serves no HTTP (nor do
     SGLang's non-zero ranks) and just holds its connection.
   - the connections stay open: when one drops (a rank died), the other end prints
     ``torch.distributed.DistBackendError: NCCL error: remote process exited or there was a
     network error`` naming the lost rank, and exits with status 1. A head that stops (even
     cleanly) takes its workers down that way; a worker that dies takes the head down.
   - SIGTERM/SIGINT end a rank that is waiting or a worker that is holding with exit status 0.
6. ``--config FILE`` (SGLang's own): the file's flags (YAML in JSON form) go before the
   command line's and are checked like them; so the API key of ``secret_args`` arrives.
7. Then (rank 0 only) it serves the stub engine in-process with SGLang's endpoints, readiness
   line and /metrics names (sglang:gen_throughput, sglang:num_running_reqs, ...); the
   DFLASHOPS_STUB_* environment knobs apply.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import _fakegpu
import _rendezvous
from _fakeengine import cuda_invalid_ordinal, load_flags, load_stub, say, unrecognized

import sglang

PROG = "launch_server.py"
USAGE = f"{PROG} [-h] --model-path MODEL_PATH [...]"
INIT_BEGIN = "Init torch distributed begin."
INIT_ENDS = "Init torch distributed ends."


class _Stop(_rendezvous.Stop):
    """SIGTERM/SIGINT while a rank waits or holds: remember it, the loops check it."""

    def exit(self, node_rank: int) -> int:
        say(f"[fake sglang] node_rank {node_rank}: received {self.name}, shut down cleanly")
        return 0


def _node_args(argv: list[str]) -> argparse.Namespace:
    """--nnodes, --node-rank and --dist-init-addr, checked; argparse-like exit 2 when wrong."""
    p = argparse.ArgumentParser(prog=PROG, usage=USAGE, add_help=False, allow_abbrev=False)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr")
    args, _others = p.parse_known_args(argv)
    if args.nnodes < 1:
        p.error(f"argument --nnodes: must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(
            f"argument --node-rank: {args.node_rank} is out of range for --nnodes "
            f"{args.nnodes} (0 <= node_rank < nnodes)"
        )
    args.dist_host, args.dist_port = None, None
    if args.nnodes > 1 and not args.dist_init_addr:
        p.error(
            f"the following arguments are required with --nnodes {args.nnodes}: --dist-init-addr"
        )
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or ":" in host or not port.isdigit() or not 0 < int(port) < 65536:
            p.error(
                f"argument --dist-init-addr: expected IPv4HOST:PORT, got {args.dist_init_addr!r}"
            )
        args.dist_host, args.dist_port = host, int(port)
    return args


def _not_divisible(tp_size: int, dp_size: int, nnodes: int) -> int:
    where = "/sgl-workspace/sglang/python/sglang/srt/server_args.py"
    say("Traceback (most recent call last):", sys.stderr)
    say(f'  File "{where}", line 1412, in check_server_args', sys.stderr)
    say(
        '    assert self.tp_size % self.nnodes == 0, "tp_size must be divisible by number of nodes"',
        sys.stderr,
    )
    say(
        f"AssertionError: tp_size must be divisible by number of nodes (tp_size {tp_size} x "
        f"dp_size {dp_size} GPUs over nnodes {nnodes})",
        sys.stderr,
    )
    return 1


def _nccl_error(lost: str) -> None:
    where = "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py"
    say("Traceback (most recent call last):", sys.stderr)
    say(f'  File "{where}", line 2650, in run_event_loop', sys.stderr)
    say("    self.event_loop_overlap()", sys.stderr)
    say(_rendezvous.nccl_lost(lost), sys.stderr)


def _dist_network_error(message: str) -> int:
    say(f"torch.distributed.DistNetworkError: {message}", sys.stderr)
    return 1


# --------------------------------------------------------------------------- rank 0


def _lost(lost: str, gpu_entry: Path | None) -> None:
    """A worker gone while the head serves: its error, and the whole process goes (like
    NCCL's watchdog: the HTTP server and all)."""
    _nccl_error(lost)
    _fakegpu.unregister(gpu_entry)
    os._exit(1)


def _refused(why: str) -> None:
    """A misconfigured rank; other callers (dflashops' own reachability check) leave no log."""
    say(f"[fake sglang] rendezvous: refused a rank: {why}", sys.stderr)


def _head(stub: Any, settings: dict[str, Any], args: argparse.Namespace, gpu: Path | None) -> int:
    stop = _Stop()
    say(INIT_BEGIN)
    try:
        listener = _rendezvous.listen(args.dist_host, args.dist_port)
    except _rendezvous.DistNetworkError as exc:
        return _dist_network_error(str(exc))
    pending: dict[socket.socket, bytes] = {}
    joined = _rendezvous.gather(listener, args.nnodes, stop, pending, _refused)
    if joined is None:
        listener.close()
        return stop.exit(0)
    say(INIT_ENDS)
    closing = threading.Event()
    watcher = threading.Thread(
        target=_rendezvous.watch,
        args=(listener, joined, pending, args.nnodes, closing, lambda lost: _lost(lost, gpu)),
        name="fake-nccl-watch",
        daemon=True,
    )
    watcher.start()
    try:
        return int(stub.run_server(settings, "sglang"))
    finally:
        closing.set()  # the workers see the connections close when this process exits


# --------------------------------------------------------------------------- rank > 0


def _worker(args: argparse.Namespace) -> int:
    stop = _Stop()
    rank, nnodes, addr = args.node_rank, args.nnodes, args.dist_init_addr
    say(INIT_BEGIN)
    try:
        sock = _rendezvous.join(args.dist_host, args.dist_port, rank, nnodes, stop, addr)
    except _rendezvous.DistNetworkError as exc:
        return _dist_network_error(str(exc))
    if sock is None:
        return stop.exit(rank)
    try:
        say(INIT_ENDS)
        while not stop.received:
            ready = select.select([sock], [], [], _rendezvous.POLL_SECONDS)[0]
            if ready and _rendezvous.hangup(sock):
                _nccl_error(f"node_rank 0 (the head at {addr}; its connection closed)")
                return 1
        return stop.exit(rank)
    finally:
        sock.close()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stub = load_stub()
    argv = stub.with_config(argv)  # --config FILE: its flags first, checked like the others
    bad = unrecognized(argv, load_flags("sglang-flags.txt"))
    if bad:
        say(f"usage: {USAGE}", sys.stderr)
        say(f"{PROG}: error: unrecognized arguments: {' '.join(bad)}", sys.stderr)
        return 2

    parser = stub.build_parser()
    parser.prog = PROG
    args, _ignored = parser.parse_known_args(argv)
    node = _node_args(argv)
    settings = vars(args)
    settings.update(
        nnodes=node.nnodes, node_rank=node.node_rank, dist_init_addr=node.dist_init_addr
    )
    if (args.tp_size * args.dp_size) % node.nnodes:
        return _not_divisible(args.tp_size, args.dp_size, node.nnodes)

    cfg = _fakegpu.load_config()
    visible = _fakegpu.visible_gpus(cfg)
    need = args.tp_size * args.dp_size // node.nnodes
    gpus = visible[args.base_gpu_id : args.base_gpu_id + need]
    say(
        f"[fake sglang {sglang.__version__}: dflashops test double, CPU only] "
        f"visible GPUs {visible}, using {gpus}"
    )
    shown = ", ".join(f"{k}={v!r}" for k, v in stub.redacted(settings).items())
    say(f"server_args=ServerArgs({shown})")
    if len(gpus) < need:
        return cuda_invalid_ordinal("/sgl-workspace/sglang/python/sglang/srt/model_executor.py")

    fraction = args.mem_fraction_static if args.mem_fraction_static is not None else 0.8
    gpu_entry = _fakegpu.register(int(fraction * cfg["memory_total_mib"]), gpus)
    if node.nnodes == 1:
        return int(stub.run_server(settings, "sglang"))
    if node.node_rank == 0:
        return _head(stub, settings, node, gpu_entry)
    return _worker(node)


if __name__ == "__main__":
    sys.exit(main())
