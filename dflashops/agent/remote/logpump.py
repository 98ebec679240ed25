"""A unit's output, copied by its supervisor from a pipe into its current log, which is rotated
by size without restarting the unit (DESIGN.md "Trust boundary" 7).

Why a pipe: a process writing straight into a file keeps writing into that inode whatever is
renamed, so the file could only be cut by copy-and-truncate, which loses what is written between
the copy and the truncate. Through a pipe, the supervisor alone holds the log (as its fd 1 and
2): it ends a full log at a line's end, opens the next (``logs.new_log``: current.log points at
it, the oldest beyond ``keep_logs`` are deleted) and goes on; nothing is lost, and a unit that
writes faster than the disk takes it is slowed by the full pipe, never dropped. The new log
starts with the old one's banner and vLLM's ``non-default args`` line: what probes read from a
log's head to tell what runs there.

A disk that is full: what cannot be written is counted and dropped (the pipe is always read,
so the unit never blocks on it), and said in the log once writing works again.

Size: ``supervise.log_max_bytes`` in unit.json, else ``$DFLASHOPS_LOG_MAX_BYTES``, else 1 GiB;
at least ``MIN_BYTES``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import subprocess
import threading

from . import logs

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

DEFAULT_BYTES = 1 << 30
MIN_BYTES = 64 * 1024
MAX_ENV = "DFLASHOPS_LOG_MAX_BYTES"
LINE_MAX = 1 << 20  # a line longer than this past the limit is cut there
READ = 64 * 1024
POLL_S = 0.2


def max_bytes(policy: Any) -> int:
    value = policy.get("log_max_bytes") if isinstance(policy, dict) else None
    if value is None:
        value = os.environ.get(MAX_ENV) or DEFAULT_BYTES
    try:
        return max(MIN_BYTES, int(value))
    except (TypeError, ValueError):
        return DEFAULT_BYTES


class Pump:
    """Owns fd 1 and 2 (the current log) of the supervisor; one thread copies each run's pipe."""

    def __init__(self, folder: str, keep: int, limit: int) -> None:
        self.folder = folder
        self.keep = keep
        self.limit = limit
        self.lock = threading.Lock()  # one writer and one log switch at a time
        self.thread: threading.Thread | None = None
        self.read_fd: int | None = None
        self.stopping = threading.Event()
        self.dropped = 0  # bytes that could not be written (disk full), not said yet

    # -- the log ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Into the current log, whole or (when the disk refuses) counted as dropped."""
        try:
            if self.dropped:
                note = f"[dflashops] supervisor: {self.dropped} bytes of output were lost (disk full)\n"
                write_all(note.encode())
                self.dropped = 0
            write_all(data)
        except OSError:
            self.dropped += len(data)

    def new_log(self, carry: bool) -> str | None:
        """Switch fd 1 and 2 to a fresh log (old ones rotated out); its name, or None when it
        cannot be made (the current one is kept). With ``carry``, the old log's head lines that
        probes read go first into the new one."""
        with self.lock:
            return self._switch(carry)

    def _switch(self, carry: bool) -> str | None:
        old_name, old_path = logs.current(self.folder)
        head = head_lines(old_path) if carry and old_path else []
        try:
            name, fd = logs.new_log(self.folder, self.keep)
        except OSError:
            return None
        try:
            if carry:
                lines = [f"[dflashops] continued from {old_name} (rotated at its size limit)"]
                write_fd(fd, "".join(f"{x}\n" for x in lines + head).encode())
        except OSError:
            pass  # the disk is full: the log goes on without the copied head
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return name

    def feed(self, data: bytes) -> None:
        """``data`` into the log, ending a full log at a line's end and going on in a new one."""
        with self.lock:
            while data:
                try:
                    room = self.limit - os.fstat(1).st_size
                except OSError:
                    room = len(data)
                if len(data) <= room:
                    self.write(data)
                    return
                cut = data.rfind(b"\n", 0, max(room, 0)) + 1  # the last whole line that fits
                if cut == 0 and room > -LINE_MAX:
                    cut = data.find(b"\n") + 1  # finish the line under way first
                    if cut == 0:
                        self.write(data)  # it goes on: kept whole until it ends (or LINE_MAX)
                        return
                self.write(data[:cut])
                self._switch(carry=True)
                data = data[cut:]

    # -- one run's pipe ----------------------------------------------------------------------

    def open(self) -> int:
        """A new pipe for a run: its write end (for the child's stdout and stderr; the caller
        closes it once the child has it); the reading thread is started."""
        self.join(None)
        read_fd, write_fd = os.pipe()
        self.read_fd = read_fd
        self.stopping.clear()
        self.thread = threading.Thread(target=self._copy, args=(read_fd,), daemon=True)
        self.thread.start()
        return write_fd

    def _copy(self, read_fd: int) -> None:
        while True:
            if self.stopping.is_set():
                return  # handed over (see finish): the descriptor stays open for that
            ready, _, _ = select.select([read_fd], [], [], POLL_S)
            if not ready:
                continue
            data = os.read(read_fd, READ)
            if not data:
                os.close(read_fd)
                self.read_fd = None
                return
            self.feed(data)

    def join(self, timeout: float | None) -> bool:
        """Wait until every writer of the run's pipe is gone and all was copied; False when
        writers remain after ``timeout``."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        self.thread = None
        return True

    def finish(self, timeout: float) -> None:
        """At the supervisor's end: copy until the run's processes are gone; processes of the
        unit still writing after ``timeout`` (the unit left them behind) get ``cat`` in this
        group to copy for them, into the current log (not rotated), until they end."""
        if self.join(timeout) or self.thread is None:
            return
        self.stopping.set()
        self.thread.join()
        self.thread = None
        if self.read_fd is None:
            return
        with contextlib.suppress(OSError):
            subprocess.Popen(["cat"], stdin=self.read_fd, stdout=1, stderr=2)
        os.close(self.read_fd)
        self.read_fd = None


def head_lines(path: str) -> list[str]:
    """The lines of a log's head that probes read: dflashops' banner, vLLM's own arguments."""
    out = []
    try:
        for line in logs.head_lines(path, logs.BANNER_LINES):
            if line.startswith(logs.BANNER_PREFIX):
                out.append(line.rstrip())
                break
        for line in logs.head_lines(path, 400, 256 * 1024):
            if logs.SERVER_ARGS_MARKER in line:
                out.append(line.rstrip()[:20000])
                break
    except OSError:
        pass
    return out


def write_all(data: bytes) -> None:
    write_fd(1, data)


def write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                continue
            raise
        view = view[n:]
