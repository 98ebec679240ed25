"""Planning what units stand on (nodestate.py), offline: every mistake is a pre-flight problem
with the file, the line, the host and the entry, before anything reaches a host."""

from __future__ import annotations

from pathlib import Path

from dflashops.config.load import load_inventory, load_playbook
from dflashops.plan import Plan, build_plan
from tests.conftest import WriteTree

INVENTORY = """
hosts:
  gen: {address: 127.0.0.1, gpus: 2}
  train: {address: 127.0.0.2, gpus: 2}
"""


def plan_of(write_tree: WriteTree, files: dict[str, str]) -> Plan:
    root = write_tree({"inventory.yaml": INVENTORY, **files})
    books = [load_playbook(root / name) for name in files if name.startswith("playbooks/")]
    return build_plan(load_inventory(root / "inventory.yaml"), books)


def messages(plan: Plan) -> list[str]:
    return [str(p) for p in plan.problems]


def test_sources_are_told_apart_and_units_linked(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "data/prompts.jsonl": "{}\n",
            "wheels/x.whl": "",
            "playbooks/p.yaml": """
            name: p
            hosts: train
            environments:
              vllm: {path: /root/venv-vllm, packages: ["vllm==0.33.0"], wheels: ../wheels}
            files:
              - {src: ../data/prompts.jsonl, dest: /w/prompts.jsonl}
              - {name: model, src: "host:/disk/m/", dest: /dev/shm/m/}
              - {name: data, src: "gen:/out/", dest: /w/data, after: gen/generate}
              - {src: "hf:org/repo@main", dest: /w/hub}
            services:
              - {name: v, engine: vllm, model: /dev/shm/m, environment: vllm}
            jobs:
              - {name: t, command: [train], needs: [v, data], environment: vllm}
            """,
        },
    )
    assert messages(plan) == []
    node = plan.hosts["train"].node
    assert [(f.kind, f.src, f.dest) for f in node.files] == [
        ("controller", str(Path(node.files[0].src)), "/w/prompts.jsonl"),
        ("host", "/disk/m", "/dev/shm/m"),
        ("relay", "/out", "/w/data"),
        ("hf", "org/repo", "/w/hub"),
    ]
    assert node.files[2].src_host == "gen" and node.files[3].revision == "main"
    units = {u.name: u for u in plan.hosts["train"].units}
    assert units["v-0"].content == ("model",) and units["v-0"].waits == ("model",)
    assert units["t"].waits == ("data",) and units["t"].needs == ("v-0",)
    assert units["v-0"].env is not None and units["v-0"].env.path == "/root/venv-vllm"
    assert len(units["v-0"].env.hash) == 64


def test_every_node_state_mistake_is_located(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "playbooks/a.yaml": """
            name: a
            hosts: train
            environments:
              e: {path: /root/venv, packages: ["x==1"], requirements: nope.txt}
            files:
              - {src: ../missing.bin, dest: /w/x}
              - {src: "ghost:/out", dest: /w/y}
              - {src: "host:/a", dest: /w/x}
              - {src: "host:/b", dest: /w/z, after: nohost/job}
            services:
              - {name: s, engine: stub, model: m, environment: other}
            """,
            "playbooks/b.yaml": """
            name: b
            hosts: train
            environments:
              e: {path: /root/venv, packages: ["x==2"]}
            """,
        },
    )
    got = "\n".join(messages(plan))
    assert "environments.e.requirements: [train] file 'nope.txt' not found" in got
    assert "files[0].src: [train] '../missing.bin' not found at" in got
    assert (
        "'ghost:/out' not found at" in got
        and "(if 'ghost' is a host, add it to the inventory)" in got
    )
    assert (
        "files[2].dest: [train] files host:/a: dest /w/x is also the dest of files ../missing.bin"
        in got
    )
    assert "files[3].after: [train] after names unknown host 'nohost'" in got
    assert "environment 'other' is not declared for host train (declared: e)" in got
    assert "environment e: is also declared, differently, by" in got


def test_bad_values_are_refused_by_the_models(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "playbooks/p.yaml": """
            name: p
            hosts: train
            environments:
              e: {path: relative/venv, packages: ["--index-url=http://evil", "ok==1"]}
              f: {path: /root/f}
            files:
              - {src: x, dest: /w/../etc, after: "not a job", mode: "999"}
              - {src: "hf:not a repo", dest: /w/h}
            """
        }
    )
    import pytest

    from dflashops.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_playbook(root / "playbooks" / "p.yaml")
    got = "\n".join(str(p) for p in exc.value.problems)
    assert "environments.e.path: 'relative/venv' is not an absolute path on the host" in got
    assert "'--index-url=http://evil' is not a requirement specifier" in got
    assert "an environment needs `packages` or `requirements`" in got
    assert "files[0].dest: '/w/../etc' contains '..'" in got
    assert "files[0].after: 'not a job' is not HOST/JOB" in got
    assert "files[0].mode: '999' is not an octal file mode" in got
    assert "files[1].src: 'hf:not a repo' is not 'hf:org/repo'" in got
