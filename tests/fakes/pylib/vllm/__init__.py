"""Fake `vllm` package for the dflashops test fleet (stdlib only; serves the stub engine)."""

__version__ = "0.33.0"
