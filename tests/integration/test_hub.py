"""Hub files with the real huggingface_hub CLI (DESIGN.md "Real parts" 4): the test host runs
the real `hf download`, offline (the fleet sets HF_HUB_OFFLINE=1), against a cache laid out
here in the hub's own layout: ``models--ORG--NAME/refs/main`` names a commit, and
``snapshots/<commit>/...`` link into ``blobs/``. The fake `hf` (tests/fakes/bin) is left for
what needs the network: a gated repo without a token (test_nodestate.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, Result

COMMIT = "3f1c0ffee5" * 4


def real_hf(host: FleetHost) -> Path:
    """The real CLI, first on the host's PATH (ahead of the fake in tests/fakes/bin)."""
    real = Path(sys.executable).parent / "hf"
    assert real.exists(), "huggingface_hub (its `hf` CLI) comes with the dev extras"
    (host.bin_dir / "hf").symlink_to(real)
    return real


def hub_cache(home: Path, repo: str, commit: str, files: dict[str, bytes]) -> Path:
    """The repo at ``commit`` (also its `main`) in the hub cache of ``home``, as
    huggingface_hub lays it out."""
    root = home / ".cache" / "huggingface" / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir(exist_ok=True)
    for rel, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "snapshots" / commit


def entry_of(res: Result, dest: Path) -> dict[str, Any]:
    (found,) = [e for e in res.events if e["action"] == "files" and f"-> {dest}:" in e["message"]]
    return found


def test_hub_files_come_through_the_real_hf_cli_offline_from_the_hubs_cache_layout(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(hub={"gpus": 0})
    host = fleet["hub"]
    real = real_hf(host)
    version = subprocess.run([real, "version"], capture_output=True, text=True, check=False)
    print("hf", version.stdout.strip() or version.stderr.strip())
    files = {
        "config.json": b'{"model_type": "qwen3"}\n',
        "tokenizer/tokenizer.json": b'{"version": "1.0"}\n',
        "model-00001.safetensors": os.urandom(1 << 20),
    }
    hub_cache(host.home_dir, "org/tiny", COMMIT, files)
    ctl = ops(fleet)
    latest, pinned = host.dir / "models" / "latest", host.dir / "models" / "pinned"
    book = {
        "hosts": "hub",
        "files": [
            {"src": "hf:org/tiny@main", "dest": str(latest)},
            {"src": f"hf:org/tiny@{COMMIT}", "dest": str(pinned)},
        ],
    }
    ctl.playbook("p", book)
    check = ctl.run("deploy", "--check")
    assert check.code == 0, check.explain()
    assert "would download hf org/tiny@main on the host" in entry_of(check, latest)["message"]
    assert not latest.exists() and not pinned.exists()  # --check runs no hf

    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    for dest in (latest, pinned):
        assert "copied 3 file(s)" in entry_of(res, dest)["message"], res.explain()
        for rel, data in files.items():
            assert not (dest / rel).is_symlink() and (dest / rel).read_bytes() == data

    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    # A commit pins the content: known from facts, hf is not run again.
    assert entry_of(again, pinned)["message"].endswith(f"ok (hf org/tiny@{COMMIT[:12]})")
    assert entry_of(again, latest)["status"] == "ok", again.explain()


def test_a_revision_the_offline_hub_cache_does_not_have_fails_with_the_clis_own_words(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(hub={"gpus": 0})
    host = fleet["hub"]
    real_hf(host)
    hub_cache(host.home_dir, "org/tiny", COMMIT, {"config.json": b"{}\n"})
    ctl = ops(fleet)
    dest = host.dir / "models" / "v9"
    ctl.playbook("p", {"hosts": "hub", "files": [{"src": "hf:org/tiny@v9", "dest": str(dest)}]})
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    message = entry_of(res, dest)["message"]
    assert "`hf download org/tiny` failed (exit 1)" in message, message
    assert "offline mode is enabled" in message and "\x1b[" not in message, message
    assert not dest.exists()
