"""Inventory and playbook models: every bad input gets one located, specific message."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashops.config.load import load_inventory, load_playbook
from dflashops.config.types import parse_duration
from dflashops.errors import ConfigError
from tests.conftest import WriteTree


def problems(fn: object, path: Path) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        fn(path)  # type: ignore[operator]
    return [str(p) for p in exc.value.problems]


def test_example_inventory_resolves_defaults() -> None:
    inv = load_inventory(Path("inventory.example.yaml"))
    b200 = inv.hosts["b200"]
    assert (b200.address, b200.port, b200.gpus, b200.user) == ("213.173.111.134", 36472, 7, "root")
    assert b200.workdir == "/workspace/dflashops" and b200.host_key_policy == "strict"
    local = inv.hosts["local"]
    assert local.is_local and local.workdir == str(Path(".dflashops/local").resolve())
    assert inv.expand(["generation", "local"]) == ["b200", "local"]


def test_all_inventory_errors_in_one_report(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "inventory.yaml": """
            defaults:
              host_key_policy: off
            hosts:
              b200:
                address: 10.0.0.1
                port: 0
                gpus: -1
                host_key: "ssh-ed25519 not*base64"
              nohost:
                gpus: 2
              "-oProxyCommand=sh":
                address: "-oProxyCommand=touch /tmp/x"
            """
        }
    )
    got = problems(load_inventory, root / "inventory.yaml")
    file = str(root / "inventory.yaml")
    assert (
        f"{file}:2:3: defaults.host_key_policy: must be one of strict, accept-new (got False)"
        in got
    )
    assert (
        f"{file}:6:5: hosts.b200.port: Input should be greater than or equal to 1, got 0 (a number)"
        in got
    )
    assert (
        f"{file}:7:5: hosts.b200.gpus: Input should be greater than or equal to 0, got -1 (a number)"
        in got
    )
    assert f"{file}:8:5: hosts.b200.host_key: the key's second field is not valid base64" in got
    assert (
        f"{file}:9:3: hosts.nohost: an ssh host needs `address` (or set `connection: local`)" in got
    )
    assert any("is not a valid name" in p and "hosts.-oProxyCommand=sh" in p for p in got)
    assert any("'-oProxyCommand=touch /tmp/x' is not a host name" in p for p in got)


def test_inventory_top_level_must_be_a_mapping(write_tree: WriteTree) -> None:
    root = write_tree({"inventory.yaml": "- b200\n- pro6000\n"})
    assert problems(load_inventory, root / "inventory.yaml") == [
        f"{root / 'inventory.yaml'}:1:1: expected a inventory mapping at the top level, got a list"
    ]


def test_empty_inventory_file(write_tree: WriteTree) -> None:
    root = write_tree({"inventory.yaml": "# nothing yet\n"})
    assert problems(load_inventory, root / "inventory.yaml") == [
        f"{root / 'inventory.yaml'}: the file is empty; expected a inventory mapping"
    ]


def test_local_host_with_address_is_refused(write_tree: WriteTree) -> None:
    root = write_tree({"inventory.yaml": "hosts:\n  l: {connection: local, address: 1.2.3.4}\n"})
    assert problems(load_inventory, root / "inventory.yaml") == [
        f"{root / 'inventory.yaml'}:2:26: hosts.l.address: a local host has no address; remove it"
    ]


def test_playbook_unknown_key_suggests_the_right_one(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "pb.yaml": """
            name: gen
            hosts: b200
            services:
              - name: sglang
                engine: sglang
                model: /m
                replica: 7
            jobs:
              - name: generate
                script: g.py
                servres: sglang
            """
        }
    )
    file = root / "pb.yaml"
    assert problems(load_playbook, file) == [
        f"{file}:7:5: services[0].replica: unknown key 'replica'; did you mean 'replicas'?",
        f"{file}:11:5: jobs[0].servres: unknown key 'servres'; did you mean 'servers'?",
    ]


def test_engine_specific_fields(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "pb.yaml": """
            name: x
            hosts: b200
            services:
              - name: s
                engine: sglang
                model: /m
                launcher: {script: l.py}
              - name: c
                engine: command
              - name: v
                engine: vllm
                model: /m
                args: {"--tensor-parallel-size": 2}
            """
        }
    )
    file = root / "pb.yaml"
    assert problems(load_playbook, file) == [
        f"{file}:7:5: services[0].launcher: unknown key 'launcher' for engine sglang: it is only valid for engine vllm",
        f"{file}:8:5: services[1]: required field `command` is missing",
        f"{file}:13:5: services[2].args: argument name '--tensor-parallel-size' is not a flag name: "
        "write it without leading dashes (letters, digits, '-', '_', '.')",
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", '"sglang; rm -rf /"', "is not a valid name"),
        ("name", '"$(touch /tmp/pwned)"', "is not a valid name"),
        ("model", '"/m\\nrm -rf /"', "paths may not contain newlines or NUL characters"),
        ("model", '"/m\\0x"', "paths may not contain newlines or NUL characters"),
        ("port", "'30000'", "Input should be a valid integer, got '30000' (a string)"),
        ("replicas", "1.5", "Input should be a valid integer, got 1.5 (a number)"),
        ("gpus", "all", "must be one of auto or a list (got 'all')"),
        ("env", "{BAD-NAME: x}", "'BAD-NAME' is not a valid environment variable name"),
        ("env", "{FLAG: yes}", "write booleans as quoted strings"),
        ("secret_env", "{HF_TOKEN: hf_abc$}", "'hf_abc$' is not a valid environment variable name"),
        ("ready", "{timeout: 0s}", "a duration must be positive and at most a week"),
        ("ready", "{path: health}", "a probe path starts with '/' and has no spaces"),
    ],
)
def test_bad_service_values(write_tree: WriteTree, field: str, value: str, message: str) -> None:
    body = {"name": "s", "engine": "sglang", "model": "/m", field: value}
    lines = "\n".join(f"    {k}: {v}" for k, v in body.items())
    root = write_tree({"pb.yaml": f"name: x\nhosts: b200\nservices:\n  - {lines.lstrip()}\n"})
    got = problems(load_playbook, root / "pb.yaml")
    assert len(got) == 1 and message in got[0], got
    assert f"services[0].{field}" in got[0]


def test_env_and_secret_env_must_not_overlap(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "pb.yaml": "name: x\nhosts: h\njobs:\n  - name: j\n    command: [x]\n    env: {A: '1'}\n    secret_env: {A: A}\n"
        }
    )
    assert problems(load_playbook, root / "pb.yaml") == [
        f"{root / 'pb.yaml'}:4:5: jobs[0]: variables set in both env and secret_env: A"
    ]


def test_duplicate_unit_names_in_one_playbook(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "pb.yaml": "name: x\nhosts: h\njobs:\n  - {name: j, command: [a]}\n  - {name: j, command: [b]}\n"
        }
    )
    assert problems(load_playbook, root / "pb.yaml") == [
        f"{root / 'pb.yaml'}:1:1: two services or jobs are named 'j'"
    ]


def test_env_numbers_become_strings(write_tree: WriteTree) -> None:
    root = write_tree(
        {"pb.yaml": "name: x\nhosts: h\njobs:\n  - {name: j, command: [a], env: {N: 1, F: 0.5}}\n"}
    )
    assert load_playbook(root / "pb.yaml").spec.jobs[0].env == {"N": "1", "F": "0.5"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("20m", 1200), ("5s", 5), ("1h30m", 5400), ("90", 90), (2.5, 2.5), ("0.5s", 0.5)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "5x", "-1", True, "8d"])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


# Every field whose value is one of a fixed set, with a wrong value: (file, yaml, expected).
CHOICE_FIELDS = [
    (
        "inventory.yaml",
        "hosts:\n  a:\n    address: x\n    host_key_policy: maybe\n",
        "hosts.a.host_key_policy: must be one of strict, accept-new (got 'maybe')",
    ),
    (
        "inventory.yaml",
        "defaults:\n  connection: telnet\nhosts:\n  a: {address: x}\n",
        "defaults.connection: must be one of ssh, local (got 'telnet')",
    ),
    (
        "playbooks/p.yaml",
        "name: p\nhosts: a\nservices:\n  - {name: s, engine: tgi, model: m}\n",
        "services[0].engine: `engine` must be one of sglang, vllm, stub, command (got 'tgi')",
    ),
    (
        "playbooks/p.yaml",
        "name: p\nhosts: a\njobs:\n  - {name: j, command: [x], restart: sometimes}\n",
        "jobs[0].restart: must be one of no, on-failure, always (got 'sometimes')",
    ),
    (
        "playbooks/p.yaml",
        "name: p\nhosts: a\nservices:\n  - {name: s, engine: stub, model: m, gpus: some}\n",
        "services[0].gpus: must be one of auto or a list (got 'some')",
    ),
    (
        "playbooks/p.yaml",
        "name: p\nhosts: a\njobs:\n  - {name: j, script: t.py, launcher: mpirun}\n",
        "jobs[0].launcher: must be one of torchrun (got 'mpirun')",
    ),
    (
        "playbooks/p.yaml",
        "name: p\nhosts: a\nservices:\n  - {name: v, engine: vllm, model: m, backend: slurm}\n",
        "services[0].backend: must be one of native, ray (got 'slurm')",
    ),
]


@pytest.mark.parametrize(("file", "text", "expected"), CHOICE_FIELDS)
def test_a_wrong_choice_names_the_value_it_got(
    write_tree: WriteTree, file: str, text: str, expected: str
) -> None:
    root = write_tree({file: text})
    load = load_inventory if file == "inventory.yaml" else load_playbook
    got = problems(load, root / file)
    assert any(p.endswith(expected) for p in got), got


def test_every_choice_field_of_the_models_is_covered() -> None:
    """A new Literal field gets a case above (the message format is the contract)."""
    from dflashops.config.inventory import HostSettings, HostSpec
    from dflashops.config.playbook import CommandService, Job, SglangService, VllmService

    found = set()
    for model in (HostSettings, HostSpec, SglangService, VllmService, CommandService, Job):
        for name, info in model.model_fields.items():
            if "Literal[" in repr(info.annotation):
                found.add(name)
    covered = {expected.split(":")[0].rsplit(".", 1)[-1] for _, _, expected in CHOICE_FIELDS}
    assert found <= covered, f"choice fields without a case: {sorted(found - covered)}"
