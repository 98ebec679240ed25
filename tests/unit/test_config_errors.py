"""Config errors a person can act on at once: a YAML syntax error at the line that is wrong (with
that line's text), a template error at the template's own file and line in a template author's
words, and every error of a run reported in one go, sorted by file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dflashops.config import yamlsource
from dflashops.config.load import load_inventory
from dflashops.config.yamlsource import parse_yaml
from dflashops.errors import ConfigError
from tests.conftest import WriteTree, missing, run_cli

# (what went wrong, the file, the line at fault, a part of the message)
YAML_MISTAKES = [
    (
        "a key without its colon, mid-mapping (PyYAML names the next line)",
        "hosts:\n  a:\n    address 10.0.0.1\n    port: 22\n",
        3,
        "missing `:` after `address 10.0.0.1`",
    ),
    (
        "a key without its colon, last of a list item's mapping",
        "services:\n  - name: s\n    engine stub\n",
        3,
        "missing `:` after `engine stub`",
    ),
    (
        "a key indented deeper than its siblings",
        "hosts:\n  a:\n    address: x\n      port: 22\n",
        4,
        "indented deeper than `address:` above it (line 3): align it with that key",
    ),
    (
        "a key indented less than its siblings",
        "hosts:\n  a:\n    address: x\n   port: 22\n",
        4,
        "the indentation lines up with no key above it",
    ),
    (
        "a tab in the indentation",
        "hosts:\n  a:\n\taddress: x\n",
        3,
        "a tab in the indentation: YAML indents with spaces only; line 3 reads: \\taddress: x",
    ),
    (
        "an unclosed double quote (PyYAML names the end of the file)",
        'name: x\nhosts: a\ncmd: "abc\nport: 2\nother: 3\n',
        3,
        'the `"` opened here is never closed; line 3 reads: cmd: "abc',
    ),
    (
        "an unclosed single quote",
        "name: x\ncmd: 'abc\nport: 2\n",
        2,
        "the `'` opened here is never closed",
    ),
    (
        "an unclosed bracket",
        "name: x\nhosts: [a, b\nport: 2\n",
        2,
        "the `[` opened here is not closed with `]` before line 3; line 2 reads: hosts: [a, b",
    ),
    (
        "an unclosed bracket on the last line",
        "name: x\nhosts: [a, b\n",
        2,
        "the `[` opened here is never closed with `]`; line 2 reads: hosts: [a, b",
    ),
    (
        "a list item where a key belongs",
        "hosts:\n  a: 1\n  - b\n",
        3,
        "a list item (`- `) where a `key:` was expected",
    ),
    (
        "a value holding ': ' unquoted",
        "name: x\nmodel: a: b\n",
        2,
        "a value with `: ` in it must be quoted",
    ),
    (
        "a duplicate key",
        "hosts:\n  a: {}\n  b: {}\n  a: {}\n",
        4,
        "duplicate key 'a'",
    ),
    (
        "a template value left unquoted",
        "name: x\nservices:\n  - name: s\n    model: {{ model }}\n",
        4,
        'a value that starts with `{{` must be quoted: write it as "{{ name }}"',
    ),
]


@pytest.fixture(params=["libyaml", "python"])
def loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both of PyYAML's parsers: libyaml's (used when PyYAML has it) and its pure-Python one
    word their errors differently and must be read the same."""
    if request.param == "libyaml":
        if not hasattr(yaml, "CSafeLoader"):
            missing("this PyYAML is built without libyaml (the C parser CI tests)")
        monkeypatch.setattr(yamlsource, "_LOADER", yaml.CSafeLoader)
    else:
        monkeypatch.setattr(yamlsource, "_LOADER", yaml.SafeLoader)
    return str(request.param)


