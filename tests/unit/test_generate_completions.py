"""Tests for dflashops/builtins/generate_completions.py, the resumable completions generator.

The pure parts (input parsing, shard selection, torn-line recovery, resume bookkeeping, server
selection, the writer) are tested in-process; the rest runs the payload as a subprocess against
stub_engine.py servers on loopback ports, as it runs on a GPU host. One test runs it with
/usr/bin/python3 (Debian's, no packages) to prove it needs nothing but the standard library.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _stubservers import (
    Stub,
    free_port,
    output_ids,
    read_records,
    run_gc,
    shard_files,
    start_gc,
    stub_servers,
    write_prompts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashops.builtins import generate_completions as gc

SYSTEM_PYTHON = "/usr/bin/python3"
PROGRESS_FIELDS = {
    "state",
    "total",
    "done",
    "failed",
    "remaining",
    "rejected",
    "tokens_per_s",
    "requests_per_s",
    "eta_s",
    "started_at",
    "updated_at",
    "servers",
}
SERVER_FIELDS = {"ok", "errors", "in_flight", "backed_off_until", "last_error"}


def assert_exactly_once(out: Path, ids: list[str]) -> None:
    counts = collections.Counter(output_ids(out))
    dups = {k: v for k, v in counts.items() if v > 1}
    assert not dups, f"ids written more than once: {dups}"
    missing = set(ids) - set(counts)
    assert not missing, f"{len(missing)} ids missing, e.g. {sorted(missing)[:5]}"
    assert set(counts) == set(ids)


def progress(out: Path) -> dict[str, Any]:
    return json.loads((out / "progress.json").read_text())


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fast_stubs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two zero-latency stubs; the first splits out reasoning (--reasoning-parser qwen3)."""
    logs = tmp_path_factory.mktemp("fast-stubs")
    a = Stub(logs, args=["--reasoning-parser", "qwen3"])
    b = Stub(logs)
    try:
        a.wait_healthy()
        b.wait_healthy()
        yield [a, b]
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def slow_stubs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two stubs answering in 20 ms: runs long enough to be interrupted."""
    with stub_servers(
        tmp_path_factory.mktemp("slow-stubs"), 2, env={"DFLASHOPS_STUB_LATENCY": "0.02"}
    ) as stubs:
        yield stubs


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}', ("a", "a", "chat")),
        ('{"id": 17, "prompt": "once"}', (17, "17", "text")),
        ('{"prompt": [1, 2, 3]}', ("line-9", "line-9", "text")),
        ('{"id": "b", "messages": [{"role": "user", "content": [{"type": "text"}]}]}', "chat"),
    ],
)
def test_parse_prompt_line_accepts(line: str, expect: Any) -> None:
    pid, key, kind, _payload = gc.parse_prompt_line(line.encode(), 9)
    if isinstance(expect, tuple):
        assert (pid, key, kind) == expect
    else:
        assert kind == expect


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"id": "a"}', "neither"),
        (b'{"id": "a", "prompt": "x", "messages": []}', "both"),
        (b'{"id": true, "prompt": "x"}', "'id'"),
        (b'{"id": 1.5, "prompt": "x"}', "'id'"),
        (b'{"id": null, "prompt": "x"}', "'id'"),
        (b'{"id": " ", "prompt": "x"}', "empty"),
        (b'{"id": "a", "messages": []}', "non-empty list"),
        (b'{"id": "a", "messages": "hi"}', "non-empty list"),
        (b'{"id": "a", "messages": [{"content": "hi"}]}', "role"),
        (b'{"id": "a", "messages": [{"role": "user", "content": 3}]}', "content"),
        (b'{"id": "a", "prompt": ""}', "empty"),
        (b'{"id": "a", "prompt": 5}', "'prompt'"),
    ],
)
def test_parse_prompt_line_rejects(line: bytes, error: str) -> None:
    with pytest.raises(gc.PromptError, match=error):
        gc.parse_prompt_line(line, 3)


def test_shard_selection_is_the_documented_sha256_formula() -> None:
    ids: list[Any] = [f"q{i}" for i in range(300)] + list(range(300)) + ["line-17", "ünï"]
    for n in (1, 2, 3, 7):
        owners = collections.Counter()
        for pid in ids:
            key = gc.id_key(pid)
            expect = int(hashlib.sha256(str(pid).encode()).hexdigest()[:16], 16) % n
            got = [i for i in range(n) if gc.in_shard(key, (i, n))]
            assert got == [expect]
            owners[expect] += 1
        assert sum(owners.values()) == len(ids)
    # Pinned values: the same on every machine and python version (no hash() randomization).
    assert gc.id_hash64("q0") == int(hashlib.sha256(b"q0").hexdigest()[:16], 16)
    assert gc.in_shard("anything", None)


def _record_line(pid: str, n: int = 3) -> bytes:
    return gc.encode_json_line({"id": pid, "answer": "w " * n, "reasoning": None})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(min_value=0, max_value=8),
    cut=st.integers(min_value=0, max_value=10_000),
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=8, max_size=8),
)
def test_scan_drops_a_torn_last_line_at_any_cut(n: int, cut: int, sizes: list[int]) -> None:
    lines = [_record_line(f"r{i}", sizes[i]) for i in range(n)]
    data = b"".join(lines)
    cut = min(cut, len(data))
    with tempfile.TemporaryDirectory() as d:
        shard = Path(d) / "completions-x-0000.jsonl"
        shard.write_bytes(data[:cut])
        done: set[str] = set()
        res = gc.scan_outputs(d, done)
        whole = data[:cut].count(b"\n")
        assert done == {f"r{i}" for i in range(whole)}
        assert res.records == whole
        kept = b"".join(lines[:whole])
        assert shard.read_bytes() == kept  # the torn tail is truncated away
        torn = Path(d) / "torn-lines.jsonl"
        assert res.torn == (1 if cut > len(kept) else 0)
        assert torn.exists() == (cut > len(kept))


def test_scan_counts_each_id_once_and_skips_bad_middle_lines(tmp_path: Path) -> None:
    (tmp_path / "completions-a-0000.jsonl").write_bytes(
        _record_line("x") + b"garbage\n" + _record_line("y") + b'{"id": "z", "answ'
    )
    (tmp_path / "completions-b-0000.jsonl").write_bytes(_record_line("y") + _record_line("7"))
    (tmp_path / "other.jsonl").write_bytes(b"not a shard")
    done: set[str] = set()
    res = gc.scan_outputs(str(tmp_path), done)
    assert done == {"x", "y", "7"}
    assert (res.records, res.duplicates, res.bad_lines, res.torn) == (3, 1, 1, 1)
    # The bad middle line is left alone; only the torn tail is cut.
    assert (tmp_path / "completions-a-0000.jsonl").read_bytes().endswith(b"\n")
    assert b"garbage" in (tmp_path / "completions-a-0000.jsonl").read_bytes()


def test_plan_prompts_resume_bookkeeping(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [
        '{"id": "a", "prompt": "x"}',
        "",
        '{"id": "b", "messages": [{"role": "user", "content": "y"}]}',
        "oops",
        '{"id": "a", "prompt": "again"}',
        '{"prompt": "no id"}',
        '{"id": 5, "prompt": "int id"}',
    ]
    prompts.write_text("\n".join(lines) + "\n")
    rejected = tmp_path / "rejected.jsonl"
    plan = gc.plan_prompts(str(prompts), {"b", "gone"}, None, str(rejected))
    assert (plan.total, plan.done, plan.pending, plan.rejected) == (4, 1, 3, 2)
    assert list(plan.lines) == [1, 6, 7]
    with open(prompts, "rb") as f:
        for off, line_no, h in zip(plan.offsets, plan.lines, plan.hashes, strict=True):
            f.seek(off)
            _pid, key, _kind, _ = gc.parse_prompt_line(f.readline(), line_no)
            assert gc.id_hash64(key) == h
    rej = [json.loads(x) for x in rejected.read_text().splitlines()]
    assert [(r["line"], r["error"][:9]) for r in rej] == [(4, "not valid"), (5, "duplicate")]
    assert rej[0]["raw"] == "oops"
    # Sharding: the two halves partition the valid ids.
    halves = [gc.plan_prompts(str(prompts), set(), (i, 2), str(rejected)) for i in (0, 1)]
    assert halves[0].total + halves[1].total == 4


def test_parse_completion_reads_both_reasoning_fields() -> None:
    sglang = {
        "choices": [
            {
                "message": {"content": "A", "reasoning_content": "R1"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    vllm = {
        "choices": [{"message": {"content": "B", "reasoning": "R2"}, "finish_reason": "length"}]
    }
    text = {"choices": [{"text": "C", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    a = gc.parse_completion(json.dumps(sglang).encode())
    assert (a["answer"], a["reasoning"], a["prompt_tokens"], a["completion_tokens"]) == (
        "A",
        "R1",
        3,
        4,
    )
    b = gc.parse_completion(json.dumps(vllm).encode())
    assert (b["answer"], b["reasoning"], b["finish_reason"], b["prompt_tokens"]) == (
        "B",
        "R2",
        "length",
        None,
    )
    assert gc.parse_completion(json.dumps(text).encode())["answer"] == "C"
    for bad in (b"<html>", b"{}", b'{"choices": []}', b"[1]"):
        with pytest.raises(gc.BadResponse):
            gc.parse_completion(bad)


def test_server_urls() -> None:
    s = gc.Server("http://127.0.0.1:30000/v1/")
    assert (s.url, s.host, s.port, s.prefix) == (
        "http://127.0.0.1:30000/v1",
        "127.0.0.1",
        30000,
        "",
    )
    assert gc.Server("127.0.0.1:30001").port == 30001
    assert gc.Server("https://h/proxy").prefix == "/proxy"
    for bad in ("ftp://h:1", "http://h:notaport", "http://:80"):
        with pytest.raises(gc.UsageError):
            gc.Server(bad)


def test_pool_picks_the_up_server_with_fewest_in_flight() -> None:
    servers = [gc.Server(f"http://127.0.0.1:{30000 + i}") for i in range(3)]
    pool = gc.ServerPool(servers)
    stop = threading.Event()
    for s in servers:
        pool.probe_result(s, True, None)
    picked = [pool.acquire(stop) for _ in range(6)]
    assert collections.Counter(p.url for p in picked if p) == {s.url: 2 for s in servers}
    pool.release(servers[0])
    pool.release(servers[0])
    assert pool.acquire(stop) is servers[0]
    # A connection failure backs a server off at once: it gets nothing until it is up again.
    pool.error(servers[0], "refused", hard=True)
    assert not servers[0].up and servers[0].down_until > time.monotonic()
    assert all(pool.acquire(stop) is not servers[0] for _ in range(10))
    # Soft errors (5xx, timeouts) back off only after three in a row; a success resets them.
    pool.error(servers[1], "HTTP 500", hard=False)
    pool.error(servers[1], "HTTP 500", hard=False)
    pool.success(servers[1])
    pool.error(servers[1], "HTTP 500", hard=False)
    assert servers[1].up
    pool.error(servers[1], "HTTP 500", hard=False)
    pool.error(servers[1], "HTTP 500", hard=False)
    assert not servers[1].up
    pool.error(servers[2], "refused", hard=True)
    # None up: acquire waits, and returns None once told to stop.
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert pool.acquire(stop) is None
    assert time.monotonic() - t0 >= 0.15
    status = pool.snapshot()
    assert set(status) == {s.url for s in servers}
    assert set(status[servers[0].url]) >= SERVER_FIELDS


def test_backoff_is_exponential_jittered_and_capped() -> None:
    for n in range(1, 40):
        b = gc.backoff_seconds(n, 1.0, 60.0)
        assert min(60.0, 2 ** (n - 1)) * 0.5 <= b <= min(60.0, 2 ** (n - 1))


class _FakeRun:
    def __init__(self, out: Path) -> None:
        self.output_dir = str(out)
        self.run_id = "test"
        self.stats = gc.Stats(0)
        self.fatal: Any = None

    def fatal_io(self, exc: BaseException, where: str) -> None:
        self.fatal = (exc, where)


def test_writer_dedupes_and_rolls_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "SHARD_ROLL_RECORDS", 3)
    run = _FakeRun(tmp_path)
    w = gc.Writer(run, {"old"})  # type: ignore[arg-type]
    w.start()
    for key in ["a", "b", "old", "c", "a", "d", "e", "f", "g"]:
        w.put_record(key, _record_line(key), 2)
    w.put_failed(gc.encode_json_line({"id": "z", "error": "HTTP 400"}))
    w.close_and_wait()
    w.join(10)
    assert run.fatal is None
    files = shard_files(tmp_path)
    assert [len(p.read_bytes().splitlines()) for p in files] == [3, 3, 1]
    assert output_ids(tmp_path) == ["a", "b", "c", "d", "e", "f", "g"]
    assert w.dropped_duplicates == 2
    assert (run.stats.done_run, run.stats.tokens_run) == (7, 14)
    assert json.loads((tmp_path / "failed.jsonl").read_text())["id"] == "z"


# --------------------------------------------------------------------------- CLI basics


def test_missing_prompt_file_is_a_clear_usage_error(tmp_path: Path) -> None:
    proc = run_gc(tmp_path / "nope.jsonl", ["http://127.0.0.1:9"], tmp_path / "out")
    assert proc.returncode == 1, explain(proc)
    assert "nope.jsonl does not exist" in proc.stderr


def test_empty_prompt_file_has_nothing_to_do(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("")
    proc = run_gc(prompts, ["http://127.0.0.1:9"], tmp_path / "out")
    assert proc.returncode == 0, explain(proc)
    assert "nothing to do" in proc.stdout
    assert shard_files(tmp_path / "out") == []


def test_only_bad_lines_is_an_input_error(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("nope\n[]\n")
    proc = run_gc(prompts, ["http://127.0.0.1:9"], tmp_path / "out")
    assert proc.returncode == 1, explain(proc)
    assert "no valid prompt" in proc.stderr


@pytest.mark.parametrize(
    "extra",
    [
        ["--shard", "2/2"],
        ["--shard", "x"],
        ["--concurrency", "0"],
        ["--chat-template-kwargs", "[1]"],
        ["--api-key-env", "DFLASHOPS_TEST_UNSET_KEY"],
    ],
)
def test_bad_flags_exit_1(tmp_path: Path, extra: list[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    proc = run_gc(prompts, ["http://127.0.0.1:9"], tmp_path / "out", *extra)
    assert proc.returncode == 1, explain(proc)


# --------------------------------------------------------------------------- end to end


def test_malformed_lines_duplicates_and_stdlib_only(tmp_path: Path, fast_stubs: Any) -> None:
    """Runs under Debian's /usr/bin/python3 (no packages): the payload is stdlib only."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("no /usr/bin/python3 here")
    prompts = tmp_path / "p.jsonl"
    good = write_prompts(prompts, 40)
    with open(prompts, "a") as f:
        f.write("this is not json\n")  # line 41
        f.write('{"id": "p00003", "prompt": "a duplicate"}\n')  # line 42
        f.write('{"id": "z", "text": "neither"}\n')  # line 43
        f.write('{"prompt": "no id: line-44"}\n')  # line 44
        f.write('{"id": 7, "messages": [{"role": "user", "content": "int id"}]}\n')  # 45
        f.write("\n")
        f.write('{"id": "half", "prompt": ')  # line 47, no newline
    out = tmp_path / "out"
    proc = run_gc(
        prompts,
        [s.url for s in fast_stubs],
        out,
        "--concurrency",
        "8",
        "--chat-template-kwargs",
        '{"enable_thinking": true}',
        python=SYSTEM_PYTHON,
    )
    assert proc.returncode == 0, explain(proc)
    assert "rejected line 41: not valid JSON" in proc.stderr
    assert "rejected line 42: duplicate id 'p00003'" in proc.stderr
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [41, 42, 43, 47]
    assert rejected[0]["raw"] == "this is not json"
    assert_exactly_once(out, [*good, "line-44", "7"])
    recs = {str(r["id"]): r for r in read_records(out)}
    assert recs["7"]["id"] == 7  # the id keeps its JSON type
    assert recs["p00003"]["answer"] != "a duplicate"
    for r in recs.values():
        assert set(r) == {
            "id",
            "answer",
            "reasoning",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "server",
            "latency_s",
            "attempts",
            "time",
        }
        assert r["finish_reason"] in ("stop", "length") and r["completion_tokens"] >= 1
    # The reasoning parser's server split reasoning out of chat answers; the other did not.
    chat_on_a = [
        r for k, r in recs.items() if r["server"] == fast_stubs[0].url and k.startswith("p0")
    ]
    assert any(r["reasoning"] for r in chat_on_a)
    assert all(r["reasoning"] is None for r in recs.values() if r["server"] == fast_stubs[1].url)
    info = progress(out)
    assert set(info) >= PROGRESS_FIELDS
    assert (info["state"], info["total"], info["done"], info["remaining"]) == ("done", 42, 42, 0)
    assert (info["failed"], info["rejected"]) == (0, 4)
    for server in info["servers"].values():
        assert set(server) >= SERVER_FIELDS
    # Re-running a finished job does nothing and says so.
    again = run_gc(prompts, [s.url for s in fast_stubs], out, python=SYSTEM_PYTHON)
    assert again.returncode == 0, explain(again)
    assert "nothing to do: all 42 prompts are done already" in again.stdout
    assert len(shard_files(out)) == 1


