"""A unit's log is bounded while it runs, and its supervisor outlives a full disk (DESIGN.md
"Trust boundary" 7). Real supervisors started by the real agent (over a LocalConnection), real
units printing fast, a real size-limited tmpfs for the full disk."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.agent.remote import logs
from tests.conftest import missing
from tests.procs import wait_for
from tests.unit.agent.test_units import Host, group

LIMIT = 64 * 1024
LINES = 12000
# Lines of different lengths (so the limit falls inside lines, not between them), each with
# its number and the writer's pid, flushed one by one like an engine's logging.
SPEW = (
    "import os, sys\n"
    f"for i in range({LINES}):\n"
    "    sys.stdout.write('line %06d pid %d %s\\n' % (i, os.getpid(), 'x' * (i % 97)))\n"
    "    sys.stdout.flush()\n"
)


def unit_record(host: Host, name: str, **supervise: object) -> None:
    record = {"unit": name, "stop_grace": 5.0, "supervise": {"restart": "no", **supervise}}
    (host.unit_dir(name) / "unit.json").write_text(json.dumps(record))


def log_files(folder: Path) -> list[Path]:
    found = [(logs._key(p.name), p) for p in folder.iterdir() if p.name != "current.log"]
    return [p for key, p in sorted((k, p) for k, p in found if k is not None)]


def test_the_current_log_is_rotated_by_size_without_losing_a_line(host: Host) -> None:
    host.python_unit("spew", SPEW)
    unit_record(host, "spew", log_max_bytes=LIMIT)
    got = host.start("spew", keep_logs=4)["spew"]
    assert got.ok, got
    exit_record = host.wait_exit("spew", timeout=120)
    assert exit_record["code"] == 0
    folder = host.unit_dir("spew") / "logs"
    kept = log_files(folder)
    assert len(kept) == 4  # the count kept is bounded: the oldest went
    longest = len("line 000000 pid 0000000 ") + 96 + 1
    for path in kept:
        assert path.stat().st_size <= LIMIT + longest, path
    current = folder / os.readlink(folder / "current.log")
    assert current == kept[-1]
    # The unit ran once, never restarted: one writer from the first line to the last.
    supervisor = host.read("spew", "supervisor.json")
    assert supervisor["restarts"] == 0 and supervisor["state"] == "ended"
    # Every line of the kept logs, in order: consecutive numbers, each line whole, none twice.
    numbers, pids = [], set()
    for i, path in enumerate(kept):
        text = path.read_text()
        assert text.endswith("\n")
        lines = text.splitlines()
        if i > 0:  # a log rotated into starts with where it came from and the unit's banner
            assert (
                lines[0]
                == f"[dflashops] continued from logs/{kept[i - 1].name} (rotated at its size limit)"
            )
            assert lines[1].startswith(logs.BANNER_PREFIX + "spew ")
        banner = logs.read_banner(str(path))
        assert banner is not None and banner["unit"] == "spew"
        for line in lines:
            if line.startswith("[dflashops]"):
                continue
            word, number, _, pid, tail = line.split(" ", 4)
            assert word == "line" and tail == "x" * (int(number) % 97), line
            numbers.append(int(number))
            pids.add(pid)
    assert numbers == list(range(numbers[0], LINES)), "a line was lost or doubled at a rotation"
    assert numbers[0] > 0 and len(pids) == 1
    assert "[dflashops] launch.sh ended (exit code 0)" in current.read_text()


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full (ENOSPC)."""
    chunk = b"\0" * (64 * 1024)
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Host]:
    """A Host whose workdir is a 4 MiB tmpfs (root and mount(8) needed)."""
    wd = tmp_path / "wd"
    wd.mkdir()
    mount = shutil.which("mount")
    if os.geteuid() != 0 or mount is None:
        missing("a full disk is made with a size-limited tmpfs: needs root and mount(8)")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(wd)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        missing(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    h = Host(wd)
    try:
        yield h
    finally:
        h.cleanup()
        subprocess.run(["umount", "-l", str(wd)], capture_output=True, check=False)


WAITER = "import time\nprint('waiting', flush=True)\ntime.sleep(300)\n"


def test_a_full_disk_does_not_end_the_supervisor(small_disk: Host) -> None:
    host = small_disk
    host.python_unit("svc", WAITER)
    unit_record(host, "svc", restart="on-failure", backoff=[0.2, 0.2], limit=[5, 3600])
    got = host.start("svc")["svc"]
    assert got.ok and got.pid is not None, got
    supervisor = got.pid
    host.wait_log("svc", "waiting")
    first = next(p for p in group(supervisor) if p != supervisor)
    filler = host.workdir / "filler"
    fill(filler)
    # The engine crashes while nothing can be written: its exit record, the backoff and the
    # new run's state all fail to be written; the supervisor restarts it all the same.
    os.kill(first, signal.SIGKILL)
    second = wait_for(
        "a new run of the unit",
        lambda: next((p for p in group(supervisor) if p not in (supervisor, first)), None),
        60,
    )
    assert os.path.exists(f"/proc/{supervisor}")
    assert host.read("svc", "supervisor.json")["restarts"] == 0  # not written: the disk is full
    filler.unlink()  # space is back: the records catch up, and the log says what happened

    def caught_up() -> bool:
        state = host.read("svc", "supervisor.json")
        return state["restarts"] == 1 and state["state"] == "running"

    wait_for("supervisor.json written again", caught_up, 60)
    assert host.read("svc", "supervisor.json")["child_pid"] == second
    assert host.read("svc", "exit")["signal"] == "SIGKILL"
    log = host.unit_dir("svc") / "logs"
    text = "".join(p.read_text() for p in log_files(log))
    assert "cannot write exit (" in text and "No space left on device" in text
    assert "supervising on, retrying" in text and "written again" in text
    assert os.path.exists(f"/proc/{supervisor}") and os.path.exists(f"/proc/{second}")
    assert host.stop(("svc", 5.0))["svc"].ok
