"""`keep:` in deploy and stop, through the CLI on a `connection: local` host: deploy restores a
kept job's lost outputs before it starts (--check says it would), mirrors once otherwise, stop
mirrors once; a `to` host that is not in the inventory fails the job at its file and line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import run_cli

JOB = "mkdir -p ../../out && echo run-$$ >> ../../out/a.jsonl"


def project(base: Path, keep: dict[str, Any]) -> None:
    (base / "playbooks").mkdir(exist_ok=True)
    (base / "wd").mkdir(exist_ok=True)
    (base / "inventory.yaml").write_text(
        yaml.safe_dump({"hosts": {"n": {"connection": "local", "workdir": "wd"}}})
    )
    job = {"name": "gen", "command": ["/bin/sh", "-c", JOB], "keep": keep}
    (base / "playbooks" / "p.yaml").write_text(
        yaml.safe_dump({"name": "p", "hosts": "n", "jobs": [job]})
    )


def events(path: Path) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return found


def done(base: Path, since: float) -> None:
    """The job's run started after ``since`` ended with exit 0."""
    exit_record = base / "wd" / "units" / "gen" / "exit"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if exit_record.exists() and exit_record.stat().st_mtime >= since:
            break
        time.sleep(0.05)
    assert json.loads(exit_record.read_text())["code"] == 0


def test_deploy_restores_before_the_start_and_stop_mirrors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project(tmp_path, {"paths": ["out/"]})
    log = tmp_path / "events.jsonl"
    out_file = tmp_path / "wd" / "out" / "a.jsonl"
    kept = tmp_path / ".dflashops" / "keep" / "n" / "gen" / "out" / "a.jsonl"

    since = time.time() - 1
    code, out = run_cli(["deploy", "--json", str(log)], tmp_path, capsys)
    assert code == 0, out
    done(tmp_path, since)
    first = out_file.read_text()
    code, out = run_cli(["deploy", "--json", str(log)], tmp_path, capsys)
    assert code == 0 and "ok=1 changed=0" in out, out  # a mirror changes no host
    (mirrored,) = [e for e in events(log) if e["action"] == "keep"]
    assert mirrored["status"] == "ok" and mirrored["data"]["kept_bytes"] == len(first)
    assert kept.read_text() == first

    out_file.unlink()  # the node lost its outputs
    code, out = run_cli(["deploy", "--rerun", "--check"], tmp_path, capsys)
    assert code == 0 and "gen would restore 1 file(s) (" in out, out
    assert not out_file.exists()
    since = time.time()
    code, out = run_cli(["deploy", "--rerun", "--json", str(log)], tmp_path, capsys)
    assert code == 0, out
    got = [(e["action"], e["status"]) for e in events(log) if e["unit"] == "gen"]
    assert got == [("restore", "changed"), ("start", "changed")], got
    done(tmp_path, since)
    second = out_file.read_text()
    assert second.startswith(first) and len(second.splitlines()) == 2  # resumed on it

    code, out = run_cli(["stop", "--json", str(log)], tmp_path, capsys)
    assert code == 0, out
    (mirrored,) = [e for e in events(log) if e["action"] == "keep"]
    assert mirrored["data"]["bytes_sent"] == len(second) - len(first)  # only the new line
    assert kept.read_text() == second


def test_a_keep_to_host_not_in_the_inventory_is_a_preflight_error_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project(tmp_path, {"paths": ["out/"], "to": "gone:/keep"})
    lines = (tmp_path / "playbooks" / "p.yaml").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "to: gone:/keep" in text)
    code, out = run_cli(["deploy"], tmp_path, capsys)
    assert code == 1, out  # pre-flight: nothing reaches the host
    assert (
        f"playbooks/p.yaml:{line}:5: jobs[0].keep.to: keep.to names 'gone', which is not a host "
        "of the inventory"
    ) in out, out
    assert not (tmp_path / "wd" / "units" / "gen").exists()


def test_a_running_job_may_shrink_its_file_a_stopped_ones_shrink_is_put_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The generator cuts a torn last line off its shard when it resumes: while the job runs,
    the copy follows the file down. With the job stopped, a shorter file lost something: the
    copy keeps the longer one, and the next start puts it back."""
    project(tmp_path, {"paths": ["out/"]})
    job = {"name": "gen", "command": ["sleep", "60"], "keep": {"paths": ["out/"]}}
    (tmp_path / "playbooks" / "p.yaml").write_text(
        yaml.safe_dump({"name": "p", "hosts": "n", "jobs": [job]})
    )
    out_file = tmp_path / "wd" / "out" / "a.jsonl"
    kept = tmp_path / ".dflashops" / "keep" / "n" / "gen" / "out" / "a.jsonl"
    out_file.parent.mkdir(parents=True)
    out_file.write_text('{"id": 1}\n{"id": 2}\n{"id": 3, "torn')
    try:
        assert run_cli(["deploy"], tmp_path, capsys)[0] == 0  # starts it: the copy takes it
        assert kept.read_text() == out_file.read_text()
        out_file.write_text('{"id": 1}\n{"id": 2}\n')  # what the job cut, while it runs
        assert run_cli(["deploy"], tmp_path, capsys)[0] == 0
        assert kept.read_text() == '{"id": 1}\n{"id": 2}\n'
    finally:
        code, out = run_cli(["stop"], tmp_path, capsys)
        assert code == 0, out
    out_file.write_text('{"id": 1}\n')  # lost with the job down
    code, out = run_cli(["stop"], tmp_path, capsys)  # its mirror leaves the copy as it is
    assert code == 0 and kept.read_text() == '{"id": 1}\n{"id": 2}\n', out
    try:
        code, out = run_cli(["deploy"], tmp_path, capsys)
        assert code == 0 and "gen restored 1 file(s)" in out, out
        assert out_file.read_text() == '{"id": 1}\n{"id": 2}\n'
    finally:
        run_cli(["stop"], tmp_path, capsys)
