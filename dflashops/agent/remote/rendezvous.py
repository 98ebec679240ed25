"""``rendezvous``: can the ranks of a multi-node unit reach its head? Checked before any GPU is
touched (the most common multi-node failure is a rank that hangs at NCCL init because it cannot
reach the head).

Request ``role``:
- ``listen`` (the head): bind ``address``:``port`` and print ``{"listening": true}`` (or why it
  cannot: the address is not this host's, the port is taken), then accept connections until
  ``expect`` peers have said hello or ``timeout`` s have passed; the answer lists them.
  A port held by the unit's own running engine is reported as such (``held``), not as a failure.
- ``dial`` (a worker): connect to ``address``:``port`` within ``timeout`` s and say hello with
  ``name`` (this host's name in the inventory); the answer says whether it worked and why not.
"""

from __future__ import annotations

import json
import socket
import sys
import time

from .common import BadRequest, Json, describe, number

HELLO = b"dflashops-rendezvous "


def check(request: Json) -> None:
    role = request.get("role")
    if role not in ("listen", "dial"):
        raise BadRequest("role must be listen or dial")
    if not isinstance(request.get("address"), str) or not request["address"]:
        raise BadRequest("address must be a non-empty string")
    port = request.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadRequest("port must be an integer 1-65535")
    request["timeout"] = number(request.get("timeout", 10.0), "timeout", 0.1)
    if role == "listen":
        expect = request.get("expect")
        if not isinstance(expect, int) or isinstance(expect, bool) or expect < 0:
            raise BadRequest("expect must be a non-negative integer")
    elif not isinstance(request.get("name"), str):
        raise BadRequest("name must be a string")


def run(request: Json) -> Json:
    return listen(request) if request["role"] == "listen" else dial(request)


def listen(request: Json) -> Json:
    address, port = request["address"], request["port"]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As torch's store and SGLang do: connections of a finished run in TIME_WAIT do not make the
    # port "in use" (a listener that holds it still does).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        why = describe(exc)
        held = getattr(exc, "errno", None) == 98  # EADDRINUSE
        return {"listening": False, "held": held, "error": why, "peers": []}
    # The controller dials only once it has read this line.
    sys.stdout.write(json.dumps({"listening": True}) + "\n")
    sys.stdout.flush()
    peers: list[Json] = []
    deadline = time.monotonic() + request["timeout"]
    try:
        while len(peers) < request["expect"]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                conn, peer = sock.accept()
            except OSError:  # timed out
                break
            with conn:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    said = conn.recv(256)
                except OSError:
                    said = b""
            name = said[len(HELLO) :].decode("utf-8", "replace").strip()
            if said.startswith(HELLO):
                peers.append({"name": name, "from": peer[0]})
    finally:
        sock.close()
    return {"listening": True, "held": False, "error": None, "peers": peers}


def dial(request: Json) -> Json:
    address, port, timeout = request["address"], request["port"], request["timeout"]
    started = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.sendall(HELLO + request["name"].encode("utf-8") + b"\n")
    except ConnectionRefusedError:
        return {"ok": False, "error": "connection refused"}
    except (socket.timeout, TimeoutError):
        return {"ok": False, "error": f"no answer within {timeout:g}s (a firewall dropping it?)"}
    except OSError as exc:
        return {"ok": False, "error": describe(exc)}
    return {"ok": True, "error": None, "seconds": round(time.monotonic() - started, 3)}
