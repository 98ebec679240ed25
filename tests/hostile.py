"""A hostile host's `python`: runs the real agent with the real interpreter and rewrites what
goes in and what comes out (DESIGN.md "Trust boundary"; issue 19 "Bad input").

`hostile_python(folder, ...)` writes `folder/python-hostile` (and its rules beside it) and
returns its path, for the inventory's `python:` of an sshd test host or a local host.

- `replace_out` / `replace_in`: byte strings replaced in the agent's stdout (its answers,
  file headers) / in its stdin (the requests): a file list can name `../x` while the real agent
  is asked for `ab/x`.
- `on`: the action whose answer is replaced (`facts`, `scan`, ...), and `flood` (that many
  bytes of `x`), `nest` (that many `[`) or `stderr` + `exit` (the agent fails saying that).
"""

from __future__ import annotations

import json
from pathlib import Path

WRAPPER = r'''#!/usr/bin/python3 -S
import json, os, select, subprocess, sys, threading

RULES = json.load(open(os.path.abspath(sys.argv[0]) + ".json"))
ENC = "latin-1"  # bytes <-> str one to one
OUT = [(a.encode(ENC), b.encode(ENC)) for a, b in RULES.get("replace_out", [])]
IN = [(a.encode(ENC), b.encode(ENC)) for a, b in RULES.get("replace_in", [])]
ON = RULES.get("on")
TRIGGER = ('"action":"%s"' % ON).encode() if ON else None
hit = threading.Event()
child = subprocess.Popen(
    ["/usr/bin/python3"] + sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE
)


def rewrite(rules, carry, data, flush):
    """Replace in carry + data; keep back what could start a match cut by the chunk's end."""
    buf = carry + data
    for a, b in rules:
        buf = buf.replace(a, b)
    keep = 0 if flush else max([len(a) for a, _ in rules] + [1]) - 1
    return buf[: len(buf) - keep], buf[len(buf) - keep:]


def pump(src, dst, rules, watch):
    carry = b""
    while True:
        ready = select.select([src], [], [], 0.05)[0]
        if not ready:  # quiet: nothing is cut in two, send what is held back
            if carry:
                os.write(dst, carry)
                carry = b""
            continue
        data = os.read(src, 1 << 16)
        if watch and TRIGGER and TRIGGER in carry + data:
            hit.set()
        if not data:
            if carry:
                os.write(dst, carry)
            return
        if not watch and hit.is_set():
            return hostile()
        out, carry = rewrite(rules, carry, data, False)
        os.write(dst, out)


def hostile():
    child.kill()
    if "stderr" in RULES:
        sys.stderr.write(RULES["stderr"])
        sys.stderr.flush()
        os._exit(RULES.get("exit", 3))
    if "nest" in RULES:
        os.write(1, b"[" * RULES["nest"] + b"\n")
    piece = b"x" * (1 << 20)
    for _ in range(RULES.get("flood", 0) >> 20):
        os.write(1, piece)
    os._exit(0)


def feed():
    try:
        pump(0, child.stdin.fileno(), IN, True)
    except OSError:
        pass
    try:
        child.stdin.close()
    except OSError:
        pass


threading.Thread(target=feed, daemon=True).start()
try:
    pump(child.stdout.fileno(), 1, OUT, False)
except OSError:
    child.kill()
sys.exit(child.wait())
'''


def hostile_python(
    folder: Path,
    *,
    replace_out: list[tuple[str, str]] | None = None,
    replace_in: list[tuple[str, str]] | None = None,
    on: str | None = None,
    flood: int = 0,
    nest: int = 0,
    stderr: str | None = None,
    exit: int = 3,
    name: str = "python-hostile",
) -> str:
    rules: dict[str, object] = {
        "replace_out": replace_out or [],
        "replace_in": replace_in or [],
        "on": on,
    }
    if flood:
        rules["flood"] = flood
    if nest:
        rules["nest"] = nest
    if stderr is not None:
        rules.update(stderr=stderr, exit=exit)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(WRAPPER)
    path.chmod(0o755)
    Path(f"{path}.json").write_text(json.dumps(rules))
    return str(path)
