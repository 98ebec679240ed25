"""dflashops stub engine: a CPU stand-in for an SGLang (or vLLM) server. It loads no model.

Shipped to hosts as a single stdlib-only file and run as ``python stub_engine.py FLAGS`` with a
subset of SGLang's own flags (every one of them is a real SGLang 0.5.23 flag). Its HTTP endpoints
mimic SGLang's (``flavor="sglang"``) or vLLM's (``flavor="vllm"``, used by the test fakes) closely
enough for deploy, verify, status and the completions job to be exercised without a GPU.

Behaviour knobs are environment variables, so that the flag set stays pure SGLang:

- ``DFLASHOPS_STUB_STARTUP_SECONDS`` (default 0.5): /health answers 503 until then.
- ``DFLASHOPS_STUB_LATENCY`` (default 0): seconds added to every completion request.
- ``DFLASHOPS_STUB_TOKENS_PER_SECOND`` (default 0 = instant): adds completion_tokens / tps.
- ``DFLASHOPS_STUB_FAILURE_RATE`` (0..1): fraction of completion requests answered with 500.
- ``DFLASHOPS_STUB_HANG_RATE`` (0..1): fraction of completion requests never answered.
- ``DFLASHOPS_STUB_EXIT_AFTER`` (seconds): crash with exit status 1 after that long (counted
  from process start, so it may fire while still starting).
- ``DFLASHOPS_STUB_EXIT_AFTER_READY`` (seconds): crash the same way that long after readiness.
- ``DFLASHOPS_STUB_WEDGE_AFTER`` (seconds after readiness): from then on the engine is wedged.
  /health still answers 200 (as vLLM's does), but /health_generate and every generation request
  (/v1/chat/completions, /v1/completions, /generate) are held open and never answered; they
  count as waiting requests in /metrics. Held connections do not delay shutdown.
- ``DFLASHOPS_STUB_IGNORE_TERM`` (``1``): SIGTERM is ignored (logged, the server keeps serving);
  SIGINT still stops it, SIGKILL kills it.
- ``DFLASHOPS_STUB_SEED`` (int): seed for the random choices above.

``GET /metrics`` serves Prometheus text format 0.0.4 with the engine's own metric names, computed
from what the stub really does. Tokens of a request are produced evenly over its simulated
duration (instantly when there is none); throughput is averaged over the last
THROUGHPUT_WINDOW seconds; KV-cache usage is min(1, running * 0.05).

- sglang (labels ``model_name``): gauges ``sglang:gen_throughput`` (tokens/s),
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` (0..1);
  counters ``sglang:generation_tokens_total``, ``sglang:prompt_tokens_total``.
- vllm (labels ``engine="0"``, ``model_name``): counters ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total``; gauges ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1).
- both (labels ``flavor``, ``model_name``): counters ``dflashops_stub_requests_total``,
  ``dflashops_stub_errors_total``; gauge ``dflashops_stub_requests_running``.

Runs on Python 3.9+: keep new syntax out of anything evaluated at runtime.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import signal
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STUB_VERSION = "0.5.23-dflashops-stub"
VLLM_FAKE_VERSION = "0.33.0-dflashops-fake"
SGLANG_READY_LINE = "The server is fired up and ready to roll!"
VLLM_READY_LINE = "INFO:     Application startup complete."
FLAVORS = ("sglang", "vllm")
HANG_SECONDS = 3600.0
HOLD_POLL_SECONDS = 0.5  # how often a held request checks for shutdown or a departed client
DEFAULT_MAX_TOKENS = 256
THROUGHPUT_WINDOW = 5.0  # seconds of produced tokens behind the throughput gauge
KV_USAGE_PER_REQUEST = 0.05
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Every server arg the stub reports, with SGLang's names and defaults. Fakes may pass more keys.
DEFAULT_SETTINGS: dict[str, Any] = {
    "model_path": None,
    "tokenizer_path": None,
    "host": "127.0.0.1",
    "port": 30000,
    "tp_size": 1,
    "dp_size": 1,
    "served_model_name": None,
    "api_key": None,
    "mem_fraction_static": None,
    "context_length": 32768,
    "log_level": "info",
    "enable_metrics": False,
    "base_gpu_id": 0,
    "trust_remote_code": False,
    "reasoning_parser": None,
    "speculative_algorithm": None,
    "speculative_draft_model_path": None,
    "speculative_num_steps": None,
    "speculative_eagle_topk": None,
    "speculative_num_draft_tokens": None,
}

_WORD_TEXT = (
    "alpha bravo cobalt delta ember fjord garnet harbor indigo jasper kernel lumen meadow nickel "
    "orbit pixel quartz river signal tensor umber vector willow xenon yonder zephyr anchor beacon "
    "cinder drift echo falcon glacier hollow island jungle kestrel lantern marble nectar opal "
    "prism quiver rocket summit thistle uplink velvet walnut axiom bramble cascade dune ferrous "
    "granite helix ion jade kiln lattice mosaic"
)
_WORDS = _WORD_TEXT.split()


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The stub's CLI: only real SGLang flags (checked against dflashops/data/sglang-flags.txt)."""
    p = argparse.ArgumentParser(
        prog="stub_engine.py",
        description="dflashops stub engine: a CPU stand-in for SGLang (not SGLang).",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--served-model-name")
    p.add_argument("--api-key")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--log-level", default="info")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--reasoning-parser")
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    return p


