"""``facts``: everything dflashops needs to know about a host, in one round trip.

Request: ``workdir``, ``imports`` (modules to try importing with this python), ``paths``
(checked for existence), ``import_timeout`` (s, 120), ``nvidia_smi_timeout`` (s, 30),
``files``/``envs``/``env_imports`` (node state, see file_states and env_states), ``ports`` (the
listeners to report, with their holders; null: all), ``probe`` (a probe request for units,
answered as ``probe``: one call for a deploy that has nothing to do), ``settled`` ({unit:
{fingerprint, job}}: when all run or finished as given, nvidia-smi is skipped, gpus.skipped).

Answer: hostname, time, python, python_executable, boot_id, node_id (identity.py; None when the
workdir has none), clock_ticks, uptime_s, workdir, workdir_exists, disk, gpus (see gpu.gather),
listening [{address, port, inode, uid, pids, and
for a port not all this workdir's units': holders [{pid, cmdline, unit, workdir, this_workdir}],
user (the socket's owner, when no holder is visible)}], payloads
{"<hash16>/<name>": sha256}, units {name: {name, script_sha256, unit, pid, exit, stopped,
progress (each with a ``*_error`` when its file is broken), process (ownership.view),
group_pids, unproven_pids, logs}}, imports {module: {ok, version, error, seconds}}, paths
{path: {exists, is_dir}}, probe {units, time}, errors {part: message}, elapsed_s. Each part reports its own failure;
one odd unit never hides the others. ``secrets.env`` files are never opened.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from . import gpu, identity, layout, logs, ownership, probe, procfs, tree
from .common import (
    TMP_MARK,
    BadRequest,
    Json,
    describe,
    first_line,
    is_int,
    number,
    read_json_object,
    sha256_file,
    which,
)

NET = "/sys/class/net"
TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any, Callable

    Records = dict[str, tuple[Any, Any]]  # unit -> (ownership record or None, problem)

PROGRESS_MAX = 64 * 1024
HASH_BUDGET = 1 << 30  # bytes facts may hash per call (a hand-edited tree): past it, "unknown"
VERSION_MARK = "__dflashops_version__="
IMPORT_CODE = (
    "import sys\n"
    "__import__(sys.argv[1])\n"
    "m = sys.modules[sys.argv[1]]\n"
    "v = getattr(m, '__version__', '')\n"
    "print('\\n" + VERSION_MARK + "' + (v if isinstance(v, str) else str(v)))\n"
)
RECORDS = (
    ("unit", layout.UNIT_RECORD),
    ("pid", layout.PID),
    ("exit", layout.EXIT),
    ("stopped", layout.STOPPED),
    ("supervisor", layout.SUPERVISOR),
    ("crashed", "crashed"),
)


def check(request: Json) -> None:
    for key in ("imports", "paths"):
        value = request.setdefault(key, [])
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise BadRequest(f"{key} must be a list of strings")
    for key in ("files", "envs", "env_imports"):
        value = request.setdefault(key, [])
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise BadRequest(f"{key} must be a list of objects")
    for key, default in (("import_timeout", 120), ("nvidia_smi_timeout", 30)):
        request[key] = number(request.get(key, default), key, 0.1)
    settled = request.setdefault("settled", None)
    if settled is not None and (
        not isinstance(settled, dict)
        or not all(
            isinstance(v, dict) and isinstance(v.get("fingerprint"), str) for v in settled.values()
        )
    ):
        raise BadRequest("settled must map unit names to {fingerprint, job} (or be null)")
    ports = request.setdefault("ports", None)
    if ports is not None and (
        not isinstance(ports, list) or not all(is_int(x) and x > 0 for x in ports)
    ):
        raise BadRequest("ports must be a list of port numbers (or null: every listener)")
    if request.setdefault("probe", None) is not None:
        if not isinstance(request["probe"], dict):
            raise BadRequest("probe must be an object (a probe request without workdir)")
        probe.check(request["probe"])


def section(errors: Json, name: str, default: Any, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        errors[name] = describe(exc)
        return default


# ----------------------------------------------------------------------------------- imports


def check_import(module: str, timeout: float, python: str | None = None) -> Json:
    import subprocess

    start = time.monotonic()
    out: Json = {"ok": False, "version": None, "error": None, "seconds": 0.0}
    try:
        proc = subprocess.Popen(
            [python or sys.executable, "-c", IMPORT_CODE, module],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a timeout can take the whole group down
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
                proc.communicate(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass  # a grandchild may still hold the pipes: give up on its output
            out["error"] = f"import {module} timed out after {timeout:g}s"
            return out
    except OSError as exc:
        out["error"] = describe(exc)
        return out
    finally:
        out["seconds"] = round(time.monotonic() - start, 3)
    text = stdout.decode("utf-8", "replace")
    if proc.returncode == 0 and VERSION_MARK in text:
        out["ok"] = True
        out["version"] = text.rsplit(VERSION_MARK, 1)[1].strip() or None
    else:
        lines = stderr.decode("utf-8", "replace").strip().splitlines()[-5:]
        out["error"] = "\n".join(lines) or f"exited with {proc.returncode}"
    return out


def gather_imports(wanted: list[tuple[str, str, str]], timeout: float) -> dict[str, Json]:
    """key -> import check, for each (key, module, python) in ``wanted``, all at once."""
    import threading

    results: dict[str, Json] = {}

    def one(key: str, module: str, python: str) -> None:
        try:
            results[key] = check_import(module, timeout, python)
        except Exception as exc:
            results[key] = {"ok": False, "version": None, "error": describe(exc), "seconds": 0.0}

    threads = [threading.Thread(target=one, args=w, daemon=True) for w in wanted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {key: results[key] for key, _, _ in wanted}


# ------------------------------------------------------------------------------------- units


def read_unit(name: str, unit_dir: str) -> Json:
    unit: Json = {"name": name}
    try:
        unit["script_sha256"] = sha256_file(os.path.join(unit_dir, layout.LAUNCH))
    except FileNotFoundError:
        unit["script_sha256"] = None
    except OSError as exc:
        unit["script_sha256"] = None
        unit["script_error"] = describe(exc)
    for key, filename in RECORDS:
        try:
            unit[key] = read_json_object(os.path.join(unit_dir, filename))
        except (OSError, ValueError) as exc:
            unit[key] = None
            unit[key + "_error"] = f"{filename}: {exc}"
    try:
        unit["progress"] = read_json_object(os.path.join(unit_dir, layout.PROGRESS), PROGRESS_MAX)
    except (OSError, ValueError) as exc:
        unit["progress"] = None
        unit["progress_error"] = f"progress.json: {exc}"
    unit["logs"] = logs.summary(unit_dir)
    return unit


def read_units(workdir: str, errors: Json) -> tuple[dict[str, Json], Records]:
    """Every unit folder's files and pid record (processes come from the one /proc pass)."""
    try:
        entries = sorted(os.scandir(os.path.join(workdir, layout.UNITS)), key=lambda e: e.name)
    except FileNotFoundError:
        return {}, {}
    units: dict[str, Json] = {}
    records: Records = {}
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue  # .pruned/ and the like
        try:
            units[entry.name] = read_unit(entry.name, entry.path)
            records[entry.name] = ownership.load_record(entry.path)
        except Exception as exc:  # one odd unit must not hide the others
            errors[f"{layout.UNITS}/{entry.name}"] = describe(exc)
    return units, records


