"""Groups with vars, and the names a host pattern may use: a host, a group, `all`, a glob."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashops.config.load import load_inventory, load_playbook
from dflashops.errors import ConfigError
from dflashops.plan import build_plan
from tests.conftest import WriteTree, run_cli

INVENTORY = """
defaults:
  vars: {model: /defaults, tp_hint: d, quant: none}
hosts:
  h100-a: {address: 10.0.0.1, vars: {model: /host-a}}
  h100-b: {address: 10.0.0.2}
  b200: {address: 10.0.0.3}
  local: {connection: local, workdir: wd}
groups:
  h100:
    hosts: [h100-a, h100-b]
    vars: {model: /group-h100, tp_hint: g}
  fp8:
    hosts: [h100-b]
    vars: {quant: fp8}
  generation: [b200]
"""


def inventory(write_tree: WriteTree, text: str = INVENTORY) -> Path:
    return write_tree({"inventory.yaml": text}) / "inventory.yaml"


def test_host_vars_beat_group_vars_beat_defaults(write_tree: WriteTree) -> None:
    inv = load_inventory(inventory(write_tree))
    assert inv.hosts["h100-a"].vars == {"model": "/host-a", "tp_hint": "g", "quant": "none"}
    assert inv.hosts["h100-b"].vars == {"model": "/group-h100", "tp_hint": "g", "quant": "fp8"}
    assert inv.hosts["b200"].vars == {"model": "/defaults", "tp_hint": "d", "quant": "none"}
    # Both forms are groups alike: members in order.
    assert inv.groups == {"h100": ["h100-a", "h100-b"], "fp8": ["h100-b"], "generation": ["b200"]}


def test_group_vars_fill_playbook_values_and_beat_playbook_vars(write_tree: WriteTree) -> None:
    path = inventory(write_tree)
    root = path.parent
    (root / "playbooks").mkdir()
    (root / "playbooks" / "p.yaml").write_text(
        "name: p\nhosts: [h100, generation]\nvars: {model: /playbook, quant: pb}\n"
        "jobs:\n  - {name: j, command: [run, '{{ model }}', '{{ quant }}']}\n"
    )
    plan = build_plan(load_inventory(path), [load_playbook(root / "playbooks" / "p.yaml")])
    assert plan.problems == []
    got = {h: tuple(hp.units[0].spec.command[1:]) for h, hp in plan.hosts.items()}  # type: ignore[union-attr]
    assert got == {
        "h100-a": ("/host-a", "none"),
        "h100-b": ("/group-h100", "fp8"),
        "b200": ("/defaults", "none"),
    }


def test_two_groups_that_disagree_on_a_var_name_both(write_tree: WriteTree) -> None:
    text = """
    hosts:
      a: {address: 10.0.0.1}
      b: {address: 10.0.0.2, vars: {model: /mine}}
      c: {address: 10.0.0.3}
    groups:
      gpu:
        hosts: [a, b, c]
        vars: {model: /gpu, port: 1}
      fast:
        hosts: [a, b, c]
        vars: {model: /fast, port: 1}
    """
    with pytest.raises(ConfigError) as exc:
        load_inventory(inventory(write_tree, text))
    # b sets model itself (its own vars win): no clash there; port agrees: no clash at all.
    assert [str(p).split(": ", 1)[1] for p in exc.value.problems] == [
        "groups.fast.vars.model: groups gpu and fast both set `model` for hosts a, c "
        "('/gpu' and '/fast'): set it in the host's own vars (they win) or in one group only"
    ]
    assert exc.value.problems[0].line == 11


@pytest.mark.parametrize(
    ("groups", "said"),
    [
        ("g: a", "groups.g: a group is a list of hosts, or a mapping with `hosts` (a list) and "),
        ("g: {hosts: [a], extra: 1}", "groups.g.extra: unknown key 'extra'; allowed here: "),
        ("g: {vars: {x: 1}}", "groups.g.hosts: required field `hosts` is missing"),
        ("g: {hosts: [a, zz]}", "groups.g.hosts[1]: unknown host 'zz'"),
        ("g: [a, zz]", "groups.g[1]: unknown host 'zz'"),
        ("g: {hosts: [a, 'B!']}", "groups.g.hosts[1]: 'B!' is not a valid name"),
        ("a: [a]", "groups.a: 'a' is already a host name"),
    ],
)
def test_a_bad_group_is_said_at_its_place(write_tree: WriteTree, groups: str, said: str) -> None:
    path = inventory(write_tree, f"hosts:\n  a: {{address: 10.0.0.1}}\ngroups:\n  {groups}\n")
    with pytest.raises(ConfigError) as exc:
        load_inventory(path)
    assert any(said in str(p) for p in exc.value.problems), str(exc.value)
    assert "GroupSpec" not in str(exc.value)


def test_expand_all_globs_and_names(write_tree: WriteTree) -> None:
    inv = load_inventory(inventory(write_tree))
    assert inv.expand(["all"]) == ["h100-a", "h100-b", "b200", "local"]
    assert inv.expand(["h100-*"]) == ["h100-a", "h100-b"]
    assert inv.expand(["h100-[b]", "b200"]) == ["h100-b", "b200"]
    # A glob over group names takes their members; hosts it matches come first, no repeats.
    assert inv.expand(["gen*"]) == ["b200"]
    # *a*: hosts h100-a and local, then group generation's b200; then h100's h100-b.
    assert inv.expand(["*a*", "h100"]) == ["h100-a", "local", "b200", "h100-b"]
    assert inv.expand(["?200", "generation", "b200"]) == ["b200"]
    for unknown in ("nope-*", "b300", "h100-c?"):
        with pytest.raises(KeyError) as exc:
            inv.expand(["b200", unknown])
        assert exc.value.args == (unknown,)


def test_a_group_named_all_keeps_its_meaning(write_tree: WriteTree) -> None:
    """Inventories that defined `all` themselves before it meant every host keep their
    group: a name in the inventory beats the implicit `all`."""
    text = "hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\ngroups:\n  all: [b]\n"
    assert load_inventory(inventory(write_tree, text)).expand(["all"]) == ["b"]


def test_playbook_hosts_all(write_tree: WriteTree) -> None:
    path = inventory(write_tree)
    (path.parent / "p.yaml").write_text(
        "name: p\nhosts: all\nservices:\n  - {name: s, engine: stub, model: m}\n"
    )
    plan = build_plan(load_inventory(path), [load_playbook(path.parent / "p.yaml")])
    assert list(plan.hosts) == ["h100-a", "h100-b", "b200", "local"]


def test_host_option_takes_globs_and_all(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tree(
        {
            "inventory.yaml": """
            hosts:
              n1: {connection: local, workdir: wd1}
              n2: {connection: local, workdir: wd2}
              m1: {connection: local, workdir: wd3}
            groups:
              odd: {hosts: [n1, m1], vars: {tag: odd}}
            """,
            "playbooks/p.yaml": """
            name: p
            hosts: [n1, n2, m1]
            jobs:
              - {name: j, command: [echo, "{{ tag | default('none') }}"]}
            """,
        }
    )
    code, out = run_cli(["preflight", "--host", "n*"], root, capsys)
    assert code == 0 and "2 units on 2 host(s) (n1, n2)" in out, out
    code, out = run_cli(["preflight", "--host", "all"], root, capsys)
    assert code == 0 and "3 units on 3 host(s) (m1, n1, n2)" in out, out
    code, out = run_cli(["preflight", "--host", "x*"], root, capsys)
    assert code == 1 and "--host 'x*' is not in" in out, out


def test_schema_shows_both_forms_of_a_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli(["schema", "--which", "inventory"], tmp_path, capsys)
    assert code == 0
    schema = json.loads(out)
    forms = schema["properties"]["groups"]["additionalProperties"]["oneOf"]
    assert {"type": "array", "items": {"type": "string"}} in forms
    group = schema["$defs"]["GroupSpec"]
    assert group["required"] == ["hosts"] and set(group["properties"]) == {"hosts", "vars"}
    assert "host's own vars beat them" in group["properties"]["vars"]["description"]
