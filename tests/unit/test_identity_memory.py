"""Node identity (DESIGN "Nothing lost when a node is lost" 4): the verdict as data (remembered x
facts -> same | rebooted | re-provisioned | first-seen), the controller's memory of its hosts in
the project's state folder, and the host side run for real (the agent over a LocalConnection):
the deploy lock gives a workdir its node id once, facts report it."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent import Agent
from dflashops.agent.answers import HostFacts
from dflashops.changes.identity import Known, Verdict, judge, kept, short_time
from dflashops.hosts.local import LocalConnection
from dflashops.lifecycle.memory import HostMemory
from dflashops.lifecycle.notices import body
from dflashops.project import state_dir
from tests.procs import boot_id

A, B = "a" * 32, "b" * 32
NOON = 1_780_000_000.0  # 2026-05-28T20:26:40Z
SEEN = "2026-05-28T12:03:00Z"
HOLDER = {"who": "test@here", "command": "dflashops deploy", "controller_pid": os.getpid()}

# {before (None: nothing remembered), now, expect}: what the controller remembered of a host,
# what facts say now, and what the host is.
CASES: list[dict[str, Any]] = [
    {"id": "never-seen", "before": None, "now": [A, "b1"], "expect": "first-seen"},
    {"id": "never-seen-no-id", "before": None, "now": [None, "b1"], "expect": "first-seen"},
    {"id": "same", "before": [A, "b1"], "now": [A, "b1"], "expect": "same"},
    {"id": "rebooted", "before": [A, "b1"], "now": [A, "b2"], "expect": "rebooted"},
    {"id": "workdir-emptied", "before": [A, "b1"], "now": [None, "b1"], "expect": "re-provisioned"},
    {"id": "new-machine", "before": [A, "b1"], "now": [None, "b2"], "expect": "re-provisioned"},
    {"id": "another-id", "before": [A, "b1"], "now": [B, "b1"], "expect": "re-provisioned"},
    {
        "id": "another-id-rebooted",
        "before": [A, "b1"],
        "now": [B, "b2"],
        "expect": "re-provisioned",
    },
    # Seen before its first deploy (no id yet): a deploy since gave it one, nothing was lost.
    {"id": "first-deploy-since", "before": [None, "b1"], "now": [A, "b1"], "expect": "same"},
    {"id": "no-id-rebooted", "before": [None, "b1"], "now": [None, "b2"], "expect": "rebooted"},
    # A boot id that could not be read proves nothing.
    {"id": "boot-unknown-now", "before": [A, "b1"], "now": [A, None], "expect": "same"},
    {"id": "boot-unknown-before", "before": [A, None], "now": [A, "b2"], "expect": "same"},
]


def known(ids: list[str | None] | None, seen_at: str | None = SEEN) -> Known | None:
    return None if ids is None else Known(ids[0], ids[1], "SHA256:k", seen_at)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_identity_as_data(case: dict[str, Any]) -> None:
    before, now = known(case["before"]), known(case["now"], None)
    assert now is not None
    assert judge(before, now) == case["expect"]
    # Looked at again with nothing changed on the host: only a lost id is said again.
    again = judge(kept(before, now), now)
    assert again == (
        "re-provisioned" if case["id"] in ("workdir-emptied", "new-machine") else "same"
    )


def test_a_lost_node_id_is_remembered_until_the_host_has_an_id_again() -> None:
    before = Known(A, "b1", "SHA256:k", SEEN)
    gone = Known(None, "b2", "SHA256:k2", "2026-05-28T13:00:00Z")
    assert kept(before, gone) == before  # when it was last seen with its id, and that id
    back = Known(B, "b2", "SHA256:k2", "2026-05-28T13:05:00Z")
    assert judge(kept(before, gone), back) == "re-provisioned" and kept(before, back) == back


def test_the_lines_under_the_table_say_what_happened_since_when_and_what_to_do() -> None:
    before = Known(A, "b1", "SHA256:k", SEEN)

    def line(now: Known) -> tuple[str, str] | None:
        return Verdict("h", judge(before, now), before, now, "/w/dfo/").warning(NOON)

    assert line(Known(A, "b2")) == (
        "rebooted",
        "[h] boot id changed since 12:03Z (processes and /dev/shm are gone): "
        "`dflashops deploy` starts what is down",
    )
    assert line(Known(None, "b2")) == (
        "re-provisioned",
        "[h] the workdir's node id is gone (/w/dfo/node.json, there when last seen at 12:03Z): "
        "the workdir was emptied or this is another machine; run deploy",
    )
    assert line(Known(B, "b1")) == (
        "re-provisioned",
        "[h] the workdir holds another node id than when last seen at 12:03Z (bbbbbbbb, was "
        "aaaaaaaa): another machine or a new workdir; run deploy",
    )
    assert line(Known(A, "b1")) is None
    assert Verdict("h", "first-seen", None, Known(A, "b1")).warning(NOON) is None


def test_key_changed_needs_both_keys() -> None:
    was = Known(A, "b1", "SHA256:old", SEEN)
    assert Verdict("h", "same", was, Known(A, "b1", "SHA256:new")).key_changed
    assert not Verdict("h", "same", was, Known(A, "b1", None)).key_changed
    assert not Verdict("h", "first-seen", None, Known(A, "b1", "SHA256:new")).key_changed


def test_short_time_names_the_day_only_when_it_is_not_today() -> None:
    assert short_time(SEEN, NOON) == "12:03Z"
    assert short_time("2026-05-01T07:00:00Z", NOON) == "2026-05-01 07:00Z"
    assert short_time(None, NOON) == "an unknown time"
    assert short_time("yesterday", NOON) == "an unknown time"


def test_known_reads_back_only_what_it_wrote() -> None:
    k = Known(A, "b1", "SHA256:k", SEEN)
    assert Known.from_json(json.loads(json.dumps(k.as_json()))) == k
    with pytest.raises(ValueError, match="node_id"):
        Known.from_json({"node_id": 7})
    with pytest.raises(ValueError, match="not a JSON object"):
        Known.from_json([A])


# -- the controller's memory -------------------------------------------------------------------


def facts(node_id: str | None, boot: str | None, workdir: str = "/w") -> HostFacts:
    """Just what identity looks at (the rest as empty as the model allows)."""
    return HostFacts.model_validate(
        {
            **{"hostname": "h", "time": NOON, "python": "3.11", "python_executable": "python3"},
            **{"boot_id": boot, "node_id": node_id, "clock_ticks": 100, "uptime_s": 1.0},
            **{"workdir": workdir, "workdir_exists": True, "disk": None, "listening": []},
            **{"payloads": {}, "units": {}, "imports": {}, "paths": {}},
            "gpus": {"available": False, "error": None, "devices": [], "processes": []},
        }
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dir_is_beside_the_inventory_and_private(tmp_path: Path) -> None:
    inventory = tmp_path / "ops" / "inventory.yaml"
    inventory.parent.mkdir()
    assert state_dir(inventory) == tmp_path / "ops" / ".dflashops"
    assert mode(tmp_path / "ops" / ".dflashops") == 0o700
    assert state_dir(inventory) == tmp_path / "ops" / ".dflashops"  # there already: kept


def test_memory_is_one_private_file_per_host_written_whole(tmp_path: Path) -> None:
    memory = HostMemory(tmp_path / "inventory.yaml")
    first = memory.observe("b200", facts(A, "b1"), "SHA256:k")
    assert first.identity == "first-seen" and memory.identity("b200") == "first-seen"
    path = tmp_path / ".dflashops" / "hosts" / "b200.json"
    record = json.loads(path.read_text())
    assert {k: record[k] for k in ("node_id", "boot_id", "key")} == {
        "node_id": A,
        "boot_id": "b1",
        "key": "SHA256:k",
    }
    assert record["seen_at"].endswith("Z") and mode(path) == 0o600
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["b200.json"]  # no temporary file left
    # Another command later: the same host, then the same host rebooted.
    assert (
        HostMemory(tmp_path / "inventory.yaml").observe("b200", facts(A, "b1")).identity == "same"
    )
    later = HostMemory(tmp_path / "inventory.yaml")
    assert later.observe("b200", facts(A, "b2")).identity == "rebooted"
    assert [label for label, _ in later.warnings(["b200", "other"])] == ["rebooted"]
    assert later.identity("other") is None


def test_a_broken_memory_file_is_first_seen_and_rewritten(tmp_path: Path) -> None:
    memory = HostMemory(tmp_path / "inventory.yaml")
    memory.observe("h", facts(A, "b1"))
    path = tmp_path / ".dflashops" / "hosts" / "h.json"
    path.write_text('{"node_id": ')  # cut short
    assert HostMemory(tmp_path / "inventory.yaml").observe("h", facts(A, "b1")).identity == (
        "first-seen"
    )
    assert json.loads(path.read_text())["node_id"] == A


def test_memory_that_cannot_be_written_is_one_line_not_a_failure(tmp_path: Path) -> None:
    (tmp_path / ".dflashops").mkdir(mode=0o700)
    (tmp_path / ".dflashops" / "hosts").write_text("not a folder")  # even root cannot write in it
    memory = HostMemory(tmp_path / "inventory.yaml")
    verdict = memory.observe("h", facts(A, "b1"))
    assert verdict.identity == "first-seen"
    [(label, line)] = memory.warnings(["h"])
    assert label == "warning" and line.startswith("[h] what the controller saw of it is not")
    assert "make the folder writable" in line


def test_a_run_with_a_state_folder_remembers_in_it(tmp_path: Path) -> None:
    """What deploy and watch hold (their HostRun's state_dir) is the same memory as status's."""
    inventory = tmp_path / "inventory.yaml"
    HostMemory.at(state_dir(inventory)).observe("h", facts(A, "b1"))
    assert HostMemory(inventory).observe("h", facts(B, "b1")).identity == "re-provisioned"
    got = HostMemory.at(tmp_path / ".dflashops").recall("h")
    assert got is not None and (got.node_id, got.boot_id) == (B, "b1")


def test_without_an_inventory_nothing_is_remembered(tmp_path: Path) -> None:
    memory = HostMemory(None)
    assert memory.observe("h", facts(A, "b1")).identity == "first-seen"
    assert memory.observe("h", facts(A, "b2")).identity == "first-seen"


def test_looks_at_once_leave_one_whole_record(tmp_path: Path) -> None:
    """Several commands remembering the same host at once: the last rename wins, whole."""
    inventory = tmp_path / "inventory.yaml"
    errors: list[BaseException] = []

    def look(i: int) -> None:
        try:
            for _ in range(20):
                HostMemory(inventory).observe("h", facts(A, f"boot{i}"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=look, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    folder = tmp_path / ".dflashops" / "hosts"
    assert [p.name for p in folder.iterdir()] == ["h.json"]
    assert json.loads((folder / "h.json").read_text())["boot_id"].startswith("boot")


# -- the host side, run for real ---------------------------------------------------------------


def node_id_of(workdir: Path) -> str:
    return str(json.loads((workdir / "node.json").read_text())["node_id"])


def take_lock(workdir: Path) -> dict[str, Any]:
    """The deploy lock taken (and released) as deploy takes it: the agent's raw answer."""
    agent = Agent(LocalConnection("local"), sys.executable, keep=True)
    try:
        request = {"workdir": str(workdir), "op": "acquire", "holder": HOLDER, "wait": 0.0}
        answer = agent.call("lock", request, timeout=30)
        assert answer["ok"] is True, answer
        return answer
    finally:
        agent.close()


def look(workdir: Path) -> HostFacts:
    return Agent(LocalConnection("local"), sys.executable).facts(str(workdir), timeout=30)


def test_the_first_deploy_lock_gives_the_workdir_its_node_id_once(tmp_path: Path) -> None:
    workdir = tmp_path / "new" / "dfo"
    before = look(workdir)
    assert before.node_id is None and "node_id" not in before.errors
    assert before.boot_id == boot_id()
    answer = take_lock(workdir)
    node = node_id_of(workdir)
    assert answer["node_id"] == node and len(node) == 32
    assert mode(workdir / "node.json") == 0o600 and mode(workdir) == 0o700
    assert look(workdir).node_id == node
    assert take_lock(workdir)["node_id"] == node and node_id_of(workdir) == node  # never rewritten
    (workdir / "node.json").unlink()  # the workdir emptied: the next deploy makes a new node
    assert look(workdir).node_id is None
    again = take_lock(workdir)["node_id"]
    assert again != node and look(workdir).node_id == again


def test_a_broken_node_file_reads_as_no_id_and_the_next_deploy_replaces_it(tmp_path: Path) -> None:
    workdir = tmp_path / "dfo"
    workdir.mkdir(mode=0o700)
    (workdir / "node.json").write_text('{"node_id": "../../etc"}')
    seen = look(workdir)
    assert seen.node_id is None and "no node id in it" in seen.errors["node_id"]
    node = take_lock(workdir)["node_id"]
    assert node == node_id_of(workdir) and look(workdir).node_id == node
    assert not [p for p in workdir.iterdir() if ".dflashops-tmp." in p.name]


# -- notices, as data (posted for real in tests/integration/test_node_identity.py) --------------


def test_a_notice_is_the_supervisors_shape_and_its_details_cannot_replace_it() -> None:
    got = body(
        "b200", "restored", {"bytes": 10, "event": "x", "time": "y", "path": Path("/p")}, NOON
    )
    assert got == {
        "host": "b200",
        "unit": None,
        "event": "restored",
        "time": "2026-05-28T20:26:40Z",
        "at": "2026-05-28T20:26:40Z",
        "bytes": 10,
        "path": "/p",
    }
    assert body("b200", "job_done", {"unit": "generate"}, NOON)["unit"] == "generate"
