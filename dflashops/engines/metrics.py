"""The engines' own numbers, from their Prometheus ``/metrics`` (fetched by the agent's probe,
parsed here with prometheus_client's parser): generation throughput, running and queued
requests, KV-cache use.

- SGLang (and the stub): ``sglang:gen_throughput`` (tok/s, a gauge), ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (0..1).
- vLLM: ``vllm:generation_tokens_total`` (a counter: tok/s is its rate between two samples),
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0..1).

Anything missing or unparsable is None (shown as ``-``), never an error: a server without
metrics, or with garbage in them, is still a server.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflashops.cache import cache_dir, warn_once
from dflashops.engines.protocol import protocol

NAMES = {
    "sglang": {
        "throughput": "sglang:gen_throughput",
        "running": "sglang:num_running_reqs",
        "queued": "sglang:num_queue_reqs",
        "kv": "sglang:token_usage",
    },
    "vllm": {
        "tokens": "vllm:generation_tokens_total",
        "running": "vllm:num_requests_running",
        "queued": "vllm:num_requests_waiting",
        "kv": "vllm:kv_cache_usage_perc",
    },
}
STALE_S = 600.0  # a counter sample older than this gives no rate


@dataclass
class Reading:
    tok_s: float | None = None
    running: float | None = None
    queued: float | None = None
    kv: float | None = None  # 0..1
    tokens_total: float | None = None  # vLLM's counter, for a rate next time
    at: float = 0.0
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "at"}


def _sums(text: str) -> dict[str, float]:
    """Sample name -> sum over its label sets (several models or DP ranks add up)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if isinstance(sample.value, float | int) and math.isfinite(sample.value):
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def parse(engine: str, text: str | None, at: float, previous: Reading | None = None) -> Reading:
    """One server's reading; ``previous`` (a vLLM server's last one) gives the counter's rate."""
    reading = Reading(at=at)
    flavor = protocol(engine)
    if flavor is None or text is None:
        return reading
    try:
        values = _sums(text)
    except Exception as exc:  # prometheus_client raises ValueError and worse on garbage
        reading.error = f"unparsable /metrics: {type(exc).__name__}"
        return reading
    names = NAMES[flavor]
    reading.running = values.get(names["running"])
    reading.queued = values.get(names["queued"])
    reading.kv = values.get(names["kv"])
    if flavor == "sglang":
        reading.tok_s = values.get(names["throughput"])
    else:
        total = values.get(names["tokens"])
        reading.tokens_total = total
        if (
            total is not None
            and previous is not None
            and previous.tokens_total is not None
            and 0 < at - previous.at < STALE_S
            and total >= previous.tokens_total
        ):
            reading.tok_s = (total - previous.tokens_total) / (at - previous.at)
    return reading


class Memory:
    """The last reading per server, kept in the cache folder between two `status` calls (a
    counter needs two samples), and in memory for `top`."""

    def __init__(self, persist: bool = True) -> None:
        self.path = cache_dir() / "metrics.json"
        self.persist = persist
        self.last: dict[str, Reading] = {}
        if persist:
            try:
                raw = json.loads(self.path.read_text())
                self.last = {k: Reading(**v) for k, v in raw.items() if isinstance(v, dict)}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError) as exc:
                warn_once(f"{self.path}: {exc}")

    def read(self, key: str, engine: str, text: str | None, at: float | None = None) -> Reading:
        reading = parse(engine, text, at if at is not None else time.time(), self.last.get(key))
        if reading.tokens_total is not None:
            self.last[key] = reading
        return reading

    def save(self) -> None:
        if not self.persist:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{self.path}.{id(self)}.tmp")
            tmp.write_text(json.dumps({k: asdict(v) for k, v in self.last.items()}))
            tmp.replace(self.path)
        except OSError as exc:
            warn_once(str(exc))


def shown(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.0f}%"
    if kind == "tok":
        return f"{value:,.0f}"
    return f"{value:.0f}"
