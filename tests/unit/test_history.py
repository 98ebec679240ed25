"""History on the host (agent/remote/history.py) and the decisions around it
(changes/history.py): revisions monotonic, only the changed units named, the last 10
revisions' scripts kept, records made only under the deploy lock, restores checked, and
which revision a rollback goes to."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.agent.history_actions import HistoryAnswer, Revision
from dflashops.agent.remote import history as host
from dflashops.agent.remote import lock
from dflashops.changes.history import (
    command_line,
    pick,
    reapplies,
    rolled_back,
    to_restart,
    touching,
)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A workdir whose deploy lock this process holds, as a command's agent session does."""
    wd = tmp_path / "wd"
    wd.mkdir()
    request = {"action": "lock", "workdir": str(wd), "op": "acquire", "wait": 0.0}
    request["holder"] = {"who": "me@here", "command": "dflashops deploy", "controller_pid": 1}
    lock.check(request)
    assert lock.run(request)["ok"]
    yield wd
    os.close(lock.HELD.pop(str(wd)))


def unit(wd: Path, name: str, version: int) -> None:
    folder = wd / "units" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "launch.sh").write_text(f"#!/bin/bash\necho {name} v{version}\n")
    record = {"unit": name, "fingerprint": f"{name}-fp{version}"}
    (folder / "unit.json").write_text(json.dumps(record))


def call(wd: Path, **request: object) -> dict[str, object]:
    request["workdir"] = str(wd)
    host.check(request)
    return host.run(request)


def record(wd: Path, units: dict[str, str | None], rollback_to: int | None = None) -> int:
    got = call(
        wd,
        op="record",
        command="dflashops deploy",
        who="me@here",
        units=units,
        rollback_to=rollback_to,
    )
    assert got["ok"], got
    return int(got["revision"])  # type: ignore[call-overload]


def listing(wd: Path) -> HistoryAnswer:
    return HistoryAnswer.model_validate(call(wd, op="list"))


def test_revisions_are_monotonic_name_only_what_changed_and_keep_ten_scripts(workdir: Path) -> None:
    unit(workdir, "web-0", 1)
    unit(workdir, "gen", 1)
    assert record(workdir, {"web-0": "web-0-fp1", "gen": "gen-fp1"}) == 1
    for version in range(2, 13):
        unit(workdir, "web-0", version)
        assert record(workdir, {"web-0": f"web-0-fp{version}"}) == version
    revs = listing(workdir).revisions
    assert [r.revision for r in revs] == list(range(12, 0, -1))  # newest first, all on record
    assert [r.revision for r in revs if r.scripts] == list(range(12, 2, -1))  # the last 10
    assert not (workdir / "history" / "2" / "units").exists()
    assert revs[0].units == {"web-0": "web-0-fp12"}  # gen did not change: not named
    assert set(revs[0].kept) == {"web-0", "gen"}  # but its script is kept with the revision
    kept = workdir / "history" / "12" / "units" / "web-0" / "launch.sh"
    assert kept.read_text() == (workdir / "units" / "web-0" / "launch.sh").read_text()
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    # Pruning never reuses a number: the next one is still one more than the newest.
    assert record(workdir, {"gen": "gen-fp1"}) == 13


def test_record_and_restore_need_the_deploy_lock(tmp_path: Path) -> None:
    unit(tmp_path, "web-0", 1)
    got = call(tmp_path, op="record", command="c", who="w", units={"web-0": "x"})
    assert not got["ok"] and "does not hold the host's deploy lock" in str(got["error"])
    assert not (tmp_path / "history").exists()
    got = call(tmp_path, op="restore", revision=1, names=["web-0"])
    assert not got["ok"]


def test_restore_puts_kept_files_back_and_refuses_a_tampered_copy(workdir: Path) -> None:
    unit(workdir, "web-0", 1)
    record(workdir, {"web-0": "web-0-fp1"})
    unit(workdir, "web-0", 2)
    record(workdir, {"web-0": "web-0-fp2"})
    assert call(workdir, op="restore", revision=1, names=["web-0"])["ok"]
    assert "v1" in (workdir / "units" / "web-0" / "launch.sh").read_text()
    assert (
        json.loads((workdir / "units" / "web-0" / "unit.json").read_text())["fingerprint"]
        == "web-0-fp1"
    )
    (workdir / "history" / "2" / "units" / "web-0" / "launch.sh").write_text("rm -rf /\n")
    got = call(workdir, op="restore", revision=2, names=["web-0"])
    assert not got["ok"] and "nothing was restored" in str(got["error"])
    assert "v1" in (workdir / "units" / "web-0" / "launch.sh").read_text()  # untouched
    shown = HistoryAnswer.model_validate(call(workdir, op="show", revision=1))
    assert "v1" in shown.launch["web-0"]


def test_rolled_units_are_marked_by_a_rollback_and_cleared_by_the_next_change(
    workdir: Path,
) -> None:
    unit(workdir, "web-0", 1)
    record(workdir, {"web-0": "web-0-fp1"})
    record(workdir, {"web-0": "web-0-fp1"}, rollback_to=1)
    rolled = listing(workdir).rolled
    assert rolled["web-0"].revision == 1 and rolled["web-0"].by == 2
    assert rolled_back(rolled, "web-0", "web-0-fp1") == 1
    assert rolled_back(rolled, "web-0", "something-else") is None  # changed by hand since
    assert reapplies(rolled, {"web-0": "web-0-fp1"}, ["web-0", "gen"]) == ["web-0 (on revision 1)"]
    record(workdir, {"web-0": "web-0-fp2"})
    assert listing(workdir).rolled == {}


def revision(n: int, scripts: bool = True, **kept: str) -> Revision:
    return Revision.model_validate(
        {
            "revision": n,
            "units": dict.fromkeys(kept),
            "scripts": scripts,
            "kept": {k: {"fingerprint": None, "script_sha256": v} for k, v in kept.items()},
        }
    )


def test_pick_defaults_to_the_previous_revision_and_names_the_kept_ones() -> None:
    revs = [revision(5, web="b"), revision(4, web="a"), revision(3, scripts=False, web="z")]
    assert pick(revs, None, "h1") == revs[1]
    assert pick(revs, 5, "h1") == revs[0]
    assert pick(revs, 3, "h1") == (
        "revision 3 of h1 is no longer kept (its scripts were pruned); kept revisions: 4, 5"
    )
    assert pick(revs, 9, "h1") == "h1 has no revision 9 on record; kept revisions: 4, 5"
    assert "no previous one" in str(pick(revs[:1], None, "h1"))
    assert touching(revs, ["gen"]) == [] and touching(revs, ["web"]) == revs


def test_to_restart_names_the_units_whose_kept_script_differs() -> None:
    scripts: dict[str, str | None] = {"web-0": "a", "gen": "same"}
    target = revision(4, **{"web-0": "old", "gen": "same", "gone": "x"})
    assert to_restart(target, scripts, None) == ["gone", "web-0"]
    assert to_restart(target, scripts, ["web-0"]) == ["web-0"]


def test_the_recorded_command_line_is_redacted() -> None:
    def redact(text: str) -> str:
        return text.replace("s3cret", "***")

    argv = ["/venv/bin/dflashops", "deploy", "--host", "b200", "--token", "s3cret"]
    assert command_line(argv, "deploy", redact) == "dflashops deploy --host b200 --token ***"
    assert command_line(["pytest", "-q"], "stop", redact) == "dflashops stop"
