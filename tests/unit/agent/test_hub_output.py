"""Where `hf download` says it put the snapshot, in each huggingface_hub's words (the real CLI
itself is run in tests/integration/test_hub.py)."""

from __future__ import annotations

from pathlib import Path

from dflashops.agent.remote.copy import snapshot_folder


def test_the_snapshot_folder_is_read_from_every_cli_versions_output(tmp_path: Path) -> None:
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    outputs = {
        "0.x: the bare folder last": f"Fetching 3 files: 100%\n{snap}\n",
        "1.x/2.x off a terminal": f"\N{CHECK MARK} Downloaded\n  path: {snap}\n",
        "2.x colored": f"\x1b[32m\N{CHECK MARK} Downloaded\x1b[0m\n  path: {snap}\n",
        "a warning after it": f"  path: {snap}\nWarning: something else\n",
    }
    for what, out in outputs.items():
        assert snapshot_folder(out) == str(snap), what
    assert snapshot_folder(f"  path: {tmp_path / 'gone'}\n") is None
    assert snapshot_folder("\N{CHECK MARK} Downloaded\n") is None
