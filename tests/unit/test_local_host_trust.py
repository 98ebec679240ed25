"""A `connection: local` host (DESIGN trust 4-5), deployed for real through the CLI: its units
get PATH, HOME, LANG and what is declared, not the controller's environment; an api-key of
secret_args reaches the stub through SGLang's --config and never its argv; the workdir and
everything in a unit's folder is the host user's alone (an existing 0755 workdir tightened)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflashops.cli import main
from tests.procs import free_port, group_members, http_status, mode, wait_for

KEY = "sk-local-5f1e2d3c4b5a-key"
AWS = "aws-secret-only-in-the-operators-shell"


def write_project(tmp_path: Path, port: int) -> Path:
    inventory = {
        "hosts": {
            "local": {
                "connection": "local",
                "gpus": 1,
                "workdir": ".dflashops/local",
                "python": "python3",
                "env": {"DECLARED_ON_HOST": "yes"},
            }
        }
    }
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    book: dict[str, Any] = {
        "name": "p",
        "hosts": "local",
        "services": [
            {
                "name": "stub",
                "engine": "stub",
                "model": "/m",
                "port": port,
                "ready": {"timeout": "30s", "interval": "0.2s"},
                "stop_grace": "2s",
                "secret_args": {"api-key": "CTL_KEY"},
            }
        ],
        "jobs": [
            {
                "name": "envdump",
                "command": ["bash", "-c", "env > env.tmp && mv env.tmp env.txt"],
                "stop_grace": "2s",
            }
        ],
    }
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "p.yaml").write_text(yaml.safe_dump(book))
    return tmp_path / "inventory.yaml"


def test_local_units_get_a_clean_environment_and_private_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS)
    monkeypatch.setenv("CTL_KEY", KEY)
    port = free_port()
    inventory = write_project(tmp_path, port)
    workdir = tmp_path / ".dflashops" / "local"
    workdir.mkdir(parents=True)
    os.chmod(workdir, 0o755)  # as an older dflashops left it
    events = tmp_path / "events.jsonl"

    def cli(*args: str) -> str:
        code = main([*args, "-i", str(inventory)])
        out = capsys.readouterr().out
        assert code == 0, out
        return out

    try:
        out = cli("deploy", "--host", "local", "--json", str(events))
        assert "stub-0 ready and verified" in out  # verification reads /server_info: with the key
        env_file = workdir / "units" / "envdump" / "env.txt"
        env = wait_for("the job's environment", lambda: env_file.is_file() and env_file.read_text())
        assert AWS not in env and "AWS_SECRET_ACCESS_KEY" not in env and "CTL_KEY" not in env
        assert "DECLARED_ON_HOST=yes" in env and "\nPATH=" in env and "\nHOME=" in env

        unit = workdir / "units" / "stub-0"
        supervisor = json.loads((unit / "pid").read_text())["pid"]
        engines = [p for p in group_members(supervisor) if p != supervisor]
        assert engines
        for pid in engines:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert KEY.encode() not in b" ".join(argv)
        assert any(a.endswith(b"/secret-args.yaml") for a in argv) and b"--config" in argv
        # The stub got the key from its --config file: it demands it.
        assert (
            http_status(port, "/v1/models", None) == 401
            and http_status(port, "/v1/models", KEY) == 200
        )
        assert AWS not in Path(f"/proc/{engines[0]}/environ").read_text(errors="replace")

        for text in (
            out,
            events.read_text(),
            (unit / "launch.sh").read_text(),
            (unit / "unit.json").read_text(),
            (unit / "logs" / "current.log").read_text(),
        ):
            assert KEY not in text
        assert mode(workdir) == 0o700 and mode(unit) == 0o700
        assert mode(unit / "launch.sh") == 0o700
        for name in ("unit.json", "secret-args.yaml", "pid"):
            assert mode(unit / name) == 0o600, name
        assert mode(unit / "logs") == 0o700
        assert {mode(p) for p in (unit / "logs").glob("*.log") if not p.is_symlink()} == {0o600}
    finally:
        cli("stop", "--host", "local")


def test_a_local_connection_passes_only_kept_and_declared_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dflashops.hosts.local import LocalConnection

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS)
    monkeypatch.setenv("LANG", "C.UTF-8")
    env = LocalConnection("local", {"DECLARED": "yes"}).run("env").out
    assert AWS not in env and "DECLARED=yes\n" in env and "LANG=C.UTF-8\n" in env


def test_deploy_diff_prints_the_hosts_launch_script_inert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deploy --check --diff` prints the launch script the host has: its escape sequences
    (a title change, a screen clear) are removed, its text stays."""
    monkeypatch.setenv("CTL_KEY", KEY)
    inventory = write_project(tmp_path, free_port())
    script = tmp_path / ".dflashops" / "local" / "units" / "stub-0" / "launch.sh"
    try:
        assert main(["deploy", "--host", "local", "-i", str(inventory)]) == 0
        with script.open("a") as f:
            f.write("# \x1b]0;pwned\x07tampered\x1b[2J on the host\n")
        capsys.readouterr()
        main(["deploy", "--check", "--diff", "--host", "local", "-i", str(inventory)])
        out = capsys.readouterr().out
        assert "# tampered on the host" in out, out
        assert "\x1b" not in out and "\x07" not in out, repr(out)
    finally:
        main(["stop", "--host", "local", "-i", str(inventory)])
