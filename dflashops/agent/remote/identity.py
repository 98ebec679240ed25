"""The node's identity: a random id written once in the workdir (``node.json``, 0600) when a
deploy first holds the host's lock there, and read by every facts call (one small file).

With the boot id (``procfs.boot_id``) it is how the controller tells a host that was
re-provisioned (the id is gone: the workdir was emptied, or another machine answers under the
same name) from one that rebooted (same id, new boot id) and from one that is unreachable. An
id that reads back is never rewritten: a new id means a new node. The id is made here and lands
through the one verified writer (``write``: a temporary file, its sha256 checked, a rename).
"""

from __future__ import annotations

import os
import re

from .common import Json, describe, now_iso, read_json_object

NODE_FILE = "node.json"
NODE_MAX = 4096  # bytes: anything bigger is not ours
ID_RE = re.compile(r"^[0-9a-f]{32}$")


def path(workdir: str) -> str:
    return os.path.join(workdir, NODE_FILE)


def read(workdir: str) -> str | None:
    """The node id; None when ``node.json`` is absent; ValueError when it holds no id of ours."""
    record = read_json_object(path(workdir), NODE_MAX)
    if record is None:
        return None
    node = record.get("node_id")
    if not isinstance(node, str) or not ID_RE.match(node):
        raise ValueError(f"{NODE_FILE}: no node id in it (got {str(node)[:40]!r})")
    return node


def ensure(workdir: str) -> Json:
    """``{"node_id": ID}``, written now when ``node.json`` is absent or unreadable; or
    ``{"node_error": why}`` when it cannot be written (the deploy goes on: only the host's
    identity is unknown until the next one)."""
    try:
        node = read(workdir)
    except (OSError, ValueError):
        node = None  # broken: replaced, so the host has an identity again
    if node is not None:
        return {"node_id": node}
    import hashlib
    import io
    import json
    import socket

    from . import write

    node = os.urandom(16).hex()
    body = json.dumps(
        {"node_id": node, "created_at": now_iso(), "hostname": socket.gethostname()}
    ).encode()
    entry = {
        "path": path(workdir),
        "size": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "mode": 0o600,
    }
    try:
        got = write.run({"workdir": workdir, "files": [entry]}, io.BytesIO(body))
    except Exception as exc:  # the lock is held already: say why, do not lose it
        return {"node_error": f"{path(workdir)}: {describe(exc)}"}
    if not got["ok"]:
        out: Json = {"node_error": got["error"]}
        if got.get("interrupted"):
            out["interrupted"] = True  # a signal asked the agent to end (main.serve)
        return out
    return {"node_id": node}
