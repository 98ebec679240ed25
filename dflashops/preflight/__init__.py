"""Pre-flight: ``offline`` (everything that can be known before touching a GPU host: for CI)
and ``live`` (what only the hosts can tell, one facts round trip each)."""

from dflashops.preflight.offline import Check, Report, run_preflight, write_outputs

__all__ = ["Check", "Report", "run_preflight", "write_outputs"]
