"""The engines' real parsers judge every engine command line dflashops renders.

.venv-parsers (bash dev/parsers-env.sh) holds SGLang 0.5.23 and vLLM 0.33.0 with CPU torch;
dflashops/builtins/engine_args.py, the payload the hosts run too, asks their parsers. Every
example playbook and every fixture with engine units is rendered; each SGLang, vLLM and stub
(which speaks SGLang's flags) line must get the real parser's verdict that pre-flight's offline
flag list gives it: accepted where the list passes it, rejected where the list refuses it. The
flag lists themselves must be exactly the parsers' option strings. Without .venv-parsers these
tests skip locally and fail under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflashops.engines.base import BUILTINS_DIR, known_flags
from dflashops.errors import DflashopsError
from dflashops.preflight import parsers
from dflashops.preflight.offline import run_preflight, subject
from dflashops.project import select
from tests.conftest import REPO, unless

PARSERS_PYTHON = REPO / ".venv-parsers" / "bin" / "python"
PAYLOAD = BUILTINS_DIR / "engine_args.py"
needs_parsers = unless(
    (REPO / ".venv-parsers" / ".dflashops-spec").is_file(),
    "no .venv-parsers here: `bash dev/parsers-env.sh` builds it",
)
# Ops folders with engine units: the repo's examples and the fixtures (inventory beside them,
# else the example inventory).
FOLDERS = [REPO, *sorted(p for p in (REPO / "tests" / "fixtures").glob("*/*") if p.is_dir())]
FOLDERS += [REPO / "tests" / "fixtures" / "train-dflash"]


def run_payload(
    python: Path | str, request: dict[str, Any], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The payload as a host runs it: JSON in, one JSON line out."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), str(PAYLOAD)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def rendered_lines() -> list[tuple[str, str, list[str], bool]]:
    """(where, engine, argv, the flag list passes it) for every engine line of every folder."""
    out = []
    for folder in dict.fromkeys(FOLDERS):
        inventory = folder / "inventory.yaml"
        if not inventory.is_file():
            inventory = REPO / "inventory.example.yaml"
        try:
            report = run_preflight(select(inventory, [], []), keep_rendered=True)
        except DflashopsError:
            continue  # a fixture whose inventory does not load renders nothing
        failed = {(c.check, c.subject) for c in report.checks if not c.ok}
        for r in report.rendered:
            engine = "vllm" if r.unit.engine == "vllm" else "sglang"
            if r.unit.engine not in ("sglang", "stub", "vllm") or not r.launch.engine_args:
                continue
            passes = (f"{engine}-flags", subject(r)) not in failed
            where = f"{folder.relative_to(REPO) or '.'}: {subject(r)}"
            out.append((where, engine, parsers.engine_argv(r.unit, r.launch), passes))
    return out


@pytest.fixture(scope="module")
def judged() -> tuple[list[tuple[str, str, list[str], bool]], dict[str, Any]]:
    """Every rendered line through the real parsers, in one process (imports cost ~20 s)."""
    lines = rendered_lines()
    request = {
        "engines": {e: [argv for _, eng, argv, _ in lines if eng == e] for e in ("sglang", "vllm")},
        "options": True,
    }
    return lines, run_payload(PARSERS_PYTHON, request)["engines"]


@needs_parsers
def test_every_rendered_line_gets_the_flag_lists_verdict_from_the_real_parser(
    judged: tuple[list[tuple[str, str, list[str], bool]], dict[str, Any]],
) -> None:
    lines, answer = judged
    assert answer["sglang"]["version"] == "0.5.23" and answer["vllm"]["version"] == "0.33.0"
    assert {e: answer[e]["status"] for e in answer} == {"sglang": "parsed", "vllm": "parsed"}
    seen = {"sglang": 0, "vllm": 0}
    wrong = []
    for where, engine, argv, passes in lines:
        verdict = answer[engine]["lines"][seen[engine]]
        seen[engine] += 1
        if verdict["ok"] != passes:
            wrong.append(
                f"{where}: flag list {'passes' if passes else 'refuses'} {argv}, "
                f"{engine} says {verdict}"
            )
    assert not wrong, "\n".join(wrong)
    # The examples and fixtures do render both engines, a refused line among them.
    assert seen["sglang"] >= 5 and seen["vllm"] >= 5, seen
    assert any(not passes for *_, passes in lines)


def negates(flag: str, other: str) -> bool:
    """``flag`` is the generated opposite of ``other`` (argparse's BooleanOptionalAction makes
    --no-X for --X; vLLM's own makes --disable-X for --enable-X and the reverse)."""
    pairs = [("--", "--no-"), ("--enable-", "--disable-"), ("--disable-", "--enable-")]
    return any(
        other.startswith(a) and flag == b + other[len(a) :] and flag != other for a, b in pairs
    )


@needs_parsers
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_flag_list_is_exactly_the_real_parsers_options(
    engine: str, judged: tuple[list[tuple[str, str, list[str], bool]], dict[str, Any]]
) -> None:
    """Every listed flag is one of the parser's option strings, and every option string is
    listed, or is the generated opposite of a listed spelling of the same option."""
    actions: list[list[str]] = judged[1][engine]["options"]
    listed = set(known_flags(engine))
    real = {o for spellings in actions for o in spellings} - {"-h", "--help"}
    unlisted = sorted(
        o
        for spellings in actions
        for o in spellings
        if o in real
        and o not in listed
        and not any(x in listed and negates(o, x) for x in spellings)
    )
    assert not unlisted, (
        f"{engine} flags missing from dflashops/data/{engine}-flags.txt: {unlisted}"
    )
    assert not listed - real, f"listed flags {engine} does not have: {sorted(listed - real)}"


@needs_parsers
def test_a_wrongly_typed_value_and_an_abbreviation_get_the_engines_word() -> None:
    request = {
        "engines": {
            "sglang": [
                ["--model-path", "m", "--mem-fraction-static", "lots"],
                ["--model-path", "m", "--tp", "2"],
                ["--model-path", "m", "--speculative-algorithm", "MTP"],
                ["--model-path", "m", "--tp-size", "2", "--speculative-algorithm", "DFLASH"],
            ],
            "vllm": [
                ["m", "--gpu-memory-utilization", "lots"],
                ["m", "--tensor", "2"],
                ["m", "-tp", "2", "--max_model_len", "4096"],
            ],
        }
    }
    answer = run_payload(PARSERS_PYTHON, request)["engines"]
    sglang = [v.get("error") for v in answer["sglang"]["lines"]]
    assert sglang[0] == (
        "sglang serve: error: argument --mem-fraction-static: invalid float value: 'lots'"
    )
    assert "--tp is not a flag of its own" in sglang[1] and "--tp-size" in sglang[1]
    # SGLang's own SpeculativeAlgorithm.from_string: there is no algorithm "MTP".
    assert sglang[2] == "ValueError: Unknown speculative algorithm name: MTP"
    assert answer["sglang"]["lines"][3] == {"ok": True}
    vllm = [v.get("error") for v in answer["vllm"]["lines"]]
    assert "invalid float value: 'lots'" in vllm[0] and "--gpu-memory-utilization" in vllm[0]
    assert "--tensor is not a flag of its own" in vllm[1]
    assert answer["vllm"]["lines"][2] == {"ok": True}  # -tp and --max_model_len are vLLM's own


def test_an_engine_that_does_not_import_is_said_so() -> None:
    answer = run_payload(sys.executable, {"engines": {"sglang": [["--model-path", "m"]]}})
    got = answer["engines"]["sglang"]
    assert got["status"] == "cannot-import"
    assert got["error"] == "ModuleNotFoundError: No module named 'sglang'"


def test_an_engine_without_a_known_entry_point_is_said_so(tmp_path: Path) -> None:
    """An SGLang of another layout: it imports, its parser is not where dflashops looks."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text('__version__ = "0.4.0"\n')
    answer = run_payload(
        sys.executable,
        {"engines": {"sglang": [["--model-path", "m"]]}},
        {"PYTHONPATH": str(tmp_path)},
    )
    got = answer["engines"]["sglang"]
    assert got["status"] == "no-entry-point"
    assert got["error"].startswith("no parser entry point known for sglang 0.4.0: ")
    assert "sglang.srt" in got["error"]


@needs_parsers
def test_secret_flags_reach_the_parser_in_place_with_a_placeholder(tmp_path: Path) -> None:
    """secret_args travel in a 0600 file (SGLang's --config, vLLM's VLLM_API_KEY): the parser
    sees each secret flag where the engine would, with a placeholder for its value, never a
    --config without its file nor the secret itself."""
    (tmp_path / "inventory.yaml").write_text("hosts:\n  b200: {address: 127.0.0.1, gpus: 8}\n")
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "serve.yaml").write_text(
        "name: serve\nhosts: b200\nservices:\n"
        "  - {name: sglang, engine: sglang, model: /m, secret_args: {api-key: K, admin-api-key: A}}\n"
        "  - {name: vllm, engine: vllm, model: /m, port: 8000, secret_args: {api-key: K, hf-token: T}}\n"
    )
    report = run_preflight(select(tmp_path / "inventory.yaml", [], []), keep_rendered=True)
    argv = {r.unit.engine: parsers.engine_argv(r.unit, r.launch) for r in report.rendered}
    placeholder = parsers.PLACEHOLDER
    assert argv["sglang"][-4:] == ["--api-key", placeholder, "--admin-api-key", placeholder]
    assert "--config" not in argv["sglang"]
    assert argv["vllm"][0] == "/m"
    assert argv["vllm"][-4:] == ["--hf-token", placeholder, "--api-key", placeholder]
    answer = run_payload(PARSERS_PYTHON, {"engines": {e: [a] for e, a in argv.items()}})["engines"]
    assert [answer[e]["lines"] for e in ("sglang", "vllm")] == [[{"ok": True}], [{"ok": True}]]