def test_refusing_server_from_the_start_does_not_block(tmp_path: Path, fast_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 200)
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = run_gc(prompts, [dead, *(s.url for s in fast_stubs)], out, "--concurrency", "16")
    assert proc.returncode == 0, explain(proc)
    assert time.monotonic() - t0 < 15
    assert_exactly_once(out, ids)
    assert {r["server"] for r in read_records(out)} == {s.url for s in fast_stubs}
    dead_status = progress(out)["servers"][dead]
    assert dead_status["ok"] == 0 and "refused" in dead_status["last_error"]


def test_server_dying_halfway_moves_its_work(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 600)
    out = tmp_path / "out"
    env = {"DFLASHOPS_STUB_LATENCY": "0.02"}
    dying = dict(env, DFLASHOPS_STUB_EXIT_AFTER="1.2")
    with stub_servers(tmp_path, 2, envs=[dying, env]) as (a, b):
        proc = run_gc(prompts, [a.url, b.url], out, "--concurrency", "8")
        assert a.proc.wait(5) == 1  # it really crashed
    assert proc.returncode == 0, explain(proc)
    assert_exactly_once(out, ids)
    served = collections.Counter(r["server"] for r in read_records(out))
    assert served[a.url] > 0 and served[b.url] > served[a.url]
    assert "backed off" in proc.stdout
    assert progress(out)["servers"][a.url]["last_error"]


