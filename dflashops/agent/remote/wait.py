"""``wait``: wait on the host until each unit given is ready, has died, or is out of time.

Request: ``units`` (probe specs, see probe.py, each with ``timeout_s``: how long the controller
still waits for it), ``poll`` (s between checks, 0.25), ``report_every`` (s, 2),
``http_timeout`` (s, 5), ``log_lines`` (30). Answer: a stream of lines, each ``{schema, action,
units: {name: probe}, done: [names], final, time}``: one with the full probes as soon as a unit
may be done, a heartbeat with no probes (``units: {}``) when ``report_every`` seconds went by
without one, the last with ``final: true``. A unit is done when it is not running as ours (or its supervisor is restarting
it), when its health answers 200 (or, with no health check, its launch banner is in its log),
or when its time is up: the
controller's own rules, read from the same full probe it is sent, so the two never disagree.
A unit with ``hold: true`` is done only when it is not running as ours (or is being restarted)
or out of time: a rank that has no readiness of its own, watched while its unit gets ready.

Between lines each check is cheap (pid record, the leader's /proc stat, supervisor.json, one
HTTP GET per unit, all at once); the full probe (a /proc pass, identity, log tail) is made only
for a line. When stdin ends (the controller went away: Ctrl-C, a dropped link) it stops at once.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

from . import layout, logs, ownership, probe, procfs, web
from .common import BadRequest, Json, number, read_json_object

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

RESTARTING = ("backoff", "waiting-gpu")


def check(request: Json) -> None:
    probe.check(request)
    for i, u in enumerate(request["units"]):
        u["timeout_s"] = number(u.get("timeout_s", 1200), f"units[{i}].timeout_s")
        u["hold"] = bool(u.get("hold", False))
    request["poll"] = number(request.get("poll", 0.25), "poll", 0.01)
    request["report_every"] = number(request.get("report_every", 2.0), "report_every", 0.1)
    if not request["units"]:
        raise BadRequest("units must not be empty")


def done(spec: Json, p: Json, late: bool) -> bool:
    if not (p.get("alive") and p.get("ours")):
        return True
    if ((p.get("supervisor") or {}).get("state")) in RESTARTING:
        return True
    if spec["hold"]:  # watched while it lives: only its death (or the time) ends its wait
        return late
    if not probe.wants_http(spec):  # launched: launch.sh has written its banner
        return p.get("banner") is not None or late
    return ((p.get("health") or {}).get("status")) == 200 or late


def quick(workdir: str, spec: Json, boot: str | None, timeout: float) -> bool:
    """Whether the unit may be done: its leader is not ours and alive, its supervisor is
    restarting it, or its health answers 200. No /proc pass, no identity, no log."""
    folder = layout.unit_dir(workdir, spec["name"])
    try:
        rec, _ = ownership.load_record(folder)
        if rec is None or ownership.leader_state(rec, boot) != "alive":
            return True
        state = (read_json_object(os.path.join(folder, layout.SUPERVISOR)) or {}).get("state")
    except (OSError, ValueError):
        return True
    if state in RESTARTING:
        return True
    if spec["hold"]:
        return False
    if not probe.wants_http(spec):
        try:
            _, path = logs.current(folder)
            return path is not None and logs.read_banner(path) is not None
        except OSError:
            return False  # the full probe (for the next line) says why
    got = web.request(
        spec["host"], spec["port"], spec["health_path"], timeout=timeout, headers=spec["headers"]
    )
    return bool(got["status"] == 200)


def quick_all(workdir: str, specs: list[Json], boot: str | None, timeout: float) -> bool:
    """True when some unit may be done (checked at once, in threads: a hung one costs one
    ``timeout``, not one per unit)."""
    import threading

    hits: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda s=s: hits.append(quick(workdir, s, boot, timeout)), daemon=True
        )
        for s in specs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return any(hits) or len(hits) < len(specs)


def stdin_ended(stdin: Any, seconds: float) -> bool:
    """Sleep up to ``seconds``; True as soon as stdin ends (nothing else is ever sent)."""
    try:
        ready, _, _ = select.select([stdin], [], [], seconds)
    except (OSError, ValueError):
        time.sleep(seconds)
        return False
    if not ready:
        return False
    try:
        return os.read(stdin.fileno(), 4096) == b""
    except OSError:
        return True


def emit(line: Json) -> bool:
    try:
        sys.stdout.write(json.dumps(line, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        return False
    return True


def run(request: Json, stdin: Any) -> Json:
    """Streams lines (see above) and returns the final one for main to print."""
    from .main import SCHEMA

    workdir = request["workdir"]
    started = time.monotonic()
    deadline = {u["name"]: started + u["timeout_s"] for u in request["units"]}
    pending = {u["name"]: u for u in request["units"]}
    poll, every = request["poll"], request["report_every"]
    http_timeout, log_lines = request["http_timeout"], request["log_lines"]
    boot = procfs.boot_id()
    last_line = started
    check_now = True  # the first full probe is made at once
    while True:
        now = time.monotonic()
        late = any(now >= deadline[n] for n in pending)
        if not (check_now or late) and now - last_line >= every:
            # A heartbeat: the controller shows progress from what it knows and honours
            # Ctrl-C; a full probe of every pending unit would cost the host its CPU for it.
            beat: Json = {"units": {}, "done": [], "final": False, "time": time.time()}
            if not emit({"schema": SCHEMA, "action": "wait", **beat}):
                return beat
            last_line = now
        elif check_now or late:
            specs = list(pending.values())
            probes = probe.probe_units(workdir, specs, http_timeout, log_lines)
            now = time.monotonic()
            finished = [
                s["name"] for s in specs if done(s, probes[s["name"]], now >= deadline[s["name"]])
            ]
            for name in finished:
                del pending[name]
            line: Json = {
                "units": probes,
                "done": finished,
                "final": not pending,
                "time": time.time(),
            }
            if not pending:
                return line
            if not emit({"schema": SCHEMA, "action": "wait", **line}):
                return line  # nobody reads any more
            last_line = now
        wait_for = min(poll, max(0.0, min(deadline[n] for n in pending) - time.monotonic()))
        if stdin_ended(stdin, wait_for):
            sys.exit(0)  # the controller is gone: nothing to answer
        check_now = quick_all(workdir, list(pending.values()), boot, min(http_timeout, 2.0))
