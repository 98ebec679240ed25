"""Entry point: one request in, one JSON answer out.

``python BUNDLE`` (or the bundle fed to ``python -c`` on stdin) reads one JSON line from stdin,
``{"action": ..., "workdir": ..., ...}``; anything after that line is the action's data (the
bytes ``write`` receives). It prints exactly one line ``{"schema": SCHEMA, "action": ...,
...answer}`` and exits 0, even when single units fail (their ``ok``/``error`` say why), and
exits 2 with the reason on stderr only for a malformed request.
``python BUNDLE supervise UNIT_DIR`` runs a unit's supervisor instead.

A first line ``{"action": "serve"}`` keeps the agent: each following line is a request
(``SERVED``: those whose data, if any, is sized by the request) answered by one line (``wait``:
its lines), until stdin ends. A deploy sends a host's facts, write, stop, start and wait over
one such session, and `top` its refreshes: one interpreter and one channel, not one per call.
A deploy's session takes the host's deploy lock first (``lock``) and holds it until it ends.
A malformed request then gets an ``{"error": ...}`` line and ends the session (exit 2): what
follows it on stdin cannot be told from the next request.
"""

from __future__ import annotations

import json
import os
import sys

from .common import BadRequest, Json

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

SCHEMA = 2
SERVED = (
    "facts",
    "probe",
    "tail",
    "scan",
    "write",
    "start",
    "stop",
    "wait",
    "lock",
    "engine_args",
    "history",
    "job_metrics",
)
ACTIONS = (
    "facts",
    "start",
    "stop",
    "probe",
    "tail",
    "write",
    "scan",
    "receive",
    "send",
    "copy",
    "build",
    "wait",
    "rendezvous",
    "lock",
    "engine_args",
    "keep",
    "history",
    "job_metrics",
)


def parse(line: bytes) -> Json:
    if not line.strip():
        raise BadRequest("no request given")
    try:
        request = json.loads(line.decode("utf-8"))
    except ValueError as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest("the request must be a JSON object")
    action = request.get("action")
    if action == "serve":
        request.setdefault("workdir", "/")
        return request
    if action not in ACTIONS:
        raise BadRequest(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    workdir = request.get("workdir")
    if not isinstance(workdir, str) or not workdir.strip():
        raise BadRequest("workdir must be a non-empty string")
    request["workdir"] = os.path.abspath(os.path.expanduser(workdir))
    return request


def handle(request: Json, stdin: Any) -> Json:
    """Validate the action's own fields, then run it (modules load only when used)."""
    import importlib

    action = request["action"]
    module = importlib.import_module(f"{__package__}.{action}")
    module.check(request)
    answer: Json = {"schema": SCHEMA, "action": action}
    # Actions whose data follows the request on stdin take it as a second argument.
    takes_data = action in ("write", "receive", "wait")
    answer.update(module.run(request, stdin) if takes_data else module.run(request))
    return answer


def main(argv: list[str]) -> int:
    if argv[:1] == ["supervise"] and len(argv) in (2, 3):
        from . import supervisor

        keep = int(argv[2]) if len(argv) == 3 and argv[2].isdigit() else 20
        return supervisor.main(os.path.abspath(argv[1]), keep)
    stdin = sys.stdin.buffer
    try:
        request = parse(stdin.readline())
        if request["action"] == "serve":
            return serve(stdin)
        answer = handle(request, stdin)
    except BadRequest as exc:
        sys.stderr.write(f"dflashops agent: bad request: {exc}\n")
        return 2
    reply(answer)
    return 0


def reply(answer: Json) -> None:
    sys.stdout.write(json.dumps(answer, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def serve(stdin: Any) -> int:
    """Answer request lines until stdin ends (the controller closed the session)."""
    for line in iter(stdin.readline, b""):
        try:
            request = parse(line)
            if request["action"] not in SERVED:
                raise BadRequest(f"{request['action']} is not served in a session")
            answer = handle(request, stdin)
            reply(answer)
            if answer.get("interrupted"):
                return 1  # a signal asked the agent to end
        except BadRequest as exc:
            reply({"schema": SCHEMA, "action": None, "error": f"bad request: {exc}"})
            sys.stderr.write(f"dflashops agent: bad request: {exc}\n")
            return 2
    return 0
