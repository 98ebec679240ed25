"""The CLI at 3 a.m. (DESIGN.md "Operating under pressure", issue 21) against the sshd fleet:
looking and stopping work while a playbook is half-edited, `status --json` is data on stdout,
`--json -` keeps stdout to the JSON, and a restarted unit's row keeps its last exit with its
restarts column agreeing with its health text."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from fleet import FleetFactory
from lifecycle_helpers import (
    Ops,
    engine_pid,
    foreign_process,
    job,
    stub,
    unit_dir,
    unit_processes,
)

from dflashops.cli import main
from tests.procs import alive, free_ports, http_status, wait_for

# A YAML syntax error on line 4 of wip.yaml (the line that is wrong).
HALF_EDITED = "name: wip\nhosts: a\nservices:\n  - name: [oops\n"
SLEEPER = ["/usr/bin/python3", "-c", "import time; time.sleep(300)"]


def cli(ctl: Ops, *argv: str) -> tuple[int, str, str]:
    """`dflashops ARGV -i INVENTORY` with stdout and stderr apart: (code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "-i", str(ctl.inventory)])
    print(f"$ dflashops {' '.join(argv)} -> {code}\n{out.getvalue()}\n{err.getvalue()}")
    return code, out.getvalue(), err.getvalue()


def status_doc(ctl: Ops, *argv: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(ctl, "status", "--json", "-", *argv)
    return code, json.loads(out), err  # one JSON document, nothing else on stdout


def healthy(port: int) -> bool:
    try:
        return http_status(port, "/health", timeout=1) == 200
    except OSError:  # refused while it restarts
        return False


def seconds(iso: str) -> int:
    return int(datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").timestamp())


def rows_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["unit"]: row for row in doc["units"]}


def test_a_half_edited_playbook_never_blocks_looking_or_stopping(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(a={"gpus": 2})
    host = fleet["a"]
    ctl = ops(fleet)
    port = free_ports(2)
    ctl.playbook("good", {"hosts": "a", "services": [stub("good", port, gpus=[0])]})
    wip = ctl.playbook("wip", {"hosts": "a", "services": [stub("wip", port + 1, gpus=[1])]})
    assert ctl.run("deploy").code == 0
    wip.write_text(HALF_EDITED)  # the typo, while both run
    warning = f"WARN {wip}:4: does not load ("

    with foreign_process(SLEEPER) as foreign:
        # status: the good playbook's unit probed as usual, wip's from what the host records.
        code, doc, err = status_doc(ctl)
        assert warning in err and "showing what the hosts record, on every inventory host" in err
        rows = rows_of(doc)
        assert rows["good-0"]["state"] == "ready" and rows["good-0"]["source"] == "playbook"
        assert rows["wip-0"]["state"] == "running" and rows["wip-0"]["source"] == "host record"
        assert rows["wip-0"]["pid"] and rows["wip-0"]["port"] == port + 1, rows["wip-0"]
        assert doc["warnings"] and f"{wip}:4: does not load" in doc["warnings"][0]
        assert code == 0, err

        # top and logs look too.
        code, out, err = cli(ctl, "top", "--once")
        assert code == 0 and warning in out and "good-0" in out and "wip-0" in out, out
        code, out, err = cli(ctl, "logs", "wip-0", "-n", "5")
        assert code == 0 and "wip-0" in out and warning in out, out

        # Deploy-like commands still refuse, and say why.
        res = ctl.run("deploy", playbooks=[])
        assert res.code == 1 and "pre-flight failed" in res.out, res.explain()
        assert healthy(port + 1)  # nothing was touched

        # stop: exactly the units the host records, never another process.
        res = ctl.run("stop", playbooks=[])
        assert res.code == 0, res.explain()
        assert f"{wip}:4: does not load (" in res.out
        assert "stopping what the hosts record" in res.out
        stopped = {e["unit"] for e in res.of(action="stop", status="changed")}
        assert stopped == {"good-0", "wip-0"}, res.explain()
        assert unit_processes(host) == []
        assert alive(foreign)


def test_a_template_error_names_its_playbook_and_status_still_shows_the_host(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """A playbook that loads but does not render (an undefined variable) blocks no look; with
    --host the warning does not claim every inventory host."""
    fleet = fleet_factory(t={"gpus": 1})
    ctl = ops(fleet)
    ctl.playbook("jobs", {"hosts": "t", "jobs": [job("tick", "sleep 60")]})
    assert ctl.run("deploy").code == 0
    bad = ctl.base / "playbooks" / "bad.yaml"
    bad.write_text(
        "name: bad\nhosts: t\njobs:\n  - name: x\n    command: [echo, '{{ nowhere }}']\n"
    )
    code, doc, err = status_doc(ctl, "--host", "t")
    assert f"WARN {bad}:" in err and "does not load (" in err, err
    assert "every inventory host" not in err, err
    assert rows_of(doc)["tick"]["state"] == "running", doc
    assert [h["host"] for h in doc["hosts"]] == ["t"] and doc["hosts"][0]["reachable"]
    assert code == 0


def test_a_broken_inventory_stops_every_command_with_its_file_and_line(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n  a: {address: 127.0.0.1\n")
    (tmp_path / "playbooks").mkdir()
    for command in ("status", "stop"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([command, "-i", str(inventory)])
        assert code == 1 and f"{inventory}:" in err.getvalue(), err.getvalue()


def test_status_json_is_raw_data_and_a_restart_keeps_its_last_exit(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(r={"gpus": 1})
    host = fleet["r"]
    ctl = ops(fleet)
    port = free_ports(1)
    backoff = {"initial": "4s", "max": "4s"}
    ctl.playbook("p", {"hosts": "r", "services": [stub("svc", port, restart_backoff=backoff)]})
    assert ctl.run("deploy").code == 0

    code, doc, _ = status_doc(ctl)
    row = rows_of(doc)["svc-0"]
    assert code == 0 and doc["ok"] is True and doc["schema"] == 1
    (seen,) = doc["hosts"]
    assert (seen["host"], seen["reachable"], seen["state"], seen["error"]) == (
        "r",
        True,
        "ok",
        None,
    )
    assert seen["time"].endswith("Z"), seen
    assert isinstance(row["uptime_s"], int) and row["started_at"].endswith("Z"), row
    assert row["fingerprint"]["match"] is True and row["http_status"] == 200, row
    assert row["restarts"] == 0 and row["last_exit"] is None, row
    assert row["gpus"] == [{"index": 0, "used_bytes": row["gpus"][0]["used_bytes"], "util_pct": 0}]
    assert isinstance(row["gpus"][0]["used_bytes"], int)

    first = engine_pid(host, "svc-0")
    os.kill(first, signal.SIGKILL)
    supervisor = unit_dir(host, "svc-0") / "supervisor.json"
    wait_for("the backoff", lambda: '"backoff"' in supervisor.read_text())
    # In the backoff: the column and the health text say the same number.
    _, doc, err = status_doc(ctl)
    row = rows_of(doc)["svc-0"]
    assert row["state"] == "restarting" and row["restarts"] == 1, row
    assert row["health"].startswith("restart 1, last exit code 137 (SIGKILL) "), row
    assert row["last_exit"]["code"] == 137 and row["last_exit"]["signal"] == "SIGKILL", row

    wait_for("the restart", lambda: healthy(port), timeout=30)
    # Restarted and ready: the row keeps the last exit, the table shows it.
    _, doc, err = status_doc(ctl)
    row = rows_of(doc)["svc-0"]
    assert row["state"] == "ready" and row["restarts"] == 1, row
    assert row["last_exit"]["code"] == 137 and row["last_exit"]["time"].endswith("Z"), row
    assert row["uptime_s"] <= seconds(doc["time"]) - seconds(row["last_exit"]["time"]), row
    assert "code 137 (SIGKILL)" in err and " ago" in err, err

    # The same document in FILE (the times aside), and the table on stdout then.
    path = ctl.base / "status.json"
    code, out, _ = cli(ctl, "status", "--json", str(path))
    written = json.loads(path.read_text())
    assert code == 0 and "svc-0" in out and "code 137 (SIGKILL)" in out
    assert rows_of(written)["svc-0"]["last_exit"] == row["last_exit"]
    assert set(written) == set(doc) and set(rows_of(written)["svc-0"]) == set(row)


def test_json_dash_keeps_stdout_to_the_json(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(j={"gpus": 1})
    ctl = ops(fleet)
    ctl.playbook("p", {"hosts": "j", "services": [stub("svc", free_ports(1))]})
    for command in ("deploy", "stop"):
        code, out, err = cli(ctl, command, "--json", "-")
        events = [json.loads(line) for line in out.splitlines()]  # every line is an event
        assert code == 0 and events and "RECAP" in err, (out, err)
        assert any(e["unit"] == "svc-0" and e["status"] == "changed" for e in events), events
    code, out, err = cli(ctl, "preflight", "--json", "-")
    report = json.loads(out)  # the whole of stdout is the report; the summary is on stderr
    assert code == 0 and report["ok"] is True and "preflight passed" in err, (out, err)
    assert not Path("-").exists()


def test_status_unit_shows_those_units_and_says_what_else_there_is(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(u={"gpus": 2})
    ctl = ops(fleet)
    port = free_ports(2)
    service = stub("echo", port, gpus=[0, 1], replicas=2)
    ctl.playbook("p", {"hosts": "u", "services": [service], "jobs": [job("tick", "sleep 60")]})
    assert ctl.run("deploy").code == 0
    _, doc, _ = status_doc(ctl, "--unit", "tick")
    assert [r["unit"] for r in doc["units"]] == ["tick"]
    _, doc, _ = status_doc(ctl, "--unit", "echo")  # a service: all its replicas
    assert sorted(r["unit"] for r in doc["units"]) == ["echo-0", "echo-1"]
    code, _, err = cli(ctl, "status", "--unit", "ech")
    assert code == 1 and "did you mean 'echo'?" in err, err