def redacted(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings safe to print or report: the api key value never leaves the process."""
    out = dict(settings)
    if out.get("api_key"):
        out["api_key"] = "<redacted>"
    return out


# --------------------------------------------------------------------------- knobs


def _env_float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"dflashops stub: {name}={raw!r} is not a number") from None


def _env_seconds(env: dict[str, str], name: str) -> float | None:
    """An optional delay in seconds: None when unset or empty."""
    if not env.get(name, "").strip():
        return None
    return _env_float(env, name, 0.0)


def _env_flag(env: dict[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def knobs_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    env = dict(os.environ if env is None else env)
    seed = env.get("DFLASHOPS_STUB_SEED", "").strip()
    return {
        "startup_seconds": _env_float(env, "DFLASHOPS_STUB_STARTUP_SECONDS", 0.5),
        "latency": _env_float(env, "DFLASHOPS_STUB_LATENCY", 0.0),
        "tokens_per_second": _env_float(env, "DFLASHOPS_STUB_TOKENS_PER_SECOND", 0.0),
        "failure_rate": _env_float(env, "DFLASHOPS_STUB_FAILURE_RATE", 0.0),
        "hang_rate": _env_float(env, "DFLASHOPS_STUB_HANG_RATE", 0.0),
        "exit_after": _env_seconds(env, "DFLASHOPS_STUB_EXIT_AFTER"),
        "exit_after_ready": _env_seconds(env, "DFLASHOPS_STUB_EXIT_AFTER_READY"),
        "wedge_after": _env_seconds(env, "DFLASHOPS_STUB_WEDGE_AFTER"),
        "ignore_term": _env_flag(env, "DFLASHOPS_STUB_IGNORE_TERM"),
        "seed": int(seed) if seed else None,
    }


# --------------------------------------------------------------------------- answers


class BadRequest(Exception):
    """A request the stub answers with 400 and this message."""


class _Dropped(Exception):
    """A request abandoned without an answer: its connection is closed."""


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "replace")).digest()


def _words(digest: bytes, count: int, salt: int = 0) -> str:
    n = len(_WORDS)
    return " ".join(_WORDS[(digest[i % 32] + (i // 32) * 7 + salt) % n] for i in range(count))


def _natural_length(digest: bytes) -> int:
    """Deterministic answer length in 16..512 tokens, from the prompt's hash."""
    return 16 + int.from_bytes(digest[:4], "big") % 497


def _count_tokens(text: str) -> int:
    return max(1, len(text.split()))


def _message_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        parts.append(f"{m.get('role', '')}: {content or ''}")
    return "\n".join(parts)


def _max_tokens(value: Any) -> int:
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("max_tokens must be a positive integer")
    return value


def _complete(text: str, max_tokens: int) -> tuple[str, int, bool, bytes]:
    """Answer text, its token count, whether max_tokens capped it, and the prompt digest."""
    digest = _digest(text)
    natural = _natural_length(digest)
    n = min(max_tokens, natural)
    return _words(digest, n), n, max_tokens < natural, digest


# --------------------------------------------------------------------------- server


class StubState:
    """Everything the request handlers share. Counters are guarded by one lock."""

    def __init__(self, settings: dict[str, Any], flavor: str, knobs: dict[str, Any]) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {flavor!r}; expected one of {FLAVORS}")
        self.settings = settings
        self.flavor = flavor
        self.knobs = knobs
        self.ready = False
        self.stopping = False
        self.wedged = False
        self.halt = threading.Event()  # set at shutdown: held requests give up
        self.started = time.time()
        self.started_mono = time.monotonic()
        self.rng = random.Random(knobs.get("seed"))
        self.lock = threading.Lock()
        self.requests_total = 0
        self.errors_total = 0
        self.running = 0  # generation requests admitted and not answered yet
        self.waiting = 0  # generation requests held by a wedged engine
        self.prompt_tokens = 0
        # Completion tokens: (start, end, count) spans in start order, produced evenly from
        # start to end; spans that ended before the throughput window are folded into retired.
        self.spans: collections.deque[tuple[float, float, int]] = collections.deque()
        self.retired_tokens = 0
        self.model_name = settings.get("served_model_name") or settings["model_path"]
        key = settings.get("api_key")
        self.auth = f"Bearer {key}" if key else None
        self.verbose = str(settings.get("log_level") or "").lower() == "debug"
        self.server_info = dict(settings)
        self.server_info.pop("api_key", None)
        self.server_info["version"] = STUB_VERSION
        self.server_info["dflashops_stub"] = True

    def produce(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """Record a request's tokens: the completion ones appear evenly over ``seconds``."""
        now = time.monotonic()
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.spans.append((now, now + max(0.0, seconds), tokens))
            self._retire(now)

    def _retire(self, now: float) -> None:
        horizon = now - THROUGHPUT_WINDOW
        while self.spans and self.spans[0][1] < horizon:
            self.retired_tokens += self.spans.popleft()[2]

    def token_stats(self) -> tuple[int, float]:
        """Completion tokens produced so far, and tokens/s over the last THROUGHPUT_WINDOW."""
        now = time.monotonic()
        horizon = now - THROUGHPUT_WINDOW
        with self.lock:
            self._retire(now)
            total = self.retired_tokens
            recent = 0.0
            for start, end, n in self.spans:
                if end <= start:  # produced at once
                    total += n
                    recent += n if start > horizon else 0
                    continue
                total += int(n * min(1.0, (now - start) / (end - start)))
                overlap = min(end, now) - max(start, horizon)
                if overlap > 0:
                    recent += n * overlap / (end - start)
        window = max(0.1, min(THROUGHPUT_WINDOW, now - self.started_mono))
        return total, recent / window


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _label_value(text: str) -> str:
    """A Prometheus label value, escaped for the text exposition format."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dflashops-stub"
    sys_version = ""
    disable_nagle_algorithm = True
    state: StubState  # set on a per-server subclass
    _slot = ""  # the StubState counter ("running", "waiting") the current request occupies

    # ---- plumbing

    def log_message(self, format: str, *args: Any) -> None:
        if self.state.verbose:
            sys.stderr.write(f"stub: {self.address_string()} {format % args}\n")

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        # An answered request is no longer running: a client that reads this answer and then
        # scrapes /metrics must not still see it counted.
        self._occupy("")
        # Headers and body leave in one write: no Nagle/delayed-ACK stall on keep-alive.
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self._headers_buffer.append(b"\r\n" + body)  # type: ignore[attr-defined]
        self.flush_headers()

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, _json_bytes(obj))

    def _error(self, code: int, message: str, etype: str = "invalid_request_error") -> None:
        self._json(code, {"object": "error", "message": message, "type": etype, "code": code})

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            n = int(length)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
        return self.rfile.read(n) if n > 0 else b""

    def _authorized(self, path: str) -> bool:
        st = self.state
        if st.auth is None:
            return True
        if st.flavor == "vllm":
            protected = path.startswith("/v1/")
        else:
            protected = path not in ("/health", "/health_generate", "/metrics")
        return not protected or self.headers.get("Authorization") == st.auth

    # ---- dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        body = b""
        self._slot = ""
        try:
            if method == "POST":
                body = self._read_body()
            routes = _ROUTES[self.state.flavor]
            route = routes.get(path)
            if route is None:
                self._error(404, f"not found: {path}", "not_found")
                return
            if not self._authorized(path):
                self._error(401, "Unauthorized", "unauthorized")
                return
            want, handler = route
            if method != want:
                self._error(405, f"method {method} not allowed on {path}", "method_not_allowed")
                return
            handler(self, body)
        except BadRequest as exc:
            self._error(400, str(exc))
        except _Dropped:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self._occupy("")

    def _occupy(self, slot: str) -> None:
        """Move this request to StubState counter ``slot`` ("running", "waiting" or none)."""
        st = self.state
        with st.lock:
            if self._slot:
                setattr(st, self._slot, getattr(st, self._slot) - 1)
            if slot:
                setattr(st, slot, getattr(st, slot) + 1)
        self._slot = slot

    def _client_gone(self) -> bool:
        if not hasattr(socket, "MSG_DONTWAIT"):
            return False
        try:
            return bool(self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"")
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _hold(self) -> None:
        """Never answer: wait (idle) for shutdown or for the client to hang up, then drop."""
        deadline = time.monotonic() + HANG_SECONDS
        while not self.state.halt.wait(HOLD_POLL_SECONDS):
            if self._client_gone() or time.monotonic() >= deadline:
                break
        raise _Dropped()

    # ---- informational endpoints

    def h_health(self, _body: bytes) -> None:
        st = self.state
        if st.ready and not st.stopping:
            self._send(200, b"")
        else:
            self._send(503, b"")

    def h_health_generate(self, body: bytes) -> None:
        """SGLang's generating health check: like /health, but a wedged engine never answers."""
        st = self.state
        if st.wedged and not st.stopping:
            self._hold()
        self.h_health(body)

    def h_server_info(self, _body: bytes) -> None:
        self._json(200, self.state.server_info)

    def h_model_info(self, _body: bytes) -> None:
        s = self.state.settings
        self._json(
            200,
            {
                "model_path": s["model_path"],
                "tokenizer_path": s.get("tokenizer_path") or s["model_path"],
                "is_generation": True,
            },
        )

    def h_models(self, _body: bytes) -> None:
        st = self.state
        card = {
            "id": st.model_name,
            "object": "model",
            "created": int(st.started),
            "root": st.settings["model_path"],
            "owned_by": "vllm" if st.flavor == "vllm" else "dflashops-stub",
            "max_model_len": st.settings.get("context_length"),
        }
        self._json(200, {"object": "list", "data": [card]})

    def h_version(self, _body: bytes) -> None:
        self._json(200, {"version": VLLM_FAKE_VERSION})

    def h_metrics(self, _body: bytes) -> None:
        st = self.state
        generated, throughput = st.token_stats()
        with st.lock:
            requests, errors = st.requests_total, st.errors_total
            running, waiting, prompt = st.running, st.waiting, st.prompt_tokens
        usage = min(1.0, running * KV_USAGE_PER_REQUEST)
        model = _label_value(str(st.model_name))
        families: list[tuple[str, str, str, Any]]
        if st.flavor == "sglang":
            labels = f'{{model_name="{model}"}}'
            families = [
                ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
                 float(throughput)),
                ("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 float(running)),
                ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
                 float(waiting)),
                ("sglang:token_usage", "gauge", "The token usage.", usage),
                ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 float(prompt)),
                ("sglang:generation_tokens_total", "counter",
                 "Number of generation tokens processed.", float(generated)),
            ]  # fmt: skip
        else:
            labels = f'{{engine="0",model_name="{model}"}}'
            families = [
                ("vllm:num_requests_running", "gauge",
                 "Number of requests in model execution batches.", float(running)),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                 float(waiting)),
                ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                 usage),
                ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 float(prompt)),
                ("vllm:generation_tokens_total", "counter",
                 "Number of generation tokens processed.", float(generated)),
            ]  # fmt: skip
        lines = []
        for name, kind, help_text, value in families:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{labels} {value!r}")
        own = f'{{flavor="{st.flavor}",model_name="{model}"}}'
        for name, kind, help_text, count in (
            ("requests_total", "counter", "Completion requests received.", requests),
            ("errors_total", "counter", "Completion requests answered with 5xx.", errors),
            ("requests_running", "gauge", "Completion requests in flight.", running),
        ):
            lines.append(f"# HELP dflashops_stub_{name} {help_text}")
            lines.append(f"# TYPE dflashops_stub_{name} {kind}")
            lines.append(f"dflashops_stub_{name}{own} {count}")
        self._send(200, ("\n".join(lines) + "\n").encode(), METRICS_CONTENT_TYPE)

    # ---- completions

    def _parse_json(self, body: bytes) -> dict[str, Any]:
        try:
            req = json.loads(body)
        except ValueError:
            raise BadRequest("request body is not valid JSON") from None
        if not isinstance(req, dict):
            raise BadRequest("request body must be a JSON object")
        if req.get("stream"):
            raise BadRequest("streaming not supported by the stub")
        return req

    def _begin(self) -> bool:
        """Admit a generation request. False: answer it with a simulated failure.

        A wedged engine holds it as waiting, the hang knob as running: neither ever answers.
        """
        st = self.state
        k = st.knobs
        with st.lock:
            st.requests_total += 1
        if st.wedged:
            self._occupy("waiting")
            self._hold()
        self._occupy("running")
        if k["hang_rate"] > 0 and st.rng.random() < k["hang_rate"]:
            self._hold()
        return not (k["failure_rate"] > 0 and st.rng.random() < k["failure_rate"])

    def _work(self, completion_tokens: int, prompt_tokens: int) -> None:
        """Produce the tokens: take as long as the latency knobs say, and count them."""
        k = self.state.knobs
        delay = k["latency"]
        if k["tokens_per_second"] > 0:
            delay += completion_tokens / k["tokens_per_second"]
        self.state.produce(completion_tokens, prompt_tokens, delay)
        if delay > 0:
            time.sleep(delay)

    def _fail(self) -> None:
        st = self.state
        with st.lock:
            st.errors_total += 1
        self._error(500, "simulated failure (DFLASHOPS_STUB_FAILURE_RATE)", "internal_error")

    def h_chat(self, body: bytes) -> None:
        st = self.state
        req = self._parse_json(body)
        prompt = _message_text(req.get("messages"))
        max_tokens = _max_tokens(req.get("max_completion_tokens", req.get("max_tokens")))
        if not self._begin():
            self._fail()
            return
        text, n, capped, digest = _complete(prompt, max_tokens)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        kwargs = req.get("chat_template_kwargs") or {}
        thinking = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
        if st.settings.get("reasoning_parser") and thinking:
            split = max(1, n // 4) if n > 1 else 0
            reasoning = "Thinking it over: " + _words(digest, split, salt=13)
            message["content"] = _words(digest, n - split) if split else text
            # SGLang names the field reasoning_content; newer vLLM names it reasoning.
            key = "reasoning" if st.flavor == "vllm" else "reasoning_content"
            message[key] = reasoning
        prompt_tokens = _count_tokens(prompt)
        self._work(n, prompt_tokens)
        self._json(
            200,
            {
                "id": "chatcmpl-" + digest[:12].hex(),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.get("model") or st.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "length" if capped else "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                },
            },
        )

    def h_completions(self, body: bytes) -> None:
        st = self.state
        req = self._parse_json(body)
        prompt = req.get("prompt")
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("'prompt' must be a string or a list of strings")
        max_tokens = _max_tokens(req.get("max_tokens"))
        if not self._begin():
            self._fail()
            return
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, p in enumerate(prompts):
            text, n, capped, _ = _complete(p, max_tokens)
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": "length" if capped else "stop",
                    "logprobs": None,
                }
            )
            prompt_tokens += _count_tokens(p)
            completion_tokens += n
        self._work(completion_tokens, prompt_tokens)
        self._json(
            200,
            {
                "id": "cmpl-" + _digest("".join(prompts))[:12].hex(),
                "object": "text_completion",
                "created": int(time.time()),
                "model": req.get("model") or st.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )

    def h_generate(self, body: bytes) -> None:
        req = self._parse_json(body)
        text = req.get("text")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("'text' must be a string or a list of strings")
        params = req.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("'sampling_params' must be an object")
        max_new = params.get("max_new_tokens")
        max_tokens = _max_tokens(max_new) if max_new is not None else 128
        if not self._begin():
            self._fail()
            return
        out = []
        total = prompt_total = 0
        for t in texts:
            answer, n, capped, digest = _complete(t, max_tokens)
            total += n
            prompt_total += _count_tokens(t)
            finish: dict[str, Any] = {"type": "length", "length": n} if capped else {"type": "stop"}
            out.append(
                {
                    "text": answer,
                    "meta_info": {
                        "id": digest[:16].hex(),
                        "prompt_tokens": _count_tokens(t),
                        "completion_tokens": n,
                        "finish_reason": finish,
                    },
                }
            )
        self._work(total, prompt_total)
        self._json(200, out if isinstance(text, list) else out[0])


_COMMON = {
    "/health": ("GET", StubHandler.h_health),
    "/health_generate": ("GET", StubHandler.h_health_generate),
    "/v1/models": ("GET", StubHandler.h_models),
    "/metrics": ("GET", StubHandler.h_metrics),
    "/v1/chat/completions": ("POST", StubHandler.h_chat),
    "/v1/completions": ("POST", StubHandler.h_completions),
}
_ROUTES: dict[str, dict[str, Any]] = {
    "sglang": {
        **_COMMON,
        "/server_info": ("GET", StubHandler.h_server_info),
        "/get_server_info": ("GET", StubHandler.h_server_info),
        "/get_model_info": ("GET", StubHandler.h_model_info),
        "/generate": ("POST", StubHandler.h_generate),
    },
    "vllm": {**_COMMON, "/version": ("GET", StubHandler.h_version)},
}


class StubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # socketserver's default backlog of 5 drops bursts of clients

    def __init__(self, host: str, port: int, handler: type) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall startup.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


def _say(line: str, stream: Any = None) -> None:
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def _fake_crash(flavor: str, reason: str) -> None:
    where = "sglang/srt/managers/scheduler.py" if flavor == "sglang" else "vllm/v1/engine/core.py"
    _say("Traceback (most recent call last):", sys.stderr)
    _say(f'  File "/opt/stub/{where}", line 2650, in run_event_loop', sys.stderr)
    _say("    self.event_loop_overlap()", sys.stderr)
    _say(f"RuntimeError: dflashops stub: simulated crash {reason}", sys.stderr)


def run_server(
    settings: dict[str, Any], flavor: str = "sglang", knobs: dict[str, Any] | None = None
) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or a DFLASHOPS_STUB_EXIT_AFTER* crash (exit 1).

    ``settings`` uses SGLang's server-arg names (see DEFAULT_SETTINGS); extra keys are reported
    as they are in /server_info. ``knobs`` defaults to the DFLASHOPS_STUB_* environment.
    """
    merged = dict(DEFAULT_SETTINGS)
    merged.update(settings)
    if not merged.get("model_path"):
        raise ValueError("settings need a model_path")
    if not merged.get("served_model_name"):
        merged["served_model_name"] = merged["model_path"]
    if not merged.get("tokenizer_path"):
        merged["tokenizer_path"] = merged["model_path"]
    k = knobs_from_env() if knobs is None else knobs

    state = StubState(merged, flavor, k)
    handler = type("BoundStubHandler", (StubHandler,), {"state": state})
    try:
        server = StubHTTPServer(str(merged["host"]), int(merged["port"]), handler)
    except OSError as exc:
        _say(
            f"ERROR: dflashops stub cannot bind {merged['host']}:{merged['port']}: {exc}",
            sys.stderr,
        )
        return 1
    state.server_info["port"] = merged["port"] = server.server_port

    wake = threading.Event()
    received: list[str] = []  # signals that stop the server
    ignored: list[str] = []  # SIGTERMs ignored under DFLASHOPS_STUB_IGNORE_TERM, not yet logged
    ignore_term = bool(k.get("ignore_term"))

    def on_signal(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        (ignored if ignore_term and signum == signal.SIGTERM else received).append(name)
        wake.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    # A short poll interval keeps shutdown() (SIGTERM to exit) around 0.1 s.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="stub-http", daemon=True
    )
    thread.start()
    t0 = time.monotonic()
    ready_at = t0 + max(0.0, float(k["startup_seconds"]))
    # EXIT_AFTER may fire before readiness: a server that dies while starting.
    crash_at: float | None = None
    crash_reason = ""
    if k.get("exit_after") is not None:
        crash_at = t0 + float(k["exit_after"])
        crash_reason = f"after {float(k['exit_after']):g} s (DFLASHOPS_STUB_EXIT_AFTER)"
    wedge_at: float | None = None
    code = 0
    try:
        while not received:
            wake.clear()
            while ignored:
                _say(
                    f"dflashops stub: ignoring {ignored.pop(0)} (DFLASHOPS_STUB_IGNORE_TERM)",
                    sys.stderr,
                )
            now = time.monotonic()
            if crash_at is not None and now >= crash_at:
                _fake_crash(flavor, crash_reason)
                code = 1
                break
            if not state.ready and now >= ready_at:
                state.ready = True
                _say(SGLANG_READY_LINE if flavor == "sglang" else VLLM_READY_LINE)
                after_ready = k.get("exit_after_ready")
                if after_ready is not None and (
                    crash_at is None or now + float(after_ready) < crash_at
                ):
                    crash_at = now + float(after_ready)
                    crash_reason = (
                        f"{float(after_ready):g} s after ready (DFLASHOPS_STUB_EXIT_AFTER_READY)"
                    )
                if k.get("wedge_after") is not None:
                    wedge_at = now + float(k["wedge_after"])
            if wedge_at is not None and now >= wedge_at:
                wedge_at = None
                state.wedged = True
                _say(
                    "dflashops stub: engine wedged (DFLASHOPS_STUB_WEDGE_AFTER): /health still "
                    "answers, generation requests are held unanswered",
                    sys.stderr,
                )
            waits = [0.5] + ([] if state.ready else [ready_at - now])
            waits += [t - now for t in (crash_at, wedge_at) if t is not None]
            if not received and not ignored:
                wake.wait(max(0.0, min(waits)))
    finally:
        state.stopping = True
        state.halt.set()
        server.shutdown()
        server.server_close()
    if received:
        _say(f"dflashops stub: received {received[0]}, shut down cleanly")
    return code


def with_config(argv: list[str]) -> list[str]:
    """SGLang's ``--config FILE``: the file's ``flag: value`` pairs become flags placed before
    the command line's own, which win (as SGLang's ConfigArgumentMerger does). Keys are flag
    names, dashes or underscores. The stub reads YAML's JSON form only (what dflashops writes
    for secret_args): it has no YAML parser (stdlib only)."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise SystemExit("stub_engine.py: error: No config file specified after --config flag!")
    path = argv[at + 1]
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"stub_engine.py: error: --config {path}: {exc} (the stub reads YAML in JSON form)"
        ) from None
    if not isinstance(data, dict):
        raise SystemExit(
            "stub_engine.py: error: Config file must contain a dictionary at root level"
        )
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags.extend([flag, *(str(v) for v in value)])
        elif value is not None and value is not False:
            flags.extend([flag, str(value)])
    return flags + argv[:at] + argv[at + 2 :]


def serve(argv: list[str] | None = None, flavor: str = "sglang") -> int:
    """The stub's command line: parse SGLang flags (and its --config file), announce what this
    is, serve."""
    args = build_parser().parse_args(with_config(sys.argv[1:] if argv is None else argv))
    settings = vars(args)
    shown = json.dumps(redacted(settings), sort_keys=True)
    _say(
        f"dflashops stub engine {STUB_VERSION} (flavor {flavor}): a CPU stand-in, NOT SGLang; "
        f"no model is loaded, answers are synthetic. args: {shown}"
    )
    return run_server(settings, flavor)


def main() -> None:
    sys.exit(serve())


if __name__ == "__main__":
    main()
