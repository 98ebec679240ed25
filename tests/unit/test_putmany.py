"""put_many: several files in one round trip, all verified before any is renamed."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from dflashops.errors import TransferError
from dflashops.hosts.base import putmany_source
from dflashops.hosts.local import LocalConnection

PYTHONS = [sys.executable, *(["/usr/bin/python3"] if Path("/usr/bin/python3").exists() else [])]


@pytest.mark.parametrize("python", PYTHONS)
def test_writes_all_in_one_command_and_keeps_prev(tmp_path: Path, python: str) -> None:
    conn = LocalConnection("local")
    a, b = tmp_path / "units" / "u" / "launch.sh", tmp_path / "payloads" / "ab" / "x.py"
    a.parent.mkdir(parents=True)
    a.write_bytes(b"old\n")
    conn.put_many(
        [(b"#!/bin/bash\necho new\n", str(a), 0o755), (b"print(1)\n", str(b), 0o644)], python
    )
    assert conn.commands == 1
    assert a.read_bytes() == b"#!/bin/bash\necho new\n" and a.stat().st_mode & 0o777 == 0o755
    assert (a.parent / "launch.sh.prev").read_bytes() == b"old\n"
    assert b.read_bytes() == b"print(1)\n" and b.stat().st_mode & 0o777 == 0o644
    assert conn.put_many([], python) is None and conn.commands == 1  # nothing to send: no call


def test_a_bad_file_means_none_is_renamed(tmp_path: Path) -> None:
    """A hash mismatch in the second file (corruption on the way): the first stays old too."""
    conn = LocalConnection("local")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"old a\n")
    manifest = [
        {
            "path": str(first),
            "size": 6,
            "sha256": hashlib.sha256(b"new a\n").hexdigest(),
            "mode": 0o644,
        },
        {"path": str(second), "size": 6, "sha256": "0" * 64, "mode": 0o644},
    ]
    result = conn.run(
        [sys.executable, "-c", putmany_source(), json.dumps(manifest)],
        input=b"new a\nnew b\n",
        check=False,
    )
    assert result.exit_code == 5 and "sha256 mismatch on the host for" in result.err
    assert first.read_bytes() == b"old a\n" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_input_that_ends_early_leaves_nothing(tmp_path: Path) -> None:
    conn = LocalConnection("local")
    target = tmp_path / "big.bin"
    manifest = [{"path": str(target), "size": 1000, "sha256": "0" * 64, "mode": 0o644}]
    result = conn.run(
        [sys.executable, "-c", putmany_source(), json.dumps(manifest)], input=b"x" * 10, check=False
    )
    assert result.exit_code == 5 and "input ended 990 bytes early" in result.err
    assert list(tmp_path.iterdir()) == []


def test_failure_is_a_transfer_error_naming_the_files(tmp_path: Path) -> None:
    conn = LocalConnection("local")
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(TransferError) as exc:
        conn.put_many([(b"x", str(blocker / "sub" / "f"), 0o644)], sys.executable)
    assert "previous versions left in place" in str(exc.value) and "cannot write in" in str(
        exc.value
    )
