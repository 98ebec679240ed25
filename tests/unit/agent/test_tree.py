"""Trees as the agent and the controller both describe them: scan with its cache, digests,
paths that must stay under dest, what moves (transfer.diff), and a streamed answer split at
every possible byte (client.Frames)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent.client import Frames
from dflashops.agent.remote import receive, tree
from dflashops.agent.remote.common import BadRequest
from dflashops.agent.transfer import diff, listing


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_scan_hashes_once_and_notices_a_change(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x").write_bytes(b"one")
    (root / "y").write_bytes(b"two")
    cache = str(tmp_path / "cache.json")
    first = tree.scan(str(root), cache)
    assert first["files"] == {"a/x": [3, sha(b"one")], "y": [3, sha(b"two")]}
    assert first["hashed_bytes"] == 6
    assert tree.scan(str(root), cache)["hashed_bytes"] == 0  # nothing changed: nothing read
    (root / "y").write_bytes(b"TWO")
    again = tree.scan(str(root), cache)
    assert again["hashed_bytes"] == 3 and again["files"]["y"] == [3, sha(b"TWO")]
    assert again["digest"] != first["digest"]


def test_scan_budget_leaves_what_it_could_not_read_unknown(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 1000)
    (tmp_path / "small").write_bytes(b"y")
    found = tree.scan(str(tmp_path), None, budget=10)
    assert found["files"]["small"][1] == sha(b"y") and found["files"]["big"][1] is None
    assert found["digest"] is None  # an unknown file never matches a real digest


def test_a_single_file_root_and_partial_transfers_beside_it(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"abc")
    (tmp_path / f".model.bin{tree.PART_MARK}{'0' * 16}").write_bytes(b"ab")
    found = tree.scan(str(f))
    assert found["kind"] == "file" and list(found["files"]) == [""]
    assert found["parts"] == {"": {"0" * 16: 2}}
    missing = tree.scan(str(tmp_path / "nothing"))
    assert not missing["exists"] and missing["files"] == {}


def test_temporary_and_partial_files_are_not_content(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / ".a.dflashops-tmp.123").write_bytes(b"junk")
    (tmp_path / f".b{tree.PART_MARK}{'1' * 16}").write_bytes(b"half")
    found = tree.scan(str(tmp_path))
    assert list(found["files"]) == ["a"] and found["parts"] == {"b": {"1" * 16: 4}}


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "a//b", "a/./b", "x\0"])
def test_relative_paths_from_a_request_are_plain(rel: str) -> None:
    with pytest.raises(BadRequest):
        tree.check_rel(rel)


def test_a_symlinked_folder_in_dest_cannot_carry_a_write_outside(tmp_path: Path) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "link").symlink_to(outside)
    with pytest.raises(BadRequest, match="resolves outside"):
        tree.target(str(dest), "link/file")
    assert tree.target(str(dest), "sub/file") == str(dest / "sub" / "file")


def test_diff_sends_what_differs_resumes_partials_and_deletes_only_with_delete() -> None:
    src = {"a": (3, "s" * 64), "b": (10, "t" * 64), "c": (1, "u" * 64)}
    dest = {"a": (3, "s" * 64), "b": (10, "x" * 64), "stale": (1, "v" * 64)}
    parts = {"b": {"t" * 16: 4, "z" * 16: 9}, "c": {"u" * 16: 5}}  # c's partial is too long
    plan = diff(src, dest, parts, delete=False)
    assert plan.send == [("b", 10, "t" * 64, 4), ("c", 1, "u" * 64, 0)]
    assert plan.delete == [] and plan.bytes == 7
    assert diff(src, dest, parts, delete=True).delete == ["stale"]
    assert diff(src, dict(src), {}, delete=True).empty


def test_receive_drops_a_partial_that_is_not_what_the_controller_expected(tmp_path: Path) -> None:
    data = b"0123456789"
    dest = tmp_path / "dest"
    dest.mkdir()
    part = dest / f".f{tree.PART_MARK}{sha(data)[:16]}"
    part.write_bytes(b"01")  # 2 bytes there, the controller thinks 4
    request: dict[str, Any] = {
        "workdir": str(tmp_path / "wd"),
        "dest": str(dest),
        "files": [{"rel": "f", "size": 10, "sha256": sha(data), "offset": 4, "mode": 0o644}],
    }
    receive.check(request)
    out = receive.run(request, io.BytesIO(data[4:]))
    assert not out["ok"] and "the partial transfer was 2 bytes, not 4" in out["failed"]["f"]
    assert not part.exists() and not (dest / "f").exists()
    # Resumed right, the hash covers the bytes that were there and the ones that came.
    part.write_bytes(data[:4])
    receive.check(request)
    out = receive.run(request, io.BytesIO(data[4:]))
    assert out["ok"] and (dest / "f").read_bytes() == data and not part.exists()
    manifest = json.loads(Path(tree.cache_path(request["workdir"], "dest", str(dest))).read_text())
    assert manifest["files"]["f"][3] == sha(data)


def test_frames_reassemble_files_split_at_any_byte(tmp_path: Path) -> None:
    body = {"a": b"hello\nworld", "b/c": b"", "d": os.urandom(300)}
    stream = b"a login banner\n"
    for rel, data in body.items():
        stream += json.dumps({"rel": rel, "size": len(data), "offset": 0}).encode() + b"\n" + data
    stream += b'{"schema": 2, "action": "send", "sent": ["a", "b/c", "d"], "missing": []}\n'
    for step in (1, 7, 64, len(stream)):
        got: dict[str, io.BytesIO] = {}

        class Sink(io.BytesIO):
            def close(self) -> None:  # keep the bytes readable after the frame ends
                pass

        def open_file(header: dict[str, Any], got: dict[str, io.BytesIO] = got) -> io.BytesIO:
            got[header["rel"]] = Sink()
            return got[header["rel"]]

        frames = Frames(open_file)
        for i in range(0, len(stream), step):
            frames.feed(stream[i : i + step])
        frames.close()
        assert {rel: f.getvalue() for rel, f in got.items()} == body, step
        assert b'"action": "send"' in frames.tail and b"a login banner" in frames.tail


def test_listing_reads_the_agents_lists() -> None:
    assert listing({"a": [3, "x"], "b": [0, None]}) == {"a": (3, "x"), "b": (0, None)}
    assert listing(None) == {}
