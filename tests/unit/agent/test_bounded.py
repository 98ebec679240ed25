"""Days on a host stay bounded (DESIGN.md "Trust boundary" 7): pruned unit folders, the agent
copies supervisors run from, the bootstrap's code cache and partial transfers of content no
longer wanted are bounded by count; what a running process uses is never removed. The real
host code runs here on real files and processes (the agent over a LocalConnection, or the
action's module in-process as in test_tree/test_units)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent.bundle import bundle, command
from dflashops.agent.remote import bounded, receive, tree
from tests.unit.agent.test_units import HOST_PYTHON, Host


def age(path: Path, seconds_ago: float) -> None:
    t = os.stat(path).st_mtime - seconds_ago
    os.utime(path, (t, t))


def test_pruned_unit_folders_are_bounded_by_count(host: Host) -> None:
    pruned = host.workdir / "units" / ".pruned"
    old = []
    for i in range(bounded.PRUNED_KEEP + 3):
        folder = pruned / f"job-2020010{i % 10}T00000{i % 10}Z-{i}"
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "x.log").write_text("old evidence\n")
        age(folder, 1000.0 * (bounded.PRUNED_KEEP + 3 - i))  # the higher i, the newer
        old.append(folder)
    host.write_unit("job", "echo done")
    assert host.start("job")["job"].ok
    host.wait_exit("job")
    got = host.stop(("job", 5.0), prune=True)["job"]
    assert got.ok and got.pruned_to is not None
    kept = sorted(p.name for p in pruned.iterdir())
    assert len(kept) == bounded.PRUNED_KEEP
    assert Path(got.pruned_to).name in kept  # the newest stays
    newest_old = {p.name for p in old[-(bounded.PRUNED_KEEP - 1) :]}
    assert newest_old <= set(kept)  # and the newest of the older ones; the oldest went


def test_agent_copies_are_bounded_but_a_running_one_is_kept(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflashops.agent.remote as remote
    from dflashops.agent.remote import start

    folder = host.workdir / "agent"
    folder.mkdir(parents=True)
    copies = []
    for i in range(bounded.AGENT_COPIES_KEEP + 3):
        copy = folder / f"{i:016x}.py"
        copy.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
        age(copy, 1000.0 * (10 - i))
        copies.append(copy)
    # The oldest copy runs (as a supervisor of an older version would): it must stay.
    running = host.popen([HOST_PYTHON, "-S", str(copies[0])], stdout=subprocess.PIPE)
    assert running.stdout is not None and running.stdout.readline() == b"up\n"
    (folder / "notes.txt").write_text("not a copy\n")
    monkeypatch.setattr(remote, "BUNDLE", bundle().decode(), raising=False)
    new = Path(start.agent_file(str(host.workdir)))
    kept = sorted(p.name for p in folder.iterdir())
    newest = {c.name for c in copies[-(bounded.AGENT_COPIES_KEEP - 1) :]}
    assert set(kept) == {new.name, copies[0].name, "notes.txt", *newest}, kept
    assert new.read_bytes() == bundle()


def test_the_bootstrap_code_cache_is_bounded(tmp_path: Path) -> None:
    """A host that saw many controller versions keeps only the newest few entries, and a
    partial entry a killed call left behind goes."""
    home = tmp_path / "home"
    tag = subprocess.run(
        [HOST_PYTHON, "-S", "-c", "import sys; print(sys.implementation.cache_tag or 'python')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cache = home / ".cache" / "dflashops-agent" / tag
    cache.mkdir(parents=True)
    old = []
    for i in range(12):
        entry = cache / f"{i:08x}.bin"
        entry.write_bytes(b"another version")
        age(entry, 1000.0 * (20 - i))
        old.append(entry)
    stale_part = cache / "00000000.bin.4242.part"
    stale_part.write_bytes(b"half")
    age(stale_part, 7200.0)
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    request = b'{"action": "facts", "workdir": "' + str(tmp_path / "wd").encode() + b'"}\n'
    done = subprocess.run(
        ["bash", "-c", command(HOST_PYTHON)],
        input=bundle() + request,
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    kept = sorted(p.name for p in cache.iterdir())
    assert len(kept) == 8, kept
    assert {p.name for p in old[-7:]} <= set(kept)  # the newest old ones and this call's
    assert stale_part.name not in kept


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_partial_transfers_of_changed_content_are_removed(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    v1, v2 = b"version one " * 100, b"version two " * 100
    # Left by interrupted transfers: v1 of a.bin (the source has v2 now), and a file the
    # source no longer has at all.
    changed = dest / f".a.bin{tree.PART_MARK}{sha(v1)[:16]}"
    changed.write_bytes(v1[:50])
    dropped = dest / "sub" / f".gone.txt{tree.PART_MARK}{sha(b'gone')[:16]}"
    dropped.write_bytes(b"go")
    request: dict[str, Any] = {
        "workdir": str(tmp_path / "wd"),
        "dest": str(dest),
        "files": [{"rel": "a.bin", "size": len(v2), "sha256": sha(v2), "offset": 0, "mode": 420}],
    }
    # Interrupted again: what arrived is kept for the resume, and so is everything else.
    receive.check(request)
    out = receive.run(request, io.BytesIO(v2[:100]))
    assert not out["ok"] and "kept for the next deploy" in out["error"]
    resumable = dest / f".a.bin{tree.PART_MARK}{sha(v2)[:16]}"
    assert resumable.stat().st_size == 100 and changed.exists() and dropped.exists()
    # Complete: a.bin in place, no partial file left under dest.
    request["files"][0]["offset"] = 100
    receive.check(request)
    out = receive.run(request, io.BytesIO(v2[100:]))
    assert out["ok"], out
    assert (dest / "a.bin").read_bytes() == v2
    assert not changed.exists() and not dropped.exists() and not resumable.exists()
    _, parts = tree.walk(str(dest))
    assert parts == {}
