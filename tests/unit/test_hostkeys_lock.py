"""known_hosts records made at once (parallel first contacts under `accept-new`) are all kept:
each record re-reads and merges under a lock. Before, records raced (read, add one, rename) and
most were lost, so those hosts were trusted on first use again later."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import paramiko
import pytest

from dflashops.hosts import hostkeys


def test_parallel_records_keep_every_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "known_hosts"
    monkeypatch.setenv(hostkeys.KNOWN_HOSTS_ENV, str(path))
    other = paramiko.ECDSAKey.generate()
    path.write_text(f"# kept\n[10.9.9.9]:2222 {other.get_name()} {other.get_base64()}\n")
    key = paramiko.ECDSAKey.generate()
    names = [f"[127.0.1.{i}]:22{i:02d}" for i in range(32)]
    start = threading.Barrier(len(names))
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            start.wait()
            hostkeys.record(name, key)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    lines = path.read_text().splitlines()
    recorded = {line.split()[0] for line in lines if line and not line.startswith("#")}
    assert recorded == {*names, "[10.9.9.9]:2222"}
    assert "# kept" in lines
    assert len(lines) == len(names) + 2  # each once
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Recording a host again replaces its line (still under the lock), nothing else goes.
    hostkeys.record(names[0], key)
    assert len(path.read_text().splitlines()) == len(names) + 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".known_hosts.")]
