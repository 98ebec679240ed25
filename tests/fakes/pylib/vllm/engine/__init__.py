"""Fake vllm.engine."""
