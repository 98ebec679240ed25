"""`dflashops prometheus-targets`: every engine's own /metrics as a file_sd_configs file, at the
address a Prometheus elsewhere dials (dflashops/commands/prometheus.py). No host is asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import WriteTree, run_cli

PROJECT = {
    "inventory.yaml": """
        hosts:
          gpu1: {address: 203.0.113.5, internal_address: 10.0.0.5, gpus: 4}
          gpu2: {address: gpu2.example.org, gpus: 4}
          here: {connection: local, gpus: 1}
        """,
    "playbooks/serve.yaml": """
        name: serve
        hosts: [gpu1, gpu2]
        services:
          - {name: open, engine: stub, model: /m, port: 30000, replicas: 2, bind: 0.0.0.0}
          - {name: inside, engine: stub, model: /m, port: 31000, bind: 10.0.0.99}
          - {name: near, engine: stub, model: /m, port: 32000}
        jobs:
          - {name: crunch, command: [sleep, "1"]}
        """,
    "playbooks/local.yaml": """
        name: local
        hosts: [here]
        services:
          - {name: mine, engine: stub, model: /m, port: 33000}
        """,
}


def test_every_engine_is_listed_at_the_address_prometheus_dials(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tree(PROJECT)
    code, out = run_cli(["prometheus-targets"], root, capsys)
    assert code == 0, out
    start, end = out.index("[\n"), out.index("\n]\n") + 2  # stdout; stderr after it
    entries = json.loads(out[start:end])
    got = {(e["labels"]["host"], e["labels"]["unit"]): e for e in entries}
    assert got[("gpu1", "open-0")] == {
        "targets": ["10.0.0.5:30000"],  # its internal address: what other machines dial
        "labels": {"host": "gpu1", "unit": "open-0", "engine": "stub"},
    }
    assert got[("gpu1", "open-1")]["targets"] == ["10.0.0.5:30001"]
    assert got[("gpu2", "open-0")]["targets"] == ["gpu2.example.org:30000"]
    assert got[("gpu2", "inside-0")]["targets"] == ["10.0.0.99:31000"]  # its own bind
    assert got[("here", "mine-0")]["targets"] == ["127.0.0.1:33000"]  # this machine: loopback
    assert not any(unit.startswith(("near", "crunch")) for _, unit in got)  # loopback, a job
    warning = out[:start] + out[end:]
    assert "gpu1/near-0" in warning and "gpu2/near-0" in warning and "bind: 0.0.0.0" in warning
    assert [list(e) for e in entries] == [["targets", "labels"]] * len(entries)
    assert sorted(got) == [(e["labels"]["host"], e["labels"]["unit"]) for e in entries]


def test_out_writes_the_whole_file(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = write_tree(PROJECT)
    target = tmp_path / "sd" / "dflashops.json"
    target.parent.mkdir()
    target.write_text("[]")  # what Prometheus reads until the new one is in place
    code, out = run_cli(
        ["prometheus-targets", "-p", "playbooks/local.yaml", "--out", str(target)], root, capsys
    )
    assert code == 0, out
    assert "1 target(s) written to" in out
    assert json.loads(target.read_text())[0]["targets"] == ["127.0.0.1:33000"]
    assert [p.name for p in target.parent.iterdir()] == ["dflashops.json"]  # no temporary left
    code, out = run_cli(
        ["prometheus-targets", "--out", str(tmp_path / "nowhere" / "x.json")], root, capsys
    )
    assert code == 1 and "--out" in out and "writable" in out
