"""A service over two nodes on real sshd hosts at distinct loopback addresses: SGLang's own
multi-node launch (the fake SGLang does a real TCP rendezvous: the head is ready only once every
rank has connected), live pre-flight's rendezvous check, deploy, status, no-op, stop."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import MODEL, READY, Ops, http_json, unit_dir

from tests.conftest import unless
from tests.procs import free_ports, http_status, wait_for


def two_node_book(port: int, dist: int, model: str = MODEL) -> dict[str, object]:
    return {
        "hosts": ["h0", "h1"],
        "services": [
            {
                "name": "big",
                "engine": "sglang",
                "model": model,
                "nodes": ["h0", "h1"],
                "tp": 4,
                "port": port,
                "dist_port": dist,
                "ready": READY,
                "stop_grace": "2s",
            }
        ],
    }


def test_a_two_node_sglang_service_deploys_shows_its_ranks_and_stops_on_both_hosts(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    ctl = ops(fleet)
    port, dist = free_ports(1), free_ports(1)
    model = fleet["h0"].dir / "models" / "big"  # one path, there on both hosts (one machine)
    model.mkdir(parents=True)
    ctl.playbook("big", two_node_book(port, dist, str(model)))
    head = fleet["h0"].address

    live = ctl.run("preflight", "--live", json_events=False)
    assert live.code == 0, live.out
    assert f"h1 reached {head}:{dist}" in live.out or "checks passed" in live.out, live.out

    up = ctl.run("deploy")
    assert up.code == 0, up.explain()
    assert up.of("big-0", host="h0", action="ready", status="changed"), up.explain()
    assert up.of("big-0", host="h1", action="start", status="changed"), up.explain()
    info = http_json(port, "/server_info")
    assert (info["tp_size"], info["nnodes"], info["node_rank"]) == (4, 2, 0)
    worker_log = (unit_dir(fleet["h1"], "big-0") / "logs" / "current.log").read_text()
    assert f"node 1 of 2 (h0,h1); rendezvous at {head}:{dist}" in worker_log
    assert "--node-rank 1" in worker_log and "Init torch distributed ends." in worker_log

    status = ctl.run("status", json_events=False)
    assert status.code == 0, status.out
    rows = [line for line in status.out.splitlines() if "big-0" in line]
    assert any("h0" in r and "big-0 [rank 0/2]" in r and "ready" in r for r in rows), status.out
    assert any("h1" in r and "big-0 [rank 1/2]" in r for r in rows), status.out

    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert {e["status"] for e in again.events if e["unit"] == "big-0"} == {"ok"}, again.explain()

    # With the head running, live pre-flight finds the port held by the unit itself: fine.
    assert ctl.run("preflight", "--live", json_events=False).code == 0

    down = ctl.run("stop")
    assert down.code == 0, down.explain()
    for h in ("h0", "h1"):
        assert down.of("big-0", host=h, action="stop", status="changed"), down.explain()


def test_live_preflight_names_the_hosts_and_port_when_the_rendezvous_cannot_happen(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    port, dist = free_ports(1), free_ports(1)
    head = fleet["h0"].address
    # A foreign listener holds the dist port on the head's address.
    squatter = socket.socket()
    squatter.bind((head, dist))
    squatter.listen(1)
    try:
        ctl = ops(fleet)
        ctl.playbook("big", two_node_book(port, dist))
        live = ctl.run("preflight", "--live", json_events=False)
        assert live.code == 1, live.out
        assert "FAIL live-rendezvous" in live.out, live.out
        assert f"[h0] the head of big-0 cannot listen on {head}:{dist}" in live.out, live.out
        assert "where the ranks on h1 dial it" in live.out and f"port {dist} is taken" in live.out
        # Deploy checks the same first, and starts nothing: no rank waits for a head that
        # cannot be.
        refused = ctl.run("deploy")
        assert refused.code == 1, refused.explain()
        assert "cannot reach their head: nothing was started" in refused.out, refused.out
        assert not (unit_dir(fleet["h1"], "big-0") / "pid").exists()
    finally:
        squatter.close()

    # An internal_address that is not the head's: named, with the likely cause.
    ctl = ops(fleet, hosts={"h0": {"internal_address": "192.0.2.10"}, "h1": {"net_if": "nope0"}})
    ctl.playbook("big", two_node_book(port, dist))
    live = ctl.run("preflight", "--live", json_events=False)
    assert live.code == 1, live.out
    assert "cannot listen on 192.0.2.10" in live.out and "internal_address" in live.out, live.out
    assert "[h1] net_if nope0 (for big-0) is not an interface of the host" in live.out, live.out
    # Forced past it, the head cannot bind its rendezvous and dies: the unit fails on both
    # hosts at once with the head's log tail (not at the ready timeout), and nothing is left.
    ctl2 = ops(fleet, hosts={"h0": {"internal_address": "192.0.2.10"}, "h1": {}})
    ctl2.playbook("big", two_node_book(port, dist))
    forced = ctl2.run("deploy", "--force")
    assert forced.code != 0 and forced.seconds < 20, forced.explain()
    (head_died,) = forced.of("big-0", host="h0", action="ready", status="failed")
    assert "died while starting" in head_died["message"], forced.explain()
    (worker,) = forced.of("big-0", host="h1", action="ready", status="failed")
    assert "big failed: big-0 (rank 0 of 2) on h0: died while starting" in worker["message"]
    assert forced.of("big-0", host="h1", action="stop", status="changed"), forced.explain()


def test_a_torchrun_job_over_two_nodes_runs_every_rank_once_and_is_done_on_both(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    ctl = ops(fleet)
    out = fleet["h0"].dir / "ranks"  # one folder both hosts see (one machine)
    out.mkdir()
    (ctl.base / "playbooks" / "train.py").write_text(
        "import json, os, sys\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "info = {k: os.environ[k] for k in keys}\n"
        "with open(os.path.join(sys.argv[2], 'rank-%s.json' % info['RANK']), 'w') as f:\n"
        "    json.dump(info, f)\n"
    )
    dist = free_ports(1)
    ctl.playbook(
        "train",
        {
            "hosts": ["h0", "h1"],
            "jobs": [
                {
                    "name": "train",
                    "script": "train.py",
                    "launcher": "torchrun",
                    "nodes": ["h0", "h1"],
                    "gpus": 2,
                    "dist_port": dist,
                    "args": {"out": str(out)},
                    "stop_grace": "2s",
                }
            ],
        },
    )
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    for h in ("h0", "h1"):
        wait_for(
            f"train done on {h}",
            lambda h=h: (unit_dir(fleet[h], "train") / "exit").exists(),
            timeout=60,
        )
        assert json.loads((unit_dir(fleet[h], "train") / "exit").read_text())["code"] == 0
    ranks = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))}
    assert sorted(ranks) == [f"rank-{i}.json" for i in range(4)]
    assert {r["WORLD_SIZE"] for r in ranks.values()} == {"4"}
    assert {r["MASTER_ADDR"] for r in ranks.values()} == {fleet["h0"].address}
    assert {r["GROUP_RANK"] for r in ranks.values()} == {"0", "1"}
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert {e["status"] for e in again.events if e["unit"] == "train"} == {"ok"}, again.explain()


def test_a_two_node_vllm_service_on_vllms_native_backend(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    ctl = ops(fleet)
    port, dist = free_ports(1), free_ports(1)
    ctl.playbook(
        "big",
        {
            "hosts": ["h0", "h1"],
            "services": [
                {
                    "name": "big",
                    "engine": "vllm",
                    "model": MODEL,
                    "nodes": ["h0", "h1"],
                    "backend": "native",
                    "tp": 2,
                    "pp": 2,
                    "port": port,
                    "dist_port": dist,
                    "ready": READY,
                    "stop_grace": "2s",
                }
            ],
        },
    )
    up = ctl.run("deploy")
    assert up.code == 0, up.explain()
    assert up.of("big-0", host="h0", action="ready", status="changed"), up.explain()
    assert up.of("big-0", host="h1", action="ready", status="changed"), up.explain()
    roots = [m["root"] for m in http_json(port, "/v1/models")["data"]]
    assert roots == [MODEL]
    worker_log = (unit_dir(fleet["h1"], "big-0") / "logs" / "current.log").read_text()
    assert "--headless" in worker_log and "--node-rank 1" in worker_log
    script = (unit_dir(fleet["h1"], "big-0") / "launch.sh").read_text()
    assert f"export VLLM_HOST_IP={fleet['h1'].address}" in script
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert {e["status"] for e in again.events if e["unit"] == "big-0"} == {"ok"}, again.explain()
    down = ctl.run("stop")
    assert down.code == 0, down.explain()
    for h in ("h0", "h1"):
        assert down.of("big-0", host=h, action="stop", status="changed"), down.explain()


REPO = Path(__file__).resolve().parents[2]


def ray_wheels() -> Path | None:
    """The wheels of the test venv's Ray and its dependencies, downloaded once by
    dev/ray-wheels.sh (dev/test.sh runs it): the hosts' Ray environment is built from them."""
    try:
        version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None
    folder = REPO / ".wheels" / f"ray-{version}"
    return folder if folder.with_name(f"{folder.name}.done").exists() else None