def all_settled(settled: Json, units: dict[str, Json], records: Records, boot: str | None) -> bool:
    """Whether nothing the controller asks about can start: each unit runs as ours (its leader
    alive, not in a restart backoff) with the fingerprint given, or is a job that finished with
    exit 0. Then nvidia-smi (slow on a busy node, and only needed to start on free GPUs) is not
    run; the controller asks again in the rare case it still starts something."""
    for name, want in settled.items():
        unit = units.get(name)
        if unit is None or (unit.get("unit") or {}).get("fingerprint") != want["fingerprint"]:
            return False
        rec = records.get(name, (None, None))[0]
        alive = rec is not None and ownership.leader_state(rec, boot) == "alive"
        if want.get("job") and not alive:
            if unit.get("stopped") is None and (unit.get("exit") or {}).get("code") == 0:
                continue
            return False
        if not alive or (unit.get("supervisor") or {}).get("state") in ("backoff", "waiting-gpu"):
            return False
    return True


def recorded_ports(units: dict[str, Json]) -> set[int]:
    out: set[int] = set()
    for unit in units.values():
        port: Any = (unit.get("unit") or {}).get("port")
        if is_int(port):
            out.add(port)
    return out


def attach_processes(
    units: dict[str, Json],
    records: Records,
    boot: str | None,
    groups: ownership.Groups,
    workdir: str,
) -> bool:
    for name, (rec, problem) in records.items():
        view = ownership.view(rec, problem, boot, groups)
        units[name]["group_pids"] = view.pop("members")
        units[name]["unproven_pids"] = view.pop("unproven")
        units[name]["process"] = view
        if rec is not None and not view.get("alive") and units[name].get("exit") is None:
            # Its records were read before the /proc pass: a unit that ended in between wrote
            # its exit (the supervisor's last act) after they were read. Read its ends again,
            # or it shows as dead without an exit for one look.
            again = read_unit(name, os.path.join(workdir, layout.UNITS, name))
            for key in ("exit", "exit_error", "supervisor", "supervisor_error", "crashed"):
                if key in again:
                    units[name][key] = again[key]
    return True


