"""Mirror and restore of kept outputs (lifecycle/keep.py) against the real agent on this machine
(a `connection: local` host): what the copy takes, how many bytes it costs, what a restore puts
back, and what it refuses. The sshd path and the generator's resume are in
tests/integration/test_keep.py."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from dflashops.agent import keep_actions
from dflashops.agent.keep_actions import KeptCopy, Pulled, _Receiver
from dflashops.config.load import load_inventory, load_playbook
from dflashops.errors import HostError
from dflashops.events import EventLog
from dflashops.hosts.untrusted import HostileHost
from dflashops.lifecycle.keep import KeepResult, host_lock, mirror, restore, state_dir
from dflashops.lifecycle.session import HostSession
from dflashops.plan import build_plan
from dflashops.plan.model import Unit

MiB = 1 << 20


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Node:
    """One local host with a job that keeps ``out/`` (workdir-relative) and a single file."""

    base: Path
    session: HostSession
    units: list[Unit]

    @property
    def out(self) -> Path:
        return self.base / "wd" / "out"

    @property
    def log(self) -> Path:
        return self.base / "run.log"

    @property
    def copy(self) -> Path:
        return self.base / ".dflashops" / "keep" / "n" / "gen"

    def mirror(self) -> KeepResult:
        (result,) = mirror(self.session, self.units, state_dir(self.base / "inventory.yaml"))
        return result

    def restore(self, check: bool = False) -> KeepResult:
        state = state_dir(self.base / "inventory.yaml")
        (result,) = restore(self.session, self.units, state, check=check)
        return result

    def record(self, key: str) -> dict[str, Any]:
        data = json.loads((self.copy.parent / "gen.json").read_text())
        return dict(data["files"][key])


def make_node(base: Path, keep: dict[str, Any], extra_hosts: dict[str, Any] | None = None) -> Node:
    (base / "playbooks").mkdir(parents=True)
    (base / "wd").mkdir()
    hosts = {"n": {"connection": "local", "workdir": "wd"}, **(extra_hosts or {})}
    (base / "inventory.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
    job = {"name": "gen", "command": ["true"], "keep": keep}
    (base / "playbooks" / "p.yaml").write_text(
        yaml.safe_dump({"name": "p", "hosts": "n", "jobs": [job]})
    )
    inventory = load_inventory(base / "inventory.yaml")
    plan = build_plan(inventory, [load_playbook(base / "playbooks" / "p.yaml")])
    assert not plan.problems, plan.problems
    session = HostSession(
        inventory.hosts["n"], [], EventLog(Console(quiet=True)), peers=inventory.hosts
    )
    return Node(base, session, plan.units)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = make_node(tmp_path, {"paths": ["out/", str(tmp_path / "run.log")]})
    n.out.mkdir()
    (n.out / "shard.jsonl").write_bytes(os.urandom(3 * MiB))
    (n.out / "sub").mkdir()
    (n.out / "sub" / "progress.json").write_text('{"done": 1}')
    n.log.write_text("started\n")
    try:
        yield n
    finally:
        n.session.close()


def grow(path: Path, count: int) -> bytes:
    data = os.urandom(count)
    with open(path, "ab") as f:
        f.write(data)
    return data


def test_the_copy_is_a_plain_mirror_and_a_second_mirror_sends_nothing(node: Node) -> None:
    first = node.mirror()
    assert first.ok and first.files == 3, first
    assert first.bytes_sent == 3 * MiB + len('{"done": 1}') + len("started\n")
    for rel in ("shard.jsonl", "sub/progress.json"):
        assert sha(node.copy / "out" / rel) == sha(node.out / rel)
    assert (node.copy / "run.log").read_text() == "started\n"
    rec = node.record("out/shard.jsonl")
    assert rec["sha256"] == sha(node.out / "shard.jsonl") and rec["size"] == 3 * MiB
    again = node.mirror()
    assert again.ok and (again.files, again.bytes_sent) == (0, 0), again
    assert again.kept_bytes == first.kept_bytes


@pytest.mark.parametrize("same_process", [True, False], ids=["hash-kept", "hash-recomputed"])
def test_an_append_only_file_sends_only_its_new_bytes(node: Node, same_process: bool) -> None:
    node.mirror()
    for _ in range(3):
        grow(node.out / "shard.jsonl", 100_000)
        if not same_process:  # a new controller process: the whole sha256 read from the copy
            keep_actions._STATES.clear()
        r = node.mirror()
        assert r.ok and (r.files, r.bytes_sent) == (1, 100_000), r
        assert sha(node.copy / "out" / "shard.jsonl") == sha(node.out / "shard.jsonl")
        rec = node.record("out/shard.jsonl")
        assert rec["sha256"] == sha(node.out / "shard.jsonl")


def test_a_changed_file_is_sent_whole_a_shrunk_one_is_not_taken_while_its_job_is_down(
    node: Node,
) -> None:
    node.mirror()
    shard = node.out / "shard.jsonl"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # inside the tail the host checks: not an append any more
    shard.write_bytes(bytes(data) + b"more")
    r = node.mirror()
    assert (r.files, r.bytes_sent) == (1, 3 * MiB + 4), r
    assert any("differ from the kept copy's" in w and "host's is longer" in w for w in r.warnings)
    kept = (node.copy / "out" / "shard.jsonl").read_bytes()
    shard.write_bytes(bytes(data[: 2 * MiB]))  # the job is not running: this lost something
    r = node.mirror()
    assert r.ok and (r.files, r.bytes_sent) == (0, 0), r
    assert (node.copy / "out" / "shard.jsonl").read_bytes() == kept
    (node.out / "sub" / "progress.json").write_text('{"done": 22}')  # rewritten, small
    r = node.mirror()
    assert (r.files, r.bytes_sent, r.warnings) == (1, len('{"done": 22}'), []), r


def test_a_file_gone_from_the_host_stays_in_the_copy(node: Node) -> None:
    node.mirror()
    (node.out / "sub" / "progress.json").unlink()
    assert node.mirror().ok
    assert (node.copy / "out" / "sub" / "progress.json").read_text() == '{"done": 1}'


def test_bytes_of_an_append_cut_short_are_dropped_before_the_next(node: Node) -> None:
    node.mirror()
    with open(node.copy / "out" / "shard.jsonl", "ab") as f:
        f.write(b"half of an append that never got its record")
    keep_actions._STATES.clear()
    grow(node.out / "shard.jsonl", 5000)
    r = node.mirror()
    assert r.ok and r.bytes_sent == 5000 and not r.warnings, r
    assert sha(node.copy / "out" / "shard.jsonl") == sha(node.out / "shard.jsonl")


def test_a_copy_that_does_not_match_its_record_is_set_aside_and_sent_again(node: Node) -> None:
    node.mirror()
    kept = node.copy / "out" / "shard.jsonl"
    data = bytearray(kept.read_bytes())
    data[1000] ^= 0xFF
    kept.write_bytes(bytes(data))
    keep_actions._STATES.clear()
    grow(node.out / "shard.jsonl", 5000)
    r = node.mirror()
    assert any("kept copy of out/shard.jsonl refused" in w for w in r.warnings), r
    aside = list((node.copy.parent / "gen.aside").rglob("shard.jsonl"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)
    r = node.mirror()
    assert r.ok and r.bytes_sent == 3 * MiB + 5000, r
    assert sha(kept) == sha(node.out / "shard.jsonl")


def test_restore_puts_back_what_the_host_lost_or_has_shorter(node: Node) -> None:
    node.mirror()
    want = {p: sha(p) for p in (node.out / "shard.jsonl", node.out / "sub" / "progress.json")}
    (node.out / "sub" / "progress.json").unlink()
    with open(node.out / "shard.jsonl", "r+b") as f:
        f.truncate(MiB)
    node.log.unlink()
    look = node.restore(check=True)
    assert (look.restored_files, look.restored_bytes) == (3, 3 * MiB + 19), look
    assert not node.log.exists()  # --check puts nothing back
    r = node.restore()
    assert r.ok and r.restored_files == 3 and r.bytes_sent == 0, r
    assert {p: sha(p) for p in want} == want and node.log.read_text() == "started\n"
    assert node.restore().restored_files == 0  # all in place: nothing to put back


def test_restore_never_overwrites_a_longer_output(node: Node) -> None:
    node.mirror()
    shard = node.out / "shard.jsonl"
    other = os.urandom(3 * MiB + 7)  # longer, and not what was kept: the host's wins
    shard.write_bytes(other)
    r = node.restore()
    assert r.ok and r.restored_files == 0, r
    assert shard.read_bytes() == other
    assert any(
        f"the host's {3 * MiB + 7} bytes" in w and f"copy's {3 * MiB}" in w for w in r.warnings
    )


def test_a_corrupt_copy_is_refused_not_restored(node: Node) -> None:
    node.mirror()
    kept = node.copy / "out" / "shard.jsonl"
    kept.write_bytes(b"x" + kept.read_bytes()[1:])
    (node.out / "shard.jsonl").unlink()
    r = node.restore()
    assert not (node.out / "shard.jsonl").exists()
    assert any(
        "kept copy of out/shard.jsonl refused: its sha256 is not the recorded" in w
        for w in r.warnings
    ), r
    assert list((node.copy.parent / "gen.aside").rglob("shard.jsonl"))
    assert "out/shard.jsonl" not in json.loads((node.copy.parent / "gen.json").read_text())["files"]


def test_a_limit_paces_the_mirror(tmp_path: Path) -> None:
    n = make_node(tmp_path, {"paths": ["out/"], "limit": "1MiB"})
    try:
        n.out.mkdir()
        (n.out / "a").write_bytes(os.urandom(MiB + MiB // 2))
        started = time.monotonic()
        r = n.mirror()
        assert r.ok and r.bytes_sent == MiB + MiB // 2
        assert time.monotonic() - started >= 1.3  # 1.5 MiB at 1 MiB/s
    finally:
        n.session.close()


def test_one_mirror_at_a_time_per_host(node: Node) -> None:
    keep_dir = node.base / ".dflashops" / "keep"
    with (
        host_lock(keep_dir, "n"),
        pytest.raises(HostError, match="another dflashops"),
        host_lock(keep_dir, "n", wait=0.3),
    ):
        pass


def test_the_copy_goes_to_another_host_too_and_catches_up_after_it_was_away(
    tmp_path: Path,
) -> None:
    away = {"address": "127.0.0.1", "port": 1, "host_key_policy": "accept-new"}
    n = make_node(tmp_path, {"paths": ["out/"], "to": f"k:{tmp_path}/far"}, {"k": away})
    try:
        n.out.mkdir()
        (n.out / "a.jsonl").write_text("one\n")
        r = n.mirror()
        assert r.ok and r.files == 1, r
        assert any(
            w.startswith("keep.to k: ") and "kept on the controller meanwhile" in w
            for w in r.warnings
        )
        assert (n.copy / "out" / "a.jsonl").read_text() == "one\n"
        # k is back (here: this machine, with its own workdir).
        k = {"connection": "local", "workdir": str(tmp_path / "kwd")}
        (tmp_path / "inventory.yaml").write_text(
            yaml.safe_dump({"hosts": {"n": {"connection": "local", "workdir": "wd"}, "k": k}})
        )
        n.session.peers = dict(load_inventory(tmp_path / "inventory.yaml").hosts)
        n.session.peer_agents.clear()
        r = n.mirror()
        assert r.ok and not r.warnings and r.files == 0, r
        far = tmp_path / "far" / "n" / "gen" / "out" / "a.jsonl"
        assert far.read_text() == "one\n"
        grow(n.out / "a.jsonl", 10)
        assert n.mirror().ok and sha(far) == sha(n.out / "a.jsonl")
    finally:
        n.session.close()


def header(**kw: Any) -> dict[str, Any]:
    base = {"rel": "out/a", "size": 4, "offset": 0, "kind": "whole", "sha256": "0" * 64}
    return {**base, "stat": [4, 1, 2], **kw}


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (header(rel="out/../../x"), "climbs out"),
        (header(rel="/etc/x"), "absolute"),
        (header(rel="elsewhere/a"), "not under a kept path"),
        (header(sha256="zz"), "its sha256 is not one"),
        (header(stat="now"), "its stat is not"),
        (header(kind="append", offset=2), "an append to a file the copy does not have"),
        (header(kind="delete"), "is not a whole file"),
    ],
)
def test_what_a_host_sends_for_keep_is_checked_before_it_is_written(
    tmp_path: Path, bad: dict[str, Any], why: str
) -> None:
    copy = KeptCopy(tmp_path / "keep", "n", "gen")
    pulled = Pulled(
        keep_actions.KeepAnswer(roots={}, files={}, decisions={}, errors={}, sent_bytes=0)
    )
    receiver = _Receiver("n", copy, {"out"}, pulled)
    with pytest.raises(HostileHost, match=why):
        receiver.open_file(bad)
    assert not (tmp_path / "keep").exists()


def test_a_copy_deleted_by_hand_is_sent_again(node: Node) -> None:
    node.mirror()
    (node.copy / "out" / "shard.jsonl").unlink()
    r = node.mirror()
    assert r.ok and r.bytes_sent == 3 * MiB and not r.warnings, r
    assert sha(node.copy / "out" / "shard.jsonl") == sha(node.out / "shard.jsonl")
