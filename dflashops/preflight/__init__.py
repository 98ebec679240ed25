"""Pre-flight: ``offline`` (everything that can be known before touching a GPU host: for CI)
and ``live`` (what only the hosts can tell, one facts round trip each).

``run_preflight`` is imported when first asked for: it brings the loader, planner and renderer,
which a pre-flight answered from its result cache (runcache.py) never needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflashops.preflight.report import Check, Report, write_outputs

if TYPE_CHECKING:
    from dflashops.preflight.offline import run_preflight

__all__ = ["Check", "Report", "run_preflight", "write_outputs"]


def __getattr__(name: str) -> Any:
    if name == "run_preflight":
        from dflashops.preflight.offline import run_preflight

        return run_preflight
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
