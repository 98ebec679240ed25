"""write: several files in one round trip, all verified on the host before any is renamed."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent import Agent
from dflashops.agent.bundle import bundle, command
from dflashops.errors import TransferError
from dflashops.hosts.local import LocalConnection

PYTHONS = [sys.executable, *(["/usr/bin/python3"] if Path("/usr/bin/python3").exists() else [])]


def entry(path: Path, data: bytes, sha256: str | None = None) -> dict[str, Any]:
    return {
        "path": str(path),
        "size": len(data),
        "sha256": sha256 or hashlib.sha256(data).hexdigest(),
        "mode": 0o644,
    }


@pytest.mark.parametrize("python", PYTHONS)
def test_writes_all_in_one_command_and_keeps_prev(tmp_path: Path, python: str) -> None:
    conn = LocalConnection("local")
    agent = Agent(conn, python)
    a, b = tmp_path / "units" / "u" / "launch.sh", tmp_path / "payloads" / "ab" / "x.py"
    a.parent.mkdir(parents=True)
    a.write_bytes(b"old\n")
    agent.write(
        str(tmp_path),
        [(b"#!/bin/bash\necho new\n", str(a), 0o755), (b"print(1)\n", str(b), 0o644)],
    )
    assert conn.commands == 1
    assert a.read_bytes() == b"#!/bin/bash\necho new\n" and a.stat().st_mode & 0o777 == 0o755
    assert (a.parent / "launch.sh.prev").read_bytes() == b"old\n"
    assert b.read_bytes() == b"print(1)\n" and b.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in a.parent.iterdir()) == ["launch.sh", "launch.sh.prev"]
    assert sorted(p.name for p in b.parent.iterdir()) == ["x.py"]
    assert agent.write(str(tmp_path), []) is None and conn.commands == 1  # nothing: no call


def test_a_bad_file_means_none_is_renamed(tmp_path: Path) -> None:
    """A hash mismatch in the second file (corruption on the way): the first stays old too."""
    agent = Agent(LocalConnection("local"), sys.executable)
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"old a\n")
    manifest = [entry(first, b"new a\n"), entry(second, b"new b\n", sha256="0" * 64)]
    answer = agent.call(
        "write", {"workdir": str(tmp_path), "files": manifest}, data=b"new a\nnew b\n", timeout=30
    )
    assert answer["schema"] == 2 and answer["action"] == "write"
    assert answer["ok"] is False and answer["written"] == []
    assert f"sha256 mismatch on the host for {second}" in answer["error"]
    assert first.read_bytes() == b"old a\n" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_input_that_ends_early_leaves_nothing(tmp_path: Path) -> None:
    """A dropped connection: the bytes stop short. The answer says so (exit 0), nothing stays."""
    conn = LocalConnection("local")
    target = tmp_path / "big.bin"
    manifest = [{"path": str(target), "size": 1000, "sha256": "0" * 64, "mode": 0o644}]
    line = json.dumps({"action": "write", "workdir": str(tmp_path), "files": manifest}).encode()
    result = conn.run(
        command(sys.executable), input=bundle() + line + b"\n" + b"x" * 10, check=False
    )
    assert result.exit_code == 0, result.err
    answer = json.loads(result.out)
    assert answer["schema"] == 2 and answer["action"] == "write"
    assert answer["ok"] is False and answer["written"] == []
    assert "input ended 990 bytes early" in answer["error"]
    assert list(tmp_path.iterdir()) == []


def test_bad_manifest_is_refused(tmp_path: Path) -> None:
    conn = LocalConnection("local")
    for files, why in (
        ([entry(Path("relative.txt"), b"x")], "files[0].path must be an absolute path"),
        ([dict(entry(tmp_path / "f", b"x"), sha256="abc")], "files[0].sha256 must be a sha256"),
        ([dict(entry(tmp_path / "f", b"x"), size=-1)], "files[0].size must be an integer >= 0"),
        ("not a list", "files must be a list of objects"),
    ):
        line = json.dumps({"action": "write", "workdir": str(tmp_path), "files": files})
        result = conn.run(
            command(sys.executable), input=bundle() + line.encode() + b"\n", check=False
        )
        assert result.exit_code == 2 and result.out == "", why
        assert f"dflashops agent: bad request: {why}" in result.err
    assert list(tmp_path.iterdir()) == []


def test_failure_is_a_transfer_error_naming_the_files(tmp_path: Path) -> None:
    agent = Agent(LocalConnection("local"), sys.executable)
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(TransferError) as exc:
        agent.write(str(tmp_path), [(b"x", str(blocker / "sub" / "f"), 0o644)])
    assert "previous versions left in place" in str(exc.value)
    assert "cannot write in" in str(exc.value)


def test_corruption_on_the_way_is_a_transfer_error(tmp_path: Path) -> None:
    """A host python whose stdin arrives altered (the last byte, the end of the last file,
    flipped): the host's sha256 check catches it and nothing is renamed."""
    wrapper = tmp_path / "python-corrupting"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import sys; d = sys.stdin.buffer.read(); "
        "sys.stdout.buffer.write(d[:-1] + bytes([d[-1] ^ 1]))' | " + sys.executable + ' "$@"\n'
    )
    wrapper.chmod(0o755)
    agent = Agent(LocalConnection("local"), str(wrapper))
    target = tmp_path / "out" / "launch.sh"
    target.parent.mkdir()
    target.write_bytes(b"old\n")
    with pytest.raises(TransferError) as exc:
        agent.write(
            str(tmp_path),
            [(b"first\n", str(tmp_path / "out" / "a"), 0o644), (b"new\n", str(target), 0o755)],
        )
    assert "previous versions left in place" in str(exc.value)
    assert f"sha256 mismatch on the host for {target}" in str(exc.value)
    assert target.read_bytes() == b"old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["launch.sh"]


def test_unusable_answers_are_transfer_errors(tmp_path: Path) -> None:
    def fake(name: str, body: str) -> Agent:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\ncat >/dev/null\n{body}\n")
        path.chmod(0o755)
        return Agent(LocalConnection("local"), str(path))

    files = [(b"x", str(tmp_path / "f"), 0o644)]
    unconfirmed = fake(
        "unconfirmed", """echo '{"schema": 2, "action": "write", "ok": true, "written": []}'"""
    )
    with pytest.raises(TransferError, match="did not confirm the files"):
        unconfirmed.write(str(tmp_path), files)
    silent = fake("silent", "true")
    with pytest.raises(TransferError, match="printed nothing") as info:
        silent.write(str(tmp_path), files)
    assert "previous versions left in place" in str(info.value)
    with pytest.raises(TransferError, match="not found on the host"):
        Agent(LocalConnection("local"), "/nonexistent/python3").write(str(tmp_path), files)
    refused = Agent(LocalConnection("local"), sys.executable)
    with pytest.raises(TransferError, match="refused the request") as info:
        refused.write(str(tmp_path), [(b"x", "relative/path", 0o644)])
    assert "must be an absolute path" in str(info.value)
    assert not (tmp_path / "f").exists()
