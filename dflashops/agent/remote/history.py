"""``history``: what each deploy, restart-servers, stop and rollback changed on this host.

``WORKDIR/history/<rev>/revision.json`` per revision (``layout``): ``{revision, time (UTC), who,
command, units {unit: fingerprint} (the units it changed, only those), kept {unit:
{fingerprint, script_sha256}}, rollback_to}``; ``history/<rev>/units/<unit>/`` keeps the
launch.sh and unit.json every unit had once that revision was made, for the newest ``KEEP``
revisions (older ones lose their scripts, and their records after ``RECORDS``).
``history/rolled.json``: ``{unit: {revision, fingerprint}}`` for units a rollback put on a kept
revision, until a later revision changes them again.

Ops: ``record`` (``command``, ``who``, ``units``, ``rollback_to``; only while this session holds
the host's deploy lock, as the command recording it does) answers ``{revision}``; ``list``
answers ``{revisions (newest first, each with ``scripts``: still kept), rolled}``; ``rolled``
answers ``{rolled}`` (status and deploy ask it with their facts); ``show`` (``revision``) adds
each kept unit's ``launch`` text; ``restore`` (``revision``, ``names``; under the lock too) puts
those units' kept files back in their folders. Copies go through the verified writer's parts
(``verified``): sha256 checked on the way in, renamed into place only when it matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from . import layout, lock
from .common import (
    TMP_MARK,
    BadRequest,
    Json,
    describe,
    is_int,
    make_private_dirs,
    now_iso,
    read_json_object,
    remove,
    sha256_file,
    unit_name,
    write_json_atomic,
)
from .verified import Signals, copy_in, mismatch

KEEP = 10  # revisions whose scripts are kept (helm's default history)
RECORDS = 200  # revisions whose record is kept at all
OPS = ("record", "list", "rolled", "show", "restore")
LAUNCH_MAX = 1024 * 1024  # a launch.sh bigger than this is not ours: not sent back


class Failed(Exception):
    pass


def check(request: Json) -> None:
    op = request.get("op")
    if op not in OPS:
        raise BadRequest(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "record":
        for key in ("command", "who"):
            if not isinstance(request.get(key), str):
                raise BadRequest(f"{key} must be a string")
        units = request.get("units")
        if not isinstance(units, dict) or not all(
            v is None or isinstance(v, str) for v in units.values()
        ):
            raise BadRequest("units must map unit names to fingerprints (or null)")
        for name in units:
            unit_name(name, "units")
        rollback_to = request.setdefault("rollback_to", None)
        if rollback_to is not None and not is_int(rollback_to):
            raise BadRequest("rollback_to must be a revision number (or null)")
    if op in ("show", "restore") and not is_int(request.get("revision")):
        raise BadRequest("revision must be a revision number")
    if op == "restore":
        names = request.get("names")
        if not isinstance(names, list) or not names:
            raise BadRequest("names must be a non-empty list of unit names")
        for name in names:
            unit_name(name, "names")


def run(request: Json) -> Json:
    workdir = request["workdir"]
    op = request["op"]
    try:
        if op in ("record", "restore") and workdir not in lock.HELD:
            raise Failed("this session does not hold the host's deploy lock")
        if op == "record":
            return {"ok": True, "error": None, "revision": record(workdir, request)}
        if op == "restore":
            restore(workdir, request["revision"], request["names"])
            return {"ok": True, "error": None}
        if op == "rolled":
            return {"ok": True, "error": None, "rolled": rolled(workdir)}
        if op == "show":
            return {"ok": True, "error": None, **show(workdir, request["revision"])}
        return {
            "ok": True,
            "error": None,
            "revisions": revisions(workdir),
            "rolled": rolled(workdir),
        }
    except (Failed, OSError, ValueError) as exc:
        return {"ok": False, "error": describe(exc) if not isinstance(exc, Failed) else str(exc)}


# -- reading -----------------------------------------------------------------------------------


def numbers(workdir: str) -> list[int]:
    """Revision numbers on record, oldest first."""
    try:
        names = os.listdir(os.path.join(workdir, layout.HISTORY))
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def read_revision(workdir: str, revision: int) -> Json | None:
    """A revision's record with ``scripts`` (still kept); None when there is no such record."""
    folder = layout.revision_dir(workdir, revision)
    rec = read_json_object(os.path.join(folder, layout.REVISION))
    if rec is None:
        return None
    rec["scripts"] = os.path.isdir(os.path.join(folder, layout.UNITS))
    return rec


def revisions(workdir: str) -> list[Json]:
    out = []
    for n in reversed(numbers(workdir)):
        try:
            rec = read_revision(workdir, n)
        except ValueError as exc:  # one broken record never hides the others
            rec = {"revision": n, "error": describe(exc), "scripts": False}
        if rec is not None:
            out.append(rec)
    return out


def rolled(workdir: str) -> Json:
    found = read_json_object(os.path.join(workdir, layout.HISTORY, layout.ROLLED))
    return found or {}


