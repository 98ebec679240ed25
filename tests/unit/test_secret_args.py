"""secret_args (DESIGN trust 4): each engine's way without argv, the 0600 files' content, the
Bearer key of probes, and redaction: events recursively, the webhook tail whole."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from dflashops.agent.remote import supervisor
from dflashops.changes.verdicts import auth_headers, unit_record
from dflashops.config.load import load_playbook
from dflashops.engines import secrets
from dflashops.errors import ConfigError
from dflashops.events import EventLog
from tests.conftest import WriteTree
from tests.fakes import harness
from tests.unit.test_render import render, run_script

KEY = "sk-h5-0123456789-abcdef"
BOOK = """
name: p
hosts: h
services:
  - {name: sg, engine: sglang, model: /m, port: 30000, secret_args: {api-key: CTL_KEY}}
  - name: vl
    engine: vllm
    model: /m
    port: 8000
    secret_args: {api-key: CTL_KEY, hf-token: CTL_HF}
    liveness: {path: /v1/models}
  - name: cmd
    engine: command
    command: [python3, -c, "import sys, json; print(json.dumps(sys.argv[1:]))"]
    port: 9000
    secret_args: {api-key: CTL_KEY}
    liveness: {path: /health}
jobs:
  - {name: j, command: [echo], servers: sg, secret_args: {token: CTL_KEY}}
