"""`keep:` on real sshd hosts (issue 22, DESIGN "Nothing lost when a node is lost" 1-2): the
built-in generator's outputs mirrored off its node (to the controller and relayed to a second
host), the node's outputs lost with its job killed, and a deploy that restores them before the
job starts: the generator resumes and ends done with each prompt id exactly once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from fleet import FleetFactory
from lifecycle_helpers import Ops, pid_record, stub, unit_dir

from tests.procs import alive, free_ports, wait_for

PROMPTS = 600


def shards(folder: Path) -> dict[str, str]:
    """name -> sha256 of each output shard in ``folder``."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.glob("completions-*.jsonl"))
    }


def ids_in(folder: Path) -> list[str]:
    return [
        json.loads(line)["id"]
        for shard in sorted(folder.glob("completions-*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]


def progress_done(host_unit: Path) -> int:
    try:
        return int(json.loads((host_unit / "progress.json").read_text())["done"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def test_a_lost_output_is_restored_and_the_generator_resumes_with_every_id_once(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    fleet = fleet_factory(g={"gpus": 1}, k={"gpus": 0})
    g, k = fleet["g"], fleet["k"]
    ctl = ops(fleet)
    prompts = tmp_path / "prompts.jsonl"
    ids = [f"p{i:04d}" for i in range(PROMPTS)]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"q {i}"}) + "\n" for i in ids))
    # 600 prompts x 0.05 s over 4 in flight: ~8 s of work, long enough to stop it halfway.
    env = {"DFLASHOPS_STUB_LATENCY": "0.05"}
    far = k.dir / "far"
    ctl.playbook(
        "p",
        {
            "hosts": "g",
            "services": [stub("s", free_ports(1), env=env)],
            "jobs": [
                {
                    "name": "generate",
                    "script": "dflashops:generate_completions",
                    "servers": "s",
                    "args": {
                        "prompts": str(prompts),
                        "output-dir": "{{ workdir }}/completions",
                        "concurrency": 4,
                        "max-output-tokens": 16,
                    },
                    "stop_grace": "5s",
                    # Workdir-relative, kept on the controller and relayed to k.
                    "keep": {"paths": ["completions/"], "to": f"k:{far}", "every": "10s"},
                }
            ],
        },
    )
    out = g.workdir / "completions"
    kept = ctl.base / ".dflashops" / "keep" / "g" / "generate" / "completions"
    assert ctl.run("deploy").code == 0
    wait_for("a third of the prompts", lambda: progress_done(out) >= PROMPTS // 3, timeout=60)

    res = ctl.run("deploy")  # the job runs on: this deploy's one mirror
    assert res.code == 0, res.explain()
    (mirrored,) = [e for e in res.events if e["action"] == "keep"]
    assert mirrored["status"] == "ok" and mirrored["data"]["bytes_sent"] > 0, mirrored
    copied = ids_in(kept)
    assert len(copied) == len(set(copied)) >= PROMPTS // 3
    relayed = far / "g" / "generate" / "completions"
    assert shards(relayed) == shards(kept) and shards(kept)

    # The node loses the job and its outputs (killed with its supervisor, files gone).
    record = pid_record(g, "generate")
    assert record is not None
    os.killpg(int(record["pgid"]), signal.SIGKILL)
    wait_for("the job to be gone", lambda: not alive(int(record["pid"])), timeout=10)
    shutil.rmtree(out)

    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    acts = [e["action"] for e in res.events if e["unit"] == "generate"]
    assert acts.index("restore") < acts.index("start"), acts
    (restored,) = [e for e in res.events if e["action"] == "restore"]
    assert restored["data"]["restored_files"] >= 1, restored
    exit_record = unit_dir(g, "generate") / "exit"
    wait_for("the generator to finish", exit_record.exists, timeout=90)
    assert json.loads(exit_record.read_text())["code"] == 0
    final = ids_in(out)
    assert sorted(final) == ids  # every prompt, exactly once
    # It resumed on what was restored: the kept shards are in the output as they were kept.
    before = shards(kept)
    assert before.items() <= shards(out).items() or all(
        (out / name).read_bytes().startswith((kept / name).read_bytes()) for name in before
    )

    res = ctl.run("stop")  # stop mirrors once more: the copy is the whole output now
    assert res.code == 0, res.explain()
    assert shards(kept) == shards(out) and sorted(ids_in(kept)) == ids
    assert shards(far / "g" / "generate" / "completions") == shards(out)