def show(workdir: str, revision: int) -> Json:
    rec = read_revision(workdir, revision)
    if rec is None:
        raise Failed(f"no revision {revision} on record")
    launch: Json = {}
    if rec["scripts"]:
        for name in rec.get("kept") or {}:
            path = kept_file(workdir, revision, name, layout.LAUNCH)
            if os.path.getsize(path) <= LAUNCH_MAX:
                with open(path, "rb") as f:
                    launch[name] = f.read().decode("utf-8", "replace")
    return {"record": rec, "launch": launch}


def kept_file(workdir: str, revision: int, unit: str, filename: str) -> str:
    return os.path.join(layout.revision_dir(workdir, revision), layout.UNITS, unit, filename)


# -- writing ------------------------------------------------------------------------------------


def copy_verified(src: str, dest: str, sha256: str, mode: int) -> None:
    """``src`` to ``dest`` through the verified writer's parts: all of it with ``sha256``, or
    nothing (no temporary file left)."""
    folder = os.path.dirname(dest)
    make_private_dirs(folder)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}{TMP_MARK}", dir=folder)
    try:
        with Signals(Failed), os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            digest = hashlib.sha256()
            if copy_in(f, out.write, os.fstat(f.fileno()).st_size, digest):
                raise Failed(f"{src} changed while it was copied")
            why = mismatch(digest, sha256, f" ({dest})")
            if why is not None:
                raise Failed(why)
            out.flush()
            os.chmod(tmp, mode)
            os.replace(tmp, dest)
    except BaseException:
        remove(tmp)
        raise


def record(workdir: str, request: Json) -> int:
    """A new revision: its record and every unit's current launch.sh and unit.json."""
    history = os.path.join(workdir, layout.HISTORY)
    make_private_dirs(history)
    have = numbers(workdir)
    revision = (have[-1] if have else 0) + 1
    folder = layout.revision_dir(workdir, revision)
    os.mkdir(folder, 0o700)
    kept: Json = {}
    units_dir = os.path.join(workdir, layout.UNITS)
    names = sorted(os.listdir(units_dir)) if os.path.isdir(units_dir) else []
    for name in names:
        src = layout.unit_dir(workdir, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(src, layout.LAUNCH)):
            continue
        shas = {}
        for filename in layout.KEPT_SCRIPTS:
            path = os.path.join(src, filename)
            if os.path.isfile(path):
                shas[filename] = sha256_file(path)
                copy_verified(
                    path, kept_file(workdir, revision, name, filename), shas[filename], 0o600
                )
        unit = read_json_object(os.path.join(src, layout.UNIT_RECORD)) or {}
        kept[name] = {
            "fingerprint": unit.get("fingerprint"),
            "script_sha256": shas[layout.LAUNCH],
            "unit_sha256": shas.get(layout.UNIT_RECORD),
        }
    rec = {
        "revision": revision,
        "time": now_iso(),
        "who": request["who"],
        "command": request["command"],
        "units": request["units"],
        "rollback_to": request["rollback_to"],
        "kept": kept,
    }
    write_json_atomic(os.path.join(folder, layout.REVISION), rec)
    mark_rolled(workdir, request["units"], request["rollback_to"], revision)
    prune(workdir)
    return revision


def mark_rolled(workdir: str, units: Json, rollback_to: int | None, revision: int) -> None:
    path = os.path.join(workdir, layout.HISTORY, layout.ROLLED)
    try:
        current = rolled(workdir)
    except ValueError:
        current = {}  # a broken file is rewritten from what is known now
    for name, fingerprint in units.items():
        if rollback_to is None:
            current.pop(name, None)
        else:
            current[name] = {"revision": rollback_to, "fingerprint": fingerprint, "by": revision}
    write_json_atomic(path, current)


def prune(workdir: str) -> None:
    have = numbers(workdir)
    for n in have[:-KEEP]:
        shutil.rmtree(os.path.join(layout.revision_dir(workdir, n), layout.UNITS), True)
    for n in have[:-RECORDS]:
        shutil.rmtree(layout.revision_dir(workdir, n), True)


def restore(workdir: str, revision: int, names: list[str]) -> None:
    """The kept launch.sh and unit.json of ``names`` back in their unit folders, all checked
    against the revision's record before any is replaced."""
    rec = read_revision(workdir, revision)
    if rec is None or not rec["scripts"]:
        raise Failed(f"revision {revision}'s scripts are not kept on this host")
    kept = rec.get("kept") or {}
    plan = []
    for name in names:
        entry = kept.get(name)
        if not isinstance(entry, dict):
            raise Failed(f"revision {revision} kept nothing of {name}")
        for filename, key, mode in (
            (layout.LAUNCH, "script_sha256", 0o700),
            (layout.UNIT_RECORD, "unit_sha256", 0o600),
        ):
            if entry.get(key):
                src = kept_file(workdir, revision, name, filename)
                plan.append((src, layout.unit_file(workdir, name, filename), entry[key], mode))
    for src, _dest, sha, _mode in plan:
        if sha256_file(src) != sha:
            raise Failed(f"{src} is not what revision {revision} recorded; nothing was restored")
    for src, dest, sha, mode in plan:
        copy_verified(src, dest, sha, mode)
