"""Services over several nodes: parts per host with ranks, the GPU split, the head's
rendezvous, and every way the `nodes` list can be wrong (said once, with where and why)."""

from __future__ import annotations

from dflashops.config.load import load_inventory, load_playbook
from dflashops.engines import launch_for
from dflashops.engines.render import make_environment, render_unit
from dflashops.plan import Plan, build_plan
from tests.conftest import WriteTree

INVENTORY = """
hosts:
  a: {address: 203.0.113.10, internal_address: 10.0.0.10, net_if: ens1, gpus: 8}
  b: {address: 203.0.113.11, net_if: ib0, gpus: 8}
  c: {address: 203.0.113.12, gpus: 4}
groups:
  pair: [a, b]
  all: [a, b, c]
"""


def plan_of(
    write_tree: WriteTree, service: str, hosts: str = "all", only: list[str] | None = None
) -> Plan:
    root = write_tree(
        {
            "inventory.yaml": INVENTORY,
            "playbooks/p.yaml": f"name: p\nhosts: {hosts}\nservices:\n  - {service}\n",
        }
    )
    return build_plan(
        load_inventory(root / "inventory.yaml"),
        [load_playbook(root / "playbooks" / "p.yaml")],
        only,
    )


def messages(plan: Plan) -> list[str]:
    return [str(p) for p in plan.problems]


def test_a_part_per_node_with_its_rank_gpu_share_and_the_heads_rendezvous(
    write_tree: WriteTree,
) -> None:
    plan = plan_of(
        write_tree,
        "{name: dsv3, engine: sglang, model: /m, nodes: [a, b], tp: 16, port: 30000, dist_port: 50000}",
    )
    assert messages(plan) == []
    a, b = plan.hosts["a"].units, plan.hosts["b"].units
    assert plan.hosts["c"].units == []  # targeted, but not one of the nodes
    assert [(u.name, u.rank, u.gpus, u.port) for u in (*a, *b)] == [
        ("dsv3-0", 0, tuple(range(8)), 30000),
        ("dsv3-0", 1, tuple(range(8)), None),  # a worker rank serves no HTTP
    ]
    assert {u.head for u in (*a, *b)} == {"10.0.0.10"}  # the head's internal_address
    env = make_environment([])
    for u, rank, nic in ((a[0], "0", "ens1"), (b[0], "1", "ib0")):
        launch = launch_for(u)
        assert launch.engine_args[-6:] == [
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--dist-init-addr",
            "10.0.0.10:50000",
        ]
        script = render_unit(env, u).script
        assert f"export NCCL_SOCKET_IFNAME={nic}" in script
        assert f"export GLOO_SOCKET_IFNAME={nic}" in script
        assert "--tp-size 16" in script
    assert "--port" not in launch_for(b[0]).engine_args


def test_a_group_names_the_nodes_and_a_node_without_internal_address_is_dialled_at_address(
    write_tree: WriteTree,
) -> None:
    plan = plan_of(write_tree, "{name: s, engine: sglang, model: /m, nodes: [b, a], tp: 4, dp: 2}")
    assert messages(plan) == []
    (head,) = plan.hosts["b"].units
    assert head.rank == 0 and head.head == "203.0.113.11" and head.dist_port == 29500
    assert len(head.gpus) == 4  # tp*dp 8 over 2 nodes
    grouped = plan_of(write_tree, "{name: s, engine: sglang, model: /m, nodes: [pair], tp: 2}")
    assert messages(grouped) == [] and [u.rank for u in grouped.hosts["b"].units] == [1]


def test_wrong_nodes_are_said_once_with_the_field(write_tree: WriteTree) -> None:
    cases = {
        "nodes: [a, nope], tp: 2": "unknown host or group 'nope' in nodes",
        "nodes: [a, pair], tp: 2": "host a is named twice in nodes",
        "nodes: [a, b, c], tp: 16": "tp 16 x dp 1 = 16 GPUs do not split evenly over 3 nodes",
        # per node: each host says it is short
        "nodes: [a, b], tp: 32": "needs 16 GPUs (tp 32 x dp 1 over 2 nodes x 1 replica(s)) but host a",
    }
    for fields, expected in cases.items():
        plan = plan_of(write_tree, f"{{name: s, engine: sglang, model: /m, {fields}}}")
        found = [m for m in messages(plan) if expected in m]
        assert len(found) == 1, (fields, messages(plan))
        assert "playbooks/p.yaml" in found[0] and "service s" in found[0]
    outside = plan_of(
        write_tree, "{name: s, engine: sglang, model: /m, nodes: [a, c], tp: 2}", hosts="pair"
    )
    assert any("nodes c are not hosts this playbook targets" in m for m in messages(outside))


