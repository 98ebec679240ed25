"""Whole pre-flight runs kept by what they read (preflight/runcache.py).

An unchanged run is answered from the cache with exactly a full run's output (text, JSON,
JUnit). Every test that changes an input asserts two things: that pre-flight ran in full again
(``full_runs``), and that it gave that input's right result, so a cache that wrongly passes
fails here. A corrupt or unusable cache costs one warning and a full run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import dflashops
from dflashops import cache
from dflashops.config import reads
from dflashops.preflight import offline, runcache
from dflashops.preflight.report import Report
from tests.conftest import REPO, run_cli

PLAYBOOK = """\
name: p
hosts: fleet
services:
  - {name: s, engine: stub, model: m, replicas: 2, port: 31000, args: {mem-fraction-static: 0.8}}
  - {name: v, engine: vllm, model: /models/m, port: 32000, args: {not-a-vllm-flag: 1}}
jobs:
  - {name: j, script: ../scripts/job.py, needs: [s]}
"""
BROKEN_TEMPLATE = (
    '{% extends "_unit.sh.j2" %}\n{% block prelude %}\nif [[ x ]; then\n{% endblock %}\n'
)


def project(base: Path, inventory: str = "inventory.yaml") -> Path:
    """Three hosts with two stub servers, a vLLM server (whose unknown flag is a warning: a
    passing run with warnings is kept too) and a job shipping a script; an override folder
    that overrides nothing yet."""
    for folder in ("playbooks", "scripts", "templates"):
        (base / folder).mkdir(parents=True)
    (base / inventory).write_text(
        "hosts:\n"
        + "".join(f"  node0{i}: {{address: 127.0.1.{10 + i}, gpus: 4}}\n" for i in range(3))
        + "groups:\n  fleet: [node00, node01, node02]\n"
    )
    (base / "playbooks" / "p.yaml").write_text(PLAYBOOK)
    (base / "scripts" / "job.py").write_text('print("ok")\n')
    (base / "templates" / "README").write_text("launch template overrides\n")
    return base


@pytest.fixture
def full_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per pre-flight that really loaded, planned and rendered."""
    calls: list[int] = []
    real = offline.run_preflight

    def counted(*args: object, **kwargs: object) -> Report:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(offline, "run_preflight", counted)
    return calls


def entries(own_cache: Path) -> list[Path]:
    return sorted((own_cache / "preflight-runs").glob("*.json"))


