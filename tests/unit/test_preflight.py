"""Pre-flight through the real front ends, on the repo's examples and on broken fixtures.

Each folder in tests/fixtures/preflight/ is a small ops repo with one kind of mistake and an
expected.txt listing lines (or parts of lines) the report must contain.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tests.conftest import REPO, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "preflight"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


@pytest.mark.parametrize("case", CASES)
def test_broken_fixture_fails_with_precise_messages(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = run_cli(["preflight"], FIXTURES / case, capsys)
    assert code == 1, output
    for expected in (FIXTURES / case / "expected.txt").read_text().splitlines():
        assert expected in output, f"missing {expected!r} in:\n{output}"


def test_repo_examples_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run_cli(["preflight"], REPO, capsys)
    assert code == 0, output
    assert (
        "preflight passed: 19 units on 7 host(s) (b200, h100-a, h100-b, h200-a, h200-b and 2 more)"
        in output
    )


def test_host_filter_selects_playbooks(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run_cli(["preflight", "--host", "local"], REPO, capsys)
    assert code == 0, output
    assert "3 units on 1 host(s) (local)" in output


def test_unknown_host_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run_cli(["preflight", "--host", "b300"], REPO, capsys)
    assert code == 1
    assert "--host 'b300' is not in inventory.example.yaml" in output


def test_json_and_junit_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, xml = tmp_path / "out" / "preflight.json", tmp_path / "out" / "junit.xml"
    code, _ = run_cli(
        ["preflight", "--json", str(js), "--junit", str(xml)],
        FIXTURES / "syntax-error-script",
        capsys,
    )
    assert code == 1
    body = json.loads(js.read_text())
    assert body["ok"] is False and body["errors"] == 1
    [failed] = [c for c in body["checks"] if not c["ok"]]
    assert failed["check"] == "py-compile" and failed["line"] == 8
    assert failed["file"].endswith("scripts/generate_completions.py")
    root = ET.parse(xml).getroot()
    failures = root.findall(".//testcase/failure")
    assert len(failures) == 1 and "used prior to global declaration" in (failures[0].text or "")
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert (
        suites["py-compile"].get("failures") == "1" and suites["bash-syntax"].get("failures") == "0"
    )


def test_broken_user_template_fails_bash_syntax(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "templates").mkdir()
    (tmp_path / "inventory.yaml").write_text("hosts:\n  l: {connection: local, gpus: 1}\n")
    (tmp_path / "playbooks" / "p.yaml").write_text(
        "name: p\nhosts: l\njobs:\n  - {name: j, command: [echo]}\n"
    )
    (tmp_path / "templates" / "job.sh.j2").write_text(
        '{% extends "_unit.sh.j2" %}\n{% block prelude %}\nif [[ x ]; then\n{% endblock %}\n'
    )
    code, output = run_cli(["preflight"], tmp_path, capsys)
    assert code == 1
    assert (
        "FAIL bash-syntax: playbooks/p.yaml:4:5: jobs[0]: [l] j: rendered launch script does not parse (bash -n)"
        in output
    )


def test_render_writes_scripts_for_review(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = run_cli(["render", "--host", "pro6000", "--out", str(tmp_path)], REPO, capsys)
    assert code == 0, output
    written = sorted(p.name for p in (tmp_path / "pro6000").iterdir())
    assert written == ["monitor.sh", "train.sh", "vllm-0.sh"]
    vllm = (tmp_path / "pro6000" / "vllm-0.sh").read_text()
    assert (
        "--tensor-parallel-size 2 --data-parallel-size 1" in vllm
        and "CUDA_VISIBLE_DEVICES=0,1" in vllm
    )
    code, output = run_cli(["render", "--host", "local"], REPO, capsys)
    assert code == 0 and "# ---- local/stub-0 (fingerprint" in output and "exec python3" in output


def test_render_refuses_broken_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run_cli(["render"], FIXTURES / "gpu-oversubscribed", capsys)
    assert code == 1 and "nothing rendered" in output and "has 4" in output


def test_schema_describes_both_files(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run_cli(["schema"], REPO, capsys)
    assert code == 0
    body = json.loads(output)
    assert body["inventory"]["title"] == "InventoryFile"
    services = json.dumps(body["playbook"])
    assert "Tensor parallel size per replica." in services and "additionalProperties" in services


def test_console_script_and_invoke_agree() -> None:
    """Both front ends, as installed: same verdict, same exit code."""
    fixture = FIXTURES / "gpu-oversubscribed"
    bindir = Path(sys.executable).parent
    cli = subprocess.run(
        [str(bindir / "dflashops"), "preflight"],
        cwd=fixture,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 1 and "has 4" in cli.stdout
    inv = subprocess.run(
        [
            str(bindir / "invoke"),
            "-r",
            str(REPO),
            "preflight",
            "-i",
            str(fixture / "inventory.yaml"),
            "-p",
            str(fixture / "playbooks" / "serve.yaml"),
        ],
        cwd=fixture,
        capture_output=True,
        text=True,
        check=False,
    )
    assert inv.returncode == 1 and "has 4" in inv.stdout, inv.stderr
    ok = subprocess.run(
        [str(bindir / "invoke"), "preflight", "--host", "local"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0 and "preflight passed" in ok.stdout, ok.stdout + ok.stderr