def test_server_failing_10_percent_still_finishes(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 300)
    out = tmp_path / "out"
    env = {"DFLASHOPS_STUB_FAILURE_RATE": "0.1", "DFLASHOPS_STUB_SEED": "7"}
    with stub_servers(tmp_path, 1, env=env) as (s,):
        proc = run_gc(prompts, [s.url], out, "--concurrency", "8", "--max-retries", "8")
    assert proc.returncode == 0, explain(proc)
    assert_exactly_once(out, ids)
    recs = read_records(out)
    assert any(r["attempts"] > 1 for r in recs)
    assert progress(out)["servers"][s.url]["errors"] > 0
    assert not (out / "failed.jsonl").exists()


def test_hanging_server_requests_time_out_and_complete(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 200)
    out = tmp_path / "out"
    env = {"DFLASHOPS_STUB_HANG_RATE": "0.05", "DFLASHOPS_STUB_SEED": "3"}
    with stub_servers(tmp_path, 1, env=env) as (s,):
        proc = run_gc(
            prompts, [s.url], out, "--concurrency", "16", "--request-timeout", "0.5", timeout=40
        )
    assert proc.returncode == 0, explain(proc)
    assert_exactly_once(out, ids)
    assert any(r["attempts"] > 1 for r in read_records(out))
    assert "timed out" in (progress(out)["servers"][s.url]["last_error"] or "")


