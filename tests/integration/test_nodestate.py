"""Environments and files against the sshd fleet (DESIGN.md "Node state"): a node from nothing
in one deploy, the no-op after it, generate -> train across hosts, and every bad input of
issue 10, each with what is (and is not) left on the host."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet import FleetFactory, FleetHost, FleetUnsupported
from lifecycle_helpers import (
    Ops,
    Result,
    job,
    sglang,
    ssh_sessions,
    stub,
    unit_dir,
    unit_pid,
)

from tests.procs import alive, free_ports, wait_for
from tests.wheels import build_wheel

PART = ".dflashops-part."


def entry_events(res: Result, dest: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in res.events
        if e["action"] == "files" and (dest is None or f"-> {dest}:" in e["message"])
    ]


def the_entry(res: Result, dest: str) -> dict[str, Any]:
    found = entry_events(res, dest)
    assert len(found) == 1, (dest, res.explain())
    return found[0]


def env_events(res: Result) -> list[dict[str, Any]]:
    return [e for e in res.events if e["action"] == "environment"]


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def model_tree(root: Path, big: int = 3 << 20) -> Path:
    """A model folder on the host's 'disk': weights, config, a nested tokenizer."""
    write(root / "config.json", '{"model_type": "qwen3"}\n')
    write(root / "tokenizer" / "tokenizer.json", '{"version": "1.0"}\n')
    write(root / "model-00001.safetensors", os.urandom(big))
    return root


def node_from_nothing(ctl: Ops, host: FleetHost, port: int) -> dict[str, Path]:
    """The issue's playbook: an environment from wheels, the model from the node's disk into
    its RAM disk, prompts from the controller; SGLang in the environment on that model."""
    build_wheel(ctl.base / "wheels", "dfotest", "1.0")
    write(ctl.base / "data" / "prompts.jsonl", '{"id": "p1", "prompt": "hi"}\n')
    disk = model_tree(host.dir / "disk" / "Qwen3.6-27B")
    places = {
        "env": host.dir / "venv-sglang",
        "model": host.dir / "shm" / "Qwen3.6-27B",
        "prompts": host.dir / "workspace" / "prompts.jsonl",
        "disk": disk,
    }
    service = sglang(port, replicas=1, model=str(places["model"]), environment="sglang")
    ctl.playbook(
        "serve",
        {
            "hosts": host.name,
            "environments": {
                "sglang": {
                    "path": str(places["env"]),
                    "packages": ["dfotest==1.0"],
                    "wheels": "../wheels",
                }
            },
            "files": [
                {"name": "model", "src": f"host:{disk}", "dest": str(places["model"])},
                {"src": "../data/prompts.jsonl", "dest": str(places["prompts"])},
            ],
            "services": [service],
        },
    )
    return places


