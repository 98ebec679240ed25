"""The engines' parser entry points for the fake ``sglang`` and ``vllm`` packages.

dflashops asks the engine on a host to parse a unit's command line before it restarts the unit
(dflashops/builtins/engine_args.py calls ``sglang.srt.server_args`` and
``vllm.entrypoints.cli.serve``). The fakes answer with argparse parsers of the flags in
dflashops/data/<engine>-flags.txt: every flag takes any number of values, and the flags below
are typed as the real engines type them, so ``--mem-fraction-static lots`` is rejected with
argparse's own ``invalid float value: 'lots'``. Stdlib only.
"""

from __future__ import annotations

import argparse

from _fakeengine import HELP_FLAGS, load_flags

TYPED = {
    "sglang": {
        "--mem-fraction-static": float,
        "--tp-size": int,
        "--tensor-parallel-size": int,
        "--dp-size": int,
        "--data-parallel-size": int,
        "--port": int,
        "--context-length": int,
        "--nnodes": int,
        "--node-rank": int,
        "--model-path": str,
        "--speculative-algorithm": str,
    },
    "vllm": {
        "--gpu-memory-utilization": float,
        "--tensor-parallel-size": int,
        "--data-parallel-size": int,
        "--pipeline-parallel-size": int,
        "--port": int,
        "--max-model-len": int,
        "--nnodes": int,
        "--node-rank": int,
    },
}
SWITCHES = {"vllm": {"--headless"}}  # take no value


def add_flags(parser: argparse.ArgumentParser, engine: str) -> None:
    typed = TYPED[engine]
    for flag in sorted(load_flags(f"{engine}-flags.txt") - HELP_FLAGS):
        if flag in typed:
            parser.add_argument(flag, type=typed[flag])
        elif flag in SWITCHES.get(engine, ()):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, nargs="*")