# ------------------------------------------------------------------------- payloads, disk, paths


def read_payloads(workdir: str) -> dict[str, str]:
    root = os.path.join(workdir, layout.PAYLOADS)
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            path = os.path.join(dirpath, fn)
            if TMP_MARK in fn or not os.path.isfile(path):
                continue  # an interrupted upload's leftover is never a shipped file
            try:
                out[os.path.relpath(path, root)] = sha256_file(path)
            except OSError:
                continue
    return out


def file_states(workdir: str, entries: list[Json]) -> dict[str, Json]:
    """Per files entry: its dest (and a host source's) digest from the manifests, listings
    only where dest does not hold what is expected, free space at dest."""
    out: dict[str, Json] = {}
    for e in entries:
        dest = os.path.abspath(os.path.expanduser(str(e["dest"])))
        found = tree.scan(dest, tree.cache_path(workdir, "dest", dest), HASH_BUDGET)
        state: Json = {"exists": found["exists"], "digest": found["digest"], "src": None}
        state["free"] = tree.free_bytes(dest)
        if e.get("src"):
            src = os.path.abspath(os.path.expanduser(str(e["src"])))
            scanned = tree.scan(src, tree.cache_path(workdir, "src", src), HASH_BUDGET)
            state["src"] = {"exists": scanned["exists"], "digest": scanned["digest"]}
            state["src"]["bytes"] = sum(size for size, _ in scanned["files"].values())
        expect = e.get("expect") or (state["src"] or {}).get("digest")
        if e.get("listing") and (expect is None or expect != found["digest"]):
            state["files"], state["parts"] = found["files"], found["parts"]
        try:
            with open(tree.cache_path(workdir, "origin", dest)) as f:
                state["origin"] = json.load(f)
        except (OSError, ValueError):
            state["origin"] = None
        out[str(e.get("key") or dest)] = state
    return out


def env_states(envs: list[Json]) -> dict[str, Json]:
    if not envs:
        return {}
    from . import build  # only when environments are declared: it is the heaviest import

    return {str(e["name"]): build.state(str(e["path"]), str(e["hash"])) for e in envs}


def path_checks(paths: list[str]) -> dict[str, Json]:
    out: dict[str, Json] = {}
    for p in paths:
        full = os.path.expanduser(p)
        out[p] = {"exists": os.path.exists(full), "is_dir": os.path.isdir(full)}
    return out


# -------------------------------------------------------------------------------------------


def start_slow(request: Json, errors: Json, units: Json, records: Json, boot: Any) -> Any:
    """The slow parts (nvidia-smi, imports) in threads while the caller reads /proc and files:
    ``(slow, threads)``, ``slow`` filled in when the threads are joined."""
    import threading

    imports = [(m, m, sys.executable) for m in dict.fromkeys(request["imports"])]
    imports += [
        (f"{e['env']}/{e['module']}", str(e["module"]), os.path.expanduser(str(e["python"])))
        for e in request["env_imports"]
    ]
    import_timeout, smi_timeout = request["import_timeout"], request["nvidia_smi_timeout"]
    slow: Json = {"gpus": gpu.empty("nvidia-smi not found"), "imports": {}}

    def gpus_job() -> None:
        slow["gpus"] = section(errors, "gpus", gpu.empty(None), lambda: gpu.gather(smi_timeout))

    def imports_job() -> None:
        slow["imports"] = section(
            errors, "imports", {}, lambda: gather_imports(imports, import_timeout)
        )

    settled = request["settled"]
    threads = []
    if settled is not None and section(
        errors, "settled", False, lambda: all_settled(settled, units, records, boot)
    ):
        slow["gpus"] = gpu.skipped()
    else:
        threads.append(threading.Thread(target=gpus_job, daemon=True))
    if imports:
        threads.append(threading.Thread(target=imports_job, daemon=True))
    for t in threads:
        t.start()
    return slow, threads


