"""Fake ``vllm.engine.arg_utils.AsyncEngineArgs``: ``from_cli_args`` checks what vLLM's engine
arguments check without a GPU in the cases the tests use (sizes are positive)."""

from __future__ import annotations

import argparse
from typing import Any


class AsyncEngineArgs:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AsyncEngineArgs:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            value = getattr(args, name, None)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        return cls(**vars(args))
