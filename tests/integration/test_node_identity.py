"""Node identity against the sshd fleet (DESIGN "Nothing lost when a node is lost" 4-5): a
deploy gives the workdir its node id, `status` remembers each host in the project's state
folder and says when one rebooted or was re-provisioned since; the controller's notices reach
the webhook (a local receiver) once per transition, and a failed post is one line without the
URL."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, Result, job
from test_supervision import Receiver

from dflashops.config.load import load_inventory
from dflashops.lifecycle.notices import Notices
from tests.procs import boot_id, free_port, wait_for


@pytest.fixture
def webhook() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


def node_id(host: FleetHost) -> str:
    return str(json.loads((host.workdir / "node.json").read_text())["node_id"])


def identity(res: Result, host: str = "a") -> str | None:
    assert res.document is not None, res.explain()
    [entry] = [h for h in res.document["hosts"] if h["host"] == host]
    return entry["identity"]  # type: ignore[no-any-return]


def said(res: Result) -> list[str]:
    """The identity lines under the status table."""
    return [
        line
        for line in res.out.splitlines()
        if line.startswith(("rebooted:", "re-provisioned:", "warning:"))
    ]


def deployed(ctl: Ops, host: FleetHost) -> str:
    """Deploy a job that ends at once, wait until it is done; the node id deploy gave."""
    ctl.playbook("work", {"hosts": [host.name], "jobs": [job("once", "echo hi")]})
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    wait_for("the job to end", lambda: ctl.run("status").rows()["once"]["state"] == "done")
    return node_id(host)


def test_status_says_rebooted_and_re_provisioned_against_what_it_saw_last(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a")
    host = fleet["a"]
    ctl = ops(fleet)
    memory = ctl.base / ".dflashops" / "hosts" / "a.json"
    assert not memory.exists()
    node = deployed(ctl, host)
    assert len(node) == 32 and (host.workdir / "node.json").stat().st_mode & 0o777 == 0o600
    looked = ctl.run("status")
    assert looked.code == 0 and said(looked) == [], looked.explain()
    assert identity(looked) == "same"  # the job's wait looked first
    record = json.loads(memory.read_text())
    assert record["node_id"] == node and record["boot_id"] == boot_id()
    assert record["key"] == host.fingerprint() and memory.stat().st_mode & 0o777 == 0o600

    # A reboot, as the controller sees one: another boot id than the one it remembered.
    memory.write_text(json.dumps(dict(record, boot_id="0" * 36, seen_at="2026-05-01T12:03:00Z")))
    rebooted = ctl.run("status")
    assert identity(rebooted) == "rebooted" and said(rebooted) == [
        "rebooted: [a] boot id changed since 2026-05-01 12:03Z (processes and /dev/shm are gone): "
        "`dflashops deploy` starts what is down"
    ], rebooted.explain()
    again = ctl.run("status")
    assert identity(again) == "same" and said(again) == []  # said once

    # The workdir's node id gone: re-provisioned, at every look until a deploy.
    (host.workdir / "node.json").unlink()
    for _ in range(2):
        gone = ctl.run("status")
        assert identity(gone) == "re-provisioned", gone.explain()
        [line] = said(gone)
        assert line.startswith(
            f"re-provisioned: [a] the workdir's node id is gone ({host.workdir}/node.json, there "
            "when last seen at "
        ) and line.endswith("the workdir was emptied or this is another machine; run deploy")
    assert ctl.run("deploy").code == 0
    assert node_id(host) != node  # a new node
    after = ctl.run("status")  # deploy remembered the id it gave: nothing more to say
    assert identity(after) == "same" and said(after) == [], after.explain()


def test_a_re_provisioned_machine_new_key_and_empty_disk_is_said_once_trusted(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a")
    host = fleet["a"]
    ctl = ops(fleet)
    deployed(ctl, host)
    memory = ctl.base / ".dflashops" / "hosts" / "a.json"
    remembered = memory.read_text()
    shutil.rmtree(host.workdir)
    old_key = host.fingerprint()
    host.rotate_host_key()
    refused = ctl.run("status")  # a changed key: not read, so nothing is remembered of it
    assert refused.code != 0 and identity(refused) is None and said(refused) == []
    assert memory.read_text() == remembered
    assert ctl.run("trust", "--host", "a", "--yes", playbooks=[], json_events=False).code == 0
    seen = ctl.run("status")
    assert identity(seen) == "re-provisioned", seen.explain()
    [line] = said(seen)
    assert line.startswith("re-provisioned: [a] the workdir's node id is gone"), line
    assert json.loads(memory.read_text())["key"] == old_key  # as last seen with its id


# -- notices ----------------------------------------------------------------------------------


def test_a_notice_reaches_the_webhook_once_per_transition(webhook: Receiver) -> None:
    lines: list[str] = []
    notices = Notices(webhook.url, lines.append)
    assert notices.send("b200", "reprovisioned", node_id="9b1c", was="3f2a")
    for _ in range(3):  # a watch tick after tick sees the host gone: one notice
        if notices.once("b200/lost"):
            assert notices.send("b200", "host_lost", after_s=120)
    notices.again("b200/lost")  # it came back: the next loss is a new transition
    if notices.once("b200/lost"):
        notices.send("b200", "host_lost", after_s=130)
    assert webhook.events() == ["reprovisioned", "host_lost", "host_lost"] and lines == []
    first = webhook.notices[0]
    assert {k: first[k] for k in ("host", "unit", "event", "node_id", "was")} == {
        "host": "b200",
        "unit": None,
        "event": "reprovisioned",
        "node_id": "9b1c",
        "was": "3f2a",
    }
    sent = time.strptime(first["time"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs(time.mktime(sent) - time.mktime(time.gmtime())) < 60 and first["at"] == first["time"]


def test_a_failed_notice_is_one_line_that_never_shows_the_url() -> None:
    secret = "hooks/T0K3N-abc"
    lines: list[str] = []
    refused = Notices(f"http://127.0.0.1:{free_port()}/{secret}", lines.append)
    assert refused.send("b200", "host_back") is False
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        slow = Notices(f"http://127.0.0.1:{silent.getsockname()[1]}/{secret}", lines.append, 0.5)
        started = time.monotonic()
        assert slow.send("b200", "key_changed", presents="SHA256:x") is False
        assert time.monotonic() - started < 5
    assert len(lines) == 2 and all(secret not in line for line in lines), lines
    assert lines[0].startswith("[b200] notice host_back not delivered: ")
    assert lines[1].startswith("[b200] notice key_changed not delivered: ")
    assert all(line.endswith("(the webhook of its notify: check the receiver)") for line in lines)


def test_notices_of_a_host_use_its_notify_webhook(tmp_path: Path, webhook: Receiver) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        json.dumps(
            {
                "hosts": {
                    "a": {"address": "127.0.0.1", "notify": {"webhook": "env:TEST_HOOK"}},
                    "b": {"address": "127.0.0.1"},
                }
            }
        )
    )
    hosts = load_inventory(inventory).hosts
    lines: list[str] = []
    unset = Notices.of(hosts["a"], lines.append, environ={})
    assert lines == [
        "[a] notify: TEST_HOOK is not set on the controller, so its notices are not sent: "
        "set it (or remove notify)"
    ]
    assert unset.send("a", "host_lost") is False
    assert Notices.of(hosts["b"], lines.append).send("b", "host_lost") is False  # no notify
    env: dict[str, Any] = dict(os.environ, TEST_HOOK=webhook.url)
    assert Notices.of(hosts["a"], lines.append, environ=env).send("a", "host_back")
    assert webhook.events() == ["host_back"] and len(lines) == 1
