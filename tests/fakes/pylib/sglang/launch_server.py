"""Fake ``python -m sglang.launch_server FLAGS`` for the dflashops test fleet (CPU only).

1. Every ``--flag`` (``--a=b`` counts as ``--a``) must be in dflashops/data/sglang-flags.txt, the
   flag list of SGLang 0.5.23. Anything else fails like argparse does: usage, then
   ``launch_server.py: error: unrecognized arguments: --tp 2`` on stderr, exit status 2.
2. The core flags are parsed with the stub engine's parser; other real SGLang flags are accepted
   and ignored. ``--model-path`` is required (exit 2 without it).
3. GPUs: the replica needs tp_size * dp_size of the visible GPUs (CUDA_VISIBLE_DEVICES as physical
   indices, else all of $FAKE_GPU_STATE's), starting at --base-gpu-id. Too few: a CUDA-like
   ``RuntimeError: CUDA error: invalid device ordinal`` and exit status 1. Otherwise it registers
   mem_fraction_static (default 0.8) x the GPU's memory on each of them for the fake nvidia-smi.
4. Then it serves the stub engine in-process with SGLang's endpoints, readiness line and
   /metrics names (sglang:gen_throughput, sglang:num_running_reqs, ...); the DFLASHOPS_STUB_*
   environment knobs apply.
"""

from __future__ import annotations

import sys

import _fakegpu
from _fakeengine import cuda_invalid_ordinal, load_flags, load_stub, say, unrecognized

import sglang

PROG = "launch_server.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = unrecognized(argv, load_flags("sglang-flags.txt"))
    if bad:
        say(f"usage: {PROG} [-h] --model-path MODEL_PATH [...]", sys.stderr)
        say(f"{PROG}: error: unrecognized arguments: {' '.join(bad)}", sys.stderr)
        return 2

    stub = load_stub()
    parser = stub.build_parser()
    parser.prog = PROG
    args, _ignored = parser.parse_known_args(argv)
    settings = vars(args)

    cfg = _fakegpu.load_config()
    visible = _fakegpu.visible_gpus(cfg)
    need = args.tp_size * args.dp_size
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
    _fakegpu.register(int(fraction * cfg["memory_total_mib"]), gpus)
    return int(stub.run_server(settings, "sglang"))


if __name__ == "__main__":
    sys.exit(main())