RAY_WHEELS = ray_wheels()
NO_RAY = "no Ray wheels beside .venv: run bash dev/ray-wheels.sh (dev/test.sh does)"
RAY_ENV = "~/venv-ray"  # each host's own HOME: a build per host, as on real nodes


def with_uv(*hosts: FleetHost) -> None:
    """uv on the hosts: it installs Ray's 240 MB in seconds where pip takes much longer."""
    uv = Path(sys.executable).parent / "uv"
    for host in hosts:
        (host.bin_dir / "uv").symlink_to(uv)


def ray_book(
    model: Path, port: int, gcs: int, services: bool = True, **extra: object
) -> dict[str, object]:
    """A vLLM service over a Ray cluster of h0 and h1: tp 2 x pp 2, 2 GPUs a node, in an
    environment dflashops builds from the Ray wheels (`ray` runs from its bin/)."""
    assert RAY_WHEELS is not None, NO_RAY
    service = {
        "name": "big",
        "engine": "vllm",
        "model": str(model),
        "nodes": ["h0", "h1"],
        "backend": "ray",
        "tp": 2,
        "pp": 2,
        "port": port,
        "dist_port": gcs,
        "ready": {"timeout": "120s", "interval": "0.5s"},
        "stop_grace": "20s",
        "environment": "ray",
    }
    env = {
        "path": RAY_ENV,
        # The interpreter the wheels were downloaded for (the fake vLLM comes from PYTHONPATH).
        "python": sys.executable,
        "packages": [f"ray=={importlib.metadata.version('ray')}"],
        "wheels": str(RAY_WHEELS),
    }
    return {
        "hosts": ["h0", "h1"],
        "environments": {"ray": env},
        "services": [{**service, **extra}] if services else [],
    }