def test_all_servers_down_waits_until_one_comes_up(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 50)
    out = tmp_path / "out"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ("--model", "/dev/shm/Qwen3.6-27B", "--request-timeout", "0.3", "--log-interval", "0.3")
    client = start_gc(prompts, [url], out, *args)
    stub = None
    try:
        time.sleep(1.5)  # longer than the request timeout: it must still be waiting
        assert client.poll() is None
        stub = Stub(tmp_path, port=port)
        stub.wait_healthy()
        stdout, stderr = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if stub is not None:
            stub.stop()
    assert client.returncode == 0, stdout + stderr
    assert "no server is up (1 down); waiting for one" in stdout
    assert "is up again" in stdout
    assert_exactly_once(out, ids)
    assert not (out / "failed.jsonl").exists()  # waiting costs no retries


def test_sigterm_at_random_points_then_resume(tmp_path: Path, slow_stubs: Any) -> None:
    rng = random.Random(1234)
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 600)
    out = tmp_path / "out"
    urls = [s.url for s in slow_stubs]
    stopped_midway = 0
    for _ in range(4):
        client = start_gc(prompts, urls, out, "--concurrency", "8", "--grace", "10")
        # Signal at a random point once it runs (its handler is installed by its first line;
        # a SIGTERM before python has even started would just kill it, writing nothing).
        assert client.stdout is not None
        first = client.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.7))
        client.send_signal(signal.SIGTERM)
        stdout, stderr = client.communicate(timeout=30)
        stdout = first + stdout
        assert client.returncode == 0, stdout + stderr
        assert any(
            what in stdout for what in ("summary:", "stopped before starting", "nothing to do")
        ), stdout
        stopped_midway += "summary: stopped" in stdout
        # A clean stop leaves no torn line behind.
        for p in shard_files(out):
            assert p.read_bytes().endswith(b"\n")
    assert stopped_midway >= 1
    proc = run_gc(prompts, urls, out, "--concurrency", "16")
    assert proc.returncode == 0, explain(proc)
    assert "resuming:" in proc.stdout or "nothing to do" in proc.stdout
    assert_exactly_once(out, ids)
    assert progress(out)["state"] == "done"


