"""Fake ``python -m vllm.entrypoints.cli.main serve MODEL FLAGS`` for the dflashops test fleet.

1. Every flag must be in dflashops/data/vllm-flags.txt (vLLM 0.33.0's ``serve`` flags, short
   aliases such as ``-tp``/``-dp`` included; ``--no-X`` for a listed ``--X`` and dotted
   ``--X.field`` forms are accepted as vLLM generates them). Anything else:
   ``vllm: error: unrecognized arguments: ...`` on stderr, exit status 2.
2. It prints a vLLM-like banner: ``vLLM API server version 0.33.0`` and ``non-default args:
   {...}``. Unlike real vLLM, tensor_parallel_size and data_parallel_size are always listed,
   and the api key is redacted.
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
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _fakegpu
from _fakeengine import cuda_invalid_ordinal, load_flags, load_stub, say, timestamp, unrecognized

import vllm

DP_CRASH_DELAY = 1.0


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
    return p


def _log(level: str, where: str, message: str, who: str = "APIServer") -> None:
    say(f"({who} pid={os.getpid()}) {level} {timestamp()} [{where}] {message}")


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


def serve(argv: list[str]) -> int:
    bad = unrecognized(argv, load_flags("vllm-flags.txt"), negatable=True)
    if bad:
        say("usage: vllm serve [model_tag] [options]", sys.stderr)
        say(f"vllm: error: unrecognized arguments: {' '.join(bad)}", sys.stderr)
        return 2
    args, _ignored = build_parser().parse_known_args(argv)
    model = args.model_tag or args.model
    if not model:
        say("vllm: error: the following arguments are required: model_tag", sys.stderr)
        return 2
    tp, dp, pp = args.tensor_parallel_size, args.data_parallel_size, args.pipeline_parallel_size

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
    _log("INFO", "utils.py:233", f"non-default args: {shown}")
    say("[fake vllm: dflashops test double, CPU only]")

    cfg = _fakegpu.load_config()
    visible = _fakegpu.visible_gpus(cfg)
    need = tp * dp * pp
    if dp > 1 and "CUDA_VISIBLE_DEVICES" in os.environ:
        return _dp_crash(local_rank=tp * pp, dp_rank=1)
    if dp > 1 and len(visible) < need:
        return _dp_crash(local_rank=len(visible), dp_rank=len(visible) // (tp * pp))
    if len(visible) < need:
        return cuda_invalid_ordinal("/usr/local/lib/python3.12/dist-packages/vllm/worker.py")

    _fakegpu.register(int(args.gpu_memory_utilization * cfg["memory_total_mib"]), visible[:need])
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
    _log(
        "INFO",
        "launcher.py:37",
        f"Starting vLLM API server 0 on http://{settings['host']}:{args.port}",
    )
    return int(stub.run_server(settings, "vllm"))


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
