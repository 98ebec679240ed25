"""Fake vllm.utils."""
