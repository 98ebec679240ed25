"""Secrets never ride in argv (DESIGN trust 4), on real sshd hosts with the fake engines: an
api-key of secret_args reaches the fake vLLM as VLLM_API_KEY and the fake SGLang and the stub
through --config; it is in no engine's /proc/PID/cmdline, launch script, log banner, unit.json,
event or console line, nor in the webhook's log tail (with a secret over two lines beside it);
the engines demand it and every probe (readiness, verify, the supervisor's liveness) sends it.
The files holding it, the unit's records and logs are the host user's alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from fleet import FleetFactory
from lifecycle_helpers import READY, Ops, engine_pid, job, sglang, stub, unit_dir
from test_supervision import Receiver, receiver  # noqa: F401 - the fixture

from tests.procs import environ, free_ports, http_status, mode, wait_for

KEY = "sk-h5-7c0ffee15-secret-key"
MULTI = "multi-line-first-half\nmulti-line-second-half"
LIVENESS = "/v1/models?probe=liveness"  # a path the key protects, seen in the stub's debug log


def test_an_api_key_given_by_secret_args_never_leaves_its_0600_files(
    fleet_factory: FleetFactory,
    ops: Callable[..., Ops],
    receiver: Receiver,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = fleet_factory(s={"gpus": 3})
    host = fleet["s"]
    ctl = ops(fleet, hosts={"s": {"notify": {"webhook": receiver.url}}})
    monkeypatch.setenv("CTL_KEY", KEY)
    monkeypatch.setenv("CTL_MULTI", MULTI)
    port = free_ports(3)
    key = {"api-key": "CTL_KEY"}
    vllm = {
        "name": "vllm",
        "engine": "vllm",
        "model": "/m",
        "port": port + 1,
        "ready": READY,
        "stop_grace": "2s",
        "secret_args": key,
    }
    probed = {"path": LIVENESS, "interval": "0.3s", "timeout": "5s", "failures": 2}
    leaky = job(
        "leaky",
        'echo "given $1"; echo "$MULTI"; exit 1',  # argv: bash -c SCRIPT --token VALUE
        restart="on-failure",
        restart_backoff={"initial": "0.2s", "max": "1s"},
        restart_limit={"count": 1, "window": "1h"},
        secret_args={"token": "CTL_KEY"},
        secret_env={"MULTI": "CTL_MULTI"},
    )
    services = [
        sglang(port, replicas=1, secret_args=key),
        vllm,
        stub("stub", port + 2, secret_args=key, args={"log-level": "debug"}, liveness=probed),
    ]
    ctl.playbook("p", {"hosts": "s", "services": services, "jobs": [leaky]})
    res = ctl.run("deploy")
    # Readiness and verification (identity from /server_info and /v1/models) sent the key.
    assert res.code == 0, res.explain()
    for unit in ("sglang-0", "vllm-0", "stub-0"):
        assert f"{unit} ready and verified" in res.out, unit

    # The engines demand the key they were given, each its own way.
    for p in (port, port + 1, port + 2):
        assert (
            http_status(p, "/v1/models", None) == 401 and http_status(p, "/v1/models", KEY) == 200
        )
    vllm_pid = engine_pid(host, "vllm-0")
    assert environ(vllm_pid).get("VLLM_API_KEY") == KEY
    for unit in ("sglang-0", "stub-0"):
        argv = Path(f"/proc/{engine_pid(host, unit)}/cmdline").read_bytes().split(b"\0")
        assert b"--config" in argv and any(a.endswith(b"/secret-args.yaml") for a in argv)

    # The supervisor's liveness probe sends the key it reads from the unit's 0600 file.
    log = unit_dir(host, "stub-0") / "logs" / "current.log"
    wait_for(
        "an authorized liveness probe", lambda: f'"GET {LIVENESS} HTTP/1.1" 200' in log.read_text()
    )
    assert f'"GET {LIVENESS} HTTP/1.1" 401' not in log.read_text()

    wait_for("the job's give-up notice", lambda: "gave_up" in receiver.events("leaky"))
    notices = json.dumps(receiver.notices)
    assert "given ***" in notices
    texts = {"webhook": notices, "console": res.out, "events": json.dumps(res.events)}
    for unit in ("sglang-0", "vllm-0", "stub-0", "leaky"):
        folder = unit_dir(host, unit)
        pid = engine_pid(host, unit) if unit != "leaky" else None
        if pid is not None:
            texts[f"{unit} cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        for name in ("launch.sh", "unit.json", "logs/current.log"):
            texts[f"{unit}/{name}"] = (folder / name).read_text()
        assert mode(folder) == 0o700 and mode(folder / "launch.sh") == 0o700
        for name in ("unit.json", "pid", "supervisor.json"):
            assert mode(folder / name) == 0o600, f"{unit}/{name}"
        secret_files = [p for p in folder.iterdir() if p.name.startswith(("secret", "secrets"))]
        assert secret_files and {mode(p) for p in secret_files} == {0o600}, unit
        assert {mode(p) for p in (folder / "logs").glob("*.log") if not p.is_symlink()} == {0o600}
    for where, text in texts.items():
        if where != "leaky/logs/current.log":  # the job printed it itself: its own business
            assert KEY not in text, where
        if where == "webhook":
            for piece in MULTI.splitlines():
                assert piece not in text, where
    assert mode(host.workdir) == 0o700  # the fleet made it 0755 before the deploy

    # An operator without the key: the servers refuse to say their settings. That is not drift.
    monkeypatch.delenv("CTL_KEY")
    rows = ctl.run("status").rows()
    for unit in ("sglang-0", "vllm-0", "stub-0"):
        assert rows[unit]["state"] == "ready", rows[unit]
        assert "settings not checked (HTTP 401): export CTL_KEY" in rows[unit]["health"]


def test_a_literal_api_key_in_args_fails_preflight_and_reaches_no_host(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(s={"gpus": 1})
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("p", {"hosts": "s", "services": [stub("stub", port, args={"api-key": KEY})]})
    res = ctl.run("deploy")
    assert res.code != 0
    assert "p.yaml:" in res.out and "`api-key` looks like a secret" in res.out
    assert "secret_args: {api-key: VAR}" in res.out and "nothing was sent to any host" in res.out
    assert not (unit_dir(fleet["s"], "stub-0") / "launch.sh").exists()
    ctl.playbooks.clear()  # nothing to stop (and stop would refuse the same playbook)
