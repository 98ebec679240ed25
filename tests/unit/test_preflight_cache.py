"""Pre-flight at fleet scale: scripts checked once per shape, passes kept by content.

The shape (digits to 0, the fingerprint to a constant) must never change whether a script
parses: the first tests hold real ``bash -n`` verdicts on tricky scripts against the verdicts on
their shapes. Then the cache: a changed script is always checked again, a corrupt or unusable
cache folder costs one warning and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflashops import cache
from dflashops.preflight.bash_syntax import bash_n, check_scripts, shape
from dflashops.preflight.memo import Passed
from tests.conftest import run_cli

FP_DIGIT = "7" + "3f" * 31 + "a"  # a fingerprint that starts with a digit
FP_LETTER = "c" + "1e" * 31 + "9"

# Scripts where a digit decides something bash's grammar sees, valid and broken alike.
TRICKY = [
    "a1=(x y)\n",  # an array assignment: needs a name
    "1a=(x y)\n",  # not a name: a syntax error
    f"{FP_LETTER}=(x y)\n",
    f"{FP_DIGIT}=(x y)\n",
    "f9() { echo 1; }\n",
    "9f() { echo 1; }\n",  # bash accepts it: the shape must as well
    "echo x 2>&1 3>/dev/null\n",
    "exec 12<>/dev/null\n",
    "[[ -n1 ]]\n",
    "[[ -n ]]\n",
    "[[ x -eq 1 ]\n",  # malformed: bash -n only prints it
    "case 5 in 5) echo;; 7) ;; esac\n",
    'echo "$1" ${10} ${2:-3}\n',
    "for i1 in 1 2; do echo; done\n",
    "for 1i in 1 2; do echo; done\n",
    'echo "unclosed 123\n',
    "if true; then echo 1\n",
    "echo $((1 + ))\n",
    "cat <<E1\nbody\nE2\nE1\n",  # a here-document: checked as it is
    "x=$(echo 5\n",
]


@pytest.mark.parametrize("script", TRICKY)
def test_a_shape_parses_exactly_when_its_script_does(script: str) -> None:
    for fingerprint in ("", FP_DIGIT, FP_LETTER):
        shaped = shape(script, fingerprint).decode()
        assert bash_n(shaped).ok == bash_n(script).ok, (script, shaped)


def test_a_fleet_of_numbered_hosts_is_one_shape() -> None:
    scripts = [
        f"# unit sglang-{u} on gpu{h:04d}\nexport FP={fp}\nexec x --port {30000 + u} --gpu {u}\n"
        for h in range(50)
        for u in range(8)
        for fp in [f"{h:02d}{u}" + "ab" * 30 + "9"]
    ]
    fps = [s.split("FP=")[1].split("\n")[0] for s in scripts]
    assert len({shape(s, fp) for s, fp in zip(scripts, fps, strict=True)}) == 1
    assert shape("cat <<EOF\n1\nEOF\n") == b"cat <<EOF\n1\nEOF\n"


def test_one_check_per_shape_and_a_failure_in_bashs_own_words(tmp_path: Path) -> None:
    passed = Passed(tmp_path / "keys")
    good = [(f"echo host{i:02d}\n", "") for i in range(40)]
    assert all(v.ok for v in check_scripts(good, passed))
    assert len(passed.new) == 1  # 40 scripts, one shape: one bash -n, one key
    bad = [(f"echo host{i:02d}\nif true; then echo {i}\n", "") for i in range(3)]
    verdicts = check_scripts(bad + good, passed)
    assert [v.ok for v in verdicts[:3]] == [False] * 3 and all(v.ok for v in verdicts[3:])
    assert "syntax error: unexpected end of file" in verdicts[0].detail
    assert len(passed.new) == 1, "a failure is never kept"


def test_a_kept_pass_never_passes_a_changed_script(tmp_path: Path) -> None:
    passed = Passed(tmp_path / "keys")
    assert check_scripts([("echo ok\n", "")], passed)[0].ok
    passed.save()
    again = Passed(tmp_path / "keys")
    assert not check_scripts([("echo ok\nfi\n", "")], again)[0].ok


def project(base: Path, hosts: int, template: str | None = None) -> Path:
    (base / "playbooks").mkdir(parents=True)
    names = [f"node{i:02d}" for i in range(hosts)]
    (base / "inventory.yaml").write_text(
        "hosts:\n"
        + "".join(f"  {n}: {{address: 127.0.1.{i + 10}, gpus: 2}}\n" for i, n in enumerate(names))
        + f"groups:\n  fleet: [{', '.join(names)}]\n"
    )
    (base / "playbooks" / "p.yaml").write_text(
        "name: p\nhosts: fleet\nservices:\n"
        "  - {name: s, engine: stub, model: m, replicas: 2, port: 31000}\n"
    )
    if template is not None:
        (base / "templates").mkdir()
        (base / "templates" / "stub.sh.j2").write_text(template)
    return base


def test_preflight_keeps_passes_and_names_a_handful_of_hosts(
    tmp_path: Path, own_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = project(tmp_path, 12)
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0, out
    summary = next(line for line in out.splitlines() if "preflight passed" in line)
    assert "24 units on 12 host(s) (node00, node01, node02, node03, node04 and 7 more)" in summary
    keys = (own_cache / "preflight-passed").read_text().split()
    # 24 scripts of at most 2 shapes (a fingerprint starts with a digit or a letter: one key
    # each) and the stub engine's shipped .py (one key)
    assert 2 <= len(keys) <= 3 and all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)
    # A broken override of the template: the kept pass is for other content, so it fails.
    (base / "templates").mkdir()
    (base / "templates" / "stub.sh.j2").write_text(
        '{% extends "_unit.sh.j2" %}\n{% block prelude %}\nif [[ x ]; then\n{% endblock %}\n'
    )
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 1 and out.count("FAIL bash-syntax") == 24, out
    assert "[node07] s-1: rendered launch script does not parse (bash -n)" in out


def test_a_corrupt_cache_file_or_an_unusable_folder_is_one_warning(
    tmp_path: Path,
    own_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = project(tmp_path, 2)
    (own_cache / "preflight-passed").write_text("not a key\n")
    cache._warned.clear()
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0, out
    assert out.count("warning: dflashops cache") == 1 and "not a list of check keys" in out
    assert 2 <= len((own_cache / "preflight-passed").read_text().split()) <= 3  # rewritten whole

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DFLASHOPS_CACHE", str(blocked))  # a folder that cannot be made
    cache._warned.clear()
    code, out = run_cli(["preflight"], base, capsys)
    assert code == 0, out
    assert out.count("warning: dflashops cache") == 1 and "Not a directory" in out
