"""Is the running unit the one we rendered? Compare the server's own report and the launch
banner with the desired unit (INCIDENTS.md #2: the old TP=2 DP=2 server kept running unnoticed).

- SGLang and the stub: ``/server_info`` (fallback ``/get_server_info``): tp_size, dp_size,
  model_path, port; for the head of a unit over several nodes, nnodes and node_rank (its worker
  ranks serve no HTTP: their banner is their identity).
- vLLM: ``/v1/models`` (``root`` is the model path); TP and DP from vLLM's own
  ``non-default args: {...}`` log line (the launch banner when that line is missing).
- Everything: the banner's unit name and fingerprint.
"""

from __future__ import annotations

import ast
from typing import Any

from dflashops.agent.answers import UnitProbe
from dflashops.config.playbook import ModelService
from dflashops.engines.protocol import protocol
from dflashops.engines.render import Rendered

Mismatch = tuple[str, str, str]  # field, expected, actual

IDENTITY_PATHS = {  # by the protocol the engine speaks
    "sglang": ["/server_info", "/get_server_info"],
    "vllm": ["/v1/models"],
}


def identity_paths(engine: str) -> list[str]:
    speaks = protocol(engine)
    return list(IDENTITY_PATHS[speaks]) if speaks is not None else []


def check(r: Rendered, probe: UnitProbe) -> list[Mismatch]:
    """Mismatches between the desired unit and what the probe found (empty: verified)."""
    unit = r.unit
    banner = probe.banner
    body = probe.identity.body if probe.identity is not None else None
    out: list[Mismatch] = []
    if banner is None:
        out.append(
            (
                "banner",
                f"unit={unit.name} fingerprint={r.short}",
                "no [dflashops] banner in the current log",
            )
        )
    else:
        _cmp(out, "banner unit", unit.name, banner.get("unit"))
        _cmp(out, "banner fingerprint", r.fingerprint, banner.get("fingerprint"))
    spec = unit.spec
    if not isinstance(spec, ModelService):
        return out
    if unit.multi_node and unit.rank:
        return out  # a worker rank serves no HTTP: the head's identity stands for the unit
    speaks = protocol(unit.engine)
    if speaks == "sglang":
        if not isinstance(body, dict):
            out.append(("server_info", "a JSON object", repr(body)[:80]))
            return out
        _cmp(out, "tp_size", spec.tp, body.get("tp_size"))
        _cmp(out, "dp_size", spec.dp, body.get("dp_size"))
        _cmp(out, "model_path", spec.model, body.get("model_path"))
        _cmp(out, "port", unit.port, body.get("port"))
        if unit.multi_node:
            _cmp(out, "nnodes", len(unit.nodes), body.get("nnodes"))
            _cmp(out, "node_rank", 0, body.get("node_rank"))
    elif speaks == "vllm":
        data = body.get("data") if isinstance(body, dict) else None
        roots = [m.get("root") for m in data or [] if isinstance(m, dict)]
        if spec.model not in roots:
            out.append(
                ("model (/v1/models root)", spec.model, ", ".join(map(str, roots)) or "no models")
            )
        parsed = vllm_args(probe.server_args)
        if parsed is not None:
            # Only non-default values are listed: absent means vLLM's default of 1.
            _cmp(
                out,
                "tensor_parallel_size (vLLM log)",
                spec.tp,
                parsed.get("tensor_parallel_size", 1),
            )
            _cmp(out, "data_parallel_size (vLLM log)", spec.dp, parsed.get("data_parallel_size", 1))
        elif banner is not None:
            _cmp(out, "banner tp", spec.tp, banner.get("tp"))
            _cmp(out, "banner dp", spec.dp, banner.get("dp"))
    return out


def vllm_args(text: str | None) -> dict[str, Any] | None:
    """vLLM's `non-default args: {...}` is a Python dict repr; None when absent or not plain
    literals (then the launch banner stands in)."""
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        # TypeError: a dict of unhashable keys ({[]: 1}), which the log may hold as well.
        return None
    return value if isinstance(value, dict) else None


def _cmp(out: list[Mismatch], field: str, expected: Any, actual: Any) -> None:
    if str(expected) != str(actual):
        out.append((field, str(expected), "missing" if actual is None else str(actual)))


def describe(mismatches: list[Mismatch]) -> str:
    width = max(len(f) for f, _, _ in mismatches)
    rows = [f"    {'field':<{width}}  expected -> running"]
    rows += [f"    {f:<{width}}  {e} -> {a}" for f, e, a in mismatches]
    return "\n".join(rows)
