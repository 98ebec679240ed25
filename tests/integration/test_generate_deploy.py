"""The repo's generation playbooks (serve-sglang + generate-completions) on a fake GPU host:
SGLang replicas (the fake accepts only real flags), the built-in resumable generator against
them, progress in `status`, and secrets that reach the host but never the output."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet import FleetFactory

from dflashops.cli import main
from tests.wheels import build_wheel

REPO = Path(__file__).resolve().parents[2]
SECRET = "hf_very_secret_token_value"


def free_base_port(count: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_generation_playbooks_end_to_end(
    fleet_factory: FleetFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = fleet_factory(b200={"gpus": 3})
    host = fleet["b200"]
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    shutil.copy(fleet.known_hosts_path, tmp_path / "home" / ".ssh" / "known_hosts")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(tmp_path / "known_hosts"))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    model = tmp_path / "shm" / "Qwen3.6-27B"
    disk = host.dir / "disk" / "Qwen3.6-27B"  # the node's disk: staged into the "RAM disk"
    disk.mkdir(parents=True)
    (disk / "config.json").write_text('{"model_type": "qwen3"}\n')
    output = tmp_path / "completions"

    ops = tmp_path / "ops"
    (ops / "playbooks").mkdir(parents=True)
    (ops / "wheels").mkdir()
    fleet.write_inventory(ops / "inventory.yaml", groups={"generation": ["b200"]})
    serve: dict[str, Any] = yaml.safe_load((REPO / "playbooks" / "serve-sglang.yaml").read_text())
    serve["vars"]["model"] = str(model)
    # The playbook's own environment and model source, pointed at the test host: a wheel
    # instead of sglang from PyPI (no index here), the model from the fake node's disk.
    build_wheel(ops / "wheels", "dfotest", "1.0")
    serve["environments"]["sglang"].update(
        path=str(host.dir / "venv-sglang"), packages=["dfotest==1.0"], wheels="../wheels"
    )
    assert serve["files"][0]["src"].startswith("host:/workspace/models/")
    serve["files"][0]["src"] = f"host:{disk}"
    sglang = serve["services"][0]
    sglang.update(
        replicas=3,
        port=free_base_port(3),
        ready={"timeout": "60s", "interval": "0.2s"},
        stop_grace="5s",
    )
    (ops / "playbooks" / "serve-sglang.yaml").write_text(yaml.safe_dump(serve, sort_keys=False))
    gen: dict[str, Any] = yaml.safe_load(
        (REPO / "playbooks" / "generate-completions.yaml").read_text()
    )
    gen["jobs"][0]["args"].update(
        {
            "prompts": str(REPO / "examples" / "demo-prompts.jsonl"),
            "output-dir": str(output),
            "max-output-tokens": 64,
            "concurrency": 8,
        }
    )
    (ops / "playbooks" / "generate-completions.yaml").write_text(
        yaml.safe_dump(gen, sort_keys=False)
    )
    common = ["-i", str(ops / "inventory.yaml")]

    def cli(*args: str) -> tuple[int, str]:
        code = main([*args, *common])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    events_path = tmp_path / "events.jsonl"
    try:
        code, out = cli("deploy", "--json", str(events_path))
        assert code == 0, out
        events = [json.loads(line) for line in events_path.read_text().splitlines()]
        ready = [e["unit"] for e in events if e["action"] == "ready" and e["status"] == "changed"]
        assert sorted(ready) == ["sglang-0", "sglang-1", "sglang-2"]
        started = [e for e in events if e["unit"] == "generate" and e["action"] == "start"]
        assert started and started[0]["status"] == "changed"
        # The job started only after every replica it needs was ready.
        first_job = events.index(started[0])
        assert all(events.index(e) < first_job for e in events if e["action"] == "ready")

        rows: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status_json = tmp_path / "status.json"
            cli("status", "--json", str(status_json))
            rows = {r["unit"]: r for r in json.loads(status_json.read_text())["units"]}
            if rows["generate"]["state"] in ("done", "failed", "dead"):
                break
            time.sleep(0.5)
        assert rows["generate"]["state"] == "done", rows
        progress = rows["generate"]["progress"]
        assert progress is not None and (progress["done"], progress["total"]) == (40, 40), rows
        assert all(rows[f"sglang-{i}"]["state"] == "ready" for i in range(3)), rows
        records = [
            json.loads(line)
            for shard in output.glob("completions-*.jsonl")
            for line in shard.read_text().splitlines()
        ]
        assert sorted(r["id"] for r in records) == [f"demo-{i:03d}" for i in range(1, 41)]
        assert {r["server"] for r in records} <= {
            f"http://127.0.0.1:{sglang['port'] + i}" for i in range(3)
        }

        # Guarantee 9: the secret is on the host in a 0600 file, and nowhere in what we print.
        secrets = host.workdir / "units" / "sglang-0" / "secrets.env"
        assert secrets.stat().st_mode & 0o777 == 0o600 and SECRET in secrets.read_text()
        assert SECRET not in (host.workdir / "units" / "sglang-0" / "launch.sh").read_text()
        assert SECRET not in out and SECRET not in events_path.read_text()
        code, diff_out = cli("deploy", "--check", "--diff")
        assert code == 0 and SECRET not in diff_out

        code, out = cli("stop")
        assert code == 0, out
        rc, smi, _ = host.run("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
        assert rc == 0 and [int(x) for x in smi.split()] == [0, 0, 0]
    finally:
        cli("stop")