@pytest.mark.parametrize(
    ("text", "line", "said"), [m[1:] for m in YAML_MISTAKES], ids=[m[0] for m in YAML_MISTAKES]
)
def test_yaml_mistake_is_reported_at_its_own_line(
    loader: str, text: str, line: int, said: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, "f.yaml")
    [problem] = exc.value.problems
    assert problem.line == line, str(problem)
    assert said in problem.message, str(problem)
    assert str(problem).startswith(f"f.yaml:{line}:")


def test_a_long_line_is_shown_cut_at_a_word(loader: str) -> None:
    text = "hosts:\n  a:\n    " + "word " * 30 + "\n    port: 22\n"
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, "f.yaml")
    [problem] = exc.value.problems
    assert problem.line == 3
    assert "`word word" in problem.message and "word...`" in problem.message
    assert len(problem.message) < 160


def test_half_edited_playbook_names_its_line_beside_good_ones(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: the colon is missing on line 7, and the report says line 7 (it said 8),
    with the line's text; the good playbook beside it is still checked in the same run."""
    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, gpus: 2, workdir: wd}\n",
            "playbooks/good.yaml": """
            name: good
            hosts: l
            services:
              - {name: s, engine: stub, model: m, port: 31000, args: {bogus-flag: 1}}
            """,
            "playbooks/wip.yaml": """
            # work in progress
            name: wip
            hosts: l
            services:
              - name: t
                engine: stub
                model /m
                port: 31100
            """,
        }
    )
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails == [
        "FAIL sglang-flags: playbooks/good.yaml:4:52: services[0].args: [l] s-0: SGLang 0.5.23 "
        "does not accept --bogus-flag",
        "FAIL config: playbooks/wip.yaml:7:5: invalid YAML: missing `:` after `model /m` "
        "(write `key: value`)",
    ], out


TEMPLATE = '{%% extends "_unit.sh.j2" %%}\n{%% block prelude %%}\n# mine\n%s\n{%% endblock %%}\n'
PLAYBOOK = """
name: p
hosts: l
services:
  - {name: s, engine: stub, model: m, port: 31000, replicas: 2}
"""


def template_case(write_tree: WriteTree, line: str) -> Path:
    return write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, gpus: 2, workdir: wd}\n",
            "playbooks/p.yaml": PLAYBOOK,
            "templates/stub.sh.j2": TEMPLATE % line,
        }
    )


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            "echo {{ unit.foo|q }}",
            "unit s-0 has no field `foo` (a unit has: cuda_visible_devices, dp, engine, "
            "env_path, gpus, host, kind, name, nodes, playbook, port, rank, rendezvous, replica, "
            "tp)",
        ),
        (
            "echo {{ model|q }}",
            "`model` is not defined (a template sees: unit, argv, env, secrets, secrets_env, "
            "secret_files, version, fingerprint)",
        ),
        ("echo {{ unit.name }}", "unquoted value 's-0' in a template: pipe every value"),
        ("{% if %}", "Expected an expression"),
        ("{% include 'nope.j2' %}", "template 'nope.j2' not found (in templates, "),
        ("echo {{ (unit.tp / 0)|q }}", "ZeroDivisionError: division by zero"),
    ],
    ids=["unit field", "undefined name", "unquoted", "syntax", "include", "python error"],
)
def test_template_error_names_the_templates_own_line(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str], line: str, said: str
) -> None:
    root = template_case(write_tree, line)
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1
    fails = [f for f in out.splitlines() if f.startswith("FAIL")]
    # Once for the template's line, whichever units it failed: both replicas here.
    assert len(fails) == 1, out
    assert fails[0].startswith(f"FAIL render: templates/stub.sh.j2:4: {said}"), out
    assert fails[0].endswith("; rendering l/s-0 (playbooks/p.yaml:4) and 1 more unit(s)"), out
    assert "_UnitView" not in out and "dflashops." not in out


