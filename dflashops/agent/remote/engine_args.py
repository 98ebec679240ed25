"""``engine_args``: the engines installed on this host judge units' command lines (parse only).

Request: ``workdir``, ``payload`` (the text of dflashops' builtins/engine_args.py, run with
``python -c``), ``groups`` [{python, engines: {ENGINE: [ARGV, ...]}}]: one group per python (an
environment's, or the host's for units without one), ``timeout`` (s, for each group).

Answer: ``groups`` [{python, ok, answer, error, seconds}] in the request's order: ``answer`` is
the payload's own JSON (see its docstring) when it gave one, else ``error`` says why (python
missing, a crash, out of time). One process per group, all at once: an engine's import alone
takes 5-15 s. Nothing is written on the host; the engines load no model and touch no GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time

from .common import BadRequest, Json, describe, number

ANSWER_MAX = 4 * 1024 * 1024  # the payload's answer is a few KiB; anything past this is not it


def check(request: Json) -> None:
    if not isinstance(request.get("payload"), str) or not request["payload"]:
        raise BadRequest("payload must be the parser payload's text")
    groups = request.get("groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("python"), str)
        and g["python"]
        and isinstance(g.get("engines"), dict)
        for g in groups
    ):
        raise BadRequest("groups must be a list of {python, engines}")
    request["timeout"] = number(request.get("timeout", 300.0), "timeout", 1.0)


def tail_text(data: bytes, lines: int = 5) -> str:
    text = data.decode("utf-8", "replace").strip()
    return "\n".join(text.splitlines()[-lines:])


def one(group: Json, payload: str, timeout: float) -> Json:
    python = os.path.expanduser(group["python"])
    out: Json = {"python": group["python"], "ok": False, "answer": None, "error": None}
    started = time.monotonic()
    request = json.dumps({"engines": group["engines"]}).encode()
    try:
        # Its own session: a timeout takes down whatever the engine started on import.
        proc = subprocess.Popen(
            [python, "-c", payload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        out["error"] = f"cannot run {python}: {describe(exc)}"
        return out
    try:
        stdout, stderr = proc.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):  # gone already
            os.killpg(proc.pid, 9)
        proc.wait()
        out["error"] = f"{python} did not finish parsing within {timeout:g}s"
        return out
    finally:
        out["seconds"] = round(time.monotonic() - started, 3)
    lines = stdout[:ANSWER_MAX].strip().splitlines()
    try:
        answer = json.loads(lines[-1].decode("utf-8")) if lines else None
    except ValueError:
        answer = None
    if proc.returncode == 0 and isinstance(answer, dict):
        out["ok"], out["answer"] = True, answer
    else:
        why = tail_text(stderr) or tail_text(stdout) or "no output"
        out["error"] = f"{python} exited with status {proc.returncode}: {why}"
    return out


def run(request: Json) -> Json:
    groups = request["groups"]
    results: list[Json] = [{} for _ in groups]

    def job(i: int) -> None:
        try:
            results[i] = one(groups[i], request["payload"], request["timeout"])
        except Exception as exc:
            results[i] = {"python": groups[i]["python"], "ok": False, "error": describe(exc)}

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"groups": results}
