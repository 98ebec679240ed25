"""``probe``: process state, health, identity, metrics, banner and (for a dead unit) its log
tail; with ``gpus``, nvidia-smi too: everything `status` and `top` show, in one call.

Request: ``units: [{name, host, port, health_path, identity_paths, metrics_path, headers}]``
(``port`` or ``health_path`` null: process and log only), ``http_timeout`` (s, 5),
``log_lines`` (30), ``gpus`` (bool). Answer: ``units: {name: {alive, ours, pid, started_at,
reason, log, exit, stopped, crashed, supervisor, progress, health, identity, metrics, banner,
server_args, log_tail, errors}}``, ``gpus``, ``time``. Every unit is probed at once; the call
takes about one ``http_timeout`` however many units hang. Metrics are fetched, not parsed: the
controller reads them with prometheus_client.
"""

from __future__ import annotations

import json
import os
import time

from . import gpu, layout, logs, ownership, procfs, web
from .common import (
    BadRequest,
    Json,
    describe,
    integer,
    number,
    read_json_object,
    unit_list,
)

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

BODY_MAX = 256 * 1024  # identity answers
RECORDS = (
    ("exit", layout.EXIT),
    ("stopped", layout.STOPPED),
    ("crashed", "crashed"),
    ("supervisor", layout.SUPERVISOR),
    ("progress", layout.PROGRESS),
    ("pid_record", layout.PID),
)
METRICS_MAX = 2 * 1024 * 1024


def check(request: Json) -> None:
    for i, u in enumerate(unit_list(request)):
        u.setdefault("host", "127.0.0.1")
        if not isinstance(u["host"], str) or not u["host"]:
            raise BadRequest(f"units[{i}].host must be a non-empty string")
        u["port"] = None if u.get("port") is None else integer(u["port"], f"units[{i}].port", 1)
        health = u.setdefault("health_path", "/health")
        if health is not None and (not isinstance(health, str) or not health.startswith("/")):
            raise BadRequest(f"units[{i}].health_path must start with / (or be null)")
        paths = u.setdefault("identity_paths", [])
        if not isinstance(paths, list) or not all(
            isinstance(p, str) and p.startswith("/") for p in paths
        ):
            raise BadRequest(f"units[{i}].identity_paths must be a list of paths")
        metrics = u.setdefault("metrics_path", None)
        if metrics is not None and (not isinstance(metrics, str) or not metrics.startswith("/")):
            raise BadRequest(f"units[{i}].metrics_path must start with / (or be null)")
        headers = u.setdefault("headers", {})
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise BadRequest(f"units[{i}].headers must map strings to strings")
    request["http_timeout"] = number(request.get("http_timeout", 5), "http_timeout", 0.05)
    request["log_lines"] = integer(request.get("log_lines", 30), "log_lines")


def wants_http(spec: Json) -> bool:
    return spec["port"] is not None and spec["health_path"] is not None


def probe_http(spec: Json, timeout: float, slot: Json) -> None:
    """Health, then identity; results land in ``slot`` as they come (the caller may give up)."""
    deadline = time.monotonic() + timeout
    host, port, headers = spec["host"], spec["port"], spec["headers"]
    got = web.request(host, port, spec["health_path"], timeout=timeout, headers=headers)
    slot["health"] = {"status": got["status"], "error": got["error"]}
    if spec["metrics_path"] and got["status"] is not None:
        left = max(0.05, deadline - time.monotonic())
        found = web.request(
            host, port, spec["metrics_path"], timeout=left, limit=METRICS_MAX, headers=headers
        )
        body = found["body"] or b""
        if found["status"] == 200 and len(body) <= METRICS_MAX:
            slot["metrics"] = body.decode("utf-8", "replace")
    if got["status"] != 200 or not spec["identity_paths"]:
        return
    identity: Json = {"path": None, "status": None, "body": None, "error": None}
    failures = []
    for path in spec["identity_paths"]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            failures.append(f"{path}: timed out")
            break
        got = web.request(host, port, path, timeout=remaining, limit=BODY_MAX, headers=headers)
        identity.update(path=path, status=got["status"])
        if got["status"] != 200:
            failures.append(f"{path}: {got['error'] or got['status']}")
            continue
        body = got["body"] or b""
        if len(body) > BODY_MAX:
            identity["error"] = f"{path}: body larger than {BODY_MAX // 1024} KiB"
        else:
            try:
                identity["body"] = json.loads(body.decode("utf-8", "replace"))
            except ValueError as exc:
                identity["error"] = f"{path}: not JSON ({exc})"
        slot["identity"] = identity
        return
    identity["error"] = "; ".join(failures) or "no identity path answered"
    slot["identity"] = identity