def test_selecting_one_node_of_a_unit_is_refused(write_tree: WriteTree) -> None:
    plan = plan_of(
        write_tree, "{name: s, engine: sglang, model: /m, nodes: [a, b], tp: 2}", only=["a"]
    )
    assert any(
        "spans a, b, but b are not selected: select every node of it" in m for m in messages(plan)
    ), messages(plan)


def test_the_rendezvous_port_is_the_heads_own(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "inventory.yaml": INVENTORY,
            "playbooks/p.yaml": (
                "name: p\nhosts: pair\nservices:\n"
                "  - {name: s, engine: sglang, model: /m, nodes: [a, b], tp: 2, dist_port: 31000}\n"
                "  - {name: t, engine: sglang, model: /m, port: 31000, gpus: [7]}\n"
            ),
        }
    )
    plan = build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks" / "p.yaml")]
    )
    assert any(
        "rendezvous port 31000 is also used by" in m or "port 31000 is also used by" in m
        for m in messages(plan)
    ), messages(plan)


def test_replicas_over_nodes_and_a_bad_interface_name_are_config_errors(
    write_tree: WriteTree,
) -> None:
    import pytest

    from dflashops.errors import ConfigError

    root = write_tree(
        {
            "inventory.yaml": INVENTORY,
            "playbooks/p.yaml": (
                "name: p\nhosts: pair\nservices:\n"
                "  - {name: s, engine: sglang, model: /m, nodes: [a, b], replicas: 2}\n"
            ),
            "bad/inventory.yaml": "hosts:\n  a: {address: 10.0.0.1, net_if: 'eth 0'}\n",
        }
    )
    with pytest.raises(ConfigError, match="one replica"):
        load_playbook(root / "playbooks" / "p.yaml")
    with pytest.raises(ConfigError, match="not a network interface name"):
        load_inventory(root / "bad" / "inventory.yaml")


def job_plan(write_tree: WriteTree, job: str) -> Plan:
    root = write_tree(
        {
            "inventory.yaml": INVENTORY,
            "train.py": "print('training')\n",
            "playbooks/p.yaml": f"name: p\nhosts: all\njobs:\n  - {job}\n",
        }
    )
    return build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks" / "p.yaml")]
    )


def test_a_torchrun_job_over_two_nodes_has_torchruns_own_flags_on_each(
    write_tree: WriteTree,
) -> None:
    plan = job_plan(
        write_tree,
        "{name: train, script: ../train.py, launcher: torchrun, nodes: [a, b], gpus: 4,"
        " dist_port: 29511, args: {epochs: 3}}",
    )
    assert messages(plan) == []
    env = make_environment([])
    for host, rank, nic in (("a", "0", "ens1"), ("b", "1", "ib0")):
        (u,) = plan.hosts[host].units
        assert (u.rank, len(u.gpus)) == (int(rank), 4)
        script = render_unit(env, u).script
        assert (
            f"--nnodes 2 --node-rank {rank} --master-addr 10.0.0.10 --master-port 29511 "
            "--nproc-per-node 4 " in script
        )
        assert script.rstrip().endswith("/train.py --epochs 3")
        assert '"$(command -v ' in script and "else echo torchrun; fi)" in script
        assert f"export NCCL_SOCKET_IFNAME={nic}" in script
    assert plan.hosts["c"].units == []


def test_torchrun_on_one_node_and_the_mistakes_around_it(write_tree: WriteTree) -> None:
    import pytest

    from dflashops.errors import ConfigError

    plan = job_plan(write_tree, "{name: t, script: ../train.py, launcher: torchrun, gpus: 2}")
    assert messages(plan) == []
    script = render_unit(make_environment([]), plan.hosts["a"].units[0]).script
    assert "--nnodes 1 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500" in script
    assert "--nproc-per-node 2" in script
    for job, why in (
        ("{name: t, script: ../train.py, nodes: [a, b]}", "needs `launcher: torchrun`"),
        ("{name: t, command: [echo], launcher: torchrun}", "runs a Python `script`"),
    ):
        with pytest.raises(ConfigError, match=why):
            job_plan(write_tree, job)
    unknown = job_plan(
        write_tree, "{name: t, script: ../train.py, launcher: torchrun, nodes: [a, x]}"
    )
    assert any(
        "unknown host or group 'x' in nodes" in m and "job t" in m for m in messages(unknown)
    )


