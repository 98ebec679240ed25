"""Days of running against the sshd fleet (DESIGN.md "Days of running"): supervisors on the
hosts restart crashed and wedged units with no dflashops command, report to a webhook, give up
after the limit, never resurrect a stopped unit, and keep going with the controller cut off;
status and top show the engines' own throughput."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet import FleetFactory
from lifecycle_helpers import Ops, engine_pid, job, sglang, stub, unit_dir, unit_pid, unit_processes

from tests.procs import Receiver, alive, free_port, free_ports, wait_for

FAST = {"initial": "1s", "max": "4s"}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


def status_rows(ctl: Ops) -> dict[str, dict[str, Any]]:
    return ctl.run("status").rows()


def ready_again(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def test_a_killed_server_comes_back_by_itself_counted_and_reported(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], receiver: Receiver
) -> None:
    fleet = fleet_factory(s={"gpus": 2})
    host = fleet["s"]
    ctl = ops(fleet, hosts={"s": {"notify": {"webhook": "env:TEST_WEBHOOK"}}})
    os.environ["TEST_WEBHOOK"] = receiver.url
    port = free_ports(1)
    service = sglang(
        port, replicas=1, restart_backoff=FAST, env={"DFLASHOPS_STUB_STARTUP_SECONDS": "1.5"}
    )
    ctl.playbook("p", {"hosts": "s", "services": [service]})
    try:
        res = ctl.run("deploy")
    finally:
        del os.environ["TEST_WEBHOOK"]
    assert res.code == 0, res.explain()
    assert receiver.url not in res.out and "T0K3N" not in res.out  # the URL is a secret
    notify = host.workdir / "notify.json"
    assert notify.stat().st_mode & 0o777 == 0o600 and json.loads(notify.read_text())["host"] == "s"
    supervisor = unit_pid(host, "sglang-0")
    first = engine_pid(host, "sglang-0")

    os.kill(first, signal.SIGKILL)  # a CUDA error at 3 a.m.; no dflashops command from here
    wait_for("the server to come back", lambda: not alive(first) and ready_again(port), timeout=30)
    assert unit_pid(host, "sglang-0") == supervisor  # the same supervisor healed it
    assert engine_pid(host, "sglang-0") != first
    wait_for("the notice", lambda: receiver.events(), timeout=10)
    (notice,) = receiver.notices
    assert notice["event"] == "restarted" and notice["unit"] == "sglang-0" and notice["host"] == "s"
    assert notice["signal"] == "SIGKILL" and notice["restarts"] == 1 and notice["log_tail"]

    row = status_rows(ctl)["sglang-0"]
    assert row["state"] == "ready" and row["restarts"] == 1, row
    logs = sorted((unit_dir(host, "sglang-0") / "logs").glob("2*.log"))
    assert len(logs) == 2  # the restart wrote a new log; the crashed run's is kept


def test_a_crash_loop_gives_up_after_the_limit_with_one_notice(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], receiver: Receiver
) -> None:
    fleet = fleet_factory(c={"gpus": 1})
    ctl = ops(fleet, hosts={"c": {"notify": {"webhook": receiver.url}}})
    port = free_ports(1)
    crashy = stub(
        "crashy",
        port,
        env={"DFLASHOPS_STUB_EXIT_AFTER_READY": "0.3", "DFLASHOPS_STUB_STARTUP_SECONDS": "0.2"},
        restart_backoff={"initial": "0.2s", "max": "1s"},
        restart_limit={"count": 2, "window": "1h"},
    )
    ctl.playbook("p", {"hosts": "c", "services": [crashy]})
    assert ctl.run("deploy").code == 0
    wait_for(
        "the supervisor to give up",
        lambda: (unit_dir(fleet["c"], "crashy-0") / "crashed").exists(),
        timeout=30,
    )
    wait_for("the give-up notice", lambda: "gave_up" in receiver.events(), timeout=10)
    time.sleep(1)
    assert receiver.events() == ["restarted", "restarted", "gave_up"]
    row = status_rows(ctl)["crashy-0"]
    assert row["state"] == "crashed" and "gave up after 2 restarts" in row["health"], row
    assert unit_processes(fleet["c"]) == []


def test_a_wedged_server_is_restarted_by_liveness(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], receiver: Receiver
) -> None:
    fleet = fleet_factory(w={"gpus": 1})
    host = fleet["w"]
    ctl = ops(fleet, hosts={"w": {"notify": {"webhook": receiver.url}}})
    port = free_ports(1)
    wedging = stub(
        "wedge",
        port,
        env={"DFLASHOPS_STUB_WEDGE_AFTER": "1", "DFLASHOPS_STUB_STARTUP_SECONDS": "0.2"},
        liveness={"path": "/health_generate", "interval": "0.3s", "timeout": "0.5s", "failures": 2},
        restart_backoff=FAST,
    )
    ctl.playbook("p", {"hosts": "w", "services": [wedging]})
    assert ctl.run("deploy").code == 0
    first = engine_pid(host, "wedge-0")
    wait_for("liveness to restart it", lambda: not alive(first) and ready_again(port), timeout=30)
    wait_for("both notices", lambda: len(receiver.events()) >= 2, timeout=10)
    assert receiver.events()[:2] == ["liveness_failed", "restarted"]
    history = json.loads((unit_dir(host, "wedge-0") / "supervisor.json").read_text())["history"]
    assert history[0]["reason"] == "liveness"


def test_stop_during_a_backoff_stays_stopped(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(b={"gpus": 1})
    host = fleet["b"]
    ctl = ops(fleet)
    port = free_ports(1)
    slow_back = stub("svc", port, restart_backoff={"initial": "5s", "max": "5s"})
    ctl.playbook("p", {"hosts": "b", "services": [slow_back]})
    assert ctl.run("deploy").code == 0
    os.kill(engine_pid(host, "svc-0"), signal.SIGKILL)
    supervisor = unit_dir(host, "svc-0") / "supervisor.json"
    wait_for(
        "the backoff",
        lambda: supervisor.exists() and json.loads(supervisor.read_text())["state"] == "backoff",
    )
    res = ctl.run("stop")
    assert res.code == 0, res.explain()
    time.sleep(6)  # past the backoff: nothing may start again
    assert unit_processes(host) == [] and not ready_again(port)
    assert status_rows(ctl)["svc-0"]["state"] == "stopped"


def test_a_crash_while_the_controller_is_cut_off_still_heals(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(d={"gpus": 1})
    host = fleet["d"]
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("p", {"hosts": "d", "services": [stub("svc", port, restart_backoff=FAST)]})
    assert ctl.run("deploy").code == 0
    first = engine_pid(host, "svc-0")
    host.stop()  # sshd gone: no dflashops command can reach the host
    try:
        os.kill(first, signal.SIGKILL)
        wait_for(
            "the unit to come back on its own",
            lambda: not alive(first) and ready_again(port),
            timeout=30,
        )
    finally:
        host.start()
    row = status_rows(ctl)["svc-0"]
    assert row["state"] == "ready" and row["restarts"] == 1, row


def test_a_webhook_that_refuses_is_logged_and_the_unit_restarts_anyway(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(n={"gpus": 1})
    host = fleet["n"]
    dead_url = f"http://127.0.0.1:{free_port()}/nobody-listens"
    ctl = ops(fleet, hosts={"n": {"notify": {"webhook": dead_url}}})
    port = free_ports(1)
    ctl.playbook("p", {"hosts": "n", "services": [stub("svc", port, restart_backoff=FAST)]})
    assert ctl.run("deploy").code == 0
    first = engine_pid(host, "svc-0")
    os.kill(first, signal.SIGKILL)
    wait_for("the restart", lambda: not alive(first) and ready_again(port), timeout=30)
    log = unit_dir(host, "svc-0") / "notify.log"
    wait_for("the failure to be logged", log.exists, timeout=15)
    assert "connection refused" in log.read_text().lower() or "refused" in log.read_text()


def test_a_job_restarted_on_failure_reports_without_its_secrets(
    fleet_factory: FleetFactory,
    ops: Callable[..., Ops],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = fleet_factory(j={"gpus": 0})
    ctl = ops(fleet, hosts={"j": {"notify": {"webhook": receiver.url}}})
    monkeypatch.setenv("JOB_TOKEN", "tok-9f8e7d6c5b")
    flaky = job(
        "flaky",
        'echo "using $TOKEN"; exit 1',
        restart="on-failure",
        restart_backoff={"initial": "0.2s", "max": "1s"},
        restart_limit={"count": 1, "window": "1h"},
        secret_env={"TOKEN": "JOB_TOKEN"},
    )
    ctl.playbook("p", {"hosts": "j", "jobs": [flaky]})
    assert ctl.run("deploy").code == 0
    wait_for("the give-up", lambda: "gave_up" in receiver.events(), timeout=20)
    text = json.dumps(receiver.notices)
    assert "tok-9f8e7d6c5b" not in text and "using ***" in text, receiver.notices


def test_status_and_top_show_the_engines_throughput_and_the_jobs_eta(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """The demo playbooks on the fleet: SGLang and vLLM fakes under load from the generator."""
    fleet = fleet_factory(t={"gpus": 3})
    ctl = ops(fleet)
    port = free_ports(3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"q {i}"}) + "\n" for i in range(4000))
    )
    slow = {"DFLASHOPS_STUB_LATENCY": "0.05", "DFLASHOPS_STUB_TOKENS_PER_SECOND": "2000"}
    ctl.playbook(
        "p",
        {
            "hosts": "t",
            "services": [
                sglang(port, replicas=2, env=slow),
                {
                    "name": "vllm",
                    "engine": "vllm",
                    "model": "/m",
                    "port": port + 2,
                    "env": slow,
                    "ready": {"timeout": "30s", "interval": "0.2s"},
                    "stop_grace": "2s",
                },
            ],
            "jobs": [
                {
                    "name": "generate",
                    "script": "dflashops:generate_completions",
                    "servers": "sglang",
                    "args": {
                        "prompts": str(prompts),
                        "output-dir": "out",
                        "concurrency": 8,
                        "max-output-tokens": 64,
                    },
                    "stop_grace": "5s",
                }
            ],
        },
    )
    assert ctl.run("deploy").code == 0
    progress = unit_dir(fleet["t"], "generate") / "progress.json"
    wait_for(
        "the generator to be under way",
        lambda: progress.exists() and json.loads(progress.read_text()).get("eta_s"),
        timeout=30,
    )
    # vLLM gets load too (it is not in the job's servers): a second generator by hand.
    res = ctl.run("top", "--once", json_events=False)
    assert res.code == 0, res.out
    lines = {
        line.split()[1]: line for line in res.out.splitlines() if line.strip().startswith("t ")
    }
    for unit in ("sglang-0", "sglang-1"):
        tok = lines[unit].split()[3]
        assert tok not in ("-", "0"), lines[unit]
    assert lines["vllm-0"].split()[3] != "-", lines["vllm-0"]  # a counter: a rate from two samples
    assert "generate" in lines and "/4,000" in lines["generate"] and "█" in lines["generate"]
    assert "fleet" in res.out and any(c in res.out for c in "▁▂▃▄▅▆▇█")
    rows = status_rows(ctl)
    assert (
        rows["sglang-0"]["metrics"]["tok_s"] is not None
        and rows["sglang-0"]["metrics"]["running"] is not None
    )
    assert rows["vllm-0"]["metrics"]["running"] is not None


def test_the_generator_runs_across_a_servers_crash_and_restart_with_every_prompt_once(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    fleet = fleet_factory(g={"gpus": 2})
    host = fleet["g"]
    ctl = ops(fleet)
    port = free_ports(2)
    prompts = tmp_path / "prompts.jsonl"
    ids = [f"p{i:04d}" for i in range(400)]
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": f"question {i}"}) + "\n" for i in ids)
    )
    # 400 prompts x 0.08 s over 8 in flight: ~4 s of work, so the crash at 1.5 s lands mid-run
    # however fast deploy hands over to the job.
    env = {"DFLASHOPS_STUB_LATENCY": "0.08", "DFLASHOPS_STUB_STARTUP_SECONDS": "0.5"}
    ctl.playbook(
        "p",
        {
            "hosts": "g",
            "services": [
                stub("steady", port, env=env),
                # Crashes 1.5 s after ready (mid-run), is restarted 0.5 s later by its supervisor.
                stub(
                    "flaky",
                    port + 1,
                    env={**env, "DFLASHOPS_STUB_EXIT_AFTER_READY": "1.5"},
                    restart_backoff={"initial": "0.5s", "max": "1s"},
                    restart_limit={"count": 1, "window": "1h"},
                ),
            ],
            "jobs": [
                {
                    "name": "generate",
                    "script": "dflashops:generate_completions",
                    "needs": ["steady", "flaky"],
                    "args": {
                        "prompts": str(prompts),
                        "output-dir": "out",
                        "concurrency": 8,
                        "max-output-tokens": 16,
                        "servers": [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"],
                    },
                    "stop_grace": "5s",
                }
            ],
        },
    )
    assert ctl.run("deploy").code == 0
    exit_record = unit_dir(host, "generate") / "exit"
    wait_for("the generator to finish", exit_record.exists, timeout=90)
    assert json.loads(exit_record.read_text())["code"] == 0
    restarts = json.loads((unit_dir(host, "flaky-0") / "supervisor.json").read_text())["restarts"]
    assert restarts >= 1, "the server crashed and came back while the job ran"
    out = unit_dir(host, "generate") / "out"
    done = [
        json.loads(line)["id"]
        for shard in sorted(out.glob("completions-*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    assert sorted(done) == ids  # every prompt, exactly once
