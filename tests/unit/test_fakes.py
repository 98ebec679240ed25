"""The GPU-host doubles in tests/fakes, run the way the sshd test fleet runs them.

Everything runs under the hosts' bare interpreter (/usr/bin/python3 when present) with
PYTHONPATH=tests/fakes/pylib and FAKE_GPU_STATE=<tmp dir>, never importing dflashops.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))
import harness
from harness import HOST_PYTHON, Proc, free_port, host_env, request, run, scrape

B200_MIB = 183359
UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def smi(state: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run([HOST_PYTHON, str(harness.NVIDIA_SMI), *args], host_env(state, **env))


def smi_rows(state: Path, query: str, fields: str) -> list[list[str]]:
    result = smi(state, f"--query-{query}={fields}", "--format=csv,noheader,nounits")
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split(", ") for line in result.stdout.splitlines()]


def used_by_gpu(state: Path) -> dict[int, int]:
    return {int(i): int(m) for i, m in smi_rows(state, "gpu", "index,memory.used")}


def apps(state: Path) -> list[tuple[int, str, int]]:
    rows = smi_rows(state, "compute-apps", "pid,gpu_uuid,used_memory")
    return [(int(p), u, int(m)) for p, u, m in rows]


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def load_fakegpu():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "_fakegpu_under_test", harness.PYLIB / "_fakegpu.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- nvidia-smi


def test_query_gpu_defaults(tmp_path: Path) -> None:
    rows = smi_rows(tmp_path, "gpu", "index,uuid,name,memory.used,memory.total")
    assert len(rows) == 8
    for i, (index, uuid, name, used, total) in enumerate(rows):
        assert (index, name, used, total) == (str(i), "NVIDIA B200", "0", str(B200_MIB))
        assert UUID.match(uuid)
    assert len({r[1] for r in rows}) == 8
    # deterministic per host directory, different across hosts
    assert smi_rows(tmp_path, "gpu", "uuid") == [[r[1]] for r in rows]
    other = tmp_path / "other-host"
    other.mkdir()
    assert smi_rows(other, "gpu", "uuid")[0] != [rows[0][1]]


def test_query_gpu_config_order_and_units(tmp_path: Path) -> None:
    write_json(
        tmp_path / "config.json",
        {"count": 2, "name": "NVIDIA RTX PRO 6000", "memory_total_mib": 97887},
    )
    assert smi_rows(tmp_path, "gpu", "memory.total,gpu_name,index") == [
        ["97887", "NVIDIA RTX PRO 6000", "0"],
        ["97887", "NVIDIA RTX PRO 6000", "1"],
    ]
    result = smi(tmp_path, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv")
    assert result.stdout.splitlines() == [
        "index, memory.used [MiB], utilization.gpu [%]",
        "0, 0 MiB, 0 %",
        "1, 0 MiB, 0 %",
    ]
    rows = smi_rows(tmp_path, "gpu", "pci.bus_id,driver_version")
    assert re.match(r"^[0-9A-F]{8}:[0-9A-F]{2}:00\.0$", rows[0][0]) and rows[0][1]
    listed = smi(tmp_path, "-L").stdout.splitlines()
    assert len(listed) == 2
    assert re.match(r"^GPU 1: NVIDIA RTX PRO 6000 \(UUID: GPU-[0-9a-f-]+\)$", listed[1])
    assert smi_rows(tmp_path, "gpu", "index") == [["0"], ["1"]]
    assert smi(tmp_path, "-i", "1", "--query-gpu=index", "--format=csv,noheader").stdout == "1\n"


def test_unknown_field_and_bare_table(tmp_path: Path) -> None:
    bad = smi(tmp_path, "--query-gpu=index,xyz", "--format=csv")
    assert bad.returncode == 2
    assert bad.stdout.strip() == 'Field "xyz" is not a valid field to query.'
    bad_app = smi(tmp_path, "--query-compute-apps=pid,bogus", "--format=csv")
    assert bad_app.returncode == 2 and 'Field "bogus"' in bad_app.stdout
    table = smi(tmp_path)
    assert table.returncode == 0
    assert "NVIDIA B200" in table.stdout and "No running processes found" in table.stdout


def test_runs_directly_as_an_executable(tmp_path: Path) -> None:
    assert os.access(harness.NVIDIA_SMI, os.X_OK)
    result = run(["nvidia-smi", "-L"], host_env(tmp_path))  # found through the host PATH
    assert result.returncode == 0 and result.stdout.count("GPU ") == 8


# ----------------------------------------------------------------------------- GPU state


def test_registered_process_counts_until_it_dies(tmp_path: Path) -> None:
    code = "import _fakegpu, time; _fakegpu.register(1234); print('registered', flush=True); time.sleep(60)"
    proc = Proc([HOST_PYTHON, "-c", code], host_env(tmp_path, CUDA_VISIBLE_DEVICES="1,3"))
    try:
        proc.wait_for_line("registered")
        assert used_by_gpu(tmp_path) == {0: 0, 1: 1234, 2: 0, 3: 1234, 4: 0, 5: 0, 6: 0, 7: 0}
        rows = apps(tmp_path)
        uuids = {int(i): u for i, u in smi_rows(tmp_path, "gpu", "index,uuid")}
        assert rows == [(proc.pid, uuids[1], 1234), (proc.pid, uuids[3], 1234)]
        names = smi_rows(tmp_path, "compute-apps", "process_name")
        assert all("python" in n[0] for n in names)
        entry = json.loads((tmp_path / "procs" / f"{proc.pid}.json").read_text())
        assert entry["pid"] == proc.pid and entry["gpus"] == [1, 3] and entry["used_mib"] == 1234
    finally:
        proc.stop(signal.SIGKILL)  # no atexit cleanup: readers must expire the entry
    assert (tmp_path / "procs" / f"{proc.pid}.json").exists()
    assert apps(tmp_path) == []
    assert not (tmp_path / "procs" / f"{proc.pid}.json").exists()
    assert set(used_by_gpu(tmp_path).values()) == {0}


def test_clean_exit_unregisters(tmp_path: Path) -> None:
    code = "import _fakegpu; p = _fakegpu.register(); assert p.exists(); print(p)"
    result = run([HOST_PYTHON, "-c", code], host_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).exists()


def test_dead_zombie_and_reused_pids_expire(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    zombie = subprocess.Popen(["true"])  # not waited for until the end: stays a zombie
    try:
        deadline = time.monotonic() + 5
        while "Z" not in Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        procs = tmp_path / "procs"
        write_json(procs / f"{gone.pid}.json", {"pid": gone.pid, "gpus": [0], "used_mib": 10})
        write_json(procs / f"{zombie.pid}.json", {"pid": zombie.pid, "gpus": [1], "used_mib": 20})
        reused = {"pid": os.getpid(), "gpus": [2], "used_mib": 30, "start_time": "1"}
        write_json(procs / f"{os.getpid()}.json", reused)
        alive = {"pid": os.getpid(), "gpus": [3], "used_mib": 40}  # no start_time: pid only
        write_json(procs / "alive.json", alive)
        assert apps(tmp_path) == [(os.getpid(), smi_rows(tmp_path, "gpu", "uuid")[3][0], 40)]
        assert sorted(p.name for p in procs.iterdir()) == ["alive.json"]
    finally:
        zombie.wait()


def test_held_memory_never_expires(tmp_path: Path) -> None:
    held = {"pid": 9999999, "gpus": [4, 5], "used_mib": 70123}
    write_json(tmp_path / "held" / "leak.json", held)
    for _ in range(2):
        assert used_by_gpu(tmp_path)[4] == 70123 and used_by_gpu(tmp_path)[5] == 70123
        assert [(p, m) for p, _, m in apps(tmp_path)] == [(9999999, 70123)] * 2
    assert (tmp_path / "held" / "leak.json").exists()
    assert smi_rows(tmp_path, "gpu", "memory.free")[4] == [str(B200_MIB - 70123)]


def test_visible_gpus_and_no_state(monkeypatch: pytest.MonkeyPatch) -> None:
    fakegpu = load_fakegpu()
    cfg = {"count": 8, "name": "x", "memory_total_mib": 1}
    assert fakegpu.visible_gpus(cfg, {}) == list(range(8))
    assert fakegpu.visible_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "4,5"}) == [4, 5]
    assert fakegpu.visible_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "0,9,2"}) == [0]  # CUDA stops
    assert fakegpu.visible_gpus(cfg, {"CUDA_VISIBLE_DEVICES": ""}) == []
    monkeypatch.delenv("FAKE_GPU_STATE", raising=False)
    assert fakegpu.register(100) is None
    assert fakegpu.read_state()["apps"] == []


# ----------------------------------------------------------------------------- fake sglang


def sglang_argv(*flags: str) -> list[str]:
    return [HOST_PYTHON, "-m", "sglang.launch_server", *flags]


def test_fake_sglang_rejects_tp(tmp_path: Path) -> None:
    result = run(sglang_argv("--model-path", "M", "--tp", "2"), host_env(tmp_path))
    assert result.returncode == 2
    assert "launch_server.py: error: unrecognized arguments: --tp 2" in result.stderr
    result = run(sglang_argv("--model-path", "M", "--dp=2"), host_env(tmp_path))
    assert result.returncode == 2 and "unrecognized arguments: --dp=2" in result.stderr
    assert not (tmp_path / "procs").exists()


def test_fake_sglang_serves_and_holds_gpu_memory(tmp_path: Path) -> None:
    port = free_port()
    flags = [
        "--model-path", "/dev/shm/Qwen3.6-27B", "--host", "127.0.0.1", "--port", str(port),
        "--tp-size", "2", "--dp-size", "1", "--mem-fraction-static", "0.5",
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
        "--chunked-prefill-size", "4096", "--enable-torch-compile", "--cuda-graph-max-bs-decode=64",
    ]  # fmt: skip
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="2,3,5", DFLASHOPS_STUB_STARTUP_SECONDS="0.1")
    proc = Proc(sglang_argv(*flags), env)
    try:
        proc.wait_http(port)
        proc.wait_for_line("The server is fired up and ready to roll!")
        info = request(port, "GET", "/server_info").json()
        assert (info["tp_size"], info["dp_size"], info["port"]) == (2, 1, port)
        assert info["model_path"] == "/dev/shm/Qwen3.6-27B"
        assert info["speculative_algorithm"] == "NEXTN"
        used = used_by_gpu(tmp_path)
        assert used[2] == used[3] == int(0.5 * B200_MIB) and used[5] == 0
        assert {p for p, _, _ in apps(tmp_path)} == {proc.pid}
    finally:
        code = proc.stop()
    assert code == 0
    assert apps(tmp_path) == []
    assert "server_args=ServerArgs(" in proc.output


def test_fake_sglang_serves_sglang_metrics(tmp_path: Path) -> None:
    port = free_port()
    flags = ["--model-path", "M", "--port", str(port), "--served-model-name", "qwen36"]
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="0", DFLASHOPS_STUB_STARTUP_SECONDS="0.05")
    proc = Proc(sglang_argv(*flags, "--enable-metrics"), env)
    try:
        proc.wait_http(port)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert request(port, "POST", "/v1/chat/completions", body).status == 200
        metrics = scrape(port)
    finally:
        assert proc.stop() == 0
    assert metrics["sglang:gen_throughput"][:2] == ("gauge", {"model_name": "qwen36"})
    assert metrics["sglang:gen_throughput"][2] > 0
    assert metrics["sglang:generation_tokens_total"][2] == 8
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
        assert metrics[name][0] == "gauge"
    assert not [name for name in metrics if name.startswith("vllm:")]


def test_fake_sglang_needs_enough_gpus(tmp_path: Path) -> None:
    flags = ("--model-path", "M", "--tp-size", "2", "--port", str(free_port()))
    result = run(sglang_argv(*flags), host_env(tmp_path, CUDA_VISIBLE_DEVICES="0"))
    assert result.returncode == 1
    assert "RuntimeError: CUDA error: invalid device ordinal" in result.stderr
    flags = ("--model-path", "M", "--base-gpu-id", "7", "--dp-size", "2", "--port", "1")
    assert run(sglang_argv(*flags), host_env(tmp_path)).returncode == 1


# ----------------------------------------------------------------------------- fake vllm


def vllm_argv(*args: str) -> list[str]:
    return [HOST_PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", *args]


def test_fake_vllm_rejects_unknown_flag(tmp_path: Path) -> None:
    result = run(vllm_argv("M", "--tp-size", "2"), host_env(tmp_path))
    assert result.returncode == 2
    assert "vllm: error: unrecognized arguments: --tp-size 2" in result.stderr
    version = run([HOST_PYTHON, "-m", "vllm.entrypoints.cli.main", "--version"], host_env())
    assert version.stdout.strip() == "0.33.0"


def test_fake_vllm_serves(tmp_path: Path) -> None:
    port = free_port()
    args = [
        "/models/target", "-tp", "2", "--port", str(port), "--api-key", "k",
        "--served-model-name", "target", "--gpu-memory-utilization", "0.5",
        "--max-model-len", "8192", "--no-enable-prefix-caching", "--enforce-eager",
    ]  # fmt: skip
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="6,7", DFLASHOPS_STUB_STARTUP_SECONDS="0.1")
    proc = Proc(vllm_argv(*args), env)
    try:
        proc.wait_http(port)
        proc.wait_for_line("Application startup complete.")
        banner = proc.wait_for_line("non-default args:")
        assert "'tensor_parallel_size': 2" in banner and "'data_parallel_size': 1" in banner
        assert "'k'" not in banner
        assert "vLLM API server version 0.33.0" in proc.output
        assert request(port, "GET", "/version").json()["version"].startswith("0.33.0")
        assert request(port, "GET", "/server_info").status == 404
        assert request(port, "GET", "/v1/models").status == 401
        models = request(port, "GET", "/v1/models", headers={"Authorization": "Bearer k"})
        card = models.json()["data"][0]
        assert (card["id"], card["root"], card["owned_by"]) == ("target", "/models/target", "vllm")
        assert card["max_model_len"] == 8192
        used = used_by_gpu(tmp_path)
        assert used[6] == used[7] == int(0.5 * B200_MIB) and used[0] == 0
    finally:
        assert proc.stop() == 0


def test_fake_vllm_serves_vllm_metrics(tmp_path: Path) -> None:
    port = free_port()
    args = ["/models/target", "--port", str(port), "--served-model-name", "target"]
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="0", DFLASHOPS_STUB_STARTUP_SECONDS="0.05")
    proc = Proc(vllm_argv(*args), env)
    try:
        proc.wait_http(port)
        body = {"model": "target", "prompt": "hi", "max_tokens": 8}
        assert request(port, "POST", "/v1/completions", body).status == 200
        metrics = scrape(port)
    finally:
        assert proc.stop() == 0
    labels = {"engine": "0", "model_name": "target"}
    assert metrics["vllm:generation_tokens_total"] == ("counter", labels, 8.0)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metrics[name] == ("gauge", labels, 0.0)
    assert metrics["vllm:kv_cache_usage_perc"][0] == "gauge"
    assert not [name for name in metrics if name.startswith("sglang:")]


def test_fake_vllm_dp_with_narrowed_devices_crashes_like_incident_2(tmp_path: Path) -> None:
    args = ["M", "-tp", "2", "-dp", "2", "--port", str(free_port())]
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3")
    result = run(vllm_argv(*args), env)
    out = result.stdout + result.stderr
    assert result.returncode == 1
    assert "'tensor_parallel_size': 2" in out and "'data_parallel_size': 2" in out
    assert re.search(r"\(EngineCore_DP1 pid=\d+\) .*DP adjusted local rank 2 is out of bounds", out)
    assert "BrokenPipeError: [Errno 32] Broken pipe" in out
    assert apps(tmp_path) == []


def test_fake_vllm_dp_without_narrowing_needs_enough_gpus(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", {"count": 2})
    result = run(vllm_argv("M", "-tp", "2", "-dp", "2", "--port", "1"), host_env(tmp_path))
    assert result.returncode == 1 and "out of bounds" in result.stdout + result.stderr
    port = free_port()
    env = host_env(tmp_path, DFLASHOPS_STUB_STARTUP_SECONDS="0.05")
    proc = Proc(vllm_argv("M", "-dp", "2", "--port", str(port)), env)  # 2 GPUs, dp 2: fine
    try:
        proc.wait_http(port)
    finally:
        assert proc.stop() == 0


def test_fake_launch_vllm_execs_vllm_in_place(tmp_path: Path) -> None:
    port = free_port()
    argv = [
        HOST_PYTHON, str(harness.LAUNCH_VLLM), "/models/target",
        "--hidden-states-path", str(tmp_path / "hs"), "--target-layer-ids", "2", "14", "27",
        "--", "-tp", "1", "--port", str(port), "--api-key", "sekret",
    ]  # fmt: skip
    env = host_env(tmp_path, CUDA_VISIBLE_DEVICES="4", DFLASHOPS_STUB_STARTUP_SECONDS="0.05")
    env.pop("PYTHONPATH")  # the launcher finds the fake vllm package itself
    proc = Proc(argv, env)
    try:
        proc.wait_http(port)
        first = proc.lines[0]
        assert "launch_vllm.py" in first and "target_layer_ids=[2, 14, 27]" in first
        assert "sekret" not in proc.output
        assert [p for p, _, _ in apps(tmp_path)] == [proc.pid]  # execv kept the pid
    finally:
        assert proc.stop() == 0


# ----------------------------------------------------------------------------- fake sglang, multi-node


INIT_BEGIN = "Init torch distributed begin."
INIT_ENDS = "Init torch distributed ends."
NCCL_LOST = "NCCL error: remote process exited or there was a network error"
SGLANG_READY = "The server is fired up and ready to roll!"


def node_argv(dist: str, rank: int, nnodes: int = 2, *flags: str) -> list[str]:
    return sglang_argv(
        "--model-path", "M", "--nnodes", str(nnodes), "--node-rank", str(rank),
        "--dist-init-addr", dist, *flags,
    )  # fmt: skip


def node_env(state: Path, gpus: int | None = None) -> dict[str, str]:
    if gpus is not None:
        write_json(state / "config.json", {"count": gpus})
    return host_env(state, DFLASHOPS_STUB_STARTUP_SECONDS="0.1")


def entry(state: Path, proc: Proc) -> Path:
    """The fake GPU registration of ``proc`` (gone after any exit but SIGKILL)."""
    return state / "procs" / f"{proc.pid}.json"


def never_healthy(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            status = request(port, "GET", "/health", timeout=1.0).status
        except OSError:
            status = None  # refused: nothing serves HTTP yet
        assert status != 200
        time.sleep(0.05)


def dial(dist: str, line: str, timeout: float = 5.0) -> socket.socket:
    """Connect to a head's rendezvous (retrying until it listens) and send ``line``."""
    host, _, port = dist.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.sendall(line.encode() + b"\n")
    return sock