def test_vllm_native_over_two_nodes_headless_on_the_other_and_its_host_ip(
    write_tree: WriteTree,
) -> None:
    plan = plan_of(
        write_tree,
        "{name: big, engine: vllm, model: /m, nodes: [a, b], backend: native, tp: 8, pp: 2,"
        " port: 8000, dist_port: 29600}",
    )
    assert messages(plan) == []
    env = make_environment([])
    for host, rank, ip in (("a", "0", "10.0.0.10"), ("b", "1", "203.0.113.11")):
        (u,) = plan.hosts[host].units
        assert len(u.gpus) == 8  # tp 8 x pp 2 over 2 nodes
        args = launch_for(u).engine_args
        assert (
            "--pipeline-parallel-size" in args
            and args[args.index("--pipeline-parallel-size") + 1] == "2"
        )
        tail = [
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "10.0.0.10",
            "--master-port",
            "29600",
        ]
        assert args[args.index("--nnodes") : args.index("--nnodes") + 8] == tail
        assert ("--headless" in args) == (rank == "1") and ("--port" in args) == (rank == "0")
        assert f"export VLLM_HOST_IP={ip}" in render_unit(env, u).script


def test_vllm_over_nodes_needs_a_backend_and_an_even_split(write_tree: WriteTree) -> None:
    import pytest

    from dflashops.errors import ConfigError

    with pytest.raises(ConfigError, match="needs `backend: native` or `backend: ray`"):
        plan_of(write_tree, "{name: v, engine: vllm, model: /m, nodes: [a, b]}")
    with pytest.raises(ConfigError, match="must be one of native, ray"):
        plan_of(write_tree, "{name: v, engine: vllm, model: /m, nodes: [a, b], backend: mpi}")
    uneven = plan_of(
        write_tree,
        "{name: v, engine: vllm, model: /m, nodes: [a, b, c], backend: native, tp: 2, pp: 2}",
    )
    assert any(
        "tp 2 x pp 2 x dp 1 = 4 GPUs do not split evenly over 3 nodes" in m
        for m in messages(uneven)
    )


def test_vllm_over_ray_a_ray_node_on_each_host_and_the_api_server_on_the_first(
    write_tree: WriteTree,
) -> None:
    plan = plan_of(
        write_tree,
        "{name: big, engine: vllm, model: /m, nodes: [a, b], backend: ray, tp: 4, pp: 2,"
        " port: 8000, dist_port: 6380, ready: {timeout: 15m}}",
    )
    assert messages(plan) == []
    env = make_environment([])
    head_ray, server = plan.hosts["a"].units
    (worker_ray,) = plan.hosts["b"].units
    assert [u.name for u in (head_ray, server, worker_ray)] == ["big-ray", "big-0", "big-ray"]
    assert (head_ray.rank, worker_ray.rank, server.rank) == (0, 1, None)
    assert len(head_ray.gpus) == len(worker_ray.gpus) == 4 and server.gpus == ()
    assert server.port == 8000 and head_ray.port is None and worker_ray.port is None

    head = launch_for(head_ray)
    assert head.stop_leader and head.health_path is None
    argv = render_unit(env, head_ray).script
    assert "start --block --head --port 6380 --node-ip-address 10.0.0.10 --num-gpus 4" in argv
    assert "/tmp/dflashops-ray-" in argv and "--disable-usage-stats" in argv
    worker = render_unit(env, worker_ray).script
    assert "--address 10.0.0.10:6380 --node-ip-address 203.0.113.11 --num-gpus 4" in worker
    assert "export VLLM_HOST_IP=203.0.113.11" in worker
    # Each node's Ray gets its own temp folder (two clusters on one machine never share one).
    assert launch_for(head_ray).argv[-2] != launch_for(worker_ray).argv[-2]

    served = launch_for(server)
    assert served.engine_args[-2:] == ["--distributed-executor-backend", "ray"]
    assert "--nnodes" not in served.engine_args and not served.stop_leader
    script = render_unit(env, server).script
    assert (
        "--address 10.0.0.10:6380 --node 10.0.0.10 --node 203.0.113.11 --gpus 8 --timeout 900 --"
        in script
    )
    assert "export RAY_ADDRESS=10.0.0.10:6380" in script
    # It holds no GPU, but sees its node's (as `vllm serve` on a Ray head does).
    assert f"export CUDA_VISIBLE_DEVICES={','.join(map(str, head_ray.gpus))}" in script
    assert [f.name for f in served.files] == ["ray_cluster.py"]


def test_vllm_over_ray_checks_the_split_and_the_ray_port_like_any_multi_node_unit(
    write_tree: WriteTree,
) -> None:
    short = plan_of(
        write_tree,
        "{name: big, engine: vllm, model: /m, nodes: [a, b], backend: ray, tp: 8, pp: 4}",
    )
    assert any("needs 16 GPUs" in m and "host a has" in m for m in messages(short)), messages(short)
