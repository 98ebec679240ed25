"""Planning: units per host, GPU and port layout, needs, and the vLLM DP rule."""

from __future__ import annotations

from pathlib import Path

from dflashops.config.load import load_inventory, load_playbook
from dflashops.plan import Plan, build_plan, topo_order
from tests.conftest import WriteTree

INVENTORY = """
hosts:
  b200: {address: 127.0.0.1, port: 36472, gpus: 7}
  pro6000: {address: 127.0.0.2, port: 22280, gpus: 8, vars: {model: /host/model}}
  small: {address: 127.0.0.3, gpus: 4}
groups:
  all: [b200, pro6000]
"""


def plan_of(
    write_tree: WriteTree, playbooks: dict[str, str], hosts: list[str] | None = None
) -> Plan:
    root = write_tree(
        {"inventory.yaml": INVENTORY, **{f"playbooks/{k}": v for k, v in playbooks.items()}}
    )
    inventory = load_inventory(root / "inventory.yaml")
    books = [load_playbook(root / "playbooks" / name) for name in playbooks]
    return build_plan(inventory, books, hosts)


def messages(plan: Plan) -> list[str]:
    return [p.message for p in plan.problems]


def test_replicas_get_consecutive_gpus_and_ports(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: b200
            services:
              - {name: sglang, engine: sglang, model: /m, replicas: 3, tp: 2, port: 30000}
              - {name: small, engine: sglang, model: /m, port: 31000}
            jobs:
              - {name: gen, command: [gen], servers: sglang, gpus: 0}
            """
        },
    )
    assert messages(plan) == []
    units = {u.name: u for u in plan.hosts["b200"].units}
    assert [
        (n, units[n].gpus, units[n].port) for n in ("sglang-0", "sglang-1", "sglang-2", "small-0")
    ] == [
        ("sglang-0", (0, 1), 30000),
        ("sglang-1", (2, 3), 30001),
        ("sglang-2", (4, 5), 30002),
        ("small-0", (6,), 31000),
    ]
    assert units["gen"].servers == (
        "http://127.0.0.1:30000",
        "http://127.0.0.1:30001",
        "http://127.0.0.1:30002",
    )
    assert units["gen"].needs == ("sglang-0", "sglang-1", "sglang-2")
    assert units["gen"].gpus == ()


def test_default_ports_clash_is_reported(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: b200
            services:
              - {name: a, engine: sglang, model: /m}
              - {name: b, engine: stub, model: /m}
            """
        },
    )
    assert messages(plan) == ["[b200] b-0: port 30000 is also used by a-0"]


def test_explicit_gpus_are_claims_auto_fills_around_them(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "t.yaml": """
            name: t
            hosts: pro6000
            services:
              - {name: auto, engine: sglang, model: /m, replicas: 2, tp: 2, port: 30000}
              - {name: vllm, engine: vllm, model: /m, tp: 2, gpus: [0, 1], port: 8000}
            jobs:
              - {name: train, command: [t], gpus: 2, needs: [vllm]}
              - {name: monitor, command: [m]}
            """
        },
    )
    assert messages(plan) == []
    units = {u.name: u for u in plan.hosts["pro6000"].units}
    # Explicit claims are taken first, whatever their order in the playbook.
    assert units["vllm-0"].gpus == (0, 1)
    assert units["auto-0"].gpus == (2, 3) and units["auto-1"].gpus == (4, 5)
    assert units["train"].gpus == (6, 7)
    assert units["monitor"].gpus == ()


def test_oversubscription_names_host_and_service(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": "name: s\nhosts: small\nservices:\n  - {name: sglang, engine: sglang, model: /m, replicas: 7}\n"
        },
    )
    assert messages(plan) == [
        "service sglang: needs 7 GPUs (tp 1 x dp 1 x 7 replica(s)) but host small has 4"
    ]


def test_jobs_take_what_services_leave(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: small
            services:
              - {name: v, engine: vllm, model: /m, tp: 2, port: 8000}
            jobs:
              - {name: train, command: [t], gpus: 3}
            """
        },
    )
    assert messages(plan) == [
        "job train: needs 3 GPU(s) but host small has only 2 left of 4 (taken: v-0 [0, 1])"
    ]


def test_explicit_gpu_out_of_range_and_wrong_count(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: small
            services:
              - {name: a, engine: sglang, model: /m, gpus: [9], port: 1000}
              - {name: b, engine: sglang, model: /m, tp: 2, gpus: [1], port: 2000}
            """
        },
    )
    assert messages(plan) == [
        "service a: GPU 9 does not exist: host small has 4 GPUs (0-3)",
        "service b: lists 1 GPU(s) but 1 replica(s) x tp*dp 2 need 2",
    ]