def answer(sock: socket.socket) -> tuple[str, bool]:
    """The head's answer line, and whether it closed the connection right after."""
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(256)
        if not chunk:
            return data.decode(), True
        data += chunk
    line, _, rest = data.partition(b"\n")
    sock.settimeout(0.3)
    try:
        closed = not rest and not sock.recv(256)
    except TimeoutError:
        closed = False
    sock.settimeout(5.0)
    return line.decode(), closed


@pytest.mark.parametrize("head_first", [True, False], ids=["head-first", "worker-first"])
def test_fake_sglang_two_nodes_meet_then_the_head_serves(tmp_path: Path, head_first: bool) -> None:
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    flags = ("--port", str(port), "--tp-size", "4", "--mem-fraction-static", "0.5")
    head_state, worker_state = tmp_path / "head", tmp_path / "worker"
    procs: list[Proc] = []
    try:
        if head_first:
            head = Proc(node_argv(dist, 0, 2, *flags), node_env(head_state, gpus=2))
            procs.append(head)
            head.wait_for_line(INIT_BEGIN)
            never_healthy(port, 0.5)
            worker = Proc(node_argv(dist, 1, 2, *flags), node_env(worker_state, gpus=2))
            procs.append(worker)
        else:
            worker = Proc(node_argv(dist, 1, 2, *flags), node_env(worker_state, gpus=2))
            procs.append(worker)
            worker.wait_for_line(INIT_BEGIN)
            time.sleep(0.5)  # a few failed dials: nobody listens yet
            assert worker.popen.poll() is None and INIT_ENDS not in worker.output
            head = Proc(node_argv(dist, 0, 2, *flags), node_env(head_state, gpus=2))
            procs.append(head)
        head.wait_http(port)
        worker.wait_for_line(INIT_ENDS)
        lines = head.lines
        assert lines.index(INIT_BEGIN) < lines.index(INIT_ENDS) < lines.index(SGLANG_READY)
        info = request(port, "GET", "/server_info").json()
        assert (info["nnodes"], info["node_rank"], info["tp_size"]) == (2, 0, 4)
        assert info["dist_init_addr"] == dist
        # tp 4 over 2 nodes: 2 GPUs each, all that each host has.
        for state, proc in ((head_state, head), (worker_state, worker)):
            assert used_by_gpu(state) == {0: int(0.5 * B200_MIB), 1: int(0.5 * B200_MIB)}
            assert {p for p, _, _ in apps(state)} == {proc.pid}
        assert SGLANG_READY not in worker.output and worker.popen.poll() is None
        assert worker.stop() == 0  # SIGTERM: a clean exit, its GPU memory released
        assert not entry(worker_state, worker).exists()
        assert "node_rank 1: received SIGTERM, shut down cleanly" in worker.output
        assert head.wait() == 1  # ...but a rank leaving takes the head down
        assert NCCL_LOST in head.lines[-1] and "node_rank 1" in head.lines[-1]
        assert not entry(head_state, head).exists()
    finally:
        for proc in procs:
            proc.stop()