def test_the_render_command_says_the_same(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    root = template_case(write_tree, "echo {{ unit.foo|q }}")
    code, out = run_cli(["render"], root, capsys)
    assert code == 1
    assert "error: templates/stub.sh.j2:4: unit s-0 has no field `foo`" in out, out


def test_every_error_of_a_run_in_one_report_sorted(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    """An undefined variable used to hide the missing script of the same playbook; now both,
    and the other file's, in file and line order. A value that could not be filled in is said
    once: not again as the file it would name."""
    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, gpus: 2, workdir: wd}\n",
            "playbooks/a.yaml": """
            name: a
            hosts: l
            services:
              - name: s
                engine: stub
                model: m
                port: 31000
                args: {served-model-name: "{{ nope }}"}
            jobs:
              - {name: gen, script: ./missing.py}
              - {name: gen2, script: "{{ scripts }}/x.py"}
            """,
            "playbooks/b.yaml": """
            name: b
            hosts: l
            services:
              - {name: t, engine: stub, model: m, port: 31000}
            """,
            "templates/stub.sh.j2": TEMPLATE % "echo {{ unit.foo|q }}",
        }
    )
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1
    fails = [f for f in out.splitlines() if f.startswith("FAIL")]
    places = [re.match(r"FAIL [\w-]+: ([^:]+):(\d+)", f) for f in fails]
    assert all(places), out
    found = [(m.group(1), int(m.group(2))) for m in places if m is not None]
    assert found == sorted(found), out
    assert [f for f in fails if ": playbooks/a.yaml:" in f] == [
        "FAIL layout: playbooks/a.yaml:8:12: services[0].args.served-model-name: [l] cannot "
        "fill in '{{ nope }}': 'nope' is undefined",
        "FAIL render: playbooks/a.yaml:10:17: jobs[0].script: [l] gen: file './missing.py' not "
        "found at playbooks/missing.py",
        "FAIL layout: playbooks/a.yaml:11:18: jobs[1].script: [l] cannot fill in "
        "'{{ scripts }}/x.py': 'scripts' is undefined",
    ], out
    # b.yaml's clash with a.yaml: both planned in the same run
    assert "FAIL layout: playbooks/b.yaml:4:39: services[0].port: [l] t-0: port 31000" in out
    assert any(f.startswith("FAIL render: templates/stub.sh.j2:4: unit ") for f in fails), out
    assert out.count("{{ scripts }}") == 1, out


def test_a_value_of_the_wrong_type_once_filled_is_said_once(write_tree: WriteTree) -> None:
    """`port: "{{ nope }}"` left as written is a string where a number goes: not said twice."""
    from dflashops.config.load import load_playbook
    from dflashops.plan import build_plan

    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, gpus: 2, workdir: wd}\n",
            "playbooks/p.yaml": """
            name: p
            hosts: l
            services:
              - {name: s, engine: stub, model: m, port: "{{ nope }}", replicas: 0}
            """,
        }
    )
    plan = build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks/p.yaml")]
    )
    assert [(p.field, p.message.split(":")[0]) for p in plan.problems] == [
        ("services[0].port", "[l] cannot fill in '{{ nope }}'"),
        ("services[0].replicas", "Input should be greater than or equal to 1, got 0 (a number)"),
    ]


def test_inventory_problems_come_in_line_order(write_tree: WriteTree) -> None:
    """Cross-reference problems (found on the raw data) and type problems (pydantic's) used to
    come in two runs of their own; they are one list in the file's order."""
    root = write_tree(
        {
            "inventory.yaml": """
            hosts:
              a: {gpus: 2}
              b: {address: 10.0.0.2, port: 0}
              c: {gpus: 1}
            groups:
              g: [a, zz]
            """
        }
    )
    with pytest.raises(ConfigError) as exc:
        load_inventory(root / "inventory.yaml")
    lines = [p.line for p in exc.value.problems]
    assert lines == [2, 3, 4, 6], str(exc.value)
    assert "unknown host 'zz'" in str(exc.value)