def unit_files(
    folder: str, record: tuple[Any, Any], boot: str | None, groups: ownership.Groups, log_lines: int
) -> Json:
    """Process (the ownership rule), exit/stopped records, banner, and unless the unit runs,
    the end of its log."""
    rec, problem = record
    view = ownership.view(rec, problem, boot, groups)
    out: Json = {
        "alive": view["alive"],
        "ours": view["ours"],
        "pid": view["pid"],
        "started_at": None,
        "reason": view["reason"],
        "log": None,
        "exit": None,
        "stopped": None,
        "crashed": None,
        "supervisor": None,
        "progress": None,
        "banner": None,
        "server_args": None,
        "log_tail": None,
        "errors": [],
    }
    for key, filename in RECORDS:
        try:
            out[key] = read_json_object(os.path.join(folder, filename))
        except (OSError, ValueError) as exc:
            out["errors"].append(f"{key}: {exc}")
    pid_record = out.pop("pid_record", None) or {}
    out["started_at"] = pid_record.get("started_at")
    out["log"], path = logs.current(folder)
    if path is not None:
        try:
            out["banner"] = logs.read_banner(path)
            out["server_args"] = logs.read_server_args(path)
            restarting = (out["supervisor"] or {}).get("state") in ("backoff", "waiting-gpu")
            if not (view["alive"] and view["ours"]) or restarting:  # down: its log says why
                data, _ = logs.tail_bytes(path, log_lines)
                out["log_tail"] = data.decode("utf-8", "replace").splitlines()
        except OSError as exc:
            out["errors"].append(f"{out['log']}: {describe(exc)}")
    return out


def run(request: Json) -> Json:
    import threading

    started = time.monotonic()
    timeout = float(request["http_timeout"])
    gpus: Json = {}
    gpus_thread = None
    if request.get("gpus"):  # nvidia-smi is slow: it runs while the units are probed
        gpus_thread = threading.Thread(
            target=lambda: gpus.update(found=gpu.gather(max(1.0, timeout))), daemon=True
        )
        gpus_thread.start()
    units = probe_units(request["workdir"], request["units"], timeout, request["log_lines"])
    if gpus_thread is not None:
        gpus_thread.join()
    out: Json = {"units": units, "time": time.time(), "gpus": gpus.get("found")}
    out["elapsed_s"] = round(time.monotonic() - started, 3)
    return out


def probe_units(
    workdir: str,
    specs: list[Json],
    timeout: float,
    log_lines: int,
    groups: ownership.Groups | None = None,
) -> Json:
    """{name: probe} for checked ``specs``; ``groups`` from a /proc pass the caller made (facts)
    saves another. Every unit's HTTP runs at once: about one ``timeout`` however many hang."""
    import threading

    started = time.monotonic()
    boot = procfs.boot_id()
    slots: dict[str, Json] = {s["name"]: {} for s in specs}

    def one(spec: Json) -> None:
        try:
            probe_http(spec, timeout, slots[spec["name"]])
        except Exception as exc:
            slots[spec["name"]].setdefault("health", {"status": None, "error": describe(exc)})

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in specs if wants_http(s)]
    for t in threads:
        t.start()
    units: Json = {}
    folders = {s["name"]: layout.unit_dir(workdir, s["name"]) for s in specs}
    records: dict[str, tuple[Any, Any]] = {}
    for name, folder in folders.items():
        try:
            records[name] = ownership.load_record(folder)
        except Exception as exc:
            records[name] = (None, describe(exc))
    if groups is None:
        groups = ownership.group_scan([r for r, _ in records.values() if r is not None])
    for spec in specs:
        try:
            units[spec["name"]] = unit_files(
                folders[spec["name"]], records[spec["name"]], boot, groups, log_lines
            )
        except Exception as exc:
            units[spec["name"]] = {"alive": False, "ours": False, "pid": None, "exit": None}
            units[spec["name"]].update(banner=None, log_tail=None, errors=[describe(exc)])
    give_up = started + timeout + 0.5
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    for spec in specs:
        unit = units[spec["name"]]
        slot = dict(slots[spec["name"]])  # a snapshot: a late thread may still write
        unit["health"] = unit["identity"] = unit["metrics"] = None
        if not wants_http(spec):
            continue
        unit["metrics"] = slot.get("metrics")
        unit["health"] = slot.get("health") or {"status": None, "error": "timed out"}
        if unit["health"]["status"] == 200 and spec["identity_paths"]:
            unit["identity"] = slot.get("identity") or {
                "path": None,
                "status": None,
                "body": None,
                "error": "timed out",
            }
    return units
