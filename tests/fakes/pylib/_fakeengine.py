"""Shared plumbing for the fake engines (sglang, vllm): flag whitelists and the stub server.

Stdlib only. The repository is found from this file's own location (tests/fakes/pylib/), and the
stub engine is loaded by file path: the host python has none of dflashops' dependencies.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[3]
DATA_DIR = REPO_ROOT / "dflashops" / "data"
STUB_PATH = REPO_ROOT / "dflashops" / "builtins" / "stub_engine.py"
HELP_FLAGS = frozenset({"-h", "--help"})  # argparse's own, absent from the source-derived lists
_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$")


def load_flags(filename: str) -> frozenset[str]:
    """The flag list shipped in dflashops/data (one flag per line), plus -h/--help."""
    lines = (DATA_DIR / filename).read_text().splitlines()
    return frozenset(s.strip() for s in lines if s.strip().startswith("-")) | HELP_FLAGS


def _known(flag: str, allowed: frozenset[str], negatable: bool) -> bool:
    if flag in allowed:
        return True
    base = flag.split(".", 1)[0]  # vLLM's --speculative-config.method style
    if negatable and base.startswith("--no-"):
        base = "--" + base[5:]  # vLLM's generated --no-<bool-flag>
    return base in allowed


def unrecognized(argv: list[str], allowed: frozenset[str], negatable: bool = False) -> list[str]:
    """Tokens argparse would report as unrecognized: each unknown flag plus the values after it.

    ``--a=b`` is checked as ``--a``; a negative number is a value, not a flag; nothing after a
    bare ``--`` is a flag.
    """
    bad: list[str] = []
    taking_values = False
    for token in argv:
        if token == "--":
            break
        if token.startswith("-") and len(token) > 1 and not _NUMBER.match(token):
            flag, eq, _ = token.partition("=")
            taking_values = not _known(flag, allowed, negatable)
            if taking_values:
                bad.append(token)
                taking_values = not eq
        elif taking_values:
            bad.append(token)
    return bad


def load_stub() -> ModuleType:
    """dflashops/builtins/stub_engine.py, imported by path (not through the dflashops package)."""
    name = "dflashops_stub_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STUB_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the stub engine from {STUB_PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def say(line: str, stream: object = None) -> None:
    out = stream if stream is not None else sys.stdout
    out.write(line + "\n")  # type: ignore[attr-defined]
    out.flush()  # type: ignore[attr-defined]


def cuda_invalid_ordinal(where: str) -> int:
    """Print a CUDA-like failure for a process that wants more GPUs than it can see."""
    say("Traceback (most recent call last):", sys.stderr)
    say(f'  File "{where}", line 312, in init_device', sys.stderr)
    say("    torch.cuda.set_device(self.device)", sys.stderr)
    say("RuntimeError: CUDA error: invalid device ordinal", sys.stderr)
    say(
        "CUDA kernel errors might be asynchronously reported at some other API call, "
        "so the stacktrace below might be incorrect.",
        sys.stderr,
    )
    return 1


def timestamp() -> str:
    return time.strftime("%m-%d %H:%M:%S")
