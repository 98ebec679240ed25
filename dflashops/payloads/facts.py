"""facts.py: everything dflashops needs to know about a host, in one round trip (dflashops payload).

Stdlib only, Python 3.9+. The controller pipes this file to the host's python::

    PYTHON - '{"workdir": "~/dflashops", "imports": ["sglang"], "paths": ["/dev/shm/M"]}' < facts.py

(``python facts.py REQUEST_JSON`` works too). It prints exactly one JSON document on stdout and
exits 0, even when parts fail: each part reports its own error (a unit's broken file in that
unit's ``*_error``, nvidia-smi trouble in ``gpus.error``, anything unexpected in ``errors``).
It exits non-zero only when it cannot produce JSON at all (a malformed request, say).

Request keys: ``workdir`` (``~`` is expanded here, on the host), ``imports`` (module names to
try importing with this python), ``paths`` (checked for existence), ``import_timeout`` (s, 120),
``nvidia_smi_timeout`` (s, 30).

Output (``schema`` 1)::

    schema, hostname, time, python, python_executable, boot_id, clock_ticks, uptime_s,
    workdir, workdir_exists, disk {path, free_bytes, total_bytes},
    gpus {available, error, devices [{index, uuid, name, memory_used_mib, memory_total_mib}],
          processes [{pid, gpu_uuid, gpu_index, used_mib, process_name}]},
    listening [{address, port, inode, pids}],
    payloads {"<hash16>/<name>": sha256},
    units {name: {name, script_sha256, unit, unit_error, pid, pid_error,
                  process {alive, ours, pid, pgid, state, start_time, cmdline, reason},
                  group_pids, exit, exit_error,
                  logs {count, current, current_size, current_mtime}, progress, progress_error}},
    imports {module: {ok, version, error, seconds}},
    paths {path: {exists, is_dir}},
    errors {part: message}, elapsed_s

A unit's process is ``ours`` only when the recorded pid exists, is not a zombie, its start time
(/proc/PID/stat field 22) equals the recorded one and the recorded boot id is this boot's: a
reused pid is never reported as ours. ``secrets.env`` files are never opened.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

# Kept light on purpose: typing is for the type checker only, and hashlib, subprocess and
# threading are imported where they are needed (an idle host without GPUs needs none of them).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

    Json = dict[str, Any]

SCHEMA = 1
PROGRESS_MAX = 64 * 1024
SMALL_FILE_MAX = 1024 * 1024  # unit.json, pid, exit: anything bigger is not ours to parse
VERSION_MARK = "__dflashops_version__="
IMPORT_CODE = (
    "import sys\n"
    "__import__(sys.argv[1])\n"
    "m = sys.modules[sys.argv[1]]\n"
    "v = getattr(m, '__version__', '')\n"
    "print('\\n" + VERSION_MARK + "' + (v if isinstance(v, str) else str(v)))\n"
)
NA_VALUES = ("", "[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]")


# ----------------------------------------------------------------------------------------------
# small helpers


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_text(path: str, limit: int = SMALL_FILE_MAX) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit // 1024} KiB")
    return data.decode("utf-8", "replace")


def read_json_object(path: str, limit: int = SMALL_FILE_MAX) -> Json | None:
    """The JSON object in ``path``; None when the file does not exist; ValueError when broken."""
    try:
        text = read_text(path, limit)
    except FileNotFoundError:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (got {type(value).__name__})")
    return value


def sha256_file(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, ...], or None.

    Index i here is field i + 3 of proc(5): state is 0, pgrp 2, start time (field 22) 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return [x.decode("ascii", "replace") for x in fields]


def first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------
# GPUs


def parse_int(text: str) -> int | None:
    text = text.strip()
    if text.lower() in NA_VALUES:
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return int(float(text))
        except ValueError:
            return None


def na_str(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in NA_VALUES else text


def which(name: str) -> str | None:
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def run_nvidia_smi(exe: str, query: str, timeout: float) -> list[list[str]]:
    """Rows of ``nvidia-smi QUERY --format=csv,noheader,nounits``; RuntimeError on failure."""
    import subprocess

    try:
        proc = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"nvidia-smi {query} timed out after {timeout:g}s") from None
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        # The real tool prints most of its errors on stdout.
        msg = proc.stderr.decode("utf-8", "replace").strip() or out.strip()
        raise RuntimeError(f"nvidia-smi exited with {proc.returncode}: {msg[-1000:]}")
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def no_gpus(error: str | None) -> Json:
    return {"available": False, "error": error, "devices": [], "processes": []}


def gather_gpus(timeout: float, exe: str | None = None) -> Json:
    import threading

    result = no_gpus(None)
    exe = exe or which("nvidia-smi")
    if exe is None:
        result["error"] = "nvidia-smi not found"
        return result
    queries = {
        "gpu": "--query-gpu=index,uuid,name,memory.used,memory.total",
        "apps": "--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
    }
    rows: dict[str, list[list[str]]] = {}
    errors: dict[str, str] = {}

    def one(key: str) -> None:
        try:
            rows[key] = run_nvidia_smi(exe, queries[key], timeout)
        except Exception as exc:
            errors[key] = str(exc) if isinstance(exc, RuntimeError) else describe(exc)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if "gpu" in errors:
        result["error"] = errors["gpu"]
        return result
    by_uuid: dict[str, int] = {}
    for cells in rows.get("gpu", []):
        if len(cells) < 5:
            continue
        index = parse_int(cells[0])
        if index is None:
            continue
        uuid = na_str(cells[1]) or ""
        name = ", ".join(cells[2:-2])  # a name with a comma in it stays whole
        result["devices"].append(
            {
                "index": index,
                "uuid": uuid,
                "name": name,
                "memory_used_mib": parse_int(cells[-2]),
                "memory_total_mib": parse_int(cells[-1]),
            }
        )
        by_uuid[uuid] = index
    result["available"] = True
    if "apps" in errors:
        result["error"] = "compute-apps query: " + errors["apps"]
        return result
    for cells in rows.get("apps", []):
        if len(cells) < 4:
            continue
        pid = parse_int(cells[0])
        if pid is None:
            continue
        uuid = na_str(cells[1]) or ""
        result["processes"].append(
            {
                "pid": pid,
                "gpu_uuid": uuid,
                "gpu_index": by_uuid.get(uuid),
                "used_mib": parse_int(cells[2]),
                "process_name": ", ".join(cells[3:]),  # process names may hold commas
            }
        )
    return result


# ----------------------------------------------------------------------------------------------
# imports


def check_import(module: str, timeout: float) -> Json:
    import subprocess

    start = time.monotonic()
    out: Json = {"ok": False, "version": None, "error": None, "seconds": 0.0}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", IMPORT_CODE, module],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a timeout can take the whole group down
        )
    except OSError as exc:
        out["error"] = describe(exc)
        out["seconds"] = round(time.monotonic() - start, 3)
        return out
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
            proc.communicate(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass  # a grandchild may still hold the pipes: give up on its output
        out["error"] = f"import {module} timed out after {timeout:g}s"
        out["seconds"] = round(time.monotonic() - start, 3)
        return out
    out["seconds"] = round(time.monotonic() - start, 3)
    text = stdout.decode("utf-8", "replace")
    if proc.returncode == 0 and VERSION_MARK in text:
        out["ok"] = True
        version = text.rsplit(VERSION_MARK, 1)[1].strip()
        out["version"] = version or None
    else:
        lines = stderr.decode("utf-8", "replace").strip().splitlines()[-5:]
        out["error"] = "\n".join(lines) or f"exited with {proc.returncode}"
    return out


def gather_imports(modules: list[str], timeout: float) -> dict[str, Json]:
    import threading

    results: dict[str, Json] = {}

    def one(name: str) -> None:
        try:
            results[name] = check_import(name, timeout)
        except Exception as exc:
            results[name] = {"ok": False, "version": None, "error": describe(exc), "seconds": 0.0}

    threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {m: results[m] for m in modules}


# ----------------------------------------------------------------------------------------------
# listening sockets and the one pass over /proc


def decode_address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} prints addresses as native-endian 32-bit words in hex."""
    raw = b"".join(
        struct.pack("=I", int(hex_addr[i : i + 8], 16)) for i in range(0, len(hex_addr), 8)
    )
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def read_listeners() -> list[Json]:
    out: list[Json] = []
    seen = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":
                continue
            addr, _, port = cols[1].partition(":")
            inode = int(cols[9])
            key = (addr, port, inode)
            if key in seen:
                continue
            seen.add(key)
            out.append(
                {"address": decode_address(addr), "port": int(port, 16), "inode": inode, "pids": []}
            )
    out.sort(key=lambda x: (x["port"], x["address"]))
    return out


