"""Fake sglang.srt: only the parser entry points (see pylib/_fakeparser.py)."""
