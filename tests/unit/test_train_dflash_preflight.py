"""Pre-flight and rendering of playbooks/train-dflash.yaml (INCIDENTS.md #2), offline.

The repo's playbook passes. Variants made from it (DP=2, training GPUs overlapping vLLM's, a GPU
count instead of a list) are written to a temporary ops folder with the example inventory and the
monitor script, so they stay in step with the real playbook.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, run_cli

PLAYBOOK = REPO / "playbooks" / "train-dflash.yaml"
INVENTORY = REPO / "inventory.example.yaml"


def variant(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """An ops folder holding the example inventory and a changed copy of the playbook."""
    shutil.copy(INVENTORY, tmp_path / "inventory.yaml")
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "monitor.py", tmp_path / "scripts" / "monitor.py")
    (tmp_path / "playbooks").mkdir()
    book = yaml.safe_load(PLAYBOOK.read_text())
    change(book)
    (tmp_path / "playbooks" / "train-dflash.yaml").write_text(yaml.safe_dump(book, sort_keys=False))
    return tmp_path


def service(book: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in book["services"] if s["name"] == name)


def job(book: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in book["jobs"] if j["name"] == name)


def test_repo_playbook_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(
        ["preflight", "-i", "inventory.example.yaml", "-p", "playbooks/train-dflash.yaml"],
        REPO,
        capsys,
    )
    assert code == 0, out
    assert "preflight passed: 3 units on 1 host(s) (pro6000)" in out, out
    assert "0 failed, 0 warnings" in out, out


def test_repo_playbook_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the issue asks of the real playbook: vLLM through launch_vllm.py with TP=2 DP=1 on
    GPUs 0-1 and port 8000; training on a disjoint set; the monitor on no GPU at all."""
    code, out = run_cli(
        [
            "render",
            "-i",
            "inventory.example.yaml",
            "-p",
            "playbooks/train-dflash.yaml",
            "--out",
            str(tmp_path),
        ],
        REPO,
        capsys,
    )
    assert code == 0, out
    scripts = {p.stem: p.read_text() for p in (tmp_path / "pro6000").glob("*.sh")}
    assert set(scripts) == {"vllm-0", "train", "monitor"}
    vllm = scripts["vllm-0"]
    assert "export CUDA_VISIBLE_DEVICES=0,1\n" in vllm
    assert "vllm-0 " in vllm and " vllm 2 1 8000 0,1 " in vllm  # banner: engine tp dp port gpus
    # vLLM runs in the playbook's vLLM + speculators environment, resolved when it starts.
    assert 'VIRTUAL_ENV="$(readlink -f -- /root/venv-vllm)"' in vllm
    assert (
        'exec "${VIRTUAL_ENV:?the unit environment is not set}"/bin/python '
        "/workspace/speculators/scripts/launch_vllm.py "
        "/workspace/models/Qwen3.6-27B --hidden-states-path /workspace/hidden_states "
        "--target-layer-ids 2 32 61 -- --host 127.0.0.1 --port 8000 "
        "--tensor-parallel-size 2 --data-parallel-size 1 "
    ) in vllm
    assert "export CUDA_VISIBLE_DEVICES=4,5,6,7\n" in scripts["train"]
    assert "exec torchrun --standalone --nproc_per_node 4 " in scripts["train"]
    assert 'export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"' in scripts["train"]  # its torchrun
    assert "--data-path /workspace/dflash/data/completions " in scripts["train"]
    assert "export CUDA_VISIBLE_DEVICES=''\n" in scripts["monitor"]
    assert "/monitor.py --watch /workspace/checkpoints/dflash --interval 60" in scripts["monitor"]


