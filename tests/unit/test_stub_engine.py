"""The stub engine (dflashops/builtins/stub_engine.py) run as a real subprocess on loopback."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fakes"))
import harness
from harness import Proc, free_port, request, scrape

MODEL = "/dev/shm/Qwen3.6-27B"
PYTHONS = [
    pytest.param(sys.executable, id="controller-python"),
    pytest.param(
        harness.SYSTEM_PYTHON,
        id="system-python",
        marks=pytest.mark.skipif(
            not os.path.exists(harness.SYSTEM_PYTHON), reason="no /usr/bin/python3"
        ),
    ),
]


def stub_env(**knobs: str) -> dict[str, str]:
    env = harness.host_env()
    env.update({f"DFLASHOPS_STUB_{k.upper()}": v for k, v in knobs.items()})
    return env


def start_stub(
    *args: str, python: str = sys.executable, flavor: str | None = None, **knobs: str
) -> tuple[Proc, int]:
    port = free_port()
    argv = ["--model-path", MODEL, "--port", str(port), *args]
    if flavor is None:
        cmd = [python, str(harness.STUB), *argv]
    else:  # serve() with another flavor, the way the fakes use the module
        code = (
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('stub', {str(harness.STUB)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"sys.exit(m.serve(sys.argv[1:], flavor={flavor!r}))\n"
        )
        cmd = [python, "-c", code, *argv]
    knobs.setdefault("startup_seconds", "0.1")
    return Proc(cmd, stub_env(**knobs)), port


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    """One ready stub with a realistic SGLang command line, shared by the read-only tests."""
    proc, port = start_stub(
        "--tp-size", "2", "--dp-size", "1", "--context-length", "65536",
        "--mem-fraction-static", "0.88", "--served-model-name", "qwen36",
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--trust-remote-code", "--enable-metrics",
    )  # fmt: skip
    try:
        proc.wait_http(port)
        yield port
    finally:
        proc.stop()


def chat(port: int, content: str, **extra: object) -> harness.Response:
    body = {"model": "qwen36", "messages": [{"role": "user", "content": content}], **extra}
    return request(port, "POST", "/v1/chat/completions", body)


# ----------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("python", PYTHONS)
def test_lifecycle_health_readiness_and_sigterm(python: str) -> None:
    proc, port = start_stub(python=python, startup_seconds="0.6")
    try:
        first = proc.wait_for_line("dflashops stub")
        assert proc.lines[0] == first
        assert "CPU stand-in" in first and "NOT SGLang" in first and MODEL in first
        statuses = proc.wait_http(port)
        assert statuses[0] == 503 and statuses[-1] == 200
        proc.wait_for_line("The server is fired up and ready to roll!")
        assert request(port, "GET", "/health_generate").status == 200
        reply = chat(port, "hello")
        assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"]
    finally:
        code = proc.stop(signal.SIGTERM)
    assert code == 0
    assert "received SIGTERM" in proc.output
    assert "The server is fired up and ready to roll!" in proc.lines


def test_sigint_exits_zero() -> None:
    proc, port = start_stub()
    try:
        proc.wait_http(port)
    finally:
        code = proc.stop(signal.SIGINT)
    assert code == 0 and "received SIGINT" in proc.output


def test_unknown_flag_is_an_argparse_error() -> None:
    result = harness.run(
        [sys.executable, str(harness.STUB), "--model-path", MODEL, "--tp", "2"], stub_env()
    )
    assert result.returncode == 2
    assert "unrecognized arguments: --tp 2" in result.stderr


def test_model_path_is_required() -> None:
    result = harness.run([sys.executable, str(harness.STUB), "--port", "1"], stub_env())
    assert result.returncode == 2 and "--model-path" in result.stderr


def test_exit_after_crashes_with_status_1() -> None:
    proc, port = start_stub(exit_after="0.4")
    try:
        proc.wait_http(port)
        assert proc.wait(5) == 1
    finally:
        proc.stop()
    assert "Traceback (most recent call last):" in proc.output
    assert "DFLASHOPS_STUB_EXIT_AFTER" in proc.output


def test_exit_after_can_fire_while_starting() -> None:
    proc, _port = start_stub(exit_after="0.2", startup_seconds="30")
    try:
        assert proc.wait(5) == 1
    finally:
        proc.stop()
    assert "simulated crash" in proc.output
    assert "ready to roll" not in proc.output


def test_runs_on_python_3_9_if_available() -> None:
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which("python3.9"), *map(str, sorted(pyenv.glob("3.9*/bin/python3.9")))]
    working = [
        c for c in candidates if c and harness.run([c, "-V"], dict(os.environ)).returncode == 0
    ]
    if not working:
        pytest.skip("no working python3.9 here")
    py39 = working[0]
    result = harness.run([py39, str(harness.STUB), "--help"], stub_env())
    assert result.returncode == 0, result.stderr
    assert "--model-path" in result.stdout


# ----------------------------------------------------------------------------- identity


def test_server_info_reports_sglang_server_args(server: int) -> None:
    info = request(server, "GET", "/server_info")
    assert info.status == 200
    data = info.json()
    assert data["model_path"] == MODEL
    assert data["tp_size"] == 2 and data["dp_size"] == 1
    assert data["port"] == server and data["host"] == "127.0.0.1"
    assert data["served_model_name"] == "qwen36"
    assert data["mem_fraction_static"] == 0.88
    assert data["context_length"] == 65536
    assert data["speculative_algorithm"] == "NEXTN"
    assert data["speculative_num_draft_tokens"] == 4
    assert data["version"] == "0.5.23-dflashops-stub"
    assert data["dflashops_stub"] is True
    assert "api_key" not in data
    assert request(server, "GET", "/get_server_info").json() == data


def test_model_info_and_models(server: int) -> None:
    info = request(server, "GET", "/get_model_info").json()
    assert info == {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    models = request(server, "GET", "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "qwen36" and card["root"] == MODEL
    assert card["owned_by"] == "dflashops-stub" and card["max_model_len"] == 65536


def test_served_model_name_defaults_to_model_path() -> None:
    proc, port = start_stub()
    try:
        proc.wait_http(port)
        assert request(port, "GET", "/server_info").json()["served_model_name"] == MODEL
        assert request(port, "GET", "/v1/models").json()["data"][0]["id"] == MODEL
    finally:
        proc.stop()


# ----------------------------------------------------------------------------- completions


def test_chat_completion_shape_and_max_tokens_cap(server: int) -> None:
    resp = chat(server, "Explain speculative decoding.", max_tokens=5)
    assert resp.status == 200
    assert resp.headers["content-type"] == "application/json"
    data = resp.json()
    assert data["object"] == "chat.completion" and data["model"] == "qwen36"
    assert data["id"].startswith("chatcmpl-") and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert "reasoning_content" not in choice["message"]  # no --reasoning-parser
    usage = data["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_chat_completion_stops_naturally_and_is_deterministic(server: int) -> None:
    first = chat(server, "Write a haiku.", max_tokens=4096).json()
    second = chat(server, "Write a haiku.", max_tokens=4096).json()
    assert first["choices"] == second["choices"]
    assert first["choices"][0]["finish_reason"] == "stop"
    assert 16 <= first["usage"]["completion_tokens"] <= 512
    default = chat(server, "Write a haiku.").json()  # max_tokens defaults to 256
    assert default["usage"]["completion_tokens"] == min(256, first["usage"]["completion_tokens"])
    other = chat(server, "Write a limerick.", max_tokens=4096).json()
    assert other["choices"][0]["message"] != first["choices"][0]["message"]


def test_completions_and_generate(server: int) -> None:
    resp = request(server, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 7})
    data = resp.json()
    assert resp.status == 200 and data["object"] == "text_completion"
    assert len(data["choices"][0]["text"].split()) == 7
    assert data["choices"][0]["finish_reason"] == "length"
    gen = request(
        server, "POST", "/generate", {"text": "Once upon", "sampling_params": {"max_new_tokens": 3}}
    ).json()
    assert len(gen["text"].split()) == 3
    assert gen["meta_info"]["completion_tokens"] == 3
    assert gen["meta_info"]["finish_reason"]["type"] == "length"
    assert gen["meta_info"]["prompt_tokens"] >= 1
    long = request(
        server, "POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1000}}
    ).json()
    assert long["meta_info"]["finish_reason"] == {"type": "stop"}


def test_bad_requests(server: int) -> None:
    bad = request(server, "POST", "/v1/chat/completions", b"{not json")
    assert bad.status == 400 and "JSON" in bad.json()["message"]
    stream = chat(server, "hi", stream=True)
    assert stream.status == 400 and "streaming not supported" in stream.json()["message"]
    assert chat(server, "hi", max_tokens=0).status == 400
    assert request(server, "POST", "/v1/chat/completions", {"messages": []}).status == 400
    missing = request(server, "GET", "/nope")
    assert missing.status == 404 and missing.json()["code"] == 404
    assert request(server, "GET", "/v1/chat/completions").status == 405


def test_keep_alive_reuses_one_connection(server: int) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Content-Length") == "0"
            resp.read()
        sock = conn.sock
        conn.request("GET", "/v1/models")
        conn.getresponse().read()
        assert conn.sock is sock
    finally:
        conn.close()


def test_metrics_count_requests(server: int) -> None:
    chat(server, "count me")
    text = request(server, "GET", "/metrics").body.decode()
    assert "# TYPE dflashops_stub_requests_total counter" in text
    line = next(x for x in text.splitlines() if x.startswith("dflashops_stub_requests_total{"))
    assert int(line.rsplit(" ", 1)[1]) >= 1


# The engine-flavoured metrics: sample name per role; vLLM has no throughput gauge.
ENGINE_METRICS = {
    "sglang": {
        "throughput": "sglang:gen_throughput",
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        "usage": "sglang:token_usage",
        "generated": "sglang:generation_tokens_total",
    },
    "vllm": {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "usage": "vllm:kv_cache_usage_perc",
        "generated": "vllm:generation_tokens_total",
    },
}


def values(port: int, flavor: str) -> dict[str, float]:
    """The engine metrics of one scrape by role, checked for type and labels on the way."""
    samples = scrape(port)
    other = "vllm:" if flavor == "sglang" else "sglang:"
    assert not [name for name in samples if name.startswith(other)]
    labels = {"model_name": "qwen36", **({"engine": "0"} if flavor == "vllm" else {})}
    out = {}
    for role, name in ENGINE_METRICS[flavor].items():
        kind, got, value = samples[name]
        assert kind == ("counter" if role == "generated" else "gauge"), name
        assert got == labels, name
        out[role] = value
    assert all(s[1]["model_name"] == "qwen36" for s in samples.values())
    return out


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_metrics_follow_the_tokens_really_produced(flavor: str) -> None:
    stub = _load_stub_module()
    questions = [
        q
        for q in (f"question {i}" for i in range(50))
        if stub._natural_length(stub._digest(f"user: {q}")) >= 40
    ][:3]  # each answer is capped at exactly 40 tokens: 1 s at 40 tokens/s
    proc, port = start_stub("--served-model-name", "qwen36", flavor=flavor, tokens_per_second="40")
    try:
        proc.wait_http(port)
        idle = values(port, flavor)
        assert idle == {role: 0.0 for role in ENGINE_METRICS[flavor]}
        replies: list[dict] = []

        def ask(question: str) -> None:
            replies.append(chat(port, question, max_tokens=40).json())

        threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while values(port, flavor)["running"] < 3:
            assert time.monotonic() < deadline, "the three requests never ran together"
            time.sleep(0.02)
        time.sleep(0.2)
        busy = values(port, flavor)
        for t in threads:
            t.join(10)
        done = values(port, flavor)
    finally:
        proc.stop()
    produced = sum(r["usage"]["completion_tokens"] for r in replies)
    assert len(replies) == 3 and produced == 120
    assert busy["running"] == 3 and busy["waiting"] == 0
    assert busy["usage"] == pytest.approx(0.15)
    assert 0 < busy["generated"] < produced  # tokens appear while requests run
    assert done["generated"] == produced
    assert done["running"] == 0 and done["usage"] == 0.0
    if flavor == "sglang":
        assert busy["throughput"] > 0 and done["throughput"] > 0  # still within the window


# ----------------------------------------------------------------------------- knobs, auth


def test_reasoning_parser_api_key_and_latency() -> None:
    proc, port = start_stub("--reasoning-parser", "qwen3", "--api-key", "sekret", latency="0.15")
    try:
        proc.wait_http(port)  # /health needs no key
        assert "sekret" not in proc.output
        assert request(port, "GET", "/server_info").status == 401
        assert request(port, "GET", "/v1/models").status == 401
        assert request(port, "GET", "/metrics").status == 200  # SGLang exempts /metrics too
        wrong = {"Authorization": "Bearer nope"}
        assert request(port, "GET", "/server_info", headers=wrong).status == 401
        auth = {"Authorization": "Bearer sekret"}
        info = request(port, "GET", "/server_info", headers=auth)
        assert info.status == 200 and b"sekret" not in info.body
        assert info.json()["reasoning_parser"] == "qwen3"
        body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 64}
        t0 = time.monotonic()
        resp = request(port, "POST", "/v1/chat/completions", body, headers=auth)
        assert time.monotonic() - t0 >= 0.15
        message = resp.json()["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"]
        assert resp.json()["usage"]["completion_tokens"] <= 64
    finally:
        proc.stop()


def test_failure_rate_one_answers_500() -> None:
    proc, port = start_stub(failure_rate="1.0", seed="7")
    try:
        proc.wait_http(port)
        for _ in range(3):
            assert chat(port, "fail").status == 500
        assert request(port, "GET", "/v1/models").status == 200  # only completions fail
        metrics = request(port, "GET", "/metrics").body.decode()
        assert any(
            x.startswith("dflashops_stub_errors_total{") and x.endswith(" 3")
            for x in metrics.splitlines()
        )
    finally:
        proc.stop()


def test_hang_rate_one_never_answers() -> None:
    proc, port = start_stub(hang_rate="1.0")
    try:
        proc.wait_http(port)
        with pytest.raises(TimeoutError):
            chat_timeout = {"messages": [{"role": "user", "content": "x"}]}
            request(port, "POST", "/v1/chat/completions", chat_timeout, timeout=0.3)
        assert request(port, "GET", "/health").status == 200  # other requests still served
    finally:
        assert proc.stop() == 0  # a hung request does not block shutdown


def test_tokens_per_second_adds_time() -> None:
    proc, port = start_stub(tokens_per_second="100")
    try:
        proc.wait_http(port)
        t0 = time.monotonic()
        assert chat(port, "slow", max_tokens=20).json()["usage"]["completion_tokens"] == 20
        assert time.monotonic() - t0 >= 0.2
    finally:
        proc.stop()


def test_exit_after_ready_crashes_once_ready() -> None:
    proc, port = start_stub(startup_seconds="1.5", exit_after_ready="0.5")
    try:
        t0 = time.monotonic()
        statuses = proc.wait_http(port)
        ready = time.monotonic()
        assert statuses[0] == 503 and ready - t0 >= 1.4  # the startup delay still holds
        assert proc.wait(5) == 1
        crashed = time.monotonic()
    finally:
        proc.stop()
    assert crashed - ready >= 0.3
    lines = proc.lines
    first_traceback = lines.index("Traceback (most recent call last):")
    assert lines.index("The server is fired up and ready to roll!") < first_traceback
    assert "simulated crash 0.5 s after ready (DFLASHOPS_STUB_EXIT_AFTER_READY)" in proc.output


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_wedge_keeps_health_but_holds_generation() -> None:
    proc, port = start_stub(wedge_after="1.0")
    held: list[object] = []
    holder = None
    try:
        proc.wait_http(port)
        assert request(port, "GET", "/health_generate").status == 200  # not wedged yet
        proc.wait_for_line("engine wedged", timeout=5)
        assert request(port, "GET", "/health").status == 200
        with pytest.raises(TimeoutError):
            request(port, "GET", "/health_generate", timeout=0.4)
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x"}),
            ("/generate", {"text": "x"}),
        ):
            with pytest.raises(TimeoutError):
                request(port, "POST", path, body, timeout=0.4)

        def hold() -> None:
            try:
                held.append(request(port, "POST", "/v1/completions", {"prompt": "y"}, timeout=30))
            except OSError as exc:  # the connection closes at shutdown, unanswered
                held.append(exc)

        holder = threading.Thread(target=hold)
        holder.start()
        deadline = time.monotonic() + 5
        while scrape(port)["sglang:num_queue_reqs"][2] < 1:
            assert time.monotonic() < deadline, "the held request never showed as waiting"
            time.sleep(0.05)
        assert scrape(port)["sglang:num_running_reqs"][2] == 0
        cpu = _cpu_seconds(proc.pid)
        time.sleep(0.6)
        assert _cpu_seconds(proc.pid) - cpu < 0.3  # holding costs no CPU
        assert request(port, "GET", "/health").status == 200
    finally:
        t0 = time.monotonic()
        code = proc.stop()
        stopped = time.monotonic() - t0
        if holder is not None:
            holder.join(10)
    assert code == 0 and stopped < 3  # held connections do not block shutdown
    assert len(held) == 1 and isinstance(held[0], OSError)


def test_ignore_term_survives_sigterm_but_not_sigkill() -> None:
    proc, port = start_stub(ignore_term="1")
    try:
        proc.wait_http(port)
        proc.popen.send_signal(signal.SIGTERM)
        proc.wait_for_line("ignoring SIGTERM (DFLASHOPS_STUB_IGNORE_TERM)")
        time.sleep(0.3)
        assert proc.popen.poll() is None
        assert request(port, "GET", "/health").status == 200
        assert chat(port, "still there?").status == 200
    finally:
        code = proc.stop(signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert "received SIGTERM" not in proc.output


def test_vllm_flavor() -> None:
    proc, port = start_stub("--api-key", "k", "--reasoning-parser", "qwen3", flavor="vllm")
    try:
        proc.wait_http(port)
        proc.wait_for_line("INFO:     Application startup complete.")
        for path in ("/server_info", "/get_server_info", "/get_model_info"):
            assert request(port, "GET", path).status == 404
        assert request(port, "POST", "/generate", {"text": "x"}).status == 404
        assert request(port, "GET", "/version").json() == {"version": "0.33.0-dflashops-fake"}
        assert request(port, "GET", "/metrics").status == 200  # the key protects /v1 only
        assert request(port, "GET", "/v1/models").status == 401
        auth = {"Authorization": "Bearer k"}
        card = request(port, "GET", "/v1/models", headers=auth).json()["data"][0]
        assert card["owned_by"] == "vllm" and card["root"] == MODEL
        body = {"messages": [{"role": "user", "content": "x"}]}
        msg = request(port, "POST", "/v1/chat/completions", body, headers=auth).json()
        assert msg["choices"][0]["message"]["reasoning"]  # newer vLLM's field name
    finally:
        assert proc.stop() == 0


# ----------------------------------------------------------------------------- flags


def _load_stub_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("stub_engine_under_test", harness.STUB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stub_flag_is_a_real_sglang_flag() -> None:
    known = set(harness.SGLANG_FLAGS.read_text().split())
    parser = _load_stub_module().build_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    options -= {"-h", "--help"}  # argparse's own; SGLang's parser has them too
    assert options, "parser exposes no options?"
    assert sorted(options - known) == []
    for required in ("--model-path", "--tp-size", "--dp-size", "--port", "--api-key"):
        assert required in options


def test_knobs_from_env() -> None:
    stub = _load_stub_module()
    knobs = stub.knobs_from_env(
        {
            "DFLASHOPS_STUB_EXIT_AFTER_READY": "2.5",
            "DFLASHOPS_STUB_WEDGE_AFTER": "0",
            "DFLASHOPS_STUB_IGNORE_TERM": "1",
        }
    )
    assert knobs["exit_after_ready"] == 2.5 and knobs["wedge_after"] == 0.0
    assert knobs["ignore_term"] is True and knobs["exit_after"] is None
    quiet = stub.knobs_from_env({"DFLASHOPS_STUB_IGNORE_TERM": "0"})
    assert quiet["ignore_term"] is False and quiet["wedge_after"] is None
    with pytest.raises(SystemExit, match="DFLASHOPS_STUB_WEDGE_AFTER"):
        stub.knobs_from_env({"DFLASHOPS_STUB_WEDGE_AFTER": "soon"})
