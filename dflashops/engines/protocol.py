"""Which protocol a model engine speaks: its flags, its HTTP identity endpoints, its metric
names and its default port. The one place that says the stub speaks SGLang (it stands in for
an SGLang server on a host without GPUs). Adding an engine starts here.

A leaf: the plan (default ports) imports it and must not load the launch code."""

from __future__ import annotations

from typing import Literal

Speaks = Literal["sglang", "vllm"]

_SPEAKS: dict[str, Speaks] = {"sglang": "sglang", "stub": "sglang", "vllm": "vllm"}
MODEL_ENGINES = tuple(_SPEAKS)  # the engines that speak a protocol: sglang, stub, vllm
_PORTS: dict[Speaks, int] = {"sglang": 30000, "vllm": 8000}
DEFAULT_PORTS = {engine: _PORTS[speaks] for engine, speaks in _SPEAKS.items()}


def protocol(engine: str) -> Speaks | None:
    """The protocol ``engine`` speaks; None for what speaks none of them (a command, a job, a
    Ray node)."""
    return _SPEAKS.get(engine)
