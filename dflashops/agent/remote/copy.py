"""``copy``: make ``dest`` hold what a path on this host holds (``host:`` sources: disk to RAM
disk), or what a hub repository holds at a revision (``hf:`` sources: downloaded first by
huggingface_hub's own ``hf`` CLI into the host's cache; the snapshot folder is read from what
it prints, which differs between its versions).

Request: ``dest``, ``src`` (a path) or ``hub {repo, revision}``, ``secrets`` (env for the hub
CLI: HF_TOKEN), ``delete``, ``mode``, ``hub_timeout``. Answer: ``{ok, copied, bytes, deleted,
digest, src_digest, origin, error}``. Only what differs is copied; every file goes through a
partial file beside its target, is verified against the source's sha256 and renamed; free
space at dest is checked against what is to be written before anything is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

from . import tree
from .common import (
    BadRequest,
    Json,
    describe,
    host_path,
    integer,
    number,
    remove,
    which,
    write_atomic,
)

CHUNK = 1 << 20
TAIL = 4000
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def check(request: Json) -> None:
    host_path(request, "dest")
    host_path(request, "src", optional=True)
    hub = request.get("hub")
    if (request.get("src") is None) == (hub is None):
        raise BadRequest("copy needs exactly one of src or hub")
    if hub is not None and not (isinstance(hub, dict) and isinstance(hub.get("repo"), str)):
        raise BadRequest("hub must be {repo, revision}")
    secrets = request.setdefault("secrets", {})
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        raise BadRequest("secrets must map names to strings")
    if request.get("mode") is not None:
        integer(request["mode"], "mode")
    request["hub_timeout"] = number(request.get("hub_timeout", 3600), "hub_timeout", 1)


def hf_cli() -> str | None:
    """huggingface_hub's `hf`: the one on PATH, else the one beside this python."""
    beside = os.path.join(os.path.dirname(sys.executable), "hf")
    return which("hf") or (beside if os.access(beside, os.X_OK) else None)


def download(hub: Json, secrets: Json, timeout: float) -> tuple[str | None, str | None]:
    """(snapshot folder, None) or (None, why): `hf download REPO --revision REV`."""
    exe = hf_cli()
    if exe is None:
        return (
            None,
            "the hub CLI `hf` is not on the host's PATH nor beside its python (pip install huggingface_hub)",
        )
    argv = [exe, "download", hub["repo"]]
    if hub.get("revision"):
        argv += ["--revision", hub["revision"]]
    env = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1", **secrets)
    try:
        proc = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"`hf download {hub['repo']}` did not finish in {timeout:g}s"
    out = proc.stdout.decode("utf-8", "replace").strip()
    err = proc.stderr.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        text = ANSI.sub("", err or out)  # the CLI colors its errors even off a terminal
        for secret in secrets.values():
            text = text.replace(secret, "***") if len(secret) >= 4 else text
        return None, f"`hf download {hub['repo']}` failed (exit {proc.returncode}):\n{text[-TAIL:]}"
    path = snapshot_folder(out)
    if path is None:
        return None, f"`hf download` printed no snapshot folder (its output: {out[-400:]!r})"
    return path, None


def snapshot_folder(stdout: str) -> str | None:
    """The folder `hf download` downloaded into: the last line of stdout that names an existing
    folder, bare (huggingface_hub 0.x, ``--quiet``) or as ``path: /...`` after ``✓ Downloaded``
    (1.x and 2.x, colored or not)."""
    for line in reversed(stdout.splitlines()):
        text = ANSI.sub("", line).strip()
        if text.lower().startswith("path:"):
            text = text[len("path:") :].strip()
        if os.path.isabs(text) and os.path.isdir(text):
            return text
    return None


def copy_one(src: str, dest: str, sha: str, mode: int) -> str | None:
    part = tree.part_name(dest, sha)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(part, "wb") as fout:
            while True:
                chunk = fin.read(CHUNK)
                if not chunk:
                    break
                fout.write(chunk)
                h.update(chunk)
        if h.hexdigest() != sha:
            remove(part)
            return f"changed while it was copied (sha256 {h.hexdigest()}, scanned {sha})"
        os.chmod(part, mode)
        os.replace(part, dest)
    except OSError as exc:
        remove(part)
        return describe(exc)
    return None


def run(request: Json) -> Json:
    workdir, dest = request["workdir"], request["dest"]
    out: Json = {"ok": False, "copied": [], "bytes": 0, "deleted": [], "digest": None}
    out.update(src_digest=None, origin=None, error=None, failed={})
    src: str = request.get("src") or ""
    if request.get("hub") is not None:
        snapshot, why = download(request["hub"], request["secrets"], request["hub_timeout"])
        if snapshot is None:
            out["error"] = why
            return out
        src = snapshot
        out["origin"] = dict(request["hub"], commit=os.path.basename(src.rstrip("/")))
    source = tree.scan(src, tree.cache_path(workdir, "src", src))
    if not source["exists"]:
        out["error"] = f"the source {src} does not exist on this host"
        return out
    cache = tree.cache_path(workdir, "dest", dest)
    have = tree.scan(dest, cache)
    todo = [rel for rel, entry in source["files"].items() if have["files"].get(rel) != entry]
    need = sum(source["files"][rel][0] for rel in todo)
    space = tree.free_bytes(dest)
    out["src_digest"] = source["digest"]
    if space["free_bytes"] < need:
        out["error"] = (
            f"{need} bytes to write to {dest} but only {space['free_bytes']} free at "
            f"{space['path']}: nothing written"
        )
        return out
    written: dict[str, str] = {}
    for rel in todo:
        size, sha = source["files"][rel]
        from_path = os.path.join(src, rel) if rel else src
        mode = request.get("mode") or (os.stat(from_path).st_mode & 0o777)
        why = copy_one(from_path, tree.target(dest, rel), sha, mode)
        if why:
            out["failed"][rel] = why
        else:
            written[rel] = sha
            out["bytes"] += size
    if request.get("delete"):
        for rel in sorted(set(have["files"]) - set(source["files"])):
            os.unlink(tree.target(dest, rel))
            out["deleted"].append(rel)
    tree.remember(cache, dest, written, out["deleted"])
    out["copied"] = sorted(written)
    out["digest"] = tree.scan(dest, cache)["digest"]
    if out["origin"] is not None:
        origin = dict(out["origin"], digest=out["digest"])
        write_atomic(tree.cache_path(workdir, "origin", dest), json.dumps(origin).encode())
    out["ok"] = not out["failed"]
    if out["failed"]:
        out["error"] = "; ".join(f"{rel or dest}: {why}" for rel, why in out["failed"].items())
    return out