def test_kill9_at_random_points_then_resume(tmp_path: Path, slow_stubs: Any) -> None:
    rng = random.Random(99)
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 600)
    out = tmp_path / "out"
    urls = [s.url for s in slow_stubs]
    for _ in range(4):
        client = start_gc(prompts, urls, out, "--concurrency", "8")
        time.sleep(rng.uniform(0.15, 0.8))
        client.kill()
        client.communicate(timeout=30)
    proc = run_gc(prompts, urls, out, "--concurrency", "16")
    assert proc.returncode == 0, explain(proc)
    assert_exactly_once(out, ids)


def test_second_signal_exits_at_once_and_resume_is_exact(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 60)
    out = tmp_path / "out"
    with stub_servers(tmp_path, 1, env={"DFLASHOPS_STUB_LATENCY": "0.4"}) as (slow,):
        client = start_gc(prompts, [slow.url], out, "--concurrency", "4", "--grace", "30")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not list(out.glob("completions-*")):
            time.sleep(0.05)
        client.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        t0 = time.monotonic()
        client.send_signal(signal.SIGTERM)
        stdout, stderr = client.communicate(timeout=10)
        assert time.monotonic() - t0 < 2
        assert client.returncode == 143, stdout + stderr
        assert "again: exiting at once" in stderr
        proc = run_gc(prompts, [slow.url], out, "--concurrency", "30")
    assert proc.returncode == 0, explain(proc)
    assert_exactly_once(out, ids)