def test_fake_sglang_head_waits_for_a_missing_rank(tmp_path: Path) -> None:
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    flags = ("--port", str(port), "--tp-size", "2")
    head = Proc(node_argv(dist, 0, 2, *flags), node_env(tmp_path / "head"))
    worker = None
    try:
        head.wait_for_line(INIT_BEGIN)
        never_healthy(port, 2.0)
        assert head.popen.poll() is None and head.lines[-1] == INIT_BEGIN
        assert {p for p, _, _ in apps(tmp_path / "head")} == {head.pid}  # it holds its GPU
        worker = Proc(node_argv(dist, 1, 2, *flags), node_env(tmp_path / "worker"))
        head.wait_http(port)
        head.wait_for_line(SGLANG_READY)
        assert head.stop() == 0  # SIGTERM: the head shuts down cleanly...
        assert worker.wait() == 1  # ...and its worker loses it
        assert NCCL_LOST in worker.output
    finally:
        head.stop()
        if worker is not None:
            worker.stop()


def test_fake_sglang_waiting_ranks_stop_cleanly(tmp_path: Path) -> None:
    dist = f"127.0.0.1:{free_port()}"
    flags = ("--port", str(free_port()), "--tp-size", "2")
    head = Proc(node_argv(dist, 0, 2, *flags), node_env(tmp_path / "head"))
    worker = Proc(node_argv(f"127.0.0.1:{free_port()}", 1, 2, *flags), node_env(tmp_path / "w"))
    try:  # the head waits for its worker, the worker (another head's) dials in vain
        head.wait_for_line(INIT_BEGIN)
        worker.wait_for_line(INIT_BEGIN)
        time.sleep(0.3)
        assert entry(tmp_path / "head", head).exists() and entry(tmp_path / "w", worker).exists()
        assert head.stop() == 0 and worker.stop(signal.SIGINT) == 0
    finally:
        head.stop()
        worker.stop()
    assert "node_rank 0: received SIGTERM, shut down cleanly" in head.output
    assert "node_rank 1: received SIGINT, shut down cleanly" in worker.output
    assert not entry(tmp_path / "head", head).exists()
    assert not entry(tmp_path / "w", worker).exists()


