"""Workloads dflashops ships as unit files (``script: dflashops:NAME``), never calls itself:
``stub_engine`` (the CPU stand-in for SGLang) and ``generate_completions`` (the resumable
completions job). Stdlib only, Python 3.9+: they run under the host's python."""
