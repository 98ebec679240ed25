"""``build``: build Python environments, each once per content, beside the one in use.

Request: ``envs: [{name, path, hash, python, packages, requirements, wheels}]``
(``requirements``/``wheels``: paths on this host, shipped before), ``timeout`` (s per build).
Answer: ``envs: {name: {ok, built, build, installer, seconds, log, error, note}}``.

A build is made where it stays, in ``PATH.builds/<hash16>/``: venv, pip and uv write that
absolute folder into every console script's shebang, ``bin/activate`` and ``pyvenv.cfg``, so a
build made elsewhere and moved into place would not run. It is made with ``uv`` when the host
has it, else ``python -m venv`` and pip; with ``wheels`` that folder is the only index. Its
completion marker (``.dflashops-env.json``) is written last: a build folder without one is
unfinished. The builds of one environment take turns: each holds an flock on
``PATH.builds/.dflashops-lock`` (the installers it starts hold it too, and the kernel drops it
when they all end, killed or not), so a second deploy waits for the first and then finds its
build done. Under the lock, a build folder without its marker is a killed build: removed and
made again.

Only a complete build is switched in: ``PATH`` becomes (atomically) a link to it; nothing else
needs to be atomic. A failed build leaves PATH, its build and everything running on it
untouched, and answers with the installer's own last lines. A build whose ``bin/python`` no
longer runs (the interpreter it was made with was upgraded or removed under it) is reported by
``state`` as ``broken``, set aside (renamed, not deleted: units may still run on it) and made
again; so is one that an older dflashops built in a temporary folder and moved. Units resolve
PATH once when they start, so a running unit keeps the build it started with. ``collect``
removes builds that are neither current, nor the one before, nor in any running process's
command line; unfinished ones; temporary folders of older agents whose writer is gone; and
set-aside builds once nothing runs from their key.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

from . import layout
from .common import (
    TMP_MARK,
    BadRequest,
    Json,
    describe,
    now_iso,
    number,
    remove,
    which,
    write_atomic,
)
from .procfs import cmdline

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from collections.abc import Iterator

TAIL = 4000
MARKER = ".dflashops-env.json"
LOCK = ".dflashops-lock"
ASIDE = ".dflashops-aside."  # .<hash16>.dflashops-aside.<n>: a broken build set aside
VERSION = "import sys; print('%d.%d' % sys.version_info[:2])"


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
    """What is at PATH: {state: ok | missing | other | unmanaged | broken, current, note}; ok
    when PATH links to the complete build of this digest and its interpreter runs."""
    path = expand(path)
    if not os.path.lexists(path):
        return {"state": "missing", "current": None}
    if not os.path.islink(path):
        return {"state": "unmanaged", "current": None}
    current = os.path.basename(os.readlink(path).rstrip("/"))
    if current != digest[:16] or not os.path.isfile(os.path.join(path, MARKER)):
        return {"state": "other", "current": current}
    why = build_problem(path)
    if why is not None:
        return {"state": "broken", "current": current, "note": f"{path}: {why}"}
    return {"state": "ok", "current": current}


def venv_version(folder: str) -> str | None:
    """'3.11' from the build's pyvenv.cfg (venv writes ``version``, uv ``version_info``)."""
    try:
        with open(os.path.join(folder, "pyvenv.cfg")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            return ".".join(value.strip().split(".")[:2]) or None
    return None


def build_problem(folder: str) -> str | None:
    """Why a complete build does not work from where it is, or None."""
    try:
        with open(os.path.join(folder, "bin", "activate"), errors="replace") as f:
            moved = TMP_MARK in f.read()
    except OSError:
        moved = False
    if moved:  # what agents before builds in place made: every script names a folder gone
        return (
            "it was built in a temporary folder and moved (by an older dflashops): its console "
            "scripts and bin/activate name that folder"
        )
    return interpreter_problem(folder)


def interpreter_problem(folder: str) -> str | None:
    """Why the build's ``bin/python`` no longer runs as the Python it was made with, or None.
    A venv links to the interpreter that made it: an upgrade or removal of that one breaks it."""
    python = os.path.join(folder, "bin", "python")
    try:
        proc = subprocess.run(
            [python, "-I", "-S", "-c", VERSION],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (
            f"its interpreter bin/python does not run ({describe(exc)}): the python it was "
            "made with was removed or upgraded under it"
        )
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        return f"its interpreter bin/python does not run (exit {proc.returncode}: {err[0]})"
    made, now = venv_version(folder), proc.stdout.decode("utf-8", "replace").strip()
    if made and now != made:
        return (
            f"it was made with Python {made} but its bin/python is now Python {now}: the "
            "interpreter it was made with was upgraded or replaced under it"
        )
    return None


def run_logged(argv: list[str], log: str, timeout: float, keep_fd: int) -> int:
    """Run an installer step into the log; it inherits ``keep_fd`` (the environment's lock),
    so a step that outlives a killed agent still keeps other builds out of its folder."""
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
                pass_fds=(keep_fd,),
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"[dflashops] timed out after {timeout:g}s\n".encode())
            return 124
        except OSError as exc:
            out.write(f"[dflashops] cannot run {argv[0]}: {describe(exc)}\n".encode())
            return 127


def note(log: str, text: str) -> None:
    with open(log, "a") as f:
        f.write(f"[dflashops] {text}\n")


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


class LockTimeout(Exception):
    pass


@contextlib.contextmanager
def locked(builds: str, timeout: float) -> Iterator[tuple[int, float]]:
    """Hold the environment's build lock: (its fd, seconds waited for it)."""
    os.makedirs(builds, exist_ok=True)
    fd = os.open(os.path.join(builds, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout:
                    raise LockTimeout(
                        f"another build of this environment still holds {builds}/{LOCK} after "
                        f"{timeout:g}s: let it finish (or end it) and deploy again"
                    ) from None
                time.sleep(0.2)
        yield fd, time.monotonic() - started
    finally:
        os.close(fd)


def used_builds(builds: str) -> set[str]:
    """Build folder names that a running process was started from (its python or script)."""
    in_use = set()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        for arg in cmdline(pid)[:2]:
            if arg.startswith(builds + os.sep):
                in_use.add(arg[len(builds) + 1 :].split(os.sep, 1)[0])
    return in_use


def collect(builds: str, keep: set[str]) -> None:
    """Remove, under the lock, what nothing needs: old builds that nothing runs from (never
    the current or the previous one), unfinished builds, older agents' temporary folders whose
    writer is gone, set-aside builds once nothing runs from their key."""
    try:
        names = os.listdir(builds)
    except OSError:
        return
    in_use = used_builds(builds)
    for name in names:
        if name == LOCK or name in keep or name in in_use:
            continue
        if TMP_MARK in name:  # .<hash16>.dflashops-tmp.<pid>: how agents before locks built
            pid = name.rsplit(TMP_MARK, 1)[1]
            if pid.isdigit() and os.path.exists(f"/proc/{pid}"):
                continue
        elif ASIDE in name and name[1:].split(ASIDE, 1)[0] in in_use:
            continue
        full = os.path.join(builds, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            remove(full)


def set_aside(builds: str, key: str) -> str:
    n = 0
    while os.path.lexists(os.path.join(builds, f".{key}{ASIDE}{n}")):
        n += 1
    aside = os.path.join(builds, f".{key}{ASIDE}{n}")
    os.rename(os.path.join(builds, key), aside)
    return aside


def make(spec: Json, builds: str, timeout: float, lock: int, out: Json) -> bool:
    """Make the build of ``spec`` in its final folder unless a working one is there; False
    (with ``out['error']``) when the installer failed."""
    key, log = out["build"], out["log"]
    final = os.path.join(builds, key)
    aside = None
    if os.path.isfile(os.path.join(final, MARKER)):
        why = build_problem(final)
        if why is None:
            return True
        out["note"] = f"{final}: {why}; set aside and built again"
        note(log, out["note"])
        aside = set_aside(builds, key)
    elif os.path.lexists(final):
        out["note"] = f"{final} had no completion marker (a killed build): removed, built again"
        note(log, out["note"])
        shutil.rmtree(final, ignore_errors=True)
    out["installer"], steps = commands(spec, final)
    for argv in steps:
        if run_logged(argv, log, timeout, lock) != 0:
            shutil.rmtree(final, ignore_errors=True)
            if aside is not None:
                os.rename(aside, final)  # as it was: broken, but what running units stand on
            with open(log, "rb") as f:
                f.seek(max(0, os.path.getsize(log) - TAIL))
                tail = f.read().decode("utf-8", "replace")
            out["error"] = f"{out['installer']} failed building {spec['name']}:\n{tail}"
            return False
    marker = {"name": spec["name"], "hash": spec["hash"], "built_at": now_iso()}
    marker["installer"] = out["installer"]
    write_atomic(os.path.join(final, MARKER), json.dumps(marker).encode())  # last: complete
    out["built"] = True
    return True


def switch(path: str, builds: str, key: str) -> None:
    link = f"{path}{TMP_MARK}{os.getpid()}"
    remove(link)
    os.symlink(os.path.join(os.path.basename(builds), key), link)
    os.replace(link, path)  # the switch: PATH names the new build, or still the old one


def build(spec: Json, timeout: float, workdir: str) -> Json:
    started = time.monotonic()
    path = expand(spec["path"])
    key = spec["hash"][:16]
    out: Json = {"ok": False, "built": False, "build": key, "installer": None, "seconds": 0.0}
    out.update(log=None, error=None, note=None)
    if os.path.lexists(path) and not os.path.islink(path):
        out["error"] = (
            f"{path} exists and is not an environment dflashops manages (not a link to a "
            "build): move it aside or choose another `path`; nothing was changed"
        )
        return out
    builds = path + ".builds"
    logs = os.path.join(workdir, layout.ENVS, spec["name"])
    os.makedirs(logs, exist_ok=True)
    out["log"] = os.path.join(logs, f"{key}.log")
    try:
        with locked(builds, timeout) as (lock, waited):
            if waited >= 1:
                note(out["log"], f"waited {waited:.0f}s for another build of {path}")
            now = state(path, spec["hash"])
            if now["state"] == "ok" and waited >= 1:
                out["note"] = f"another deploy built it meanwhile (waited {waited:.0f}s)"
            if now["state"] != "ok":
                # The client waits about `timeout` per environment: waiting took part of it.
                if not make(spec, builds, max(1.0, timeout - waited), lock, out):
                    out["seconds"] = round(time.monotonic() - started, 2)
                    return out
                switch(path, builds, key)
            collect(builds, {key, now["current"] or ""})
    except LockTimeout as exc:
        out["error"] = str(exc)
        return out
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