def test_fake_sglang_worker_killed_after_ready_takes_the_head_down(tmp_path: Path) -> None:
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    flags = ("--port", str(port), "--tp-size", "2")
    head = Proc(node_argv(dist, 0, 2, *flags), node_env(tmp_path / "head"))
    worker = Proc(node_argv(dist, 1, 2, *flags), node_env(tmp_path / "worker"))
    try:
        head.wait_http(port)
        worker.wait_for_line(INIT_ENDS)
        worker.popen.kill()
        assert worker.wait() == -signal.SIGKILL
        assert head.wait() == 1
    finally:
        worker.stop()
        head.stop()
    assert NCCL_LOST in head.lines[-1] and "lost node_rank 1 of nnodes 2" in head.lines[-1]
    assert not entry(tmp_path / "head", head).exists()


def test_fake_sglang_head_killed_takes_the_worker_down(tmp_path: Path) -> None:
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    flags = ("--port", str(port), "--tp-size", "2")
    worker = Proc(node_argv(dist, 1, 2, *flags), node_env(tmp_path / "worker"))
    head = Proc(node_argv(dist, 0, 2, *flags), node_env(tmp_path / "head"))
    try:
        head.wait_http(port)
        worker.wait_for_line(INIT_ENDS)
        head.popen.kill()
        assert head.wait() == -signal.SIGKILL
        assert worker.wait() == 1
    finally:
        head.stop()
        worker.stop()
    assert NCCL_LOST in worker.lines[-1] and f"node_rank 0 (the head at {dist}" in worker.lines[-1]
    assert not entry(tmp_path / "worker", worker).exists()