def test_torn_last_line_written_by_hand_is_dropped(tmp_path: Path, fast_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 30)
    out = tmp_path / "out"
    out.mkdir()
    shard = out / "completions-20250101T000000Z-1-0000.jsonl"
    whole = _record_line("p00000") + _record_line("p00001")
    shard.write_bytes(whole + b'{"id": "p00002", "answer": "cut off in the mid')
    proc = run_gc(prompts, [s.url for s in fast_stubs], out)
    assert proc.returncode == 0, explain(proc)
    assert "resuming: 2 done, 28 remaining" in proc.stdout
    assert "torn last line" in proc.stderr
    assert shard.read_bytes() == whole
    torn = json.loads((out / "torn-lines.jsonl").read_text())
    assert torn["shard"] == shard.name and "cut off" in torn["raw"]
    assert_exactly_once(out, ids)


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_output_disk_full_exits_75_then_resumes(tmp_path: Path, fast_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 300)
    out = tmp_path / "out"
    urls = [s.url for s in fast_stubs]
    proc = run_gc(prompts, urls, out, preexec_fn=_limit_file_size(20_000))
    assert proc.returncode == 75, explain(proc)
    assert "disk full" in proc.stderr and str(out) in proc.stderr
    assert 0 < len(read_records(out)) < 300
    assert progress(out)["state"] == "failed"
    again = run_gc(prompts, urls, out)
    assert again.returncode == 0, explain(again)
    assert "resuming:" in again.stdout
    assert_exactly_once(out, ids)