"""


def test_each_engine_gets_the_key_its_own_way_never_as_a_value_in_argv(
    write_tree: WriteTree,
) -> None:
    units = render(write_tree, BOOK)
    sg, vl, cmd, job = units["sg-0"], units["vl-0"], units["cmd-0"], units["j"]
    assert sg.launch.argv[-2:] == ["--config", secrets.UnitFile("secret-args.yaml")]
    assert '--config "$DFLASHOPS_UNIT_DIR"/secret-args.yaml\n' in sg.script
    # vLLM: VLLM_API_KEY in secrets.env and never --api-key too (it would win); other flags
    # through vLLM's own --config.
    assert vl.launch.secrets.env == {"VLLM_API_KEY": "CTL_KEY"}
    assert vl.launch.secrets.config == {"hf-token": "CTL_HF"}
    assert "--api-key" not in vl.script and '. "$DFLASHOPS_UNIT_DIR/secrets.env"' in vl.script
    # Any other program: read from secret-args.env into the flag at exec time.
    assert "exec python3 -c" in cmd.script and '--api-key "$DFLASHOPS_SECRET_ARG_0"' in cmd.script
    assert '. "$DFLASHOPS_UNIT_DIR/secret-args.env"' in cmd.script
    # A job's --servers stays last.
    assert job.script.rstrip().endswith(
        'exec echo --token "$DFLASHOPS_SECRET_ARG_0" --servers http://127.0.0.1:30000'
    )
    for r in units.values():
        assert KEY not in r.script and "CTL_KEY" not in r.script.split("exec")[-1]


def test_unit_records_name_where_the_key_is_never_the_key(
    write_tree: WriteTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTL_KEY", KEY)
    units = render(write_tree, BOOK)
    vl, cmd = units["vl-0"], units["cmd-0"]
    record = json.dumps(unit_record(vl)) + json.dumps(unit_record(cmd))
    assert KEY not in record
    assert unit_record(vl)["supervise"]["liveness"]["bearer"] == {
        "file": "secrets.env",
        "name": "VLLM_API_KEY",
    }
    assert unit_record(cmd)["supervise"]["liveness"]["bearer"] == {
        "file": "secret-args.env",
        "name": "DFLASHOPS_SECRET_ARG_0",
    }
    # The controller's probes: the key from its environment, as the run resolved it.
    assert auth_headers(vl, {"CTL_KEY": KEY}) == {"Authorization": f"Bearer {KEY}"}
    assert auth_headers(vl, {}) == {}


def test_secret_files_carry_values_that_yaml_and_bash_read_back(tmp_path: Path) -> None:
    value = 'it\'s "quoted"\nover two lines: {x} $HOME `id` ü'
    environ = {"A": value, "B": "plain-value"}
    files = secrets.files(
        secrets.SecretArgs(env={"VLLM_API_KEY": "A"}, config={"api-key": "A", "x-token": "B"}),
        {"HF_TOKEN": "B"},
        environ,
    )
    assert set(files) == {"secrets.env", "secret-args.yaml"}
    # SGLang and vLLM read --config with yaml.safe_load; flag names with dashes.
    assert yaml.safe_load(files["secret-args.yaml"]) == {"api-key": value, "x-token": "plain-value"}
    (tmp_path / "secrets.env").write_bytes(files["secrets.env"])
    got = subprocess.run(
        ["bash", "-c", 'set -a; . ./secrets.env; printf %s "$VLLM_API_KEY"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert got == value
    # The supervisor reads the very same files back (its liveness key, its redactions).
    (tmp_path / "secret-args.yaml").write_bytes(files["secret-args.yaml"])
    assert supervisor.secret_file(str(tmp_path), "secret-args.yaml")["api-key"] == value
    assert supervisor.secret_file(str(tmp_path), "secrets.env") == {
        "HF_TOKEN": "plain-value",
        "VLLM_API_KEY": value,
    }


def test_the_launch_script_passes_the_value_it_read_at_exec_time(
    write_tree: WriteTree, tmp_path: Path
) -> None:
    r = render(write_tree, BOOK)["cmd-0"]
    proc = run_script(tmp_path, r)
    assert proc.returncode == 78 and "secret-args.env is missing" in proc.stderr
    assert "CTL_KEY" in proc.stderr
    unit_dir = tmp_path / "workdir" / "units" / "cmd-0"
    files = secrets.files(r.launch.secrets, {}, {"CTL_KEY": "two words\nand a line"})
    (unit_dir / "secret-args.env").write_bytes(files["secret-args.env"])
    proc = subprocess.run(["bash", str(unit_dir / "launch.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ["--api-key", "two words\nand a line"]
    # The banner's exec line shows where the value comes from, not the value.
    assert (
        '--api-key "$DFLASHOPS_SECRET_ARG_0"' in proc.stdout
        and "two words" not in (proc.stdout.splitlines()[1])
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "  - {name: s, engine: sglang, model: /m, args: {api-key: x}, secret_args: {api-key: K}}",
            "flags set in both args and secret_args: api-key",
        ),
        (
            "  - {name: s, engine: sglang, model: /m, secret_args: {--api-key: K}}",
            "is not a flag name",
        ),
        (
            "  - {name: s, engine: vllm, model: /m, env: {VLLM_API_KEY: x}, secret_args: {api-key: K}}",
            "delivered as VLLM_API_KEY",
        ),
        (
            "  - {name: s, engine: sglang, model: /m, secret_args: {api-key: 'no-such$'}}",
            "not a valid environment variable name",
        ),
    ],
)
def test_secret_args_config_errors(write_tree: WriteTree, body: str, message: str) -> None:
    root = write_tree({"pb.yaml": f"name: p\nhosts: h\nservices:\n{body}\n"})
    with pytest.raises(ConfigError) as err:
        load_playbook(root / "pb.yaml")
    assert message in str(err.value)


def test_a_config_arg_and_secret_args_cannot_share_the_engines_one_config_file(
    write_tree: WriteTree,
) -> None:
    from dflashops.config.load import load_inventory
    from dflashops.engines.render import render_plan
    from dflashops.plan import build_plan
    from tests.unit.test_render import INVENTORY

    root = write_tree(
        {
            "inventory.yaml": INVENTORY,
            "p.yaml": "name: p\nhosts: h\nservices:\n  - {name: s, engine: sglang, model: /m, "
            "args: {config: /etc/s.yaml}, secret_args: {api-key: K}}\n",
        }
    )
    plan = build_plan(load_inventory(root / "inventory.yaml"), [load_playbook(root / "p.yaml")])
    _, problems = render_plan(plan, [])
    assert any("one --config file" in str(p) and "p.yaml:4:" in str(p) for p in problems), problems


@pytest.mark.parametrize(
    ("flag", "secret"),
    [
        ("api-key", True),
        ("admin-api-key", True),
        ("hf-token", True),
        ("hf_token", True),
        ("ssl-keyfile-password", True),
        ("client-secret", True),
        ("token", True),
        ("max-new-tokens", False),
        ("tokenizer-path", False),
        ("api-key-env", False),
        ("speculative-num-draft-tokens", False),
    ],
)
def test_secret_looking_flags(flag: str, secret: bool) -> None:
    assert secrets.looks_secret(flag) is secret


def test_events_redact_every_string_of_the_event_not_its_json_text(tmp_path: Path) -> None:
    """A secret with a quote, a backslash or a newline is escaped in JSON text: a regex over
    that text misses it (today's leak); redacting the values finds it."""
    secret = 'pa"ss\\word\nline-2'
    log = EventLog(Console(file=io.StringIO()), str(tmp_path / "events.jsonl"))
    log.add_secrets([secret])
    log.emit(
        "h",
        "u",
        "failed",
        "start",
        f"boom {secret}",
        detail={"nested": [f"x {secret} y", ("t", secret)], secret: 1, "n": 3, "p": Path("/a")},
    )
    log.close()
    text = (tmp_path / "events.jsonl").read_text()
    event = json.loads(text)
    assert secret not in json.dumps(event) and json.dumps(secret)[1:-1] not in text
    assert event["data"]["detail"] == {
        "nested": ["x *** y", ["t", "***"]],
        "***": 1,
        "n": 3,
        "p": "/a",
    }
    assert event["message"] == "boom ***"


def test_the_webhook_tail_loses_every_secret_a_multi_line_one_too(tmp_path: Path) -> None:
    """Today one value over two lines makes secrets.env unreadable as lines: the webhook then
    redacts none of the unit's secrets."""
    multi = "first-line-aaaa\nsecond-line-bbbb"
    (tmp_path / "secrets.env").write_text(
        f"MULTI='{multi}'\nTOKEN=tok-9f8e7d6c5b\n", encoding="utf-8"
    )
    (tmp_path / "secret-args.yaml").write_text(json.dumps({"api-key": KEY}))
    found = supervisor.secret_values(str(tmp_path))
    assert sorted(found) == sorted([multi, "tok-9f8e7d6c5b", KEY])
    tail = ["start", *f"printed {multi} here".splitlines(), f"key {KEY}", "tok-9f8e7d6c5b"]
    tail += ["second-line-bbbb alone (the tail began inside the value)"]
    out = supervisor.redact_lines(tail, found)
    text = "\n".join(out)
    for piece in ("first-line-aaaa", "second-line-bbbb", KEY, "tok-9f8e7d6c5b"):
        assert piece not in text, out
    assert out[:2] == ["start", "printed *** here"]


def test_a_fifo_in_place_of_a_secret_file_does_not_hang_the_supervisor(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "secrets.env", 0o600)
    assert supervisor.secret_file(str(tmp_path), "secrets.env") == {}


def test_the_stub_reads_sglangs_config_file_and_the_command_line_wins(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("stub", harness.STUB)
    assert spec is not None and spec.loader is not None
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    config = tmp_path / "secret-args.yaml"
    config.write_text(json.dumps({"api-key": KEY, "log_level": "debug", "enable-metrics": True}))
    argv = ["--model-path", "/m", "--config", str(config), "--log-level", "info"]
    merged = stub.with_config(argv)
    assert merged == [
        "--api-key", KEY, "--log-level", "debug", "--enable-metrics",
        "--model-path", "/m", "--log-level", "info",
    ]  # fmt: skip
    args = stub.build_parser().parse_args(merged)
    assert args.api_key == KEY and args.log_level == "info" and args.enable_metrics
