"""Work spread over the cores: a list of items cut into one contiguous slice per core, each
slice computed in a forked child (the parent computes the first), results back in order.

Fork, not spawn: a child starts with everything the parent has built (the plan of 8,000 units,
the imported modules) and sends back only its slice's result, pickled on a pipe. A child that
fails in any way (an exception, a signal, a result that does not unpickle) is not trusted: the
parent computes that slice itself, so the outcome, an exception included, is always the one a
serial run gives. Where fork is unsafe or missing (another thread is running, another OS) the
whole list is computed in the parent.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def can_fork() -> bool:
    # A fork copies only the calling thread: a lock another thread holds stays held forever
    # in the child (Python 3.12 warns for this reason). Only a single-threaded parent forks.
    return hasattr(os, "fork") and threading.active_count() == 1


def spread(work: Callable[[int, int], T], count: int, workers: int) -> list[T]:
    """``[work(lo, hi) for each slice]`` over ``range(count)``, in slice order, with the
    slices after the first computed by forked children at the same time as the first."""
    workers = max(1, min(workers, count))
    bounds = [(count * i // workers, count * (i + 1) // workers) for i in range(workers)]
    if workers == 1 or not can_fork():
        return [work(lo, hi) for lo, hi in bounds]
    children: list[tuple[int, int]] = []  # (pid, read end of its pipe)
    try:
        for lo, hi in bounds[1:]:
            children.append(_fork(work, lo, hi))
        results = [work(*bounds[0])]
        for (pid, fd), (lo, hi) in zip(list(children), bounds[1:], strict=True):
            data = _read_all(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            children.remove((pid, fd))
            results.append(_result(data, status, work, lo, hi))
        return results
    finally:
        for pid, fd in children:  # only when interrupted: stop what this call started
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def _fork(work: Callable[[int, int], T], lo: int, hi: int) -> tuple[int, int]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, and leave without running the parent's exit code
        code = 1
        try:
            os.close(read)
            data = pickle.dumps(work(lo, hi), pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(write, view) :]
            code = 0
        except BaseException:  # the parent redoes the slice, and sees the error itself
            pass
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _result(data: bytes, status: int, work: Callable[[int, int], T], lo: int, hi: int) -> T:
    if os.waitstatus_to_exitcode(status) == 0:
        try:
            return pickle.loads(data)  # type: ignore[no-any-return]
        except Exception:  # garbled: computed again below
            pass
    return work(lo, hi)