def scan_proc(
    inodes: set[int], want_groups: bool
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """One pass over /proc: socket inode -> pids holding it, pgid -> live (non-zombie) pids.

    Each half is skipped when nobody asked for it; pids we cannot read are skipped."""
    by_inode: dict[int, list[int]] = {}
    by_pgid: dict[int, list[int]] = {}
    if not inodes and not want_groups:
        return by_inode, by_pgid
    try:
        names = os.listdir("/proc")
    except OSError:
        return by_inode, by_pgid
    readlink = os.readlink
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if want_groups:
            stat = proc_stat(pid)
            if stat is not None and stat[0] not in ("Z", "X"):
                by_pgid.setdefault(int(stat[2]), []).append(pid)
        if inodes:
            fd_dir = f"/proc/{name}/fd/"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = readlink(fd_dir + fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inode = int(target[8:-1])
                    if inode in inodes:
                        pids = by_inode.setdefault(inode, [])
                        if pid not in pids:
                            pids.append(pid)
    return by_inode, by_pgid


# ----------------------------------------------------------------------------------------------
# units


def unit_process(record: Json | None, boot_id: str | None) -> Json:
    proc: Json = {
        "alive": False,
        "ours": False,
        "pid": None,
        "pgid": None,
        "state": None,
        "start_time": None,
        "cmdline": [],
        "reason": None,
    }
    if record is None:
        proc["reason"] = "no pid record"
        return proc
    pid = record.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        proc["reason"] = "the pid record has no valid pid"
        return proc
    proc["pid"] = pid
    stat = proc_stat(pid)
    if stat is None:
        proc["reason"] = f"pid {pid} is gone"
        return proc
    proc["state"] = stat[0]
    proc["pgid"] = int(stat[2])
    proc["start_time"] = int(stat[19])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(65536)
        proc["cmdline"] = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    except OSError:
        pass
    if stat[0] in ("Z", "X"):
        proc["reason"] = f"pid {pid} is a zombie (exited, not yet reaped)"
        return proc
    proc["alive"] = True
    recorded_start = record.get("start_time")
    recorded_boot = record.get("boot_id")
    if isinstance(recorded_start, str) and recorded_start.strip().isdigit():
        recorded_start = int(recorded_start)
    if not is_int(recorded_start):
        proc["reason"] = "the pid record has no start_time: cannot tell whether the pid is ours"
    elif not isinstance(recorded_boot, str) or not recorded_boot:
        proc["reason"] = "the pid record has no boot_id: cannot tell whether the pid is ours"
    elif boot_id is None or recorded_boot.strip() != boot_id:
        proc["reason"] = "recorded on another boot: the pid now belongs to another process"
    elif recorded_start != proc["start_time"]:
        proc["reason"] = (
            f"pid {pid} was reused: start time {proc['start_time']} != recorded {recorded_start}"
        )
    else:
        proc["ours"] = True
    return proc


def unit_logs(unit_dir: str) -> Json:
    logs: Json = {"count": 0, "current": None, "current_size": None, "current_mtime": None}
    log_dir = os.path.join(unit_dir, "logs")
    try:
        entries = list(os.scandir(log_dir))
    except OSError:
        return logs
    count = 0
    for entry in entries:
        if entry.name == "current.log":
            try:
                logs["current"] = os.readlink(entry.path) if entry.is_symlink() else entry.name
                st = os.stat(entry.path)
                logs["current_size"] = st.st_size
                logs["current_mtime"] = st.st_mtime
            except OSError:
                pass
        elif entry.name.endswith(".log") and entry.is_file(follow_symlinks=False):
            count += 1
    logs["count"] = count
    return logs


def read_unit(name: str, unit_dir: str, boot_id: str | None) -> Json:
    unit: Json = {"name": name}
    # Never touch secrets.env: only the files below are opened.
    try:
        unit["script_sha256"] = sha256_file(os.path.join(unit_dir, "launch.sh"))
    except FileNotFoundError:
        unit["script_sha256"] = None
    except OSError as exc:
        unit["script_sha256"] = None
        unit["script_error"] = describe(exc)
    for key, filename in (
        ("unit", "unit.json"),
        ("pid", "pid"),
        ("exit", "exit"),
        ("stopped", "stopped"),
    ):
        try:
            unit[key] = read_json_object(os.path.join(unit_dir, filename))
        except (OSError, ValueError) as exc:
            unit[key] = None
            unit[key + "_error"] = f"{filename}: {exc}"
    try:
        unit["progress"] = read_json_object(os.path.join(unit_dir, "progress.json"), PROGRESS_MAX)
    except (OSError, ValueError) as exc:
        unit["progress"] = None
        unit["progress_error"] = f"progress.json: {exc}"
    unit["process"] = unit_process(unit["pid"], boot_id)
    unit["group_pids"] = []
    unit["logs"] = unit_logs(unit_dir)
    return unit


def read_units(workdir: str, boot_id: str | None, errors: Json) -> dict[str, Json]:
    units_dir = os.path.join(workdir, "units")
    try:
        entries = sorted(os.scandir(units_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return {}
    units: dict[str, Json] = {}
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            units[entry.name] = read_unit(entry.name, entry.path, boot_id)
        except Exception as exc:  # one odd unit must not hide the others
            errors[f"units/{entry.name}"] = describe(exc)
    return units


# ----------------------------------------------------------------------------------------------
# payloads, disk, paths


def read_payloads(workdir: str) -> dict[str, str]:
    root = os.path.join(workdir, "payloads")
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.startswith(".") and ".dflashops-tmp." in fn:
                continue  # an interrupted upload's leftover, never a shipped file
            path = os.path.join(dirpath, fn)
            if not os.path.isfile(path):
                continue
            try:
                out[os.path.relpath(path, root)] = sha256_file(path)
            except OSError:
                continue
    return out


def disk_facts(workdir: str) -> Json:
    path = workdir
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return {
        "path": path,
        "free_bytes": st.f_bavail * st.f_frsize,
        "total_bytes": st.f_blocks * st.f_frsize,
    }


def path_checks(paths: list[str]) -> dict[str, Json]:
    out: dict[str, Json] = {}
    for p in paths:
        full = os.path.expanduser(p)
        out[p] = {"exists": os.path.exists(full), "is_dir": os.path.isdir(full)}
    return out


# ----------------------------------------------------------------------------------------------


def section(errors: Json, name: str, default: Any, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        errors[name] = describe(exc)
        return default


def parse_request(argv: list[str]) -> Json:
    if len(argv) < 2:
        return {}
    request = json.loads(argv[1])
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    for key in ("imports", "paths"):
        value = request.get(key, [])
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f"request {key!r} must be a list of strings")
    return request


def gather(request: Json) -> Json:
    started = time.monotonic()
    errors: Json = {}
    workdir = os.path.abspath(os.path.expanduser(str(request.get("workdir") or "~/dflashops")))
    imports = list(dict.fromkeys(request.get("imports") or []))
    import_timeout = float(request.get("import_timeout", 120))
    smi_timeout = float(request.get("nvidia_smi_timeout", 30))

    # The slow parts (nvidia-smi, imports) run in threads while this one reads /proc and files.
    slow: Json = {"gpus": no_gpus("nvidia-smi not found"), "imports": {}}
    smi = which("nvidia-smi")

    def gpus_job() -> None:
        slow["gpus"] = section(errors, "gpus", no_gpus(None), lambda: gather_gpus(smi_timeout, smi))

    def imports_job() -> None:
        slow["imports"] = section(
            errors, "imports", {}, lambda: gather_imports(imports, import_timeout)
        )

    jobs = ([gpus_job] if smi else []) + ([imports_job] if imports else [])
    threads: list[Any] = []
    if jobs:
        import threading

        threads = [threading.Thread(target=job, daemon=True) for job in jobs]
        for t in threads:
            t.start()

    boot_id = first_line("/proc/sys/kernel/random/boot_id")
    uptime = first_line("/proc/uptime")
    facts: Json = {
        "schema": SCHEMA,
        "hostname": socket.gethostname(),
        "time": time.time(),
        "python": ".".join(str(x) for x in sys.version_info[:3]),
        "python_executable": sys.executable,
        "boot_id": boot_id,
        "clock_ticks": section(errors, "clock_ticks", None, lambda: os.sysconf("SC_CLK_TCK")),
        "uptime_s": float(uptime.split()[0]) if uptime else None,
        "workdir": workdir,
        "workdir_exists": os.path.isdir(workdir),
    }
    facts["disk"] = section(errors, "disk", None, lambda: disk_facts(workdir))
    units = section(errors, "units", {}, lambda: read_units(workdir, boot_id, errors))
    listening = section(errors, "listening", [], read_listeners)

    groups = {
        u["pid"]["pgid"]
        for u in units.values()
        if u["process"]["ours"] and is_int((u["pid"] or {}).get("pgid"))
    }
    inodes = {entry["inode"] for entry in listening if entry["inode"]}
    by_inode, by_pgid = section(errors, "proc", ({}, {}), lambda: scan_proc(inodes, bool(groups)))
    for entry in listening:
        entry["pids"] = sorted(by_inode.get(entry["inode"], []))
    for u in units.values():
        pgid = (u["pid"] or {}).get("pgid")
        if u["process"]["ours"] and is_int(pgid):
            u["group_pids"] = sorted(by_pgid.get(pgid, []))
    facts["listening"] = listening
    facts["units"] = units
    facts["payloads"] = section(errors, "payloads", {}, lambda: read_payloads(workdir))
    facts["paths"] = section(errors, "paths", {}, lambda: path_checks(request.get("paths") or []))

    for t in threads:
        t.join()
    facts["gpus"] = slow["gpus"]
    facts["imports"] = slow["imports"]
    facts["errors"] = errors
    facts["elapsed_s"] = round(time.monotonic() - started, 4)
    return facts


def main(argv: list[str]) -> int:
    try:
        request = parse_request(argv)
    except ValueError as exc:
        sys.stderr.write(f"dflashops facts: bad request: {exc}\n")
        return 2
    facts = gather(request)
    sys.stdout.write(json.dumps(facts, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
