"""Fake sglang.srt.speculative."""