def test_fake_sglang_multi_node_bad_input(tmp_path: Path) -> None:
    env = host_env(tmp_path)
    dist = f"127.0.0.1:{free_port()}"
    result = run(sglang_argv("--model-path", "M", "--tp-size", "2", "--nnodes", "2"), env)
    assert result.returncode == 2
    assert "launch_server.py: error: " in result.stderr and "--dist-init-addr" in result.stderr
    result = run(node_argv(dist, 2, 2, "--tp-size", "2"), env)
    assert result.returncode == 2
    assert "error: argument --node-rank: 2 is out of range for --nnodes 2" in result.stderr
    result = run(node_argv("127.0.0.1", 1, 2, "--tp-size", "2"), env)
    assert result.returncode == 2 and "argument --dist-init-addr" in result.stderr
    result = run(node_argv(dist, 0, 2, "--tp-size", "3"), env)
    assert result.returncode == 1
    assert "AssertionError: tp_size must be divisible by number of nodes" in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run(node_argv(busy, 0, 2, "--tp-size", "2", "--port", str(free_port())), env)
    assert result.returncode == 1
    assert "torch.distributed.DistNetworkError: " in result.stderr
    assert "name: EADDRINUSE, message: address already in use" in result.stderr
    assert result.stdout.splitlines()[-1] == INIT_BEGIN
    assert not list((tmp_path / "procs").glob("*.json"))  # nothing left registered


