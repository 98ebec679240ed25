"""Identity: the running server's own report and the banner against the rendered unit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflashops.agent.answers import UnitProbe
from dflashops.config.load import load_inventory, load_playbook
from dflashops.engines import identity
from dflashops.engines.render import Rendered, render_plan
from dflashops.plan import build_plan
from tests.conftest import WriteTree

PLAYBOOK = """
name: p
hosts: h
services:
  - {name: sglang, engine: sglang, model: /m/qwen, tp: 2, port: 30000}
  - {name: vllm, engine: vllm, model: /m/target, tp: 2, gpus: [2, 3], port: 8000}
"""


def rendered(write_tree: WriteTree) -> dict[str, Rendered]:
    root = write_tree(
        {"inv.yaml": "hosts:\n  h: {address: 127.0.0.1, gpus: 4}\n", "p.yaml": PLAYBOOK}
    )
    plan = build_plan(load_inventory(root / "inv.yaml"), [load_playbook(root / "p.yaml")])
    units, problems = render_plan(plan, [])
    assert problems == []
    return {r.unit.name: r for r in units}


def probe(r: Rendered, body: Any, server_args: str | None = None, **banner: Any) -> UnitProbe:
    return UnitProbe.model_validate(
        {
            "name": r.unit.name,
            "alive": True,
            "ours": True,
            "pid": 1,
            "exit": None,
            "health": {"status": 200, "error": None},
            "identity": {"path": "/x", "status": 200, "body": body},
            "banner": {
                "line": f"[dflashops] unit={r.unit.name} ...",
                "unit": r.unit.name,
                "fingerprint": r.fingerprint,
                "tp": r.unit.tp,
                "dp": r.unit.dp,
                **banner,
            },
            "log_tail": None,
            "server_args": server_args,
        }
    )


def test_sglang_server_info_must_match(write_tree: WriteTree) -> None:
    r = rendered(write_tree)["sglang-0"]
    good = {"tp_size": 2, "dp_size": 1, "model_path": "/m/qwen", "port": 30000}
    assert identity.check(r, probe(r, good)) == []
    drifted = identity.check(r, probe(r, {**good, "dp_size": 2}))
    assert drifted == [("dp_size", "1", "2")]
    assert "dp_size  1 -> 2" in identity.describe(drifted)


def test_stale_banner_fingerprint_is_drift(write_tree: WriteTree) -> None:
    r = rendered(write_tree)["sglang-0"]
    body = {"tp_size": 2, "dp_size": 1, "model_path": "/m/qwen", "port": 30000}
    assert identity.check(r, probe(r, body, fingerprint="0" * 64))[0][0] == "banner fingerprint"


def test_vllm_reports_tp_dp_in_its_own_log(write_tree: WriteTree) -> None:
    r = rendered(write_tree)["vllm-0"]
    models = {"data": [{"id": "/m/target", "root": "/m/target"}]}
    # Real vLLM lists only non-defaults: DP=1 is absent and means 1.
    assert (
        identity.check(r, probe(r, models, "{'model_tag': '/m/target', 'tensor_parallel_size': 2}"))
        == []
    )
    # INCIDENTS.md #2: the old TP=2 DP=2 server still running, whatever the banner says.
    old = "{'model_tag': '/m/target', 'tensor_parallel_size': 2, 'data_parallel_size': 2}"
    assert identity.check(r, probe(r, models, old)) == [("data_parallel_size (vLLM log)", "1", "2")]
    # Without vLLM's own line (or one that is not plain literals) the banner stands in.
    assert identity.check(r, probe(r, models, "{'x': <Enum.A: 1>}", dp=2)) == [
        ("banner dp", "1", "2")
    ]
    wrong_model = identity.check(
        r, probe(r, {"data": [{"root": "/m/other"}]}, "{'tensor_parallel_size': 2}")
    )
    assert wrong_model == [("model (/v1/models root)", "/m/target", "/m/other")]


def test_the_probe_reads_vllms_own_args_from_the_log(tmp_path: Path) -> None:
    from dflashops.agent.remote.logs import read_server_args

    log = tmp_path / "x.log"
    log.write_text(
        "[dflashops] unit=vllm-0 fingerprint=ab engine=vllm tp=2 dp=1 port=8000 gpus=0,1 started=x\n"
        "INFO 11-30 09:00:00 [api_server.py:1] vLLM API server version 0.33.0\n"
        "INFO 11-30 09:00:00 [utils.py:233] non-default args: {'model_tag': '/m', 'tensor_parallel_size': 2}\n"
    )
    assert read_server_args(str(log)) == "{'model_tag': '/m', 'tensor_parallel_size': 2}"
    log.write_text("no such line\n")
    assert read_server_args(str(log)) is None


def test_metrics_of_both_engines_and_of_a_server_without_them() -> None:
    from dflashops.engines.metrics import Memory, parse, shown

    sglang = (
        '# TYPE sglang:gen_throughput gauge\nsglang:gen_throughput{model_name="m"} 234.5\n'
        'sglang:num_running_reqs{model_name="m"} 48\nsglang:num_queue_reqs{model_name="m"} 3\n'
        'sglang:token_usage{model_name="m"} 0.61\n'
    )
    r = parse("sglang", sglang, 10.0)
    assert (r.tok_s, r.running, r.queued, r.kv) == (234.5, 48, 3, 0.61)
    assert shown(r.kv, "pct") == "61%" and shown(r.tok_s, "tok") == "234"
    vllm = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{{engine="0",model_name="m"}} {}\n'
        'vllm:num_requests_running{{engine="0",model_name="m"}} 5\n'
    )
    memory = Memory(persist=False)
    first = memory.read("h/v", "vllm", vllm.format(1000), at=100.0)
    assert first.tok_s is None and first.running == 5  # a counter: no rate from one sample
    second = memory.read("h/v", "vllm", vllm.format(3000), at=110.0)
    assert second.tok_s == 200.0
    for garbage in (None, "not metrics at all {{{", "sglang:gen_throughput NaN\n"):
        bad = parse("sglang", garbage, 1.0)
        assert bad.tok_s is None and shown(bad.tok_s, "tok") == "-"
    assert parse("command", sglang, 1.0).tok_s is None  # a plain command is not asked
