"""The DFlash training pipeline (playbooks/train-dflash.yaml, INCIDENTS.md #2) against an 8-GPU
sshd test host: vLLM for hidden states through speculators' launch_vllm.py (the fakes), a training
job on a disjoint GPU set, a CPU-only monitor and a CPU job that needs vLLM without restarting
with it. Everything goes through `dflashops.cli.main`, as a user would type it.

The playbook is tests/fixtures/train-dflash/playbooks/train-dflash.yaml; each test copies the
fixture folder, gives vLLM a free port and changes what the step needs.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet import Fleet, FleetFactory, FleetHost

from dflashops.cli import main
from tests.procs import free_port

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "train-dflash"
GPU_MIB = 97887  # an RTX PRO 6000
VLLM_MIB = int(0.85 * GPU_MIB)  # the fake vLLM registers gpu-memory-utilization x memory
TRAIN_MIB = 40000  # fake_train.py's default --gpu-mib


@dataclass
class Ops:
    """A controller checkout for one test: inventory, the playbook copy, and the CLI."""

    root: Path
    host: FleetHost
    capsys: pytest.CaptureFixture[str]
    book: dict[str, Any]
    port: int
    runs: int = 0
    deployed: bool = False  # teardown runs `dflashops stop` when set

    @property
    def inventory(self) -> Path:
        return self.root / "inventory.yaml"

    @property
    def playbook(self) -> Path:
        return self.root / "playbooks" / "train-dflash.yaml"

    def write(self, change: Callable[[dict[str, Any]], None] | None = None) -> None:
        book = copy.deepcopy(self.book)
        book["services"][0]["port"] = self.port
        if change is not None:
            change(book)
        self.playbook.write_text(yaml.safe_dump(book, sort_keys=False))

    def cli(self, *args: str) -> tuple[int, str]:
        code = main([*args, "-i", str(self.inventory), "-p", str(self.playbook)])
        captured = self.capsys.readouterr()
        out = captured.out + captured.err
        with (self.root / "transcript.txt").open("a") as f:  # for a failing test's reader
            f.write(f"$ dflashops {' '.join(args)}  # exit {code}\n{out}\n")
        return code, out

    def deploy(self, *extra: str) -> tuple[int, str, list[dict[str, Any]]]:
        self.runs += 1
        events = self.root / f"deploy-{self.runs}.jsonl"
        code, out = self.cli("deploy", "--json", str(events), *extra)
        self.deployed = True
        lines = events.read_text().splitlines() if events.exists() else []
        return code, out, [json.loads(line) for line in lines]

    def status(self) -> tuple[int, str, dict[str, dict[str, Any]]]:
        """(code, output, the --json document's units by name: one host, names unique)."""
        self.runs += 1
        path = self.root / f"status-{self.runs}.json"
        code, out = self.cli("status", "--json", str(path))
        units = json.loads(path.read_text())["units"]
        return code, out, {row["unit"]: row for row in units}

    def wait_status(
        self, ok: Callable[[dict[str, dict[str, Any]]], bool], timeout: float = 30.0
    ) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            _, out, rows = self.status()
            if ok(rows):
                return rows
            if time.monotonic() > deadline:
                raise AssertionError(f"status never got there:\n{out}")
            time.sleep(0.3)

    def gpu_used(self) -> dict[int, int]:
        """MiB used per GPU, as the host's (fake) nvidia-smi reports it over ssh."""
        rc, out, err = self.host.run(
            "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits"
        )
        assert rc == 0, err
        return {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines())}


