"""Fake of speculators' ``scripts/launch_vllm.py`` for the dflashops test fleet.

``launch_vllm.py MODEL [--hidden-states-path P] [--target-layer-ids N ...] -- VLLM_ARGS...``
prints what it got, then execs ``python -m vllm.entrypoints.cli.main serve MODEL VLLM_ARGS...``
in the same process (same pid), with the fake vllm package on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import sys

PYLIB = os.path.join(os.path.dirname(os.path.realpath(__file__)), "pylib")


def _redact(args: list[str]) -> list[str]:
    out = []
    hide = False
    for a in args:
        if hide:
            out.append("<redacted>")
        elif a.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(a)
        hide = a == "--api-key"
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, vllm_args = argv, []
    if "--" in argv:
        cut = argv.index("--")
        own, vllm_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="launch_vllm.py", allow_abbrev=False)
    parser.add_argument("model")
    parser.add_argument("--hidden-states-path")
    parser.add_argument("--target-layer-ids", type=int, nargs="+")
    args = parser.parse_args(own)
    print(
        "launch_vllm.py [dflashops fake of speculators' scripts/launch_vllm.py]: "
        f"model={args.model} hidden_states_path={args.hidden_states_path} "
        f"target_layer_ids={args.target_layer_ids} vllm_args={_redact(vllm_args)}",
        flush=True,
    )
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PYLIB not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([PYLIB, *paths])
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, *vllm_args]
    os.execv(sys.executable, cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
