"""``build``: build Python environments, each once per content, beside the one in use.

Request: ``envs: [{name, path, hash, python, packages, requirements, wheels}]``
(``requirements``/``wheels``: paths on this host, shipped before), ``timeout`` (s per build).
Answer: ``envs: {name: {ok, built, build, installer, seconds, log, error}}``.

A build goes to ``PATH.builds/<hash16>/`` (through a temporary folder, renamed when complete),
made with ``uv`` when the host has it, else ``python -m venv`` and pip; with ``wheels`` that
folder is the only index. Only a complete build is switched in: ``PATH`` becomes (atomically) a
link to it. A failed build leaves PATH, its build and everything running on it untouched, and
answers with the installer's own last lines. Units resolve PATH once when they start, so a
running unit keeps the build it started with; builds that are neither current, nor the one
before, nor in any running process's command line are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from .common import TMP_MARK, BadRequest, Json, describe, now_iso, number, remove, which
from .procfs import cmdline

TAIL = 4000
MARKER = ".dflashops-env.json"


def check(request: Json) -> None:
    envs = request.get("envs")
    if not isinstance(envs, list) or not all(isinstance(e, dict) for e in envs):
        raise BadRequest("envs must be a list of objects")
    for i, e in enumerate(envs):
        for key in ("name", "path", "hash", "python"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise BadRequest(f"envs[{i}].{key} must be a non-empty string")
        if not isinstance(e.get("packages", []), list):
            raise BadRequest(f"envs[{i}].packages must be a list")
    request["timeout"] = number(request.get("timeout", 3600), "timeout", 1)


def expand(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def state(path: str, digest: str) -> Json:
    """What is at PATH: {state: ok | missing | other | unmanaged, current}; ok when PATH links
    to the build of this digest and that build is complete."""
    path = expand(path)
    if not os.path.lexists(path):
        return {"state": "missing", "current": None}
    if not os.path.islink(path):
        return {"state": "unmanaged", "current": None}
    current = os.path.basename(os.readlink(path).rstrip("/"))
    done = os.path.isfile(os.path.join(path, MARKER))
    return {"state": "ok" if current == digest[:16] and done else "other", "current": current}


def run_logged(argv: list[str], log: str, timeout: float) -> int:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            return subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"[dflashops] timed out after {timeout:g}s\n".encode())
            return 124
        except OSError as exc:
            out.write(f"[dflashops] cannot run {argv[0]}: {describe(exc)}\n".encode())
            return 127


def commands(spec: Json, folder: str) -> tuple[str, list[list[str]]]:
    """(installer, the argv lists that create ``folder`` and install into it)."""
    python = which(spec["python"]) if "/" not in spec["python"] else expand(spec["python"])
    python = python or spec["python"]
    index = ["--no-index", "--find-links", spec["wheels"]] if spec.get("wheels") else []
    wanted = (["-r", spec["requirements"]] if spec.get("requirements") else []) + list(
        spec.get("packages", [])
    )
    uv = which("uv")
    if uv:
        return "uv", [
            [uv, "venv", "--quiet", "--python", python, folder],
            [
                uv,
                "pip",
                "install",
                "--python",
                os.path.join(folder, "bin", "python"),
                *index,
                *wanted,
            ],
        ]
    pip = [os.path.join(folder, "bin", "python"), "-m", "pip", "install"]
    return "pip", [
        [python, "-m", "venv", folder],
        [*pip, "--disable-pip-version-check", "--no-input", *index, *wanted],
    ]


def collect(builds: str, keep: set[str]) -> None:
    """Remove old builds that nothing runs from (never the current or the previous one)."""
    try:
        names = os.listdir(builds)
    except OSError:
        return
    in_use = set()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        for arg in cmdline(pid)[:2]:
            if arg.startswith(builds + os.sep):
                in_use.add(arg[len(builds) + 1 :].split(os.sep, 1)[0])
    for name in names:
        if name not in keep and name not in in_use and TMP_MARK not in name:
            shutil.rmtree(os.path.join(builds, name), ignore_errors=True)


def build(spec: Json, timeout: float, workdir: str) -> Json:
    started = time.monotonic()
    path = expand(spec["path"])
    key = spec["hash"][:16]
    out: Json = {"ok": False, "built": False, "build": key, "installer": None, "seconds": 0.0}
    out.update(log=None, error=None)
    now = state(path, spec["hash"])
    if now["state"] == "ok":
        out["ok"] = True
        return out
    if now["state"] == "unmanaged":
        out["error"] = (
            f"{path} exists and is not an environment dflashops manages (not a link to a "
            "build): move it aside or choose another `path`; nothing was changed"
        )
        return out
    builds = path + ".builds"
    final = os.path.join(builds, key)
    tmp = os.path.join(builds, f".{key}{TMP_MARK}{os.getpid()}")
    logs = os.path.join(workdir, "envs", spec["name"])
    os.makedirs(logs, exist_ok=True)
    out["log"] = os.path.join(logs, f"{key}.log")
    if not os.path.isfile(os.path.join(final, MARKER)):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(builds, exist_ok=True)
        out["installer"], steps = commands(spec, tmp)
        for argv in steps:
            if run_logged(argv, out["log"], timeout) != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                with open(out["log"], "rb") as f:
                    f.seek(max(0, os.path.getsize(out["log"]) - TAIL))
                    tail = f.read().decode("utf-8", "replace")
                out["error"] = f"{out['installer']} failed building {spec['name']}:\n{tail}"
                out["seconds"] = round(time.monotonic() - started, 2)
                return out
        marker = {"name": spec["name"], "hash": spec["hash"], "built_at": now_iso()}
        marker["installer"] = out["installer"]
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete build of this hash
        os.rename(tmp, final)
        out["built"] = True
    link = f"{path}{TMP_MARK}{os.getpid()}"
    remove(link)
    os.symlink(os.path.join(os.path.basename(builds), key), link)
    os.replace(link, path)  # the switch: PATH names the new build, or still the old one
    collect(builds, {key, now["current"] or ""})
    out["ok"] = True
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def run(request: Json) -> Json:
    envs: Json = {}
    for spec in request["envs"]:
        try:
            envs[spec["name"]] = build(spec, request["timeout"], request["workdir"])
        except Exception as exc:
            envs[spec["name"]] = {"ok": False, "built": False, "error": describe(exc)}
    return {"envs": envs, "python": sys.version.split()[0]}