def test_shards_partition_the_ids(tmp_path: Path, fast_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 120)
    urls = [s.url for s in fast_stubs]
    got = []
    for i in (0, 1):
        out = tmp_path / f"out{i}"
        proc = run_gc(prompts, urls, out, "--shard", f"{i}/2")
        assert proc.returncode == 0, explain(proc)
        part = output_ids(out)
        assert len(part) == len(set(part))
        for pid in part:
            assert int(hashlib.sha256(pid.encode()).hexdigest()[:16], 16) % 2 == i
        assert progress(out)["total"] == len(part)
        got.append(set(part))
    assert got[0].isdisjoint(got[1])
    assert got[0] | got[1] == set(ids)
    assert got[0] and got[1]


def test_api_key_and_model_discovery(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 20)
    out = tmp_path / "out"
    secret = "sk-dflashops-test-secret-value"
    args = ["--api-key", secret, "--served-model-name", "qwen36"]
    with stub_servers(tmp_path, 1, args=args) as (s,):
        proc = run_gc(
            prompts, [s.url], out, "--api-key-env", "DFLASHOPS_TEST_KEY",
            env={"DFLASHOPS_TEST_KEY": secret},
        )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    assert secret not in proc.stdout + proc.stderr
    assert secret not in (out / "progress.json").read_text()
    assert progress(out)["model"] == "qwen36"
    assert_exactly_once(out, ids)


def test_prompt_level_4xx_fails_at_once_and_exits_3(tmp_path: Path, fast_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 10)
    with open(prompts, "a") as f:  # the stub answers 400 to a zero-token budget... per prompt
        f.write('{"id": "bad", "messages": [{"role": "user", "content": "x"}]}\n')
    out = tmp_path / "out"
    # max_tokens 0 is rejected by argparse, so make this one prompt invalid for the server:
    # token-id prompts are not accepted by the stub's /v1/completions (400).
    lines = prompts.read_text().splitlines()
    lines[-1] = '{"id": "bad", "prompt": [1, 2, 3]}'
    prompts.write_text("\n".join(lines) + "\n")
    proc = run_gc(prompts, [s.url for s in fast_stubs], out)
    assert proc.returncode == 3, explain(proc)
    failed = [json.loads(x) for x in (out / "failed.jsonl").read_text().splitlines()]
    assert [(f["id"], f["attempts"]) for f in failed] == [("bad", 1)]
    assert "HTTP 400" in failed[0]["error"]
    assert_exactly_once(out, ids)
    assert progress(out)["state"] == "failed"


