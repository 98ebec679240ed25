"""What a changing command (deploy, restart-servers, stop) is asked to do, and how it ends early."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dflashops.errors import HostError
from dflashops.lifecycle.spans import Spans

Board = Callable[[str, str], None]  # host, text: the live progress line (no-op off a terminal)


@dataclass
class Options:
    check: bool = False
    diff: bool = False
    force: bool = False  # start even where GPUs hold memory of processes that are not ours
    rerun: bool = False  # run jobs again that finished with exit 0
    prune: bool = False  # deploy: stop orphans and move their folders to units/.pruned/
    keep_logs: int = 20
    gpu_timeout: float = 60.0
    lock_wait: float = 0.0  # s to wait for a host's deploy lock held by another actor
    abort: threading.Event = field(default_factory=threading.Event)  # set on Ctrl-C
    spans: Spans = field(default_factory=Spans)  # the hosts' word on units over several hosts


class Interrupted(HostError):
    """Ctrl-C: the host stops between steps (never in the middle of a verified put)."""