def gib(row: dict[str, Any]) -> list[tuple[int, int]]:
    """A row's GPUs as (index, GiB used, rounded down): the table's `0:79G 1:79G`."""
    return [(g["index"], g["used_bytes"] // 2**30) for g in row["gpus"]]


def progress_shown(row: dict[str, Any]) -> bool:
    """The row has a `done/total` to show (the table's progress cell is not empty)."""
    p = row["progress"]
    return p is not None and p["done"] is not None and bool(p["total"])


def actions(events: list[dict[str, Any]], unit: str) -> list[str]:
    return [e["action"] for e in events if e["unit"] == unit]


def messages(events: list[dict[str, Any]], unit: str) -> str:
    return "\n".join(
        f"{e['status']} {e['action']}: {e['message']}" for e in events if e["unit"] == unit
    )


def started_or_restarted(events: list[dict[str, Any]]) -> set[str]:
    return {
        e["unit"]
        for e in events
        if e["unit"] and e["status"] == "changed" and e["action"] in ("start", "restart")
    }


@pytest.fixture
def ops(
    fleet_factory: FleetFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Iterator[Ops]:
    fleet: Fleet = fleet_factory(
        pro6000={"gpus": 8, "gpu_name": "NVIDIA RTX PRO 6000", "memory_total_mib": GPU_MIB}
    )
    host = fleet["pro6000"]
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(fleet.known_hosts_path, home / ".ssh" / "known_hosts")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(tmp_path / "known_hosts"))
    root = tmp_path / "ops"
    shutil.copytree(FIXTURE, root)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    fleet.write_inventory(
        root / "inventory.yaml",
        hosts={"pro6000": {"vars": {"repo": str(REPO), "scratch": str(scratch)}}},
        groups={"training": ["pro6000"]},
    )
    book = yaml.safe_load((FIXTURE / "playbooks" / "train-dflash.yaml").read_text())
    o = Ops(root, host, capsys, book, free_port())
    o.write()
    try:
        yield o
    finally:
        # Stop what the test started, through dflashops itself (the fleet kills leftovers after).
        if o.deployed:
            o.cli("stop")


def set_dp2(book: dict[str, Any]) -> None:
    """The field failure: TP=2 DP=2 on CUDA_VISIBLE_DEVICES=0,1,2,3, forced past pre-flight."""
    vllm = book["services"][0]
    vllm.update(dp=2, allow_dp=True, gpus=[0, 1, 2, 3])


def test_dp2_crash_then_dp1_fix_restarts_only_vllm_and_its_restart_with_job(ops: Ops) -> None:
    code, out = ops.cli("preflight")
    assert code == 0, out

    # 1. DP=2 (allow_dp: true gets it past pre-flight): vLLM's engine cores crash; deploy says so
    #    with the log tail, does not start what needs vLLM, and starts the independent monitor.
    ops.write(set_dp2)
    code, out, events = ops.deploy()
    assert code != 0, out
    vllm = messages(events, "vllm-0")
    assert "died while starting (exit code 1)" in vllm, out
    assert "its supervisor restarts it (on-failure" in vllm, out
    assert "DP adjusted local rank 2 is out of bounds" in vllm, out
    assert "BrokenPipeError: [Errno 32] Broken pipe" in vllm, out
    assert "not started: vllm-0 not ready" in messages(events, "train"), out
    assert "not started: vllm-0 not ready" in messages(events, "eval"), out
    assert started_or_restarted(events) == {"vllm-0", "monitor"}, out
    _, _, rows = ops.status()
    # Its supervisor keeps restarting it by the default policy, each time with the same crash.
    assert rows["vllm-0"]["state"] in ("restarting", "starting"), rows
    assert (
        rows["vllm-0"]["health"].startswith("restart 1, last exit code 1")
        or rows["vllm-0"]["state"] == "starting"
    ), rows
    assert rows["train"]["state"] in ("absent", "stopped"), rows
    assert rows["monitor"]["state"] == "running", rows
    monitor_pid = rows["monitor"]["pid"]
    assert monitor_pid

    # 2. The fix, TP=2 DP=1 on GPUs 0-1: only vLLM (re)starts, is verified from /v1/models and
    #    the banner, then the jobs that need it start; the monitor is left alone.
    ops.write()
    code, out, events = ops.deploy("--check", "--diff")  # the plan and the launch.sh diff
    assert code == 0, out
    assert "--tensor-parallel-size 2 --data-parallel-size 2 " in out, out
    assert "--tensor-parallel-size 2 --data-parallel-size 1 " in out, out
    plan = {e["unit"]: e["message"] for e in events if e["action"] == "plan"}
    # Its supervisor is restarting it (or it crashed again): the new rendering replaces it.
    assert plan["vllm-0"].startswith("would restart (fingerprint "), plan
    assert plan["monitor"].startswith("ok ("), plan
    code, out, events = ops.deploy()
    assert code == 0, out
    assert started_or_restarted(events) == {"vllm-0", "train", "eval"}, out
    assert "ready and verified" in messages(events, "vllm-0"), out
    assert actions(events, "monitor") and "start" not in actions(events, "monitor"), out
    code, log = ops.cli("logs", "vllm-0", "--lines", "50")
    assert code == 0, log
    assert "engine=vllm tp=2 dp=1" in log and "gpus=0,1" in log, log
    assert "'tensor_parallel_size': 2, 'data_parallel_size': 1" in log, log
    assert "launch_vllm.py [dflashops fake of speculators'" in log, log

    rows = ops.wait_status(lambda r: progress_shown(r["train"]))
    assert rows["vllm-0"]["state"] == "ready", rows
    assert gib(rows["vllm-0"]) == [(0, VLLM_MIB // 1024), (1, VLLM_MIB // 1024)], rows
    assert rows["train"]["state"] == "running", rows
    assert gib(rows["train"]) == [(g, TRAIN_MIB // 1024) for g in (4, 5, 6, 7)], rows
    assert rows["train"]["progress"]["total"] == 100000, rows
    assert rows["monitor"]["state"] == "running" and rows["monitor"]["gpus"] == [], rows
    assert rows["monitor"]["pid"] == monitor_pid, "the monitor was restarted by the DP fix"
    used = ops.gpu_used()
    assert used == {0: VLLM_MIB, 1: VLLM_MIB, 2: 0, 3: 0, **dict.fromkeys((4, 5, 6, 7), TRAIN_MIB)}
    train_pid, eval_pid, vllm_pid = (rows[u]["pid"] for u in ("train", "eval", "vllm-0"))
    progress = ops.host.workdir / "units" / "train" / "progress.json"
    trainer = json.loads(progress.read_text())["pid"]  # the training process (not the unit's pid)

    # 3. Nothing changed: nothing restarts.
    code, out, events = ops.deploy()
    assert code == 0, out
    assert started_or_restarted(events) == set(), out

    # 4. A vLLM change restarts vLLM and train (restart_with: [vllm]), never the monitor, and not
    #    `eval`, which needs vLLM without restart_with.
    ops.write(lambda b: b["services"][0]["args"].update({"max-model-len": 4096}))
    code, out, events = ops.deploy("--check")
    assert code == 0, out
    plan = {e["unit"]: e["message"] for e in events if e["action"] == "plan"}
    assert plan["vllm-0"].startswith("would restart (fingerprint "), plan
    assert plan["train"] == "would restart (restart_with: vllm restarts)", plan
    assert plan["monitor"].startswith("ok (") and plan["eval"].startswith("ok ("), plan
    code, out, events = ops.deploy()
    assert code == 0, out
    assert started_or_restarted(events) == {"vllm-0", "train"}, out
    # The new run has not finished its warm-up: any progress status shows must be its own.
    stale = progress.exists() and json.loads(progress.read_text())["pid"] == trainer
    train_said = messages(events, "train")  # checked last: the reason is cosmetic, pids are not
    rows = ops.wait_status(
        lambda r: r["train"]["state"] == "running" and progress_shown(r["train"])
    )
    assert rows["vllm-0"]["state"] == "ready", rows
    assert rows["vllm-0"]["pid"] != vllm_pid and rows["train"]["pid"] != train_pid, rows
    assert rows["eval"]["pid"] == eval_pid, "eval has no restart_with and must keep running"
    assert rows["monitor"]["pid"] == monitor_pid, "the monitor was restarted with training"

    # 5. stop frees every GPU, and status says the units are stopped (not dead, done or failed:
    #    a stopped monitor that exits 0 on SIGTERM did not finish its work).
    code, out = ops.cli("stop")
    assert code == 0, out
    assert ops.gpu_used() == dict.fromkeys(range(8), 0)
    _, _, rows = ops.status()
    states = {u: r["state"] for u, r in rows.items()}

    # 6. deploy after stop brings every unit back, the monitor included.
    code, out, events = ops.deploy()
    assert code == 0, out
    back = started_or_restarted(events)

    # Checked last and together, so that one wrong word does not hide the steps above.
    wrong = [
        f"deploy after stop started {sorted(back)}, not all four units:\n{out}"
        if back != {"vllm-0", "train", "monitor", "eval"}
        else "",
        "right after a restart, status showed the previous run's progress.json" if stale else "",
        f"after stop, status says {states}, not stopped"
        if states != dict.fromkeys(("vllm-0", "train", "monitor", "eval"), "stopped")
        else "",
        # train's own fingerprint did not change: the restart must say vllm's restart did it.
        f"train's restart does not say why: {train_said!r}"
        if "restart_with: vllm" not in train_said
        else "",
    ]
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


def short_training(steps: int, exit_code: int = 0) -> Callable[[dict[str, Any]], None]:
    def change(book: dict[str, Any]) -> None:
        book["jobs"][0]["args"].update({"steps": steps, "step-seconds": 0.05, "warmup-seconds": 0})
        if exit_code:
            book["jobs"][0]["args"]["exit-code"] = exit_code

    return change


def test_training_job_done_is_kept_and_failure_shows_its_log(ops: Ops) -> None:
    ops.write(short_training(5))
    code, out, events = ops.deploy()
    assert code == 0, out
    assert {"vllm-0", "train"} <= started_or_restarted(events), out
    rows = ops.wait_status(lambda r: r["train"]["state"] not in ("running", "absent"))
    assert rows["train"]["state"] == "done", rows
    assert rows["train"]["progress"] is not None, rows
    assert (rows["train"]["progress"]["done"], rows["train"]["progress"]["total"]) == (5, 5), rows
    monitor_pid = rows["monitor"]["pid"]
    assert rows["train"]["health"] == "-" or "exit 0" in rows["train"]["health"], rows
    done_row = rows["train"]
    # Exit code and run time are recorded on the host.
    unit_dir = ops.host.workdir / "units" / "train"
    exit_record = json.loads((unit_dir / "exit").read_text())
    first_run = json.loads((unit_dir / "pid").read_text())
    assert exit_record["code"] == 0 and exit_record["finished_at"], exit_record
    assert first_run["started_at"], first_run

    # A done job is not run again by deploy, only with --rerun.
    code, out, events = ops.deploy()
    assert code == 0, out
    assert started_or_restarted(events) == set(), out
    assert "done (exit 0); --rerun runs it again" in messages(events, "train"), out
    code, out, events = ops.deploy("--rerun")
    assert code == 0, out
    assert started_or_restarted(events) == {"train"}, out
    assert json.loads((unit_dir / "pid").read_text())["pid"] != first_run["pid"]
    ops.wait_status(lambda r: r["train"]["state"] == "done")

    # A training run that crashes is `failed`, with its exit code and the end of its log.
    ops.write(short_training(3, exit_code=3))
    code, out, events = ops.deploy()
    assert code == 0, out
    assert started_or_restarted(events) == {"train"}, out
    ops.wait_status(lambda r: r["train"]["state"] not in ("running", "done"))
    code, failed_out, rows = ops.status()
    assert code != 0, failed_out
    assert rows["train"]["state"] == "failed" and rows["train"]["health"].startswith("exit 3"), rows
    assert rows["monitor"]["pid"] == monitor_pid, "a training (re)start touched the monitor"
    failed_row = rows["train"]

    code, out = ops.cli("stop")
    assert code == 0, out
    assert ops.gpu_used() == dict.fromkeys(range(8), 0)

    # Checked last and together, so that what status shows does not hide the lifecycle checks
    # above. `done` shows its exit code and run time (the issue: "with its exit code and run
    # time recorded"), `failed` the end of its log.
    crash = "RuntimeError: fake-train: simulated crash after 3 steps (exit 3)"
    wrong = [
        f"status of a done job shows no exit code and run time: {done_row}"
        if not str(done_row["health"]).startswith("exit 0 after ")
        else "",
        f"status of a failed job shows no end of its log: {failed_row}\n{failed_out}"
        if crash not in json.dumps(failed_row) or crash not in failed_out
        else "",
    ]
    assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)
