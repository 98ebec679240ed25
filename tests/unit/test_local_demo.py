"""The embedded default, as README's first command runs it: playbooks/demo.yaml on a
`connection: local` host (no SSH, no GPU): deploy, the generator finishes with progress in
status, a second deploy is all ok, stop cleans up and keeps the logs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflashops.cli import main
from tests.conftest import REPO
from tests.procs import free_ports


def test_local_demo_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "demo-key-3f9c2a"
    monkeypatch.setenv("DFLASHOPS_DEMO_API_KEY", key)  # what dev/demo.sh sets
    (tmp_path / "playbooks").mkdir()
    inventory = yaml.safe_load((REPO / "inventory.example.yaml").read_text())
    local = inventory["hosts"]["local"]
    (tmp_path / "inventory.yaml").write_text(
        yaml.safe_dump({"hosts": {"local": local}, "groups": {"demo": ["local"]}})
    )
    demo: dict[str, Any] = yaml.safe_load((REPO / "playbooks" / "demo.yaml").read_text())
    demo["services"][0]["port"] = free_ports(2)
    # The copy lives elsewhere: its controller paths point back into the repo.
    demo["environments"]["demo"]["wheels"] = str(REPO / "examples" / "wheels")
    demo["files"][0]["src"] = str(REPO / "examples" / "demo-prompts.jsonl")
    (tmp_path / "playbooks" / "demo.yaml").write_text(yaml.safe_dump(demo))
    common = ["-i", str(tmp_path / "inventory.yaml")]

    def cli(*args: str) -> str:
        code = main([*args, *common])
        out = capsys.readouterr().out
        assert code == 0, out
        return out

    try:
        out = cli("deploy", "--host", "local")
        assert "stub-0 ready and verified" in out and "generate started" in out
        assert "environment demo built with" in out and "files prompts -> " in out
        rows: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            cli("status", "--json", str(tmp_path / "status.json"))
            units = json.loads((tmp_path / "status.json").read_text())["units"]
            rows = {r["unit"]: r for r in units}
            if rows["generate"]["state"] != "running":
                break
            time.sleep(0.3)
        progress = rows["generate"]["progress"]
        assert rows["generate"]["state"] == "done" and progress is not None, rows
        assert (progress["done"], progress["total"]) == (40, 40), rows
        # The environment's console script runs from its path, as in a venv made there by hand.
        script = tmp_path / ".dflashops" / "local" / "venv-demo" / "bin" / "demo-tools"
        ran = subprocess.run([script], capture_output=True, text=True, check=False)
        assert ran.returncode == 0 and "the demo environment works: " in ran.stdout, ran
        assert ".builds/" in ran.stdout and "dflashops-tmp" not in ran.stdout, ran.stdout
        # The servers' key went through secret_args: on no command line on this machine.
        assert rows["stub-0"]["state"] == "ready", rows
        assert not [c for c in command_lines() if key in c], "the api key is in a command line"
        again = cli("deploy", "--host", "local")
        # 3 units, the environment and the prompts entry: all ok, nothing moved or rebuilt.
        assert "changed:" not in again and "ok=5 changed=0 failed=0" in again
    finally:
        stopped = cli("stop", "--host", "local")
    assert "stub-0 stopped" in stopped and "stub-1 stopped" in stopped
    workdir = tmp_path / ".dflashops" / "local"
    assert list((workdir / "units" / "stub-0" / "logs").glob("*.log"))
    completions = workdir / "units" / "generate" / "completions"
    assert sum(1 for shard in completions.glob("completions-*.jsonl") for _ in shard.open()) == 40
    assert (workdir / "venv-demo").is_symlink() and (
        workdir / "data" / "demo-prompts.jsonl"
    ).is_file()


def command_lines() -> list[str]:
    lines = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            lines.append((proc / "cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            continue  # ended meanwhile
    return lines