def test_dp2_variant_fails_with_the_incident_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def dp2(book: dict[str, Any]) -> None:
        service(book, "vllm").update(dp=2, gpus=[0, 1, 2, 3])

    code, out = run_cli(["preflight"], variant(tmp_path, dp2), capsys)
    assert code == 1, out
    [line] = [x for x in out.splitlines() if x.startswith("FAIL")]
    assert line.startswith("FAIL layout: playbooks/train-dflash.yaml:"), line
    assert "services[0].dp: [pro6000] vllm-0: vLLM with data-parallel-size 2 on " in line
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in line
    assert "'DP adjusted local rank ... is out of bounds' and a broken pipe" in line
    assert "(INCIDENTS.md #2)" in line
    assert "use `replicas: 2` with `dp: 1`" in line
    assert "set `allow_dp: true` only for MoE models" in line
    assert "preflight failed: 3 units on 1 host(s) (pro6000)" in out


def test_dp2_variant_line_points_at_dp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The message is located at the `dp:` key of the written file."""

    def dp2(book: dict[str, Any]) -> None:
        service(book, "vllm").update(dp=2, gpus=[0, 1, 2, 3])

    root = variant(tmp_path, dp2)
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1, out
    lines = (root / "playbooks" / "train-dflash.yaml").read_text().splitlines()
    row = next(i for i, text in enumerate(lines, 1) if text.strip() == "dp: 2")
    assert f"playbooks/train-dflash.yaml:{row}:" in out, out


def test_overlap_variant_names_both_units_and_the_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def overlap(book: dict[str, Any]) -> None:
        job(book, "train")["gpus"] = [1, 4, 5, 6]

    code, out = run_cli(["preflight"], variant(tmp_path, overlap), capsys)
    assert code == 1, out
    fails = [x for x in out.splitlines() if x.startswith("FAIL")]
    assert len(fails) == 1, out
    assert fails[0].startswith("FAIL layout: playbooks/train-dflash.yaml:"), fails
    assert "jobs[0].gpus: job train: GPU 1 is already used by vllm-0 on host pro6000" in fails[0]


def test_auto_vllm_gpus_overlap_training_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Explicit lists are claims: an `auto` vLLM is placed around the training's list, and a
    training list that leaves it too little room is refused, naming the service."""

    def crowded(book: dict[str, Any]) -> None:
        service(book, "vllm")["gpus"] = "auto"
        job(book, "train")["gpus"] = [0, 1, 2, 3, 4, 5, 6]

    code, out = run_cli(["preflight"], variant(tmp_path, crowded), capsys)
    assert code == 1, out
    assert "services[0].gpus: service vllm: needs 2 GPU(s) but host pro6000 has only 1 left" in out
    assert "(taken: train [0, 1, 2, 3, 4, 5, 6])" in out, out


def test_job_gpu_count_is_allocated_after_the_services(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpus: 4` on the training job takes the lowest GPUs left once every service has its own,
    even when the job comes first in the file and the service is `auto`."""

    def counted(book: dict[str, Any]) -> None:
        vllm = service(book, "vllm")
        vllm["gpus"] = "auto"
        job(book, "train")["gpus"] = 4
        second = {k: v for k, v in vllm.items() if k != "launcher"}
        book["services"].append({**second, "name": "vllm-b", "port": 8100})
        # jobs: before services: in the file, the count comes before both auto services.
        services = book.pop("services")
        jobs = book.pop("jobs")
        book.update(jobs=jobs, services=services)

    root = variant(tmp_path, counted)
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 0, out
    code, out = run_cli(["render", "--out", str(tmp_path / "out")], root, capsys)
    assert code == 0, out
    cvd = {
        p.stem: next(
            line.split("=", 1)[1]
            for line in p.read_text().splitlines()
            if line.startswith("export CUDA_VISIBLE_DEVICES=")
        )
        for p in (tmp_path / "out" / "pro6000").glob("*.sh")
    }
    assert cvd == {"vllm-0": "0,1", "vllm-b-0": "2,3", "train": "4,5,6,7", "monitor": "''"}


def test_job_gpu_count_that_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def too_many(book: dict[str, Any]) -> None:
        job(book, "train")["gpus"] = 7

    code, out = run_cli(["preflight"], variant(tmp_path, too_many), capsys)
    assert code == 1, out
    assert (
        "jobs[0].gpus: job train: needs 7 GPU(s) but host pro6000 has only 6 left of 8 "
        "(taken: vllm-0 [0, 1])"
    ) in out, out