def basics(workdir: str, boot: Any, errors: Json) -> Json:
    uptime = first_line("/proc/uptime")
    facts: Json = {
        "hostname": socket.gethostname(),
        "time": time.time(),
        "python": ".".join(str(x) for x in sys.version_info[:3]),
        "python_executable": sys.executable,
        "boot_id": boot,
        "clock_ticks": section(errors, "clock_ticks", None, lambda: os.sysconf("SC_CLK_TCK")),
        "uptime_s": float(uptime.split()[0]) if uptime else None,
        "workdir": workdir,
        "workdir_exists": os.path.isdir(workdir),
        # Written at the first deploy: gone (None) means an emptied workdir or a new machine.
        "node_id": section(errors, "node_id", None, lambda: identity.read(workdir)),
    }
    facts["disk"] = section(errors, "disk", None, lambda: tree.free_bytes(workdir))
    # Network interfaces, for a multi-node unit's net_if (NCCL_SOCKET_IFNAME must name one).
    facts["interfaces"] = section(errors, "interfaces", [], lambda: sorted(os.listdir(NET)))
    return facts


def run(request: Json) -> Json:
    started = time.monotonic()
    errors: Json = {}
    workdir = request["workdir"]
    boot = procfs.boot_id()
    units, records = section(errors, "units", ({}, {}), lambda: read_units(workdir, errors))
    slow, threads = start_slow(request, errors, units, records, boot)
    facts = basics(workdir, boot, errors)
    listening = section(errors, "listening", [], procfs.listeners)
    # Whose sockets these are costs a readlink per open fd of every process: only for the ports
    # asked about (what the plan will use) and those the units' records name (orphans).
    wanted = None if request["ports"] is None else set(request["ports"]) | recorded_ports(units)
    inodes = {
        e["inode"] for e in listening if e["inode"] and (wanted is None or e["port"] in wanted)
    }
    pgids = {rec.pgid for rec, _ in records.values() if rec is not None}
    # One pass over /proc answers both: the units' process groups and the ports' holders.
    groups, holders = section(
        errors, "proc", ({g: [] for g in pgids}, {}), lambda: procfs.scan(pgids, inodes)
    )
    attached = section(
        errors, "units", False, lambda: attach_processes(units, records, boot, groups, workdir)
    )
    facts["units"] = units if attached else {}
    if request["probe"] is not None:  # the units' health too: a no-op deploy needs nothing else
        spec = request["probe"]
        facts["probe"] = section(
            errors,
            "probe",
            None,
            lambda: {
                "units": probe.probe_units(
                    workdir, spec["units"], spec["http_timeout"], spec["log_lines"], groups
                ),
                "time": time.time(),
            },
        )
    ours = {pid for unit in units.values() for pid in unit.get("group_pids", ())}
    for entry in listening:
        entry["pids"] = sorted(holders.get(entry["inode"], []))
    # Who is in the way of a port, and whose unit it is.
    section(
        errors, "holders", None, lambda: procfs.describe_holders(listening, wanted, ours, workdir)
    )
    # Asked about some ports: only their listeners (a GPU node may listen on hundreds).
    facts["listening"] = [e for e in listening if wanted is None or e["port"] in wanted]
    facts["payloads"] = section(errors, "payloads", {}, lambda: read_payloads(workdir))
    facts["paths"] = section(errors, "paths", {}, lambda: path_checks(request["paths"]))
    facts["files"] = section(errors, "files", {}, lambda: file_states(workdir, request["files"]))
    facts["envs"] = section(errors, "envs", {}, lambda: env_states(request["envs"]))
    facts["tools"] = {name: which(name) for name in ("uv", "hf")}
    notify = os.path.join(workdir, layout.NOTIFY)
    facts["notify_sha256"] = sha256_file(notify) if os.path.isfile(notify) else None
    for t in threads:
        t.join()
    facts["gpus"] = slow["gpus"]
    facts["imports"] = slow["imports"]
    facts["errors"] = errors
    facts["elapsed_s"] = round(time.monotonic() - started, 4)
    return facts
