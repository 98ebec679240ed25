"""Fake vllm.entrypoints.cli."""