def env_build(host: FleetHost) -> Path:
    return Path(os.path.realpath(host.home_dir / "venv-ray"))


@unless(RAY_WHEELS is not None, NO_RAY)
def test_a_two_node_vllm_service_over_a_real_ray_cluster(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """Real Ray (the `ray` CLI of the environment dflashops built on each host): a head and a
    worker node as units big-ray on h0 and h1, then the API server big-0 on h0, which the fake
    vLLM serves only once its placement group of tp x pp GPUs fits on the cluster."""
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    with_uv(fleet["h0"], fleet["h1"])
    ctl = ops(fleet)
    port, gcs = free_ports(1), free_ports(1)
    model = fleet["h0"].dir / "models" / "big"  # Ray's workers load it on every node
    model.mkdir(parents=True)
    ctl.playbook(
        "big",
        ray_book(
            model,
            port,
            gcs,
            restart_backoff={"initial": "1s", "max": "2s"},
            # Ray's own: how long a node waits for a lost GCS (60 s by default).
            env={"RAY_gcs_rpc_server_reconnect_timeout_s": "5"},
        ),
    )
    live = ctl.run("preflight", "--live", json_events=False)
    assert live.code == 0, live.out

    up = ctl.run("deploy")
    assert up.code == 0, up.explain()
    for h in ("h0", "h1"):
        assert up.of("big-ray", host=h, action="start", status="changed"), up.explain()
        # `ray start` runs from the environment's bin/: its script's shebang names the build.
        leader = json.loads((unit_dir(fleet[h], "big-ray") / "supervisor.json").read_text())
        argv = Path(f"/proc/{leader['child_pid']}/cmdline").read_bytes().split(b"\0")
        build = env_build(fleet[h])
        assert [os.fsdecode(a) for a in argv[:2]] == [f"{build}/bin/python", f"{build}/bin/ray"]
    assert up.of("big-0", host="h0", action="ready", status="changed"), up.explain()
    assert not [e for e in up.events if e["host"] == "h1" and e["unit"] == "big-0"]
    roots = [m["root"] for m in http_json(port, "/v1/models")["data"]]
    assert roots == [str(model)]
    server_log = (unit_dir(fleet["h0"], "big-0") / "logs" / "current.log").read_text()
    assert "ray cluster: 2 of 2 nodes, 4 of 4 GPUs: complete" in server_log, server_log
    assert "4 Ray workers on 2 node(s)" in server_log, server_log
    assert "--distributed-executor-backend ray" in server_log
    head_script = (unit_dir(fleet["h0"], "big-ray") / "launch.sh").read_text()
    worker_script = (unit_dir(fleet["h1"], "big-ray") / "launch.sh").read_text()
    assert f"--head --port {gcs}" in head_script
    assert f"--address {fleet['h0'].address}:{gcs}" in worker_script
    assert f"--node-ip-address {fleet['h1'].address}" in worker_script

    status = ctl.run("status")
    assert status.code == 0 and status.document is not None, status.out
    rows = {(r["host"], r["unit"]): r for r in status.document["units"]}
    assert (rows[("h0", "big-ray")]["rank"], rows[("h1", "big-ray")]["rank"]) == (0, 1), rows
    assert rows[("h0", "big-0")]["rank"] is None and rows[("h0", "big-0")]["state"] == "ready"
    assert "big-ray [rank 1/2]" in status.out, status.out

    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert {e["status"] for e in again.events if e["unit"]} <= {"ok", "info"}, again.explain()

    # vLLM asking the cluster for more GPUs than it has is refused (the reason the API server
    # waits for every node first).
    python = str(env_build(fleet["h0"]) / "bin" / "python")
    greedy = subprocess.run(
        [
            *(python, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "-tp", "8"),
            *("--distributed-executor-backend", "ray", "--port", str(free_ports(1))),
        ],
        env={**fleet["h0"].env(), "RAY_ADDRESS": f"{fleet['h0'].address}:{gcs}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert greedy.returncode == 1, greedy.stdout + greedy.stderr
    assert "The number of required GPUs exceeds the total number" in greedy.stderr
    assert "(required 8, the cluster has 4)" in greedy.stderr

    # A node that crashes after ready: its supervisor ends what is left of it (Ray's raylet
    # goes, the cluster marks the node dead), the API server's Ray workers die with it and the
    # server exits; both supervisors restart their part and the unit forms again.
    server_restarts = restarts_of(fleet["h0"], "big-0")
    ray_leader = json.loads((unit_dir(fleet["h1"], "big-ray") / "supervisor.json").read_text())
    os.kill(int(ray_leader["child_pid"]), signal.SIGKILL)
    wait_for(
        "the API server to restart and serve again",
        lambda: (
            restarts_of(fleet["h0"], "big-0") > server_restarts
            and restarts_of(fleet["h1"], "big-ray") >= 1
            and healthy(port)
        ),
        timeout=90,
        every=0.5,
    )
    server_log = (unit_dir(fleet["h0"], "big-0") / "logs" / "current.log").read_text()
    assert "ray cluster: 2 of 2 nodes, 4 of 4 GPUs: complete" in server_log, server_log

    # The head crashes: the API server loses its cluster and exits, the worker node loses its
    # GCS and ends (Ray's own reconnect timeout, shortened here); every supervisor restarts
    # its part and the worker joins the new head.
    worker_restarts = restarts_of(fleet["h1"], "big-ray")
    server_restarts = restarts_of(fleet["h0"], "big-0")
    head_leader = json.loads((unit_dir(fleet["h0"], "big-ray") / "supervisor.json").read_text())
    os.kill(int(head_leader["child_pid"]), signal.SIGKILL)
    wait_for(
        "every part to restart and the server to serve again",
        lambda: (
            restarts_of(fleet["h1"], "big-ray") > worker_restarts
            and restarts_of(fleet["h0"], "big-0") > server_restarts
            and healthy(port)
        ),
        timeout=120,
        every=0.5,
    )

    down = ctl.run("stop")
    assert down.code == 0, down.explain()
    for h, unit in (("h0", "big-0"), ("h0", "big-ray"), ("h1", "big-ray")):
        stopped = down.of(unit, host=h, action="stop", status="changed")
        assert stopped and "by SIGTERM" in stopped[0]["message"], down.explain()


@unless(RAY_WHEELS is not None, NO_RAY)
def test_a_ray_node_that_cannot_start_fails_the_whole_unit_at_once_on_every_host(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """h1's environment lost its `ray` script and none is on its PATH: its Ray node dies at
    once. The API server on h0, waiting for the cluster, fails then too (not at its 120 s
    ready timeout), naming h1's rank and its log tail, and every part stops on both hosts."""
    fleet = fleet_factory(h0={"gpus": 2}, h1={"gpus": 2})
    with_uv(fleet["h0"], fleet["h1"])
    ctl = ops(fleet)
    port, gcs = free_ports(1), free_ports(1)
    model = fleet["h0"].dir / "models" / "big"
    model.mkdir(parents=True)
    ctl.playbook("big", ray_book(model, port, gcs, services=False))
    built = ctl.run("deploy")
    assert built.code == 0, built.explain()
    (env_build(fleet["h1"]) / "bin" / "ray").unlink()
    ctl.playbook("big", ray_book(model, port, gcs))
    up = ctl.run("deploy")
    assert up.code != 0, up.explain()
    assert up.seconds < 60, up.explain()
    (dead,) = up.of("big-ray", host="h1", action="ready", status="failed")
    assert "died while starting" in dead["message"] and "ray" in dead["message"], up.explain()
    (server,) = up.of("big-0", host="h0", action="ready", status="failed")
    assert "big failed: big-ray (rank 1 of 2) on h1: died while starting" in server["message"]
    assert up.of("big-ray", host="h0", action="ready", status="failed"), up.explain()
    for h, unit in (("h0", "big-0"), ("h0", "big-ray")):
        (stopped,) = up.of(unit, host=h, action="stop", status="changed")
        assert "stopped with the rest of big" in stopped["message"], up.explain()
    status = ctl.run("status")
    assert status.document is not None, status.explain()
    states = {(r["host"], r["unit"]): r["state"] for r in status.document["units"]}
    assert all(state in ("stopped", "failed", "exited", "crashed") for state in states.values()), (
        states
    )


def restarts_of(host: FleetHost, unit: str) -> int:
    try:
        return int(json.loads((unit_dir(host, unit) / "supervisor.json").read_text())["restarts"])
    except (OSError, ValueError, KeyError):
        return 0


def healthy(port: int) -> bool:
    try:
        return http_status(port, "/health", timeout=1) == 200
    except OSError:  # refused: not listening (yet, or any more)
        return False


def test_a_rolling_restart_restarts_a_two_node_unit_as_one_replica_on_both_hosts(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """The ranks of `big` restart together on h0 and h1 (one step of the roll, met on both
    hosts), before h0's own replica `solo-0`, which restarts only once `big` is ready again."""
    fleet = fleet_factory(h0={"gpus": 3}, h1={"gpus": 2})
    ctl = ops(fleet)
    port, dist, solo = free_ports(1), free_ports(1), free_ports(1)
    model = fleet["h0"].dir / "models" / "big"
    model.mkdir(parents=True)
    # solo comes first in h0's own order, and takes 4 s to be ready: a roll that took units
    # one by one per host would restart big's head 4 s after its worker.
    slow = {"DFLASHOPS_STUB_STARTUP_SECONDS": "4"}
    solo_book = {"name": "solo", "engine": "stub", "model": MODEL, "port": solo, "env": slow}
    ctl.playbook("solo", {"hosts": ["h0"], "services": [{**solo_book, "ready": READY}]})
    ctl.playbook("big", two_node_book(port, dist, str(model)))
    up = ctl.run("deploy")
    assert up.code == 0, up.explain()

    roll = ctl.run("restart-servers")
    assert roll.code == 0, roll.explain()
    (head,) = roll.of("big-0", host="h0", action="restart", status="changed")
    (worker,) = roll.of("big-0", host="h1", action="restart", status="changed")
    (ready,) = roll.of("big-0", host="h0", action="ready", status="changed")
    (alone,) = roll.of("solo-0", host="h0", action="restart", status="changed")
    assert abs(head["time"] - worker["time"]) < 3.0, roll.explain()  # together
    assert ready["time"] <= alone["time"], roll.explain()  # one replica at a time
    assert http_json(port, "/server_info")["nnodes"] == 2
