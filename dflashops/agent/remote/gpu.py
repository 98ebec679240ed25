"""nvidia-smi, parsed once: devices (memory, utilisation), compute processes, and the wait
until given processes no longer hold GPU memory (after a stop, before a restart)."""

from __future__ import annotations

import time

from .common import Json, describe, which

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

NA_VALUES = ("", "[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]")
DEVICE_QUERY = "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu"
APPS_QUERY = "--query-compute-apps=pid,gpu_uuid,used_memory,process_name"
POLL_S = 0.25


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


def rows(exe: str, query: str, timeout: float) -> list[list[str]]:
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


def empty(error: str | None) -> Json:
    return {"available": False, "error": error, "devices": [], "processes": []}


def skipped() -> Json:
    """nvidia-smi was not run: nothing asked about could start (see facts.all_settled)."""
    return {**empty("not gathered: nothing here is to start"), "skipped": True}


def numbered(table: list[list[str]], width: int) -> Iterator[tuple[int, str, list[str]]]:
    """(first cell as a number, GPU uuid, the cells) of each well-formed row of an nvidia-smi
    CSV answer: rows too short or without a number first are skipped."""
    for cells in table:
        first = parse_int(cells[0]) if len(cells) >= width else None
        if first is not None:
            yield first, na_str(cells[1]) or "", cells


def gather(timeout: float, exe: str | None = None) -> Json:
    """{available, error, devices [{index, uuid, name, memory_used_mib, memory_total_mib,
    utilization_pct}], processes [{pid, gpu_uuid, gpu_index, used_mib, process_name}]}.

    The compute-apps query runs only when a device has memory in use: a process on a GPU holds
    memory (its CUDA context alone is hundreds of MiB), so with every device at 0 MiB the list is
    empty, and an idle node pays for one nvidia-smi, not two (it is slow: NVML's start-up)."""
    exe = exe or which("nvidia-smi")
    if exe is None:
        return empty("nvidia-smi not found")
    got: dict[str, list[list[str]]] = {}
    errors: dict[str, str] = {}

    def one(key: str, query: str) -> None:
        try:
            got[key] = rows(exe, query, timeout)
        except Exception as exc:
            errors[key] = str(exc) if isinstance(exc, RuntimeError) else describe(exc)

    one("gpu", DEVICE_QUERY)
    if "gpu" in errors:
        return empty(errors["gpu"])
    used = [parse_int(c[-3]) if len(c) >= 6 else None for c in got.get("gpu", [])]
    if any(u != 0 for u in used):  # in use, or not known: ask who holds it
        one("apps", APPS_QUERY)
    result = empty(None)
    by_uuid: dict[str, int] = {}
    for index, uuid, cells in numbered(got.get("gpu", []), 6):
        result["devices"].append(
            {
                "index": index,
                "uuid": uuid,
                "name": ", ".join(cells[2:-3]),  # a name with a comma in it stays whole
                "memory_used_mib": parse_int(cells[-3]),
                "memory_total_mib": parse_int(cells[-2]),
                "utilization_pct": parse_int(cells[-1]),
            }
        )
        by_uuid[uuid] = index
    result["available"] = True
    if "apps" in errors:
        result["error"] = "compute-apps query: " + errors["apps"]
        return result
    for pid, uuid, cells in numbered(got.get("apps", []), 4):
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


def wait_released(pids: set[int], timeout: float, give_up: Any = None) -> Json:
    """Wait until nvidia-smi lists none of ``pids``: {freed, held [{pid, gpu_index, used_mib}],
    error}. ``freed`` is None without a usable nvidia-smi (nothing to wait for), False when
    memory is still held after ``timeout`` or as soon as ``give_up()`` says so (a process of
    theirs survived KILL: waiting longer cannot help)."""
    exe = which("nvidia-smi")
    if exe is None or not pids:
        return {"freed": None if exe is None else True, "held": [], "error": None}
    deadline = time.monotonic() + timeout
    seen: list[Json] | None = None  # what the last answer that came said was held
    while True:
        remaining = deadline - time.monotonic()
        found = gather(max(1.0, min(30.0, remaining + 1.0)), exe)
        if not found["available"] or found["error"]:
            if seen is not None:  # held when last seen: a slow nvidia-smi since is no release
                return {"freed": False, "held": seen, "error": found["error"]}
            return {"freed": None, "held": [], "error": found["error"]}
        held = sorted(
            (
                {"pid": p["pid"], "gpu_index": p["gpu_index"], "used_mib": p["used_mib"]}
                for p in found["processes"]
                if p["pid"] in pids
            ),
            key=lambda a: (a["pid"], -1 if a["gpu_index"] is None else a["gpu_index"]),
        )
        if not held:
            return {"freed": True, "held": [], "error": None}
        seen = held
        if time.monotonic() >= deadline or (give_up is not None and give_up()):
            return {"freed": False, "held": held, "error": None}
        time.sleep(POLL_S)


def held_text(held: list[Json]) -> str:
    return ", ".join(f"pid {a['pid']} on GPU {a['gpu_index']} ({a['used_mib']} MiB)" for a in held)
