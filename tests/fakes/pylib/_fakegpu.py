"""Fake GPU state for the test fleet, shared by the fake nvidia-smi and the fake engines.

Stdlib only: it runs under the test hosts' bare /usr/bin/python3.

``$FAKE_GPU_STATE`` is a per-host directory:

- ``config.json``: ``{"count": 8, "name": "NVIDIA RTX PRO 6000", "memory_total_mib": 97887}``,
  every key optional (defaults: 8 x "NVIDIA B200" with 183359 MiB).
- ``procs/<pid>.json``: ``{"pid": N, "gpus": [physical indices], "used_mib": M}`` written by a
  fake engine (``register``). M is per GPU. The entry counts only while the process lives:
  readers drop and delete entries whose pid is gone, a zombie, or reused by another process
  (``start_time`` from /proc, when recorded, must match).
- ``held/*.json``: the same shape, never expired: GPU memory that stays held after the process
  that took it is gone (a wedged driver context, a leaked child).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CONFIG: dict[str, Any] = {"count": 8, "name": "NVIDIA B200", "memory_total_mib": 183359}
DRIVER_VERSION = "580.95.05"
CUDA_VERSION = "13.0"


def state_dir() -> Path | None:
    raw = os.environ.get("FAKE_GPU_STATE", "")
    return Path(raw) if raw else None


def load_config(sd: Path | None = None) -> dict[str, Any]:
    sd = state_dir() if sd is None else sd
    cfg = dict(DEFAULT_CONFIG)
    if sd is not None:
        with contextlib.suppress(FileNotFoundError):
            cfg.update(json.loads((sd / "config.json").read_text()))
    cfg["count"] = int(cfg["count"])
    cfg["memory_total_mib"] = int(cfg["memory_total_mib"])
    return cfg


def gpu_uuid(index: int, sd: Path | None = None) -> str:
    """Deterministic per host directory and GPU index, formatted like a real GPU UUID."""
    sd = state_dir() if sd is None else sd
    seed = f"{sd.resolve() if sd is not None else ''}:{index}"
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def pci_bus_id(index: int) -> str:
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def visible_gpus(cfg: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> list[int]:
    """Physical GPU indices a process may use, like CUDA reads CUDA_VISIBLE_DEVICES.

    Unset: every GPU. Parsing stops at the first entry that is not a valid index (CUDA ignores
    the rest of the list too), so ``""`` means no GPU at all.
    """
    cfg = load_config() if cfg is None else cfg
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(cfg["count"]))
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= cfg["count"] or int(part) in out:
            break
        out.append(int(part))
    return out


def proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), or None when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_alive(pid: int, start_time: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return False
    return start_time is None or fields[19] == start_time


def _write_atomic(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def register(
    used_mib: int | None = None, gpus: list[int] | None = None, cleanup: bool = True
) -> Path | None:
    """Record that this process holds ``used_mib`` MiB on each of ``gpus``.

    ``gpus`` defaults to the visible GPUs (CUDA_VISIBLE_DEVICES as physical indices, else all),
    ``used_mib`` to 80% of a GPU. No-op without FAKE_GPU_STATE. With ``cleanup`` the entry is
    removed at normal interpreter exit (a killed process leaves it for readers to expire).
    """
    sd = state_dir()
    if sd is None:
        return None
    cfg = load_config(sd)
    gpus = visible_gpus(cfg) if gpus is None else list(gpus)
    if used_mib is None:
        used_mib = int(cfg["memory_total_mib"] * 0.8)
    pid = os.getpid()
    path = sd / "procs" / f"{pid}.json"
    entry = {
        "pid": pid,
        "gpus": gpus,
        "used_mib": int(used_mib),
        "name": sys.executable or "python3",
        "start_time": proc_start_time(pid),
    }
    _write_atomic(path, entry)
    if cleanup:
        atexit.register(unregister, path)
    return path


def unregister(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _entries(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (FileNotFoundError, ValueError):
            continue  # removed meanwhile, or half-written by someone not using _write_atomic
    return out


def read_state(prune: bool = True) -> dict[str, Any]:
    """Current GPUs and processes; dead processes' entries are deleted when ``prune``.

    Returns ``{"dir", "config", "gpus": [{index, uuid, name, pci_bus_id, memory_total_mib,
    memory_used_mib, memory_free_mib}], "apps": [{pid, gpu, gpu_uuid, used_mib, process_name,
    held}]}`` with one app row per (process, GPU).
    """
    sd = state_dir()
    cfg = load_config(sd)
    count = cfg["count"]
    used = [0] * count
    apps: list[dict[str, Any]] = []
    if sd is not None:
        live = []
        for path, e in _entries(sd / "procs"):
            if process_alive(int(e["pid"]), e.get("start_time")):
                live.append((e, False))
            elif prune:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        live += [(e, True) for _, e in _entries(sd / "held")]
        for e, held in live:
            for g in e.get("gpus", []):
                if not 0 <= int(g) < count:
                    continue
                used[int(g)] += int(e["used_mib"])
                apps.append(
                    {
                        "pid": int(e["pid"]),
                        "gpu": int(g),
                        "gpu_uuid": gpu_uuid(int(g), sd),
                        "used_mib": int(e["used_mib"]),
                        "process_name": e.get("name") or ("[held]" if held else "python3"),
                        "held": held,
                    }
                )
    total = cfg["memory_total_mib"]
    gpus = [
        {
            "index": i,
            "uuid": gpu_uuid(i, sd),
            "name": cfg["name"],
            "pci_bus_id": pci_bus_id(i),
            "memory_total_mib": total,
            "memory_used_mib": min(used[i], total),
            "memory_free_mib": max(total - used[i], 0),
        }
        for i in range(count)
    ]
    apps.sort(key=lambda a: (a["gpu"], a["pid"]))
    return {"dir": str(sd) if sd else None, "config": cfg, "gpus": gpus, "apps": apps}