@pytest.mark.parametrize("spread_from", [offline.SPREAD_FROM, 1])  # serial; over 2 cores
def test_an_unchanged_run_is_answered_with_a_full_runs_exact_output(
    tmp_path: Path,
    full_runs: list[int],
    spread_from: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(offline, "SPREAD_FROM", spread_from)
    monkeypatch.setattr(offline, "cores", lambda: 2)
    base = project(tmp_path / "p")
    outputs = []
    for n in (1, 2, 3):
        args = ["preflight", "--json", f"out{n}.json", "--junit", f"out{n}.xml"]
        code, text = run_cli(args, base, capsys)
        assert code == 0, text
        outputs.append(text)
    assert len(full_runs) == 1, "the second and third runs read nothing but the cache"
    assert outputs[0] == outputs[1] == outputs[2]
    assert "12 units on 3 host(s) (node00, node01, node02)" in outputs[1]
    assert outputs[1].count("WARN vllm-flags") == 3
    for ext in ("json", "xml"):
        full = (base / f"out1.{ext}").read_text()
        assert full == (base / f"out2.{ext}").read_text() == (base / f"out3.{ext}").read_text()
    assert '"warnings": 3' in (base / "out2.json").read_text()


def test_a_changed_playbook_byte_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    book = base / "playbooks" / "p.yaml"
    book.write_text(book.read_text().replace("mem-fraction-static", "mem-fraction-statik"))
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and out.count("SGLang 0.5.23 does not accept --mem-fraction-statik") == 6


def test_a_new_playbook_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    (base / "playbooks" / "q.yaml").write_text(
        "name: q\nhosts: node01\nservices:\n  - {name: t, engine: stub, model: m, port: 33000}\n"
    )
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 0 and "13 units on 3 host(s)" in out, out


def test_a_changed_template_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    override = base / "templates" / "stub.sh.j2"
    override.write_text('{% extends "_unit.sh.j2" %}\n')
    assert run_cli(["preflight"], base, capsys)[0] == 0
    override.write_text(BROKEN_TEMPLATE)
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and out.count("FAIL bash-syntax") == 6, out


def test_a_new_override_template_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """The override folder was there, the template was not: the miss was a fact too."""
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert len(full_runs) == 1
    (base / "templates" / "stub.sh.j2").write_text(BROKEN_TEMPLATE)
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and out.count("FAIL bash-syntax") == 6, out


def test_a_new_override_folder_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    (base / "playbooks" / "templates").mkdir()
    (base / "playbooks" / "templates" / "vllm.sh.j2").write_text(BROKEN_TEMPLATE)
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and out.count("FAIL bash-syntax") == 3, out


def test_a_shipped_script_with_a_syntax_error_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    (base / "scripts" / "job.py").write_text("def f(:\n    pass\n")
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and "FAIL py-compile" in out and "SyntaxError" in out, out


def test_a_shipped_script_whose_compile_pass_was_kept_is_still_an_input(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """The second run compiles nothing (the pass is kept by the script's sha256): what it
    ships is an input all the same."""
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    book = base / "playbooks" / "p.yaml"
    book.write_text(book.read_text().replace("replicas: 2", "replicas: 1"))
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0 and "9 units on 3 host(s)" in out and len(full_runs) == 2, out
    (base / "scripts" / "job.py").write_text("def f(:\n    pass\n")
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 3
    assert code == 1 and "FAIL py-compile" in out and "SyntaxError" in out, out


def test_another_host_selection_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    code, out = run_cli(["preflight", "--host", "node00"], base, capsys)
    assert code == 0 and "4 units on 1 host(s) (node00)" in out, out
    code, out = run_cli(["preflight", "--host", "node01"], base, capsys)
    assert code == 0 and "4 units on 1 host(s) (node01)" in out, out
    assert len(full_runs) == 2
    code, out = run_cli(["preflight", "--host", "node00"], base, capsys)
    assert code == 0 and "4 units on 1 host(s) (node00)" in out, out
    assert len(full_runs) == 2, "each selection has its own entry"
    code, out = run_cli(["preflight", "-p", "playbooks/p.yaml", "--host", "node00"], base, capsys)
    assert code == 0 and len(full_runs) == 3


def test_the_inventory_found_by_default_is_an_input(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p", inventory="inventory.example.yaml")
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0 and "12 units on 3 host(s)" in out, out
    (base / "inventory.yaml").write_text(
        "hosts:\n  node00: {address: 127.0.1.10, gpus: 4}\ngroups:\n  fleet: [node00]\n"
    )
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 0 and "4 units on 1 host(s) (node00)" in out, out


def test_a_files_source_removed_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    (base / "data.txt").write_text("prompts\n")
    book = base / "playbooks" / "p.yaml"
    book.write_text(
        book.read_text().replace("services:", "files:\n  - {src: ../data.txt, dest: /d}\nservices:")
    )
    assert run_cli(["preflight"], base, capsys)[0] == 0
    (base / "data.txt").unlink()
    code, out = run_cli(["preflight"], base, capsys)
    assert len(full_runs) == 2
    assert code == 1 and "'../data.txt' not found" in out, out


def test_a_changed_wheel_runs_again(
    tmp_path: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """An environment's wheels are in its units' fingerprints: an input, by content."""
    base = project(tmp_path / "p")
    (base / "wheels").mkdir()
    (base / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"one")
    book = base / "playbooks" / "p.yaml"
    book.write_text(
        book.read_text()
        .replace(
            "services:",
            "environments:\n  e: {path: /e, packages: [a], wheels: ../wheels}\nservices:",
        )
        .replace("needs: [s]}", "needs: [s], environment: e}")
    )
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert len(full_runs) == 1
    (base / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"two")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert len(full_runs) == 2
    (base / "wheels" / "a-1.0-py3-none-any.whl").unlink()
    assert run_cli(["preflight"], base, capsys)[0] == 0  # an empty folder of wheels is allowed
    assert len(full_runs) == 3


def test_home_is_part_of_the_key(
    tmp_path: Path,
    full_runs: list[int],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``~/x.py`` is read from HOME: another HOME is another selection of files."""
    base = project(tmp_path / "p")
    assert run_cli(["preflight"], base, capsys)[0] == 0
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_cli(["preflight"], base, capsys)[0] == 0
    assert len(full_runs) == 2


def test_a_failing_run_is_never_kept(
    tmp_path: Path, own_cache: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    (base / "scripts" / "job.py").write_text("def f(:\n")
    for _ in range(2):
        assert run_cli(["preflight"], base, capsys)[0] == 1
    assert len(full_runs) == 2 and entries(own_cache) == []


def test_a_corrupt_entry_is_one_warning_and_a_full_run(
    tmp_path: Path, own_cache: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    code, first = run_cli(["preflight"], base, capsys)
    [entry] = entries(own_cache)
    data = bytearray(entry.read_bytes())
    data[-40] ^= 0x01  # one bit of a kept message: the body's sha256 no longer matches
    entry.write_bytes(bytes(data))
    cache._warned.clear()
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0 and len(full_runs) == 2
    assert out.count("warning: dflashops cache") == 1 and "not a kept pre-flight result" in out
    assert (
        out.startswith(first) and out[len(first) :].count("\n") == 1
    )  # the same, then the warning
    cache._warned.clear()
    code, out = run_cli(["preflight"], base, capsys)  # rewritten whole: used again
    assert (code, out, len(full_runs)) == (0, first, 2)


@pytest.mark.parametrize("garbage", [b"", b"not json\n{", b"x" * 64 + b"\n[]"])
def test_garbage_in_an_entry_is_never_a_result(
    tmp_path: Path,
    own_cache: Path,
    full_runs: list[int],
    garbage: bytes,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = project(tmp_path / "p")
    run_cli(["preflight"], base, capsys)
    [entry] = entries(own_cache)
    entry.write_bytes(garbage)
    cache._warned.clear()
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0 and len(full_runs) == 2 and out.count("warning: dflashops cache") == 1


def test_an_unusable_runs_folder_is_one_warning_and_a_full_run(
    tmp_path: Path, own_cache: Path, full_runs: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path / "p")
    (own_cache / "preflight-runs").write_text("a file where the folder would be\n")
    cache._warned.clear()
    for n in (1, 2):
        code, out = run_cli(["preflight"], base, capsys)
        assert code == 0 and "12 units on 3 host(s)" in out, out
        assert out.count("warning: dflashops cache") == (1 if n == 1 else 0)
    assert len(full_runs) == 2


def test_entries_are_bounded(
    tmp_path: Path,
    own_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(runcache, "KEEP", 2)
    base = project(tmp_path / "p")
    for host in ("node00", "node01", "node02"):
        assert run_cli(["preflight", "--host", host], base, capsys)[0] == 0
    assert len(entries(own_cache)) == 2
    assert not list((own_cache / "preflight-runs").glob(".run.*")), "no temporary file left"


def test_a_file_that_changes_while_it_is_read_is_not_kept(tmp_path: Path) -> None:
    """Facts are taken before the reader reads and all taken again before a run is kept."""
    path = tmp_path / "inventory.yaml"
    path.write_text("one\n")
    with reads.recording() as recorded:
        reads.look(path)
        path.write_text("two\n")  # after the fact was taken, before (or while) it is read
    assert reads.changed(recorded.facts) == str(path)
    report = Report(units=1)
    assert not runcache.keepable(report, recorded)
    with reads.recording() as again:
        reads.look(path)
        reads.known(path, "0" * 64)  # its reader hashed other bytes than the fact says
    assert again.unstable is not None and not runcache.keepable(report, again)
    assert reads.look(path) is None, "nothing is recorded outside a recording run"


def test_the_code_identity_covers_the_package_and_its_templates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of the package counts (code, flag lists), and the built-in templates beside
    it in a source checkout; bytecode does not."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "dflashops", copy / "dflashops", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copytree(REPO / "templates", copy / "templates")
    monkeypatch.setattr(dflashops, "__file__", str(copy / "dflashops" / "__init__.py"))
    seen = {runcache.code_identity()}
    (copy / "dflashops" / "__pycache__").mkdir(exist_ok=True)
    (copy / "dflashops" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    assert runcache.code_identity() in seen
    for changed in (
        "templates/_unit.sh.j2",
        "dflashops/data/sglang-flags.txt",
        "dflashops/plan/build.py",
    ):
        with (copy / changed).open("a") as f:
            f.write("\n")
        seen.add(runcache.code_identity())
    assert len(seen) == 4


def test_the_fixed_part_names_the_selection_and_the_working_folder(tmp_path: Path) -> None:
    key = runcache.RunKey("inventory.yaml")
    here = key.digest()
    assert here == key.digest() != runcache.RunKey("other.yaml").digest()
    assert here != runcache.RunKey("inventory.yaml", hosts=["node00"]).digest()
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # relative paths name other files there
        assert key.digest() != here
    finally:
        os.chdir(cwd)