def test_units_on_every_host_of_a_group_and_host_filter(write_tree: WriteTree) -> None:
    books = {"s.yaml": "name: s\nhosts: all\nservices:\n  - {name: s, engine: stub, model: /m}\n"}
    assert sorted(plan_of(write_tree, books).hosts) == ["b200", "pro6000"]
    assert sorted(plan_of(write_tree, books, ["pro6000"]).hosts) == ["pro6000"]


def test_unknown_target_lists_what_exists(write_tree: WriteTree) -> None:
    plan = plan_of(write_tree, {"s.yaml": "name: s\nhosts: [b200, b300]\n"})
    assert messages(plan) == [
        "unknown host or group 'b300' (inventory has: all, b200, pro6000, small)"
    ]
    assert plan.problems[0].line == 2 and plan.problems[0].field == "hosts[1]"


def test_vars_host_overrides_playbook(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: all
            vars: {model: /play/model}
            services:
              - {name: s, engine: stub, model: "{{ model }}", env: {WHERE: "{{ host }}"}}
            """
        },
    )
    assert messages(plan) == []
    assert plan.hosts["b200"].units[0].spec.model == "/play/model"  # type: ignore[union-attr]
    assert plan.hosts["pro6000"].units[0].spec.model == "/host/model"  # type: ignore[union-attr]
    assert plan.hosts["pro6000"].units[0].spec.env == {"WHERE": "pro6000"}


def test_undefined_var_is_located(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": "name: s\nhosts: b200\nservices:\n  - {name: s, engine: stub, model: '{{ nope }}'}\n"
        },
    )
    [problem] = plan.problems
    assert problem.line == 4 and problem.field == "services[0].model"
    assert problem.message == "[b200] cannot fill in '{{ nope }}': 'nope' is undefined"


def test_needs_cycles_and_order(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "j.yaml": """
            name: j
            hosts: b200
            jobs:
              - {name: c, command: [c], needs: [b]}
              - {name: b, command: [b], needs: [a]}
              - {name: a, command: [a]}
            """
        },
    )
    assert messages(plan) == []
    assert [u.name for u in topo_order(plan.units)] == ["a", "b", "c"]
    cyclic = plan_of(
        write_tree,
        {
            "k.yaml": "name: k\nhosts: b200\njobs:\n  - {name: x, command: [x], needs: [y]}\n  - {name: y, command: [y], needs: [x]}\n"
        },
    )
    assert messages(cyclic) == ["[b200] x: needs form a cycle: x -> y -> x"]


def test_vllm_dp_rule_and_allow_dp(write_tree: WriteTree) -> None:
    dense = plan_of(
        write_tree,
        {
            "v.yaml": "name: v\nhosts: pro6000\nservices:\n  - {name: v, engine: vllm, model: /m, tp: 2, dp: 2}\n"
        },
    )
    [problem] = dense.problems
    assert problem.field == "services[0].dp"
    assert "vLLM with data-parallel-size 2 on CUDA_VISIBLE_DEVICES=0,1,2,3" in problem.message
    assert "INCIDENTS.md #2" in problem.message and "`replicas: 2` with `dp: 1`" in problem.message
    moe = plan_of(
        write_tree,
        {
            "w.yaml": "name: w\nhosts: pro6000\nservices:\n  - {name: v, engine: vllm, model: /m, tp: 2, dp: 2, allow_dp: true}\n"
        },
    )
    assert moe.problems == []


def test_repo_examples_plan_cleanly() -> None:
    inventory = load_inventory(Path("inventory.example.yaml"))
    books = [load_playbook(p) for p in sorted(Path("playbooks").glob("*.yaml"))]
    plan = build_plan(inventory, books)
    assert plan.problems == []
    b200 = plan.hosts["b200"]
    assert [(u.name, u.gpus, u.port) for u in b200.units if u.kind == "service"] == [
        (f"sglang-{i}", (i,), 30000 + i) for i in range(7)
    ]
    pro = {u.name: u for u in plan.hosts["pro6000"].units}
    assert pro["vllm-0"].gpus == (0, 1) and (pro["vllm-0"].tp, pro["vllm-0"].dp) == (2, 1)
    assert pro["train"].gpus == (4, 5, 6, 7) and pro["monitor"].gpus == ()


def test_vars_keep_their_type_for_numeric_fields(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree,
        {
            "s.yaml": """
            name: s
            hosts: all
            vars: {base: 31000, reps: 2}
            services:
              - {name: s, engine: stub, model: "/m/{{ base }}", port: "{{ base + 10 }}", replicas: "{{ reps }}"}
            """
        },
    )
    assert messages(plan) == []
    units = plan.hosts["b200"].units
    assert [(u.name, u.port) for u in units] == [("s-0", 31010), ("s-1", 31011)]
    assert units[0].spec.model == "/m/31000"  # type: ignore[union-attr]