def test_fake_sglang_rendezvous_protocol(tmp_path: Path) -> None:
    """The head admits ranks 1..N-1 once each, answers them all ``ok`` together, then no one."""
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    head = Proc(node_argv(dist, 0, 3, "--port", str(port), "--tp-size", "3"), node_env(tmp_path))
    socks: list[socket.socket] = []
    wrong = None
    try:
        socks.append(dial(dist, "rank 1 of 3"))
        for line, why in (
            ("rank 1 of 3", "duplicate rank 1"),
            ("rank 3 of 3", "rank 3 is out of range"),
            ("rank 0 of 3", "rank 0 is out of range"),
            ("rank 2 of 4", "nnodes mismatch"),
            ("hello", "expected 'rank R of N'"),
        ):
            with dial(dist, line) as sock:
                text, closed = answer(sock)
            assert text.startswith("error ") and why in text and closed, (line, text)
        env = host_env(tmp_path / "wrong")
        wrong = Proc(node_argv(dist, 1, 4, "--tp-size", "4"), env)  # a worker told --nnodes 4
        assert wrong.wait() == 1
        assert "DistNetworkError: rank 1 of 4: the rendezvous at" in wrong.output
        assert "nnodes mismatch" in wrong.output
        never_healthy(port, 0.2)
        socks.append(dial(dist, "rank 2 of 3"))
        assert [answer(sock) for sock in socks] == [("ok", False), ("ok", False)]
        head.wait_http(port)
        with dial(dist, "rank 1 of 3") as late:
            text, closed = answer(late)
        assert "rendezvous complete" in text and closed
        assert head.popen.poll() is None
        socks.pop().close()  # rank 2 goes away
        assert head.wait() == 1
        assert "lost node_rank 2 of nnodes 3" in head.lines[-1]
    finally:
        for sock in socks:
            sock.close()
        if wrong is not None:
            wrong.stop()
        head.stop()


# ----------------------------------------------------------------------------- fake torchrun


TORCHRUN = harness.FAKES / "bin" / "torchrun"
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
RANK_SCRIPT = """\
import json, os, sys, time
out, plan = sys.argv[1], json.loads(sys.argv[2])
rank = os.environ["RANK"]
info = {
    "rank": int(rank),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "master": os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"],
    "argv": sys.argv[1:],
    "python": sys.executable,
    "pid": os.getpid(),
}
with open(os.path.join(out, "rank-%s.json.tmp" % rank), "w") as f:
    json.dump(info, f)
os.replace(os.path.join(out, "rank-%s.json.tmp" % rank), os.path.join(out, "rank-%s.json" % rank))
while len([n for n in os.listdir(out) if n.endswith(".json")]) < plan.get("wait_for", 0):
    time.sleep(0.01)  # until every rank has started
time.sleep(plan.get("sleep", {}).get(rank, 0))
sys.exit(plan.get("exit", {}).get(rank, 0))
"""


def rank_script(tmp_path: Path) -> tuple[Path, Path]:
    """The worker script and OUT: it writes OUT/rank-<RANK>.json, then does as its plan says."""
    script, out = tmp_path / "ranks.py", tmp_path / "out"
    script.write_text(RANK_SCRIPT)
    out.mkdir()
    return script, out


def torchrun_argv(script: Path, out: Path, *opts: str, plan: object = None) -> list[str]:
    return [HOST_PYTHON, str(TORCHRUN), *opts, str(script), str(out), json.dumps(plan or {})]


def node_opts(rank: int, port: int, nproc: int, nnodes: int = 2) -> tuple[str, ...]:
    return (
        "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--nproc-per-node", str(nproc),
    )  # fmt: skip


