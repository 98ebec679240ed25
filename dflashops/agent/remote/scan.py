"""``scan``: one tree's manifest (``tree.scan``, with the cache kept under WORKDIR/files/), and
optionally the state of a job on this host: what a relay needs to know of its source host
before it copies (``after: HOST/JOB``: nothing is copied from a job that is not done).

Request: ``root``, ``cache`` ("src" or "dest"), ``listing`` (send the files, not only the
digest), ``job``. Answer: ``{tree {exists, kind, digest, files?, parts?}, job {state, exit,
progress}}``.
"""

from __future__ import annotations

import os

from . import layout, ownership, procfs, tree
from .common import BadRequest, Json, host_path, read_json_object, unit_name


def check(request: Json) -> None:
    host_path(request, "root", optional=True)  # null: the job only
    if request.setdefault("cache", "src") not in ("src", "dest"):
        raise BadRequest("cache must be src or dest")
    if request.get("job") is not None:
        unit_name(request["job"], "job")


def job_state(workdir: str, name: str) -> Json:
    """never | running | done | failed | stopped, from the unit's own records."""
    folder = layout.unit_dir(workdir, name)
    out: Json = {"state": "never", "exit": None, "progress": None}
    if not os.path.isdir(folder):
        return out
    records = {}
    for key, filename in (
        ("exit", layout.EXIT),
        ("stopped", layout.STOPPED),
        ("progress", layout.PROGRESS),
    ):
        try:
            records[key] = read_json_object(os.path.join(folder, filename))
        except (OSError, ValueError):
            records[key] = None
    rec, problem = ownership.load_record(folder)
    view = ownership.view(
        rec, problem, procfs.boot_id(), ownership.group_scan([rec] if rec else [])
    )
    out["exit"], out["progress"] = records["exit"], records["progress"]
    code = (records["exit"] or {}).get("code")
    if view["alive"] and view["ours"]:
        out["state"] = "running"
    elif records["stopped"] is not None:
        out["state"] = "stopped"
    elif code is not None:
        out["state"] = "done" if code == 0 else "failed"
    return out


def run(request: Json) -> Json:
    out: Json = {"tree": None, "job": None}
    if request.get("root"):
        cache = tree.cache_path(request["workdir"], request["cache"], request["root"])
        found = tree.scan(request["root"], cache)
        if not request.get("listing", True):
            found = {k: v for k, v in found.items() if k not in ("files", "parts")}
        out["tree"] = found
    if request.get("job"):
        out["job"] = job_state(request["workdir"], request["job"])
    return out