def test_a_node_from_nothing_in_one_deploy_then_a_no_op(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(fresh={"gpus": 2})
    host = fleet["fresh"]
    ctl = ops(fleet)
    port = free_ports(1)
    places = node_from_nothing(ctl, host, port)

    check = ctl.run("deploy", "--check")
    assert check.code == 0, check.explain()
    assert "environment sglang would be built" in check.out
    assert "would copy what differs from" in check.out and "would send 1 file(s)" in check.out
    assert not places["env"].exists() and not places["model"].exists()  # --check changes nothing

    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    (built,) = env_events(res)
    assert built["status"] == "changed" and "built with pip" in built["message"]
    assert places["env"].is_symlink() and (places["env"] / ".dflashops-env.json").is_file()
    assert the_entry(res, str(places["model"]))["status"] == "changed"
    for rel in ("config.json", "tokenizer/tokenizer.json", "model-00001.safetensors"):
        assert (places["model"] / rel).read_bytes() == (places["disk"] / rel).read_bytes()
    assert places["prompts"].read_text().startswith('{"id": "p1"')
    assert res.of("sglang-0", action="ready", status="changed"), res.explain()
    # The engine runs on the environment's build, resolved when it started.
    script = (unit_dir(host, "sglang-0") / "launch.sh").read_text()
    assert f'VIRTUAL_ENV="$(readlink -f -- {places["env"]})"' in script
    assert '"${VIRTUAL_ENV:?the unit environment is not set}"/bin/python' in script

    before = ssh_sessions(host)
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert {e["status"] for e in again.events if e["status"] not in ("info",)} == {"ok"}
    assert all(not e["data"].get("bytes") for e in entry_events(again))
    # The no-op costs what a no-op deploy without files costs: one command (facts carrying the
    # entries' state and the probe).
    assert ssh_sessions(host) - before == 1
    stats = [e for e in again.events if e["action"] == "stats"]
    assert stats[0]["data"]["commands"] == 1


def test_changed_model_content_restarts_its_server_and_a_changed_prompts_file_does_not(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(m={"gpus": 2})
    host = fleet["m"]
    ctl = ops(fleet)
    port = free_ports(1)
    places = node_from_nothing(ctl, host, port)
    assert ctl.run("deploy").code == 0
    first = unit_pid(host, "sglang-0")

    write(ctl.base / "data" / "prompts.jsonl", '{"id": "p2", "prompt": "again"}\n')
    res = ctl.run("deploy")
    assert res.code == 0 and the_entry(res, str(places["prompts"]))["status"] == "changed"
    assert unit_pid(host, "sglang-0") == first and not res.of("sglang-0", action="restart")

    write(places["disk"] / "config.json", '{"model_type": "qwen3", "rope": 2}\n')
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    moved = the_entry(res, str(places["model"]))
    assert moved["status"] == "changed" and "copied 1 file(s)" in moved["message"]
    (restart,) = res.of("sglang-0", action="restart")
    assert "content of files model changed" in restart["message"]
    assert unit_pid(host, "sglang-0") != first


def test_generate_on_one_host_train_on_another_after_the_job_is_done(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(gen={"gpus": 1}, train={"gpus": 1})
    gen, train = fleet["gen"], fleet["train"]
    ctl = ops(fleet)
    out_dir = gen.dir / "workspace" / "completions"
    dest = train.dir / "workspace" / "dflash" / "data" / "completions"
    release = gen.dir / "release"
    # The generator writes two shards and its progress, then waits for the test to let it end.
    script = (
        f"mkdir -p {out_dir}; echo a > {out_dir}/shard-0.jsonl; echo b > {out_dir}/shard-1.jsonl; "
        f'echo \'{{"done": 1, "total": 2, "state": "running"}}\' > "$DFLASHOPS_PROGRESS_FILE"; '
        f"while [ ! -e {release} ]; do sleep 0.1; done; "
        f'echo \'{{"done": 2, "total": 2, "state": "done"}}\' > "$DFLASHOPS_PROGRESS_FILE"'
    )
    ctl.playbook("generate", {"hosts": "gen", "jobs": [job("generate", script)]})
    ctl.playbook(
        "train",
        {
            "hosts": "train",
            "files": [
                {
                    "name": "completions",
                    "src": f"gen:{out_dir}/",
                    "dest": f"{dest}/",
                    "after": "gen/generate",
                }
            ],
            "jobs": [job("train", f"ls {dest} > {train.dir}/trained.txt", needs=["completions"])],
        },
    )
    assert ctl.run("deploy", playbooks=["generate"]).code == 0
    progress = unit_dir(gen, "generate") / "progress.json"
    wait_for("the generator's first shards", progress.exists)
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()  # waiting is not a failure
    waiting = the_entry(res, str(dest))
    assert (
        waiting["status"] == "waiting"
        and "waiting for gen/generate (running, 1/2 done)" in waiting["message"]
    ), res.explain()
    (held,) = res.of("train", status="waiting")
    assert "waiting for gen/generate" in held["message"]
    assert not dest.exists() and "waiting=2" in res.out

    release.write_text("go")
    wait_for("the generator to finish", lambda: (unit_dir(gen, "generate") / "exit").exists())
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    copied = the_entry(res, str(dest))
    assert copied["status"] == "changed" and "sent 2 file(s)" in copied["message"]
    assert sorted(p.name for p in dest.iterdir()) == ["shard-0.jsonl", "shard-1.jsonl"]
    assert res.of("train", action="start", status="changed"), res.explain()
    # The shell makes trained.txt (empty) before ls writes to it: wait for what ls wrote.
    trained = train.dir / "trained.txt"
    wait_for("training to read the data", lambda: trained.exists() and trained.read_text())
    assert trained.read_text().split() == ["shard-0.jsonl", "shard-1.jsonl"]


def test_nothing_is_copied_from_a_failed_job(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(gen={"gpus": 0}, train={"gpus": 0})
    gen, train = fleet["gen"], fleet["train"]
    ctl = ops(fleet)
    out_dir = gen.dir / "out"
    ctl.playbook(
        "generate",
        {
            "hosts": "gen",
            "jobs": [job("generate", f"mkdir -p {out_dir}; echo x > {out_dir}/a; exit 3")],
        },
    )
    ctl.playbook(
        "train",
        {
            "hosts": "train",
            "files": [
                {"src": f"gen:{out_dir}", "dest": str(train.dir / "in"), "after": "gen/generate"}
            ],
        },
    )
    assert ctl.run("deploy", playbooks=["generate"]).code == 0
    wait_for("the job to fail", lambda: (unit_dir(gen, "generate") / "exit").exists())
    res = ctl.run("deploy", playbooks=["train"])
    assert res.code == 2, res.explain()
    assert (
        "gen/generate failed (exit 3): nothing is copied"
        in the_entry(res, str(train.dir / "in"))["message"]
    )
    assert not (train.dir / "in").exists()


def test_a_dropped_connection_mid_file_resumes_and_sends_less_the_next_time(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(flaky={"gpus": 0})
    host = fleet["flaky"]
    ctl = ops(fleet)
    big = write(ctl.base / "data" / "big.bin", os.urandom(192 << 20))
    dest = host.dir / "data" / "big.bin"
    ctl.playbook("p", {"hosts": "flaky", "files": [{"src": "../data/big.bin", "dest": str(dest)}]})
    results: list[Result] = []
    worker = threading.Thread(target=lambda: results.append(ctl.run("deploy")))
    worker.start()

    def part() -> Path | None:
        found = [p for p in dest.parent.glob(f".big.bin{PART}*")] if dest.parent.is_dir() else []
        return found[0] if found and found[0].stat().st_size > (16 << 20) else None

    wait_for("the transfer to be under way", part, timeout=30, every=0.01)
    host.kill_sessions()
    worker.join(60)
    (first,) = results
    assert first.code == 2, first.explain()
    assert not dest.exists()
    kept = part()
    assert kept is not None, "the bytes already written are kept beside dest"
    already = kept.stat().st_size

    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    done = the_entry(res, str(dest))
    assert "(1 resumed)" in done["message"], done
    assert done["data"]["bytes"] == big.stat().st_size - already < big.stat().st_size
    assert dest.read_bytes() == big.read_bytes()
    assert not list(dest.parent.glob(f".*{PART}*"))


def corrupting_python(host: FleetHost) -> str:
    """A host python whose stdin flips one byte 1.5 MB in (inside a 2 MiB transfer), as a
    corrupted link would. It streams (a kept session's stdin never ends) and small requests
    (facts) pass untouched."""
    relay = host.bin_dir / "corrupt-stdin.py"
    relay.write_text(
        "import os, sys\n"
        "AT = 1_500_000\n"
        "seen = 0\n"
        "while True:\n"
        "    chunk = os.read(0, 1 << 16)\n"
        "    if not chunk:\n"
        "        break\n"
        "    if seen <= AT < seen + len(chunk):\n"
        "        i = AT - seen\n"
        "        chunk = chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1 :]\n"
        "    seen += len(chunk)\n"
        "    sys.stdout.buffer.write(chunk)\n"
        "    sys.stdout.buffer.flush()\n"
    )
    wrapper = host.bin_dir / "python-corrupting"
    wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/python3 -u {relay} | /usr/bin/python3 "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_corrupted_transfer_is_caught_and_leaves_nothing_at_dest(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(liar={"gpus": 0})
    host = fleet["liar"]
    ctl = ops(fleet, hosts={"liar": {"python": corrupting_python(host)}})
    write(ctl.base / "data" / "blob.bin", os.urandom(2 << 20))
    dest = host.dir / "data" / "blob.bin"
    ctl.playbook("p", {"hosts": "liar", "files": [{"src": "../data/blob.bin", "dest": str(dest)}]})
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    message = the_entry(res, str(dest))["message"]
    assert "sha256 mismatch on the host" in message, message
    assert not dest.exists() and not list(dest.parent.glob(".*"))


def test_a_full_disk_and_a_too_small_ram_disk_are_refused_before_writing(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    try:
        fleet = fleet_factory(tiny={"gpus": 0, "workdir_size_mib": 3})
    except FleetUnsupported as exc:
        pytest.fail(f"this machine cannot mount a small tmpfs: {exc}")
    host = fleet["tiny"]
    ctl = ops(fleet)
    write(ctl.base / "data" / "big.bin", os.urandom(8 << 20))
    model = model_tree(host.dir / "disk" / "m", big=6 << 20)
    # The workdir is the 3 MiB tmpfs: dests inside it are the "disk" and the "RAM disk".
    disk_dest, shm_dest = host.workdir / "data" / "big.bin", host.workdir / "shm" / "m"
    ctl.playbook(
        "p",
        {
            "hosts": "tiny",
            "files": [
                {"src": "../data/big.bin", "dest": str(disk_dest)},
                {"src": f"host:{model}", "dest": str(shm_dest)},
            ],
        },
    )
    live = ctl.run("preflight", "--live", json_events=False)
    assert live.code == 1 and "8.0 MiB to write to" in live.out, live.out
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    for dest, need in ((disk_dest, "8.0 MiB"), (shm_dest, "6.0 MiB")):
        message = the_entry(res, str(dest))["message"]
        assert (
            f"to write to {dest}" in message
            and "free at" in message
            and "nothing written" in message
        ), message
        assert need in message or "bytes to write" in message, message
    assert not disk_dest.exists() and not shm_dest.exists()


def test_missing_sources_and_an_unreachable_relay_host_are_named(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(a={"gpus": 0}, gone={"gpus": 0})
    a, gone = fleet["a"], fleet["gone"]
    ctl = ops(fleet)
    ctl.playbook(
        "p", {"hosts": "a", "files": [{"src": "../data/nothing.txt", "dest": str(a.dir / "x")}]}
    )
    res = ctl.run("preflight", json_events=False)
    assert res.code == 1 and "'../data/nothing.txt' not found at" in res.out, res.out

    ctl.playbook(
        "p",
        {
            "hosts": "a",
            "files": [
                {"src": "host:/nonexistent/model", "dest": str(a.dir / "m")},
                {"src": f"gone:{gone.dir}/out", "dest": str(a.dir / "out")},
            ],
        },
    )
    gone.stop()
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    assert (
        "the source /nonexistent/model does not exist on a"
        in the_entry(res, str(a.dir / "m"))["message"]
    )
    relay = the_entry(res, str(a.dir / "out"))["message"]
    assert "[gone]" in relay and "connection refused" in relay, relay


def test_a_package_that_does_not_exist_fails_with_the_installers_message_and_running_units_keep_running(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(e={"gpus": 1})
    host = fleet["e"]
    ctl = ops(fleet)
    build_wheel(ctl.base / "wheels", "dfotest", "1.0")
    port = free_ports(1)
    env = {"path": str(host.dir / "venv"), "packages": ["dfotest==1.0"], "wheels": "../wheels"}
    book = {
        "hosts": "e",
        "environments": {"tools": env},
        "services": [stub("web", port, environment="tools")],
    }
    ctl.playbook("p", book)
    assert ctl.run("deploy").code == 0
    running = unit_pid(host, "web-0")
    build = os.readlink(host.dir / "venv")

    env["packages"] = ["dfotest==1.0", "no-such-package==9.9"]
    ctl.playbook("p", book)
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    (failed,) = env_events(res)
    assert "No matching distribution found for no-such-package==9.9" in failed["message"], failed
    assert "untouched" in failed["message"]
    (kept,) = res.of("web-0", status="failed")
    assert "still running its old process" in kept["message"]
    assert alive(running) and unit_pid(host, "web-0") == running
    assert os.readlink(host.dir / "venv") == build  # the switch never happened
    assert not [p for p in (host.dir / "venv.builds").iterdir() if ".dflashops-tmp." in p.name]


def test_a_gated_hub_repo_without_a_token_says_how_to_give_one_and_with_it_downloads(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = fleet_factory(hub={"gpus": 0})
    host = fleet["hub"]
    ctl = ops(fleet)
    repo = host.home_dir / ".fake-hub" / "org" / "gated-model"
    write(repo / "GATED", "hf_secret_token_123\n")
    write(repo / "main" / "config.json", "{}\n")
    write(repo / "main" / "weights.bin", os.urandom(1 << 16))
    dest = host.dir / "models" / "gated"
    entry: dict[str, Any] = {"src": "hf:org/gated-model@main", "dest": str(dest)}
    ctl.playbook("p", {"hosts": "hub", "files": [entry]})
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    message = the_entry(res, str(dest))["message"]
    assert (
        "GatedRepoError: 401 Client Error" in message
        and "secret_env: {HF_TOKEN: HF_TOKEN}" in message
    )
    assert not dest.exists()

    entry["secret_env"] = {"HF_TOKEN": "HF_TOKEN"}
    ctl.playbook("p", {"hosts": "hub", "files": [entry]})
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123")
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    assert (dest / "weights.bin").read_bytes() == (repo / "main" / "weights.bin").read_bytes()
    assert "hf_secret_token_123" not in res.out and "hf_secret_token_123" not in str(res.events)


def test_delete_removes_only_files_under_dest_and_odd_names_are_data(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(d={"gpus": 0})
    host = fleet["d"]
    ctl = ops(fleet)
    odd = "a b;$(touch INJECTED)'\"`x`"
    src = ctl.base / "data" / odd
    write(src / "keep.txt", "keep\n")
    write(src / f"sub {odd}" / "deep.txt", "deep\n")
    dest = host.dir / "out" / f"dest {odd}"
    write(dest / "stale.txt", "stale\n")  # under dest, not in src: deleted
    outside = write(host.dir / "out" / "sibling.txt", "mine\n")  # beside dest: never touched
    ctl.playbook(
        "p",
        {
            "hosts": "d",
            "files": [{"src": f"../data/{odd}", "dest": str(dest), "delete": True, "mode": "0600"}],
        },
    )
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    assert "delete 1" in the_entry(res, str(dest))["message"]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "keep.txt",
        f"sub {odd}/deep.txt",
    ]
    assert (dest / "keep.txt").stat().st_mode & 0o777 == 0o600
    assert outside.read_text() == "mine\n"
    assert not list(Path("/").glob("INJECTED")) and not list(host.dir.rglob("INJECTED"))
    assert not list(ctl.base.rglob("INJECTED")) and not list(Path.cwd().glob("INJECTED"))


def test_fetch_brings_a_host_tree_home_verified_and_resumes(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(f={"gpus": 0})
    host = fleet["f"]
    ctl = ops(fleet)
    tree = model_tree(host.dir / "results", big=1 << 20)
    local = ctl.base / "fetched"
    res = ctl.run("fetch", str(tree), str(local), "--host", "f", playbooks=[], json_events=False)
    assert res.code == 0 and "3 file(s)" in res.out, res.out
    for rel in ("config.json", "tokenizer/tokenizer.json", "model-00001.safetensors"):
        assert (local / rel).read_bytes() == (tree / rel).read_bytes()
    # A half-fetched file (an earlier run cut short) is completed, not fetched again.
    weights = local / "model-00001.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    import hashlib

    part = local / f".model-00001.safetensors{PART}{hashlib.sha256(data).hexdigest()[:16]}"
    part.write_bytes(data[: len(data) // 2])
    res = ctl.run("fetch", str(tree), str(local), "--host", "f", playbooks=[], json_events=False)
    assert res.code == 0 and "1 file(s)" in res.out and "2 already there" in res.out, res.out
    assert weights.read_bytes() == data and not part.exists()


def test_uv_builds_where_the_host_has_it_and_live_preflight_checks_the_engine_in_the_environment(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    import shutil
    import sys

    uv = Path(sys.executable).parent / "uv"
    assert uv.exists() or shutil.which("uv"), "uv comes with the dev extras"
    fleet = fleet_factory(uvh={"gpus": 1})
    host = fleet["uvh"]
    (host.bin_dir / "uv").symlink_to(uv if uv.exists() else Path(str(shutil.which("uv"))))
    ctl = ops(fleet)
    port = free_ports(1)
    node_from_nothing(ctl, host, port)
    before = ctl.run("preflight", "--live", json_events=False)
    assert before.code == 0, before.out
    assert "live: 1 of 1 host(s) reached" in before.out
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    (built,) = env_events(res)
    assert "built with uv" in built["message"], built
    # Built: the engine's import is checked in the environment's own python now.
    path = ctl.base / "live.json"
    after = ctl.run("preflight", "--live", "--json", str(path), json_events=False)
    assert after.code == 0, after.out
    import json

    checks = json.loads(path.read_text())["checks"]
    engine = [
        c for c in checks if c["check"] == "live-engines" and c["subject"] == "uvh/sglang@sglang"
    ]
    assert engine and engine[0]["ok"] and engine[0]["message"] != "", engine
    assert not [c for c in checks if c["check"] == "live-paths" and not c["ok"]]