def ranks_written(out: Path) -> dict[int, dict]:
    return {int(p.stem[5:]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def alive(pid: int, script: Path) -> bool:
    """Whether ``pid`` is still one of our workers (its command line names ``script``)."""
    try:
        return str(script) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return False


def end_workers(out: Path, script: Path) -> list[int]:
    """SIGKILL any worker a torchrun left behind (none should be); their pids."""
    left = [r["pid"] for r in ranks_written(out).values() if alive(r["pid"], script)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("slow", ["head", "other"], ids=["head-finishes-last", "other-last"])
def test_fake_torchrun_two_nodes_meet_and_both_finish(tmp_path: Path, slow: str) -> None:
    script, out = rank_script(tmp_path)
    port = free_port()
    plan = {"sleep": {"0" if slow == "head" else "3": 0.6}}  # one node finishes 0.6 s later
    extra = ("--nnodes", "9", "--", "-x")  # the script's, not torchrun's
    other = Proc(
        [*torchrun_argv(script, out, *node_opts(1, port, 2), plan=plan), *extra], host_env()
    )
    head = None
    try:
        other.wait_for_line("node_rank 1 of 2: rendezvous at 127.0.0.1:")
        time.sleep(0.5)  # it dials in vain: nobody listens yet
        assert other.popen.poll() is None and not list(out.iterdir())
        head = Proc(
            [*torchrun_argv(script, out, *node_opts(0, port, 2), plan=plan), *extra], host_env()
        )
        assert head.wait() == 0, head.output
        assert other.wait() == 0, other.output
    finally:
        other.stop()
        if head is not None:
            head.stop()
        assert end_workers(out, script) == []
    ranks = ranks_written(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, info in ranks.items():
        assert (info["local_rank"], info["group_rank"]) == (rank % 2, rank // 2)
        assert (info["world_size"], info["master"]) == (4, f"127.0.0.1:{port}")
        assert info["argv"] == [str(out), json.dumps(plan), *extra]
        assert info["python"] == HOST_PYTHON  # the interpreter that runs torchrun
    assert "node_rank 1 of 2: all 2 nodes in" in other.output
    assert "node_rank 0 of 2: node_rank 1 finished" in head.output
    assert head.lines[-1] == "[fake torchrun] node_rank 0 of 2: every node finished"
    assert NCCL_LOST not in head.output + other.output


def test_fake_torchrun_one_node_opens_no_socket(tmp_path: Path) -> None:
    script, out = rank_script(tmp_path)
    with socket.socket() as taken:  # the master port is busy: a single node never listens
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        opts = ("--master_port", str(port), "--nproc_per_node=3")
        result = run(torchrun_argv(script, out, *opts), host_env())
    assert result.returncode == 0, result.stderr
    ranks = ranks_written(out)
    assert sorted(ranks) == [0, 1, 2]
    assert {(r["world_size"], r["group_rank"], r["master"]) for r in ranks.values()} == {
        (3, 0, f"127.0.0.1:{port}")
    }
    assert "rendezvous" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith("node_rank 0 of 1: workers finished (exit 0)")


@pytest.mark.parametrize("nproc", [2, 1], ids=["fails-on-the-head", "fails-on-node-1"])
def test_fake_torchrun_failing_worker_ends_both_nodes(tmp_path: Path, nproc: int) -> None:
    script, out = rank_script(tmp_path)
    port = free_port()
    sleep = {str(r): 30 for r in range(2 * nproc) if r != 1}
    plan = {"exit": {"1": 3}, "sleep": sleep, "wait_for": 2 * nproc}
    procs = [
        Proc(torchrun_argv(script, out, *node_opts(r, port, nproc), plan=plan), host_env())
        for r in (0, 1)
    ]
    failing, other = procs if nproc == 2 else procs[::-1]  # rank 1 is node 1's when nproc is 1
    try:
        assert failing.wait() == 1, failing.output
        assert other.wait() == 1, other.output  # it does not hang on
    finally:
        for proc in procs:
            proc.stop()
        assert end_workers(out, script) == []
    assert sorted(ranks_written(out)) == list(range(2 * nproc))
    text = failing.output
    assert f"failed (exitcode: 3) local_rank: {1 % nproc} (pid: " in text
    assert CHILD_FAILED in text and f"{script} FAILED" in text
    assert f"  rank      : 1 (local_rank: {1 % nproc})" in text
    assert re.search(r"^  exitcode  : 3 \(pid: \d+\)$", text, re.M)
    assert failing.lines[-1] == "=" * 60
    lost = "lost node_rank 0 (the head at" if nproc == 2 else "lost node_rank 1 of nnodes 2"
    assert NCCL_LOST in other.lines[-1] and lost in other.lines[-1], other.output
    assert "closing signal SIGTERM" in other.output  # its sleeping workers were ended


def test_fake_torchrun_head_waits_for_a_missing_node(tmp_path: Path) -> None:
    script, out = rank_script(tmp_path)
    head = Proc(torchrun_argv(script, out, *node_opts(0, free_port(), 2)), host_env())
    try:
        head.wait_for_line("node_rank 0 of 2: rendezvous at")
        time.sleep(1.5)
        assert head.popen.poll() is None and not list(out.iterdir())
        assert head.stop() == 128 + signal.SIGTERM
    finally:
        head.stop()
    assert "Received SIGTERM death signal, shutting down workers" in head.output
    assert head.lines[-1].endswith(f"SignalException: Process {head.pid} got signal: 15")
    assert "starting" not in head.output


def test_fake_torchrun_forwards_sigterm_to_its_workers(tmp_path: Path) -> None:
    script, out = rank_script(tmp_path)
    plan = {"sleep": {"0": 30, "1": 30}}
    proc = Proc(torchrun_argv(script, out, "--nproc-per-node", "2", plan=plan), host_env())
    try:
        deadline = time.monotonic() + 10
        while len(ranks_written(out)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = sorted(r["pid"] for r in ranks_written(out).values())
        assert len(pids) == 2 and all(alive(pid, script) for pid in pids)
        assert proc.stop() == 128 + signal.SIGTERM
    finally:
        proc.stop()
        assert end_workers(out, script) == []
    for pid in pids:
        assert f"Sending process {pid} closing signal SIGTERM" in proc.output


def test_fake_torchrun_bad_options(tmp_path: Path) -> None:
    script, out = rank_script(tmp_path)
    for opts, error in (
        (("--tee", "3"), "torchrun: error: unrecognized arguments: --tee"),
        (("--nnodes", "2", "--node-rank", "2"), "argument --node-rank: 2 is out of range"),
        (("--nproc-per-node", "auto"), "invalid int value: 'auto'"),
    ):
        argv = [str(TORCHRUN), *opts, str(script), str(out)]  # run as an executable
        result = run(argv, host_env())
        assert result.returncode == 2, (opts, result.stderr)
        assert result.stderr.startswith("usage: torchrun ") and error in result.stderr
    assert not list(out.iterdir())


# ----------------------------------------------------------------------------- fake vllm, multi-node


VLLM_WAITING = "Waiting for 1 headless node(s) to join"
VLLM_JOINED = "Headless node_rank 1 joined the head at"


def vllm_node_argv(master_port: int, rank: int, *flags: str, nnodes: int = 2) -> list[str]:
    """vLLM's native multi-node flags, ``--headless`` on every rank but 0 (as dflashops does)."""
    return vllm_argv(
        "M", "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1",
        "--master-port", str(master_port), *(["--headless"] if rank else []), *flags,
    )  # fmt: skip


def test_fake_vllm_native_two_nodes_meet_then_the_head_serves(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    flags = ("-tp", "2", "-pp", "2", "--gpu-memory-utilization", "0.5")
    head_state, worker_state = tmp_path / "head", tmp_path / "worker"
    head = Proc(vllm_node_argv(master, 0, "--port", str(port), *flags), node_env(head_state, 2))
    worker = None
    try:
        head.wait_for_line(VLLM_WAITING)
        never_healthy(port, 0.5)  # no HTTP before every rank is in
        assert {p for p, _, _ in apps(head_state)} == {head.pid}  # it holds its GPUs already
        worker = Proc(vllm_node_argv(master, 1, *flags), node_env(worker_state, 2))
        head.wait_http(port)
        worker.wait_for_line(VLLM_JOINED)
        assert head.output.index("All 2 nodes joined") < head.output.index("Starting vLLM API")
        banner = head.wait_for_line("non-default args:")
        assert "'tensor_parallel_size': 2" in banner and "'data_parallel_size': 1" in banner
        assert "'nnodes': 2" in banner and "master_addr" not in banner  # 127.0.0.1: default
        assert "node_rank" not in banner and "headless" not in banner
        banner = worker.wait_for_line("non-default args:")
        assert "'nnodes': 2, 'node_rank': 1, 'headless': True" in banner
        assert "'tensor_parallel_size': 2" in banner
        models = request(port, "GET", "/v1/models").json()["data"]
        assert [(m["id"], m["owned_by"]) for m in models] == [("M", "vllm")]
        # tp 2 x pp 2 over 2 nodes: 2 GPUs each, all that each host has.
        for state, proc in ((head_state, head), (worker_state, worker)):
            assert used_by_gpu(state) == {0: int(0.5 * B200_MIB), 1: int(0.5 * B200_MIB)}
            assert {p for p, _, _ in apps(state)} == {proc.pid}
        assert "Starting vLLM API" not in worker.output and worker.popen.poll() is None
        assert worker.stop() == 0  # SIGTERM: a clean exit, its GPU memory released
        assert "node_rank 1: received SIGTERM, shutting down cleanly" in worker.output
        assert not entry(worker_state, worker).exists()
        assert head.wait() == 1  # ...but a node leaving takes the head down
        assert NCCL_LOST in head.lines[-1] and "lost node_rank 1 of nnodes 2" in head.lines[-1]
        assert not entry(head_state, head).exists()
    finally:
        head.stop()
        if worker is not None:
            worker.stop()


def test_fake_vllm_native_worker_killed_takes_the_head_down(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    worker = Proc(vllm_node_argv(master, 1, "-tp", "2"), node_env(tmp_path / "worker"))
    head = Proc(
        vllm_node_argv(master, 0, "-tp", "2", "--port", str(port)), node_env(tmp_path / "h")
    )
    try:  # the worker starts first and dials until the head listens
        head.wait_http(port)
        worker.wait_for_line(VLLM_JOINED)
        worker.popen.kill()
        assert worker.wait() == -signal.SIGKILL
        assert head.wait() == 1
    finally:
        worker.stop()
        head.stop()
    assert NCCL_LOST in head.lines[-1] and "lost node_rank 1 of nnodes 2" in head.lines[-1]
    assert not entry(tmp_path / "h", head).exists()


def test_fake_vllm_native_head_stopping_takes_the_worker_down(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    head = Proc(
        vllm_node_argv(master, 0, "-tp", "2", "--port", str(port)), node_env(tmp_path / "h")
    )
    worker = Proc(vllm_node_argv(master, 1, "-tp", "2"), node_env(tmp_path / "worker"))
    try:
        head.wait_http(port)
        worker.wait_for_line(VLLM_JOINED)
        assert head.stop() == 0  # the head shuts down cleanly...
        assert worker.wait() == 1  # ...and the headless node loses it
    finally:
        head.stop()
        worker.stop()
    last = worker.lines[-1]
    assert NCCL_LOST in last and f"lost node_rank 0 (the head at 127.0.0.1:{master};" in last
    assert not entry(tmp_path / "worker", worker).exists()


def test_fake_vllm_native_bad_input(tmp_path: Path) -> None:
    env, master = host_env(tmp_path), free_port()
    for argv, error in (
        (
            vllm_argv("M", "-tp", "2", "--nnodes", "2", "--headless"),
            "vllm: error: argument --headless: node_rank 0 runs the API server",
        ),
        (
            vllm_argv("M", "-tp", "2", "--nnodes", "2", "--node-rank", "1"),
            "vllm: error: argument --node-rank: node_rank 1 > 0 needs --headless",
        ),
        (
            vllm_node_argv(master, 2, "-tp", "2"),
            "vllm: error: argument --node-rank: 2 is out of range for --nnodes 2",
        ),
    ):
        result = run(argv, env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("usage: vllm serve ") and error in result.stderr
    for rank in (0, 1):
        result = run(vllm_node_argv(master, rank, "-tp", "3"), env)
        assert result.returncode == 1
        assert "ValueError: world size 3 (tensor_parallel_size 3 x " in result.stderr
        assert "is not divisible by nnodes 2" in result.stderr
    assert not list((tmp_path / "procs").glob("*.json"))  # nothing left registered
