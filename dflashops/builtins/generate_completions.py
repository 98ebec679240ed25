"""generate_completions.py: a resumable, multi-server completions generator (dflashops payload).

Shipped to GPU hosts as a single stdlib-only file and run there with the host's own python 3.9+::

    python generate_completions.py --prompts prompts.jsonl --servers URL [URL ...] \\
        --output-dir completions/ --max-output-tokens 4096 --concurrency 48 \\
        [--temperature 0.6] [--top-p 0.95] [--model NAME] [--chat-template-kwargs JSON] \\
        [--request-timeout 1800] [--max-retries 5] [--shard I/N] [--api-key-env VAR] \\
        [--progress-interval 5] [--log-interval 30] [--grace 30]

It sends every prompt of a JSONL file to a fleet of OpenAI-compatible servers (SGLang, vLLM) and
appends one record per completion to JSONL shards in the output directory. Any restart resumes:
the shards already in the output directory are the only record of what is done, so a prompt is
never generated twice into the output and never lost.

Input (``--prompts``), one JSON object per line:
  ``{"id": "q1", "messages": [{"role": "user", "content": "..."}]}`` -> /v1/chat/completions
  ``{"id": 17, "prompt": "Once upon a time"}``                       -> /v1/completions
  ``id`` is a string or an integer (ids are compared as ``str(id)``; without one the prompt is
  ``"line-N"``, N its 1-based line number). Bad lines (not JSON, not an object, neither or both
  of messages/prompt, wrong types) and repeated ids (the first one wins) are reported on stderr
  and listed in OUTPUT_DIR/rejected.jsonl (``{"line", "error", "raw"}``, rewritten every run);
  the run goes on without them. Blank lines are skipped.

Output directory:
  completions-<runid>-<n>.jsonl  append-only shards, a new set per run, rolled over every
      100,000 records. One record per line: {"id", "answer", "reasoning", "finish_reason",
      "prompt_tokens", "completion_tokens", "server", "latency_s", "attempts", "time"}.
      Records are written by one thread, in batches that are flushed and fsync'ed; a record is
      either whole in the output or not at all: on resume a torn last line (no newline, or not
      JSON) is ignored, saved to torn-lines.jsonl and truncated away.
  failed.jsonl     prompts that failed after all retries ({"id", "error", "attempts", "time",
      "run"}); advisory only: they are not in the shards, so the next run tries them again.
  rejected.jsonl   bad input lines of the current prompt file (see above).
  progress.json    rewritten atomically every --progress-interval seconds and at exit.
  .lock            flock'ed while a run uses the directory (one run per directory; give each
      --shard its own directory).

Servers: each request goes to the healthy server with the fewest requests in flight, over
keep-alive connections (one per worker thread and server). A server whose connection fails
(refused, reset, closed) is backed off at once; one that answers 5xx/408/429, a broken body,
``finish_reason: abort`` or times out three times in a row is backed off too. Backoff is
exponential with jitter (1 s doubling to 60 s); a backed-off server is probed (GET /v1/models,
which must list the model) until it answers, then used again. When every server is down the run
waits (servers restart), logging every --log-interval; waiting costs no prompt retries.
Prompts: a request that reached a server and failed (5xx, 408, 429, timeout, reset, bad body) is
retried with exponential backoff and jitter, up to --max-retries times (1 + N attempts), then
written to failed.jsonl. Any other 4xx (400, 404, 413, 422, ...) fails the prompt at once: a
retry would get the same answer. 401/403 mark the server down instead (a key problem is not the
prompt's fault).

Signals: SIGTERM/SIGINT stop taking prompts, give the requests in flight up to --grace seconds,
write what finished, print a summary and exit 0. A second signal exits at once with 128+signum
(130 SIGINT, 143 SIGTERM); nothing is duplicated by that (records are deduplicated when written
and when resuming, and a torn last line is dropped).

Exit codes:
  0   done, nothing to do, or stopped cleanly by SIGTERM/SIGINT
  1   usage or input error (bad flags, missing or unreadable prompt file, no valid prompt,
      output directory unusable or used by another run, prompt file changed while running)
  3   finished, but some prompts still failed after all retries (listed in failed.jsonl)
  75  output write failed (disk full: ENOSPC, EDQUOT, EFBIG); rerun once there is room
  130, 143  second SIGINT / SIGTERM: stopped at once

Stdlib only, python 3.9+: nothing newer than 3.9 may be evaluated at runtime.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import errno
import hashlib
import http.client
import json
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Callable
from urllib.parse import urlsplit

try:  # Linux hosts; the lock is skipped where fcntl does not exist.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

EXIT_OK = 0
EXIT_USAGE = 1
EXIT_FAILED = 3
EXIT_DISK_FULL = 75

SHARD_ROLL_RECORDS = 100_000
WRITE_BATCH_RECORDS = 256
WRITE_BATCH_SECONDS = 0.5
SERVER_BACKOFF_BASE_S = 1.0
SERVER_BACKOFF_CAP_S = 60.0
SERVER_SOFT_ERRORS_TO_TRIP = 3
PROMPT_BACKOFF_BASE_S = 0.25
PROMPT_BACKOFF_CAP_S = 30.0
KEEPALIVE_IDLE_S = 4.0  # uvicorn (SGLang, vLLM) drops idle keep-alive connections after 5 s
PROBE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
RATE_WINDOW_S = 60.0
MAX_STDERR_REJECTS = 50
MAX_FAILURE_LOGS = 100
MAX_RAW_CHARS = 4000
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))
SHARD_PREFIX = "completions-"
SHARD_SUFFIX = ".jsonl"

_print_lock = threading.Lock()


# --------------------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    """One timestamped line on stdout, flushed (stdout is usually a log file)."""
    line = time.strftime("%Y-%m-%d %H:%M:%S ") + msg + "\n"
    with _print_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def warn(msg: str) -> None:
    with _print_lock:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def utc_iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def id_key(pid: Any) -> str:
    """The comparison key of a prompt id: ``str(id)`` (so 17 and "17" are the same prompt)."""
    return pid if isinstance(pid, str) else str(pid)


def id_hash64(key: str) -> int:
    """First 64 bits of sha256(key): deterministic on every machine and python version."""
    return int(hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16], 16)


def in_shard(key: str, shard: tuple[int, int] | None) -> bool:
    """--shard I/N: keep ids with int(sha256(str(id)).hexdigest()[:16], 16) % N == I."""
    if shard is None:
        return True
    index, count = shard
    return id_hash64(key) % count == index


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def write_all(fd: int, data: bytes) -> None:
    """os.write until everything is written (a write may be short, e.g. near a size limit)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """tmp + fsync + os.replace: readers see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def encode_json_line(obj: Any) -> bytes:
    """One JSON line; UTF-8 text as is, or escaped when it holds lone surrogates."""
    try:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj) + "\n").encode("ascii")


class UsageError(Exception):
    """Bad flags or input: exit 1 with this message."""


# --------------------------------------------------------------------------- input


class PromptError(ValueError):
    """A prompt line that cannot be used; the message goes to rejected.jsonl."""


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"messages[{i}] is not an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise PromptError(f"messages[{i}] has no 'role' string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise PromptError(f"messages[{i}].content must be a string, a list or null")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("'prompt' is empty")
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return  # token ids
    raise PromptError("'prompt' must be a non-empty string or a list of token ids")


def parse_prompt_line(raw: bytes, line_no: int) -> tuple[Any, str, str, Any]:
    """One input line -> (id, key, kind, payload); kind is "chat" or "text". Or PromptError."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # includes UnicodeDecodeError
        raise PromptError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PromptError(f"not a JSON object (a {type(obj).__name__})")
    if "id" in obj:
        pid = obj["id"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise PromptError("'id' must be a string or an integer")
        if isinstance(pid, str) and not pid.strip():
            raise PromptError("'id' is empty")
    else:
        pid = f"line-{line_no}"
    has_messages = "messages" in obj
    has_prompt = "prompt" in obj
    if has_messages and has_prompt:
        raise PromptError("has both 'messages' and 'prompt'")
    if has_messages:
        _check_messages(obj["messages"])
        return pid, id_key(pid), "chat", obj["messages"]
    if has_prompt:
        _check_prompt(obj["prompt"])
        return pid, id_key(pid), "text", obj["prompt"]
    raise PromptError("has neither 'messages' nor 'prompt'")


class Plan:
    """What pass 1 over the prompt file found.

    Memory for 900K prompts: pending prompts are kept as file offsets (8 bytes each) plus a
    64-bit id hash to verify the line when it is re-read, not as parsed prompts (which can be
    gigabytes); the set of ids seen is needed to detect duplicates and is dropped after pass 1.
    """

    def __init__(self) -> None:
        self.offsets = array.array("q")  # byte offset of each pending line
        self.lines = array.array("q")  # its 1-based line number
        self.hashes = array.array("Q")  # id_hash64 of its id
        self.total = 0  # valid, unique prompts in this shard
        self.done = 0  # of those, already in the output
        self.rejected = 0
        self.valid_lines = 0  # valid prompt lines in the whole file (any shard)
        self.other_shard = 0

    @property
    def pending(self) -> int:
        return len(self.offsets)


def plan_prompts(
    path: str,
    done_keys: set[str],
    shard: tuple[int, int] | None,
    rejected_path: str,
    should_stop: Callable[[], bool] | None = None,
) -> Plan:
    """Pass 1: validate every line, drop duplicates and done ids, note what is pending.

    Rejected lines are reported on stderr and written to rejected_path (replaced atomically).
    """
    plan = Plan()
    seen: set[str] = set()
    tmp = rejected_path + ".tmp"
    rej_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    rej_buf: list[bytes] = []

    def reject(line_no: int, error: str, raw: bytes) -> None:
        plan.rejected += 1
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if len(text) > MAX_RAW_CHARS:
            text = text[:MAX_RAW_CHARS] + f"...[{len(text) - MAX_RAW_CHARS} more chars]"
        if plan.rejected <= MAX_STDERR_REJECTS:
            warn(f"rejected line {line_no}: {error}")
        elif plan.rejected == MAX_STDERR_REJECTS + 1:
            warn(f"(more rejected lines: see {rejected_path})")
        rej_buf.append(encode_json_line({"line": line_no, "error": error, "raw": text}))
        if len(rej_buf) >= 1000:
            write_all(rej_fd, b"".join(rej_buf))
            del rej_buf[:]

    try:
        with open(path, "rb") as f:
            offset = 0
            line_no = 0
            for raw in f:
                line_no += 1
                start = offset
                offset += len(raw)
                if should_stop is not None and should_stop():
                    break
                if not raw.strip():
                    continue
                try:
                    _pid, key, _kind, _payload = parse_prompt_line(raw, line_no)
                except PromptError as exc:
                    reject(line_no, str(exc), raw)
                    continue
                plan.valid_lines += 1
                if not in_shard(key, shard):
                    plan.other_shard += 1
                    continue
                if key in seen:
                    reject(line_no, f"duplicate id {key!r} (the first one wins)", raw)
                    continue
                seen.add(key)
                plan.total += 1
                if key in done_keys:
                    plan.done += 1
                    continue
                plan.offsets.append(start)
                plan.lines.append(line_no)
                plan.hashes.append(id_hash64(key))
        if rej_buf:
            write_all(rej_fd, b"".join(rej_buf))
        os.fsync(rej_fd)
    finally:
        os.close(rej_fd)
    os.replace(tmp, rejected_path)
    return plan


def build_body(kind: str, payload: Any, model: str, opts: dict[str, Any]) -> tuple[str, bytes]:
    """The request path and JSON body for one prompt."""
    body: dict[str, Any] = {"model": model}
    if kind == "chat":
        body["messages"] = payload
    else:
        body["prompt"] = payload
    body["max_tokens"] = opts["max_tokens"]
    if opts.get("temperature") is not None:
        body["temperature"] = opts["temperature"]
    if opts.get("top_p") is not None:
        body["top_p"] = opts["top_p"]
    if kind == "chat" and opts.get("chat_template_kwargs") is not None:
        body["chat_template_kwargs"] = opts["chat_template_kwargs"]
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return path, json.dumps(body).encode("ascii")


# --------------------------------------------------------------------------- resume


class ScanResult:
    def __init__(self) -> None:
        self.records = 0  # unique completed ids found
        self.duplicates = 0
        self.bad_lines = 0  # invalid lines in the middle of a shard (ignored, left alone)
        self.torn = 0  # torn last lines dropped
        self.shards = 0


def scan_outputs(output_dir: str, done: set[str]) -> ScanResult:
    """Collect the ids of every record in the output shards into ``done`` (first one wins).

    A torn last line (no newline, or not JSON) is ignored and, once saved to torn-lines.jsonl,
    truncated away. The caller must hold the output directory's lock.
    """
    res = ScanResult()
    names = sorted(
        n for n in os.listdir(output_dir) if n.startswith(SHARD_PREFIX) and n.endswith(SHARD_SUFFIX)
    )
    for name in names:
        res.shards += 1
        scan_shard(os.path.join(output_dir, name), done, res, output_dir)
    return res


def _record_key(line: bytes) -> str | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    pid = rec.get("id")
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        return None
    return id_key(pid)


def scan_shard(path: str, done: set[str], res: ScanResult, output_dir: str) -> None:
    good_end = 0
    torn: bytes | None = None
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            start = offset
            offset += len(line)
            key = _record_key(line) if line.endswith(b"\n") else None
            if key is None:
                # Last line of the file? Then it is a torn write: drop it below.
                if not line.endswith(b"\n") or not f.peek(1):
                    torn = line
                    good_end = start
                    break
                res.bad_lines += 1
                warn(f"warning: {path}: line at byte {start} is not a record; ignored")
                good_end = offset
                continue
            good_end = offset
            if key in done:
                res.duplicates += 1
            else:
                done.add(key)
                res.records += 1
    if torn is not None:
        res.torn += 1
        _drop_torn_tail(path, good_end, torn, output_dir)


def _drop_torn_tail(path: str, good_end: int, torn: bytes, output_dir: str) -> None:
    """Keep the torn bytes as evidence, then cut them off the shard (only if that succeeded)."""
    size = good_end + len(torn)
    evidence = os.path.join(output_dir, "torn-lines.jsonl")
    entry = {
        "shard": os.path.basename(path),
        "offset": good_end,
        "size": len(torn),
        "time": utc_now(),
        "raw": torn.decode("utf-8", "replace"),
    }
    try:
        fd = os.open(evidence, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            write_all(fd, encode_json_line(entry))
            os.fsync(fd)
        finally:
            os.close(fd)
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size != size:
                warn(f"warning: {path} changed while scanning; torn line left in place (ignored)")
                return
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        warn(f"warning: could not truncate the torn last line of {path} ({exc}); it is ignored")
        return
    warn(
        f"dropped a torn last line ({len(torn)} bytes) from {path}; "
        f"kept a copy in {evidence}; that prompt will be generated again"
    )


# --------------------------------------------------------------------------- servers


class Server:
    """One server URL and its health; mutable fields are guarded by ServerPool.cond."""

    def __init__(self, url: str) -> None:
        raw = url.rstrip("/")
        u = urlsplit(raw if "://" in raw else "http://" + raw)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"bad server URL {url!r}: expected http://HOST:PORT")
        try:
            port = u.port
        except ValueError:
            raise UsageError(f"bad port in server URL {url!r}") from None
        self.url = raw
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = port or (443 if self.https else 80)
        prefix = u.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self.prefix = prefix
        self.up = False
        self.in_flight = 0
        self.ok = 0
        self.errors = 0
        self.soft_errors = 0  # consecutive 5xx/timeouts since the last success
        self.trips = 0  # consecutive backoffs since the last success
        self.down_until = 0.0  # monotonic
        self.last_error: str | None = None

    def status(self) -> dict[str, Any]:
        until = None
        if not self.up:
            until = utc_iso(time.time() + max(0.0, self.down_until - time.monotonic()))
        return {
            "up": self.up,
            "ok": self.ok,
            "errors": self.errors,
            "in_flight": self.in_flight,
            "backed_off_until": until,
            "last_error": self.last_error,
        }


def backoff_seconds(n: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter for the n-th (1-based) consecutive failure."""
    return min(cap, base * (2 ** min(n - 1, 30))) * random.uniform(0.5, 1.0)


class ServerPool:
    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self.cond = threading.Condition()
        self._rr = 0

    def acquire(self, stop: threading.Event) -> Server | None:
        """The up server with the fewest requests in flight; waits while none is up."""
        with self.cond:
            while not stop.is_set():
                best = None
                n = len(self.servers)
                self._rr = (self._rr + 1) % n
                for i in range(n):
                    s = self.servers[(self._rr + i) % n]
                    if s.up and (best is None or s.in_flight < best.in_flight):
                        best = s
                if best is not None:
                    best.in_flight += 1
                    return best
                self.cond.wait(0.5)
        return None

    def release(self, s: Server) -> None:
        with self.cond:
            s.in_flight -= 1

    def success(self, s: Server) -> None:
        with self.cond:
            s.ok += 1
            s.soft_errors = 0
            s.trips = 0

    def answered(self, s: Server) -> None:
        """The server answered sanely (e.g. a 400 for a bad prompt): it is healthy."""
        with self.cond:
            s.soft_errors = 0

    def error(self, s: Server, msg: str, hard: bool) -> None:
        """A failed request: hard (connection) errors back the server off at once, soft ones
        (5xx, timeout, ...) after SERVER_SOFT_ERRORS_TO_TRIP in a row."""
        with self.cond:
            s.errors += 1
            s.last_error = msg
            s.soft_errors += 1
            if s.up and (hard or s.soft_errors >= SERVER_SOFT_ERRORS_TO_TRIP):
                self._trip(s, msg)

    def _trip(self, s: Server, msg: str) -> None:
        s.up = False
        s.trips += 1
        wait = backoff_seconds(s.trips, SERVER_BACKOFF_BASE_S, SERVER_BACKOFF_CAP_S)
        s.down_until = time.monotonic() + wait
        log(f"server {s.url} backed off for {wait:.1f}s: {msg}")

    def probe_result(self, s: Server, ok: bool, msg: str | None) -> None:
        with self.cond:
            if ok:
                was_known = s.trips > 0 or s.last_error is not None
                s.up = True
                s.soft_errors = 0
                self.cond.notify_all()
                if was_known:
                    log(f"server {s.url} is up again")
            else:
                s.last_error = msg
                s.trips += 1
                s.down_until = time.monotonic() + backoff_seconds(
                    s.trips, SERVER_BACKOFF_BASE_S, SERVER_BACKOFF_CAP_S
                )

    def mark_down(self, s: Server, msg: str) -> None:
        with self.cond:
            s.up = False
            s.last_error = msg
            s.trips += 1
            s.down_until = time.monotonic() + backoff_seconds(
                s.trips, SERVER_BACKOFF_BASE_S, SERVER_BACKOFF_CAP_S
            )

    def wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def up_count(self) -> int:
        with self.cond:
            return sum(1 for s in self.servers if s.up)

    def in_flight(self) -> int:
        with self.cond:
            return sum(s.in_flight for s in self.servers)

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            return {s.url: s.status() for s in self.servers}


# --------------------------------------------------------------------------- HTTP


class NotSent(Exception):
    """The request never reached the server (connect failed)."""


class SentError(Exception):
    """The request was sent but no proper answer came back; ``hard``: the connection broke."""

    def __init__(self, msg: str, hard: bool) -> None:
        super().__init__(msg)
        self.hard = hard


class BadResponse(Exception):
    pass


def _exc_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _OneWrite:
    """http.client sends a request's head and its body with two sendall calls (two syscalls,
    two TCP segments, two GIL round trips for a busy worker thread). This glues the body to
    the head so that a request leaves in one write, through the public ``send`` hook."""

    _glue: bytes | None = None

    def request_one_write(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> None:
        if not body:
            self.request(method, url, headers=headers)  # type: ignore[attr-defined]
            return
        h = dict(headers)
        h["Content-Length"] = str(len(body))
        self._glue = body
        try:
            self.request(method, url, headers=h)  # type: ignore[attr-defined]
        finally:
            self._glue = None

    def send(self, data: Any) -> None:
        glue = self._glue
        if glue is not None:
            self._glue = None
            data = bytes(data) + glue
        super().send(data)  # type: ignore[misc]


class _HTTPConnection(_OneWrite, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_OneWrite, http.client.HTTPSConnection):
    pass


class Client:
    """Keep-alive connections of one worker thread: at most one per server."""

    def __init__(self, timeout: float, headers: dict[str, str]) -> None:
        self.timeout = timeout
        self.headers = headers
        self.conns: dict[str, tuple[Any, float]] = {}

    def _new(self, s: Server, timeout: float) -> Any:
        """A connected connection. Connecting gets at most CONNECT_TIMEOUT_S (a host that drops
        packets must not hold a worker for the whole request timeout), reading ``timeout``."""
        cls = _HTTPSConnection if s.https else _HTTPConnection
        conn = cls(s.host, s.port, timeout=min(timeout, CONNECT_TIMEOUT_S))
        try:
            conn.connect()
            conn.sock.settimeout(timeout)
        except OSError as exc:
            conn.close()
            raise NotSent(f"connect failed: {_exc_text(exc)}") from None
        conn.timeout = timeout
        with contextlib.suppress(OSError, AttributeError):  # small requests leave at once
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def close(self) -> None:
        for conn, _ in self.conns.values():
            conn.close()
        self.conns.clear()

    def request(
        self, s: Server, method: str, path: str, body: bytes | None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """(status, body). Raises NotSent or SentError; the connection is dropped on errors."""
        entry = self.conns.pop(s.url, None)
        conn = None
        if entry is not None:
            if time.monotonic() - entry[1] < KEEPALIVE_IDLE_S and timeout is None:
                conn = entry[0]
            else:
                entry[0].close()
        for _ in range(2):
            reused = conn is not None
            if conn is None:
                conn = self._new(s, timeout or self.timeout)
            try:
                conn.request_one_write(method, s.prefix + path, body, self.headers)
                resp = conn.getresponse()
                data = resp.read()
            except socket.timeout:
                conn.close()
                raise SentError(f"timed out after {timeout or self.timeout:g}s", False) from None
            except (http.client.HTTPException, OSError) as exc:
                conn.close()
                conn = None
                if reused and isinstance(
                    exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    continue  # a keep-alive connection the server had closed: once more, fresh
                raise SentError(_exc_text(exc), True) from None
            if resp.will_close or timeout is not None:
                conn.close()
            else:
                self.conns[s.url] = (conn, time.monotonic())
            return resp.status, data
        raise SentError("connection closed twice", True)  # pragma: no cover


def parse_models(data: bytes) -> list[str]:
    obj = json.loads(data)
    ids = [m.get("id") for m in obj.get("data") or [] if isinstance(m, dict)]
    return [str(i) for i in ids if i]


def probe(
    s: Server, headers: dict[str, str], model: str | None, timeout: float
) -> tuple[bool, Any]:
    """GET /v1/models: (True, [model ids]) or (False, why). With a model, it must be served."""
    client = Client(timeout, headers)
    try:
        status, data = client.request(s, "GET", "/v1/models", None, timeout=timeout)
    except (NotSent, SentError) as exc:
        return False, str(exc)
    finally:
        client.close()
    if status != 200:
        return False, f"GET /v1/models: HTTP {status} {_snippet(data)}"
    try:
        ids = parse_models(data)
    except (ValueError, AttributeError):
        return False, "GET /v1/models: not an OpenAI model list"
    if not ids:
        return False, "GET /v1/models: no model served"
    if model is not None and model not in ids:
        return False, f"serves {ids}, not {model!r}"
    return True, ids


def _snippet(data: bytes, n: int = 300) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= n else text[:n] + "..."


def parse_completion(data: bytes) -> dict[str, Any]:
    """The fields we keep from an OpenAI chat or text completion response."""
    try:
        obj = json.loads(data)
    except ValueError:
        raise BadResponse(f"response is not JSON: {_snippet(data, 200)}") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadResponse(f"response has no choices: {_snippet(data, 200)}")
    choice = choices[0]
    msg = choice.get("message")
    if isinstance(msg, dict):
        answer = msg.get("content")
        # SGLang and older vLLM: reasoning_content; newer vLLM: reasoning.
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")
    else:
        answer = choice.get("text")
        reasoning = choice.get("reasoning_content")
        if reasoning is None:
            reasoning = choice.get("reasoning")
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    return {
        "answer": answer,
        "reasoning": reasoning,
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


# --------------------------------------------------------------------------- writer


class Writer(threading.Thread):
    """The only thread that writes shards and failed.jsonl: batches, writes, fsyncs.

    ``written`` holds every id already in the output (from the resume scan, then every record
    written): a record for an id in it is dropped, never written twice.
    """

    CLOSE = ("close",)

    def __init__(self, run: Run, written: set[str]) -> None:
        super().__init__(name="writer", daemon=True)
        self.run_ = run
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.written = written
        self.fd: int | None = None
        self.shard_index = 0
        self.shard_records = 0
        self.shard_paths: list[str] = []
        self.failed_fd: int | None = None
        self.dropped_duplicates = 0

    def put_record(self, key: str, line: bytes, tokens: int) -> None:
        self.q.put(("rec", key, line, tokens))

    def put_failed(self, line: bytes) -> None:
        self.q.put(("fail", line))

    def close_and_wait(self) -> None:
        self.q.put(self.CLOSE)

    def run(self) -> None:
        recs: list[tuple[str, bytes, int]] = []
        fails: list[bytes] = []
        deadline = None
        closing = False
        try:
            while not closing:
                timeout = 0.5 if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = self.q.get(timeout=timeout)
                except queue.Empty:
                    item = None
                if item is self.CLOSE:
                    closing = True
                elif item is not None:
                    if item[0] == "rec":
                        if item[1] in self.written:
                            self.dropped_duplicates += 1
                        else:
                            self.written.add(item[1])
                            recs.append(item[1:])
                    else:
                        fails.append(item[1])
                    if deadline is None:
                        deadline = time.monotonic() + WRITE_BATCH_SECONDS
                if (recs or fails) and (
                    closing
                    or len(recs) >= WRITE_BATCH_RECORDS
                    or (deadline is not None and time.monotonic() >= deadline)
                ):
                    self._flush(recs, fails)
                    recs = []
                    fails = []
                    deadline = None
                elif not recs and not fails:
                    deadline = None
        except OSError as exc:
            self.run_.fatal_io(exc, self.current_path())
        except Exception as exc:  # pragma: no cover - a bug: stop loudly, never hang
            self.run_.fatal_io(exc, self.current_path())
        finally:
            for fd in (self.fd, self.failed_fd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.fd = self.failed_fd = None

    def current_path(self) -> str:
        return self.shard_paths[-1] if self.shard_paths else self.run_.output_dir

    def _open_shard(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            self.shard_index += 1
        name = f"{SHARD_PREFIX}{self.run_.run_id}-{self.shard_index:04d}{SHARD_SUFFIX}"
        path = os.path.join(self.run_.output_dir, name)
        self.shard_paths.append(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        self.fd = os.open(path, flags, 0o644)
        self.shard_records = 0
        fsync_dir(self.run_.output_dir)

    def _flush(self, recs: list[tuple[str, bytes, int]], fails: list[bytes]) -> None:
        i = 0
        while i < len(recs):
            if self.fd is None or self.shard_records >= SHARD_ROLL_RECORDS:
                self._open_shard()
            chunk = recs[i : i + SHARD_ROLL_RECORDS - self.shard_records]
            assert self.fd is not None
            write_all(self.fd, b"".join(r[1] for r in chunk))
            self.shard_records += len(chunk)
            i += len(chunk)
        if recs and self.fd is not None:
            os.fsync(self.fd)
            self.run_.stats.written(len(recs), sum(r[2] for r in recs))
        if fails:
            if self.failed_fd is None:
                path = os.path.join(self.run_.output_dir, "failed.jsonl")
                self.failed_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            write_all(self.failed_fd, b"".join(fails))
            os.fsync(self.failed_fd)


# --------------------------------------------------------------------------- the run


class Stats:
    def __init__(self, done_before: int) -> None:
        self.lock = threading.Lock()
        self.done_before = done_before
        self.done_run = 0  # records durably written by this run
        self.tokens_run = 0
        self.failed = 0
        self.attempts = 0
        self.samples: deque = deque()

    def written(self, n: int, tokens: int) -> None:
        with self.lock:
            self.done_run += n
            self.tokens_run += tokens

    def add_failed(self) -> int:
        with self.lock:
            self.failed += 1
            return self.failed

    def add_attempt(self) -> None:
        with self.lock:
            self.attempts += 1

    def sample(self) -> tuple[float, float] | None:
        """(records/s, completion tokens/s) over the last RATE_WINDOW_S seconds, if known."""
        now = time.monotonic()
        with self.lock:
            self.samples.append((now, self.done_run, self.tokens_run))
        while len(self.samples) > 2 and self.samples[1][0] < now - RATE_WINDOW_S:
            self.samples.popleft()
        t0, d0, k0 = self.samples[0]
        t1, d1, k1 = self.samples[-1]
        if t1 - t0 < 2.0:
            return None
        return (d1 - d0) / (t1 - t0), (k1 - k0) / (t1 - t0)


class Job:
    __slots__ = ("body", "key", "line", "path", "pid")

    def __init__(self, pid: Any, key: str, line: int, path: str, body: bytes) -> None:
        self.pid = pid
        self.key = key
        self.line = line
        self.path = path
        self.body = body


_END = None  # sentinel on the job queue


class Run:
    def __init__(self, args: argparse.Namespace, headers: dict[str, str]) -> None:
        self.args = args
        self.headers = headers
        self.output_dir = args.output_dir
        self.run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        self.stop = threading.Event()  # stop taking prompts
        self.stop_signal: str | None = None
        self.stop_at = 0.0
        self.signals = 0
        self.fatal_lock = threading.Lock()
        self.fatal: tuple[int, str] | None = None
        self.fatal_event = threading.Event()
        self.workers_left = 0
        self.workers_lock = threading.Lock()
        self.workers_done = threading.Event()
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.gen_started = self.started  # reset when requests start
        self.model: str | None = args.model
        self.plan: Plan | None = None
        self.stats = Stats(0)
        self.servers = [Server(u) for u in args.servers]
        self.pool = ServerPool(self.servers)
        self.writer: Writer | None = None
        self.lock_fd: int | None = None

    # ---- signals and fatal errors

    def on_signal(self, signum: int, _frame: Any) -> None:
        """Runs in the main thread between two bytecodes, maybe while it holds a lock: so it
        only sets plain attributes (no print, no Event.set, whose lock is not reentrant);
        the main thread polls them (poll_signal). A second signal leaves at once."""
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            msg = f"\n{name} again: exiting at once (exit {128 + signum})\n"
            with contextlib.suppress(OSError):
                os.write(2, msg.encode())
            os._exit(128 + signum)
        self.stop_at = time.monotonic()
        self.stop_signal = name

    def poll_signal(self) -> bool:
        """Main thread: pass a received signal on to the other threads. True when stopping."""
        if self.stop_signal is not None and not self.stop.is_set():
            self.stop.set()
            self.pool.wake_all()
        return self.stop.is_set()

    def signalled(self) -> bool:
        return self.stop_signal is not None

    def fatal_io(self, exc: BaseException, where: str) -> None:
        """Writing the output failed: stop at once (exit 75); a rerun resumes cleanly."""
        if is_disk_full(exc):
            msg = (
                f"output disk full: cannot write to {self.output_dir} ({where}): {exc}. "
                "Free some space and run the same command again: it resumes where it stopped."
            )
        elif isinstance(exc, OSError):
            msg = f"cannot write to the output directory {self.output_dir} ({where}): {exc}"
        else:
            msg = f"writer failed on {where}: {_exc_text(exc)}"
        self.set_fatal(EXIT_DISK_FULL, msg)

    def set_fatal(self, code: int, msg: str) -> None:
        """Stop the run with this exit code. Output errors stop at once; others like SIGTERM
        (requests in flight get --grace seconds to finish and be written)."""
        with self.fatal_lock:
            if self.fatal is not None:
                return
            self.fatal = (code, msg)
        if not self.stop.is_set():
            self.stop_at = time.monotonic()
        self.stop.set()
        if code == EXIT_DISK_FULL:
            self.fatal_event.set()
        self.pool.wake_all()

    # ---- setup

    def lock_output_dir(self) -> None:
        path = os.path.join(self.output_dir, ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    warn(
                        f"warning: cannot lock {path} ({exc}); make sure no other run "
                        "uses this output directory"
                    )
                    self.lock_fd = fd
                    return
                try:
                    other = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
                except OSError:
                    other = "?"
                os.close(fd)
                raise UsageError(
                    f"{self.output_dir} is in use by another run (pid {other or '?'}); "
                    "one run per output directory (give each --shard its own directory)"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd  # held (and the flock with it) until the process exits

    def discover(self) -> bool:
        """Probe every server at once; find the model (first reachable server's data[0].id).

        A server that does not answer quickly does not hold up the others: once one server
        has answered, the rest get half a second, then the probers take over. Returns False
        when stopped before any server answered.
        """
        timeout = min(PROBE_TIMEOUT_S, self.args.request_timeout)
        next_log = time.monotonic()
        while True:
            results = self._probe_all(timeout)
            if results is None:
                return False
            if self.model is None:
                for r in results:
                    if r is not None and r[0]:
                        self.model = r[1][0]
                        log(f"model: {self.model} (from /v1/models)")
                        break
            if self.model is not None:
                break
            now = time.monotonic()
            if now >= next_log:
                why = "; ".join(
                    f"{s.url}: {r[1] if r else 'no answer'}" for s, r in zip(self.servers, results)
                )
                log(f"no server answers /v1/models yet; waiting ({why})")
                next_log = now + self.args.log_interval
            for _ in range(20):
                if self.poll_signal():
                    return False
                time.sleep(0.1)
        for s, r in zip(self.servers, results):
            if r is not None and r[0] and self.model in r[1]:
                self.pool.probe_result(s, True, None)
            else:
                why = "no answer yet" if r is None else r[1]
                if r is not None and r[0]:
                    why = f"serves {r[1]}, not {self.model!r}"
                self.pool.mark_down(s, why)
                log(f"server {s.url} not usable yet: {why}")
        return True

    def _probe_all(self, timeout: float) -> list[Any] | None:
        results: list[Any] = [None] * len(self.servers)

        def one(i: int, s: Server) -> None:
            results[i] = probe(s, self.headers, None, timeout)

        threads = [
            threading.Thread(target=one, args=(i, s), daemon=True)
            for i, s in enumerate(self.servers)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout + 1
        first_ok = None
        while any(t.is_alive() for t in threads):
            if self.poll_signal():
                return None
            now = time.monotonic()
            if first_ok is None and any(r is not None and r[0] for r in results):
                first_ok = now
            if now >= deadline or (first_ok is not None and now - first_ok >= 0.5):
                break
            time.sleep(0.02)
        return list(results)

    # ---- threads

    def feeder(self, jobs: queue.Queue, plan: Plan, opts: dict[str, Any], nworkers: int) -> None:
        try:
            with open(self.args.prompts, "rb") as f:
                for i in range(plan.pending):
                    if self.stop.is_set():
                        break
                    f.seek(plan.offsets[i])
                    raw = f.readline()
                    line_no = plan.lines[i]
                    try:
                        pid, key, kind, payload = parse_prompt_line(raw, line_no)
                    except PromptError:
                        key = None
                    if key is None or id_hash64(key) != plan.hashes[i]:
                        self.set_fatal(
                            EXIT_USAGE,
                            f"the prompt file {self.args.prompts} changed while running "
                            f"(line {line_no} is not what it was); stopping",
                        )
                        break
                    assert self.model is not None
                    path, body = build_body(kind, payload, self.model, opts)
                    job = Job(pid, key, line_no, path, body)
                    while not self.stop.is_set():
                        try:
                            jobs.put(job, timeout=0.5)
                            break
                        except queue.Full:
                            pass
        except OSError as exc:
            self.set_fatal(EXIT_USAGE, f"cannot read {self.args.prompts}: {exc}")
        finally:
            for _ in range(nworkers):
                while True:
                    try:
                        jobs.put(_END, timeout=0.5)
                        break
                    except queue.Full:
                        if self.stop.is_set():
                            return  # workers leave on their own when stopping

    def worker(self, jobs: queue.Queue) -> None:
        client = Client(self.args.request_timeout, self.headers)
        try:
            while not self.stop.is_set():
                try:
                    job = jobs.get(timeout=0.5)
                except queue.Empty:
                    continue
                if job is _END:
                    break
                self.process(client, job)
        except Exception as exc:  # pragma: no cover - a bug must not hang the run
            self.set_fatal(EXIT_USAGE, f"worker crashed: {_exc_text(exc)}")
        finally:
            client.close()
            with self.workers_lock:
                self.workers_left -= 1
                if self.workers_left == 0:
                    self.workers_done.set()

    def process(self, client: Client, job: Job) -> None:
        attempts = 0
        error = ""
        max_attempts = 1 + self.args.max_retries
        while True:
            if self.stop.is_set():
                return  # not done: the next run takes it
            s = self.pool.acquire(self.stop)
            if s is None:
                return
            t0 = time.monotonic()
            try:
                status, data = client.request(s, "POST", job.path, job.body)
            except NotSent as exc:
                self.pool.error(s, str(exc), hard=True)
                continue  # no attempt spent: the server is backed off, try another
            except SentError as exc:
                attempts += 1
                self.stats.add_attempt()
                error = f"{s.url}: {exc}"
                self.pool.error(s, str(exc), hard=exc.hard)
            else:
                attempts += 1
                self.stats.add_attempt()
                latency = time.monotonic() - t0
                if status == 200:
                    try:
                        fields = parse_completion(data)
                        if fields["finish_reason"] == "abort":
                            raise BadResponse("finish_reason abort (request aborted by server)")
                    except BadResponse as exc:
                        error = f"{s.url}: {exc}"
                        self.pool.error(s, str(exc), hard=False)
                    else:
                        self.pool.success(s)
                        self.done(job, fields, s, latency, attempts)
                        return
                elif status in (401, 403):
                    attempts -= 1  # the server's key problem, not the prompt's
                    msg = f"HTTP {status} {_snippet(data, 120)} (check --api-key-env)"
                    self.pool.error(s, msg, hard=True)
                    continue
                elif 400 <= status < 500 and status not in (408, 429):
                    self.pool.answered(s)
                    self.failed(job, f"{s.url}: HTTP {status} {_snippet(data)}", attempts)
                    return
                else:
                    msg = f"HTTP {status} {_snippet(data, 200)}"
                    error = f"{s.url}: {msg}"
                    self.pool.error(s, msg, hard=False)
            finally:
                self.pool.release(s)
            if attempts >= max_attempts:
                self.failed(job, error, attempts)
                return
            if self.stop.wait(
                backoff_seconds(attempts, PROMPT_BACKOFF_BASE_S, PROMPT_BACKOFF_CAP_S)
            ):
                return

    def done(
        self, job: Job, fields: dict[str, Any], s: Server, latency: float, attempts: int
    ) -> None:
        rec = {"id": job.pid}
        rec.update(fields)
        rec["server"] = s.url
        rec["latency_s"] = round(latency, 3)
        rec["attempts"] = attempts
        rec["time"] = utc_now()
        tokens = fields["completion_tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            tokens = 0
        assert self.writer is not None
        self.writer.put_record(job.key, encode_json_line(rec), tokens)

    def failed(self, job: Job, error: str, attempts: int) -> None:
        n = self.stats.add_failed()
        if n <= MAX_FAILURE_LOGS:
            log(f"prompt {job.key!r} (line {job.line}) failed after {attempts} attempt(s): {error}")
        elif n == MAX_FAILURE_LOGS + 1:
            log("more prompts failed: see failed.jsonl (and the progress lines)")
        entry = {
            "id": job.pid,
            "error": error,
            "attempts": attempts,
            "time": utc_now(),
            "run": self.run_id,
        }
        assert self.writer is not None
        self.writer.put_failed(encode_json_line(entry))

    def prober(self, s: Server) -> None:
        """Bring a backed-off server back: probe it once its backoff is over."""
        timeout = min(PROBE_TIMEOUT_S, self.args.request_timeout)
        while not self.workers_done.is_set() and not self.fatal_event.is_set():
            with self.pool.cond:
                due = (not s.up) and time.monotonic() >= s.down_until
                wait = 0.5 if s.up else max(0.02, min(0.5, s.down_until - time.monotonic()))
            if not due:
                self.workers_done.wait(wait)
                continue
            ok, info = probe(s, self.headers, self.model, timeout)
            self.pool.probe_result(s, ok, None if ok else str(info))

    # ---- progress

    def progress(self, state: str) -> dict[str, Any]:
        plan = self.plan
        total = plan.total if plan else 0
        rejected = plan.rejected if plan else 0
        st = self.stats
        rates = st.sample()
        with st.lock:
            done = st.done_before + st.done_run
            failed = st.failed
            attempts = st.attempts
            if rates is None or state != "running":  # short run, or the end: whole-run average
                elapsed = max(1e-6, time.monotonic() - self.gen_started)
                rates = (st.done_run / elapsed, st.tokens_run / elapsed)
        req_rate, tok_rate = rates
        remaining = max(0, total - done)
        to_try = max(0, remaining - failed)
        eta = to_try / req_rate if req_rate > 0 and state == "running" else None
        if state != "running" and to_try == 0:
            eta = 0.0
        return {
            "state": state,
            "total": total,
            "done": done,
            "failed": failed,
            "remaining": remaining,
            "rejected": rejected,
            "tokens_per_s": round(tok_rate, 1),
            "requests_per_s": round(req_rate, 2),
            "eta_s": None if eta is None else round(eta, 1),
            "requests_sent": attempts,
            "started_at": utc_iso(self.started_wall),
            "updated_at": utc_now(),
            "run_id": self.run_id,
            "model": self.model,
            "servers": self.pool.snapshot(),
        }

    def write_progress(self, state: str) -> dict[str, Any]:
        info = self.progress(state)
        body = (json.dumps(info, indent=1) + "\n").encode()
        path = os.path.join(self.output_dir, "progress.json")
        try:
            atomic_write(path, body)
        except OSError as exc:
            if self.fatal is None:
                self.fatal_io(exc, path)
        # Under dflashops, the unit's own progress file is what `dflashops status` shows.
        unit_progress = os.environ.get("DFLASHOPS_PROGRESS_FILE")
        if unit_progress:
            try:
                atomic_write(unit_progress, body)
            except OSError as exc:
                log(f"cannot write {unit_progress}: {exc}")
        return info

    def log_progress(self, info: dict[str, Any]) -> None:
        total = info["total"]
        pct = 100.0 * info["done"] / total if total else 100.0
        up = sum(1 for v in info["servers"].values() if v["up"])
        log(
            f"progress: {fmt_int(info['done'])}/{fmt_int(total)} done ({pct:.1f}%), "
            f"{fmt_int(info['remaining'])} remaining, {fmt_int(info['failed'])} failed, "
            f"{info['requests_per_s']:.1f} req/s, {fmt_int(int(info['tokens_per_s']))} tok/s, "
            f"ETA {fmt_duration(info['eta_s'])}, servers up {up}/{len(info['servers'])}, "
            f"in flight {self.pool.in_flight()}"
        )

    # ---- main

    def execute(self) -> int:
        args = self.args
        os.makedirs(self.output_dir, exist_ok=True)
        self.lock_output_dir()

        done_keys: set[str] = set()
        scan = scan_outputs(self.output_dir, done_keys)
        if scan.duplicates or scan.bad_lines:
            warn(
                f"warning: the output shards hold {scan.duplicates} duplicate record(s) and "
                f"{scan.bad_lines} unreadable line(s); each id counts once (the first)"
            )
        t0 = time.monotonic()
        plan = plan_prompts(
            args.prompts,
            done_keys,
            args.shard,
            os.path.join(self.output_dir, "rejected.jsonl"),
            self.signalled,
        )
        self.plan = plan
        self.stats = Stats(plan.done)
        if self.poll_signal():
            log(f"{self.stop_signal}: stopped before starting")
            self.write_progress("stopped")
            return EXIT_OK
        where = f" in shard {args.shard[0]}/{args.shard[1]}" if args.shard else ""
        log(
            f"prompts: {fmt_int(plan.total)} valid{where}, {fmt_int(plan.rejected)} rejected "
            f"(read in {time.monotonic() - t0:.1f}s); output: {fmt_int(scan.records)} records in "
            f"{scan.shards} shard(s)"
        )
        if plan.total == 0:
            self.write_progress("done")
            if plan.valid_lines == 0 and plan.rejected > 0:
                warn(
                    f"error: no valid prompt in {args.prompts} ({plan.rejected} rejected; "
                    f"see {os.path.join(self.output_dir, 'rejected.jsonl')})"
                )
                return EXIT_USAGE
            log("nothing to do: no prompts" + (where or f" in {args.prompts}"))
            return EXIT_OK
        if plan.pending == 0:
            self.write_progress("done")
            log(f"nothing to do: all {fmt_int(plan.total)} prompts are done already")
            return EXIT_OK
        if plan.done:
            log(
                f"resuming: {fmt_int(plan.done)} done, {fmt_int(plan.pending)} remaining"
                + (f" ({scan.torn} torn line(s) dropped)" if scan.torn else "")
            )
        else:
            log(f"starting: {fmt_int(plan.pending)} prompts to generate")
        if not self.discover():
            log(f"{self.stop_signal}: stopped before starting")
            self.write_progress("stopped")
            return EXIT_OK
        # done_keys becomes the writer's set of ids already written (its duplicate guard).
        return self.generate(plan, done_keys)

    def generate(self, plan: Plan, written: set[str]) -> int:
        args = self.args
        opts = {
            "max_tokens": args.max_output_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "chat_template_kwargs": args.chat_template_kwargs,
        }
        self.gen_started = time.monotonic()
        self.writer = Writer(self, written)
        self.writer.start()
        nworkers = min(args.concurrency, plan.pending)
        jobs: queue.Queue = queue.Queue(maxsize=2 * nworkers + 16)
        self.workers_left = nworkers
        threading.Thread(
            target=self.feeder, args=(jobs, plan, opts, nworkers), name="feeder", daemon=True
        ).start()
        for i in range(nworkers):
            threading.Thread(
                target=self.worker, args=(jobs,), name=f"worker-{i}", daemon=True
            ).start()
        for s in self.servers:
            threading.Thread(target=self.prober, args=(s,), name="prober", daemon=True).start()
        log(
            f"generating with {nworkers} concurrent requests on {len(self.servers)} server(s), "
            f"model {self.model}, run {self.run_id}"
        )

        self.write_progress("running")
        now = time.monotonic()
        next_progress = now + args.progress_interval
        next_log = now + args.log_interval
        next_down_log = now
        announced_stop = False
        abandoned = False
        while not self.workers_done.is_set():
            self.workers_done.wait(0.2)
            if self.fatal_event.is_set():
                break
            now = time.monotonic()
            if self.poll_signal():
                if not announced_stop:
                    announced_stop = True
                    why = (
                        f"received {self.stop_signal}"
                        if self.stop_signal
                        else f"error: {self.fatal[1] if self.fatal else '?'}"
                    )
                    log(
                        f"{why}: taking no new prompts; waiting up to {args.grace:g}s for "
                        f"{self.pool.in_flight()} request(s) in flight "
                        "(send SIGTERM again to exit at once)"
                    )
                    self.pool.wake_all()
                if now - self.stop_at >= args.grace:
                    abandoned = True
                    log(f"grace period over: abandoning {self.pool.in_flight()} request(s)")
                    break
            if now >= next_progress:
                self.write_progress("running")
                next_progress = now + args.progress_interval
            if now >= next_log:
                self.log_progress(self.progress("running"))
                next_log = now + args.log_interval
            if (
                not self.stop.is_set()
                and now >= next_down_log
                and self.pool.up_count() == 0
                and now - self.started > 1.0
            ):
                why = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                log(f"no server is up ({len(self.servers)} down); waiting for one ({why})")
                next_down_log = now + args.log_interval

        # Stop everything still going, then let the writer write what finished.
        self.stop.set()
        self.pool.wake_all()
        self.writer.close_and_wait()
        while self.writer.is_alive():
            self.writer.join(0.2)
        elapsed = time.monotonic() - self.started
        if self.fatal is not None:
            code, state = self.fatal[0], "failed"
        elif self.stop_signal is not None and (abandoned or not self._all_attempted(plan)):
            code, state = EXIT_OK, "stopped"
        elif self.stats.failed:
            code, state = EXIT_FAILED, "failed"
        else:
            code, state = EXIT_OK, "done"
        info = self.write_progress(state)
        if self.fatal is not None:  # maybe the progress write itself hit a full disk
            code, state = self.fatal[0], "failed"
            warn(f"error: {self.fatal[1]}")
        st = self.stats
        log(
            f"summary: {state}; {fmt_int(info['done'])}/{fmt_int(info['total'])} done "
            f"({fmt_int(st.done_run)} this run), {fmt_int(st.failed)} failed, "
            f"{fmt_int(info['rejected'])} rejected, {fmt_int(info['remaining'])} remaining; "
            f"{elapsed:.1f}s, {info['requests_per_s']:.1f} req/s, "
            f"{fmt_int(int(info['tokens_per_s']))} tok/s; "
            f"output {self.output_dir}"
        )
        if self.writer.dropped_duplicates:
            log(f"note: {self.writer.dropped_duplicates} duplicate record(s) were not written")
        if code == EXIT_FAILED:
            log(
                f"{st.failed} prompt(s) failed after all retries (see "
                f"{os.path.join(self.output_dir, 'failed.jsonl')}); run again to retry them"
            )
        elif state == "stopped":
            log("stopped: run the same command again to resume")
        return code

    def _all_attempted(self, plan: Plan) -> bool:
        with self.stats.lock:
            return self.stats.done_run + self.stats.failed >= plan.pending


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return v


def _shard(text: str) -> tuple[int, int]:
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"need 0 <= I < N, got {text!r}")
    return i, n


def _json_object(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object: {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="generate_completions.py",
        description="Resumable multi-server completions generator (dflashops payload). "
        "Exit codes: 0 done/stopped, 1 usage or input error, 3 prompts failed after retries, "
        "75 output disk full, 130/143 second signal.",
        allow_abbrev=False,
    )
    p.add_argument("--prompts", required=True, help="input JSONL: {id, messages|prompt}")
    p.add_argument("--servers", required=True, nargs="+", metavar="URL")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-output-tokens", type=_positive_int, default=4096)
    p.add_argument("--concurrency", type=_positive_int, default=48)
    p.add_argument("--temperature", type=_nonneg_float, default=None)
    p.add_argument("--top-p", type=_positive_float, default=None)
    p.add_argument("--model", default=None, help="default: data[0].id of /v1/models")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON")
    p.add_argument("--request-timeout", type=_positive_float, default=1800.0, metavar="S")
    p.add_argument("--max-retries", type=_nonneg_int, default=5)
    p.add_argument("--shard", type=_shard, default=None, metavar="I/N")
    p.add_argument("--api-key-env", default=None, metavar="VAR")
    p.add_argument("--progress-interval", type=_positive_float, default=5.0, metavar="S")
    p.add_argument("--log-interval", type=_positive_float, default=30.0, metavar="S")
    p.add_argument("--grace", type=_nonneg_float, default=30.0, metavar="S")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    try:
        if len(set(args.servers)) != len(args.servers):
            raise UsageError("--servers lists the same URL twice")
        if args.api_key_env:
            key = os.environ.get(args.api_key_env, "")
            if not key:
                raise UsageError(f"--api-key-env {args.api_key_env}: that variable is not set")
            headers["Authorization"] = f"Bearer {key}"
        if not os.path.isfile(args.prompts):
            what = "does not exist" if not os.path.exists(args.prompts) else "is not a file"
            raise UsageError(f"prompt file {args.prompts} {what}")
        if not os.access(args.prompts, os.R_OK):
            raise UsageError(f"prompt file {args.prompts} is not readable")
        run = Run(args, headers)
    except UsageError as exc:
        warn(f"error: {exc}")
        return EXIT_USAGE
    signal.signal(signal.SIGTERM, run.on_signal)
    signal.signal(signal.SIGINT, run.on_signal)
    try:
        return run.execute()
    except UsageError as exc:
        warn(f"error: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        if is_disk_full(exc):
            warn(f"error: output disk full: cannot write to {args.output_dir}: {exc}")
            return EXIT_DISK_FULL
        if exc.filename is not None and os.path.abspath(str(exc.filename)) == os.path.abspath(
            args.prompts
        ):
            warn(f"error: cannot read the prompt file: {exc}")
            return EXIT_USAGE
        warn(f"error: output directory {args.output_dir}: {exc}")
        return EXIT_USAGE


if __name__ == "__main__":
    _code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # Daemon threads may still sit in a socket read (abandoned after --grace): leave now.
        os._exit(_code)