@pytest.mark.skipif(sys.platform != "linux", reason="flock and loopback stubs: Linux")
def test_one_run_per_output_dir(tmp_path: Path, slow_stubs: Any) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 300)
    out = tmp_path / "out"
    urls = [s.url for s in slow_stubs]
    first = start_gc(prompts, urls, out, "--concurrency", "2")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not shard_files(out):
            time.sleep(0.05)
        assert first.poll() is None
        second = run_gc(prompts, urls, out)
        assert second.returncode == 1, explain(second)
        assert "in use by another run" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0


def test_sigterm_lets_requests_in_flight_finish_within_grace(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 40)
    out = tmp_path / "out"
    with stub_servers(tmp_path, 1, env={"DFLASHOPS_STUB_LATENCY": "1.0"}) as (s,):
        client = start_gc(prompts, [s.url], out, "--concurrency", "4", "--grace", "20")
        assert client.stdout is not None
        lines = []
        while not any("generating with" in line for line in lines):
            line = client.stdout.readline()
            assert line, "client ended early"
            lines.append(line)
        time.sleep(0.4)  # four requests are in flight, each needs another ~0.6 s
        client.send_signal(signal.SIGTERM)
        stdout, stderr = client.communicate(timeout=20)
        stdout = "".join(lines) + stdout
        assert client.returncode == 0, stdout + stderr
        m = re.search(r"waiting up to 20s for (\d) request\(s\) in flight", stdout)
        assert m and int(m.group(1)) >= 1, stdout
        assert "summary: stopped" in stdout
        # Those in flight (4, unless the machine is very slow) were finished and written.
        in_flight = int(m.group(1))
        assert len(output_ids(out)) == in_flight
        assert progress(out)["state"] == "stopped"
        proc = run_gc(prompts, [s.url], out, "--concurrency", "40")
    assert proc.returncode == 0, explain(proc)
    assert f"resuming: {in_flight} done, {40 - in_flight} remaining" in proc.stdout
    assert_exactly_once(out, ids)


def test_retries_exhausted_go_to_failed_jsonl_and_exit_3(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 6)
    out = tmp_path / "out"
    with stub_servers(tmp_path, 1, env={"DFLASHOPS_STUB_FAILURE_RATE": "1"}) as (s,):
        proc = run_gc(prompts, [s.url], out, "--max-retries", "1", "--concurrency", "6")
    assert proc.returncode == 3, explain(proc)
    failed = [json.loads(x) for x in (out / "failed.jsonl").read_text().splitlines()]
    assert sorted(f["id"] for f in failed) == [f"p{i:05d}" for i in range(6)]
    assert all(f["attempts"] == 2 and "HTTP 500" in f["error"] and f["time"] for f in failed)
    assert read_records(out) == []
    info = progress(out)
    assert (info["state"], info["failed"], info["remaining"]) == ("failed", 6, 6)
    assert "run again to retry them" in proc.stdout


def test_sigterm_while_no_server_answers_yet(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 5)
    out = tmp_path / "out"
    client = start_gc(prompts, [f"http://127.0.0.1:{free_port()}"], out, "--log-interval", "0.2")
    assert client.stdout is not None
    first = client.stdout.readline()
    while "no server answers" not in first:
        first = client.stdout.readline()
        assert first, "client ended early"
    client.send_signal(signal.SIGTERM)
    stdout, stderr = client.communicate(timeout=10)
    assert client.returncode == 0, stdout + stderr
    assert "SIGTERM: stopped before starting" in stdout
    assert progress(out)["state"] == "stopped"
