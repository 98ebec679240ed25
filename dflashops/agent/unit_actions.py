"""The actions on a host's units: facts, start, stop, probe, tail and the verified write."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from dflashops.agent.answers import (
    GpuFacts,
    HostFacts,
    ProbeResult,
    ProbeSpec,
    StartResult,
    StopResult,
    TailResult,
    UnitProbe,
    WriteResult,
)
from dflashops.agent.calling import SLACK, AgentError, Caller
from dflashops.errors import HostError, TransferError


class UnitActions(Caller):
    def facts(
        self,
        workdir: str,
        *,
        imports: Sequence[str] = (),
        paths: Sequence[str] = (),
        files: Sequence[dict[str, Any]] = (),
        envs: Sequence[dict[str, Any]] = (),
        env_imports: Sequence[dict[str, Any]] = (),
        ports: Sequence[int] | None = None,
        probes: Sequence[ProbeSpec] = (),
        settled: dict[str, dict[str, Any]] | None = None,
        timeout: float = 180.0,
    ) -> HostFacts:
        """Everything about the host in one remote call (files: [{key, dest, expect, src,
        listing}], envs: [{name, path, hash}], env_imports: [{env, module, python}]).
        ``ports``: the listeners whose holders matter (None: all); ``probes``: units probed in
        the same call (``HostFacts.probe``), so that a deploy with nothing to do needs no other;
        ``settled`` ({unit: {fingerprint, job}}): when all of them run (or finished) as given,
        nvidia-smi is skipped (``gpus.skipped``; ask ``gpus`` if something starts after all)."""
        request: dict[str, Any] = {
            "workdir": workdir,
            "imports": list(imports),
            "paths": list(paths),
            "files": list(files),
            "envs": list(envs),
            "env_imports": list(env_imports),
            "ports": None if ports is None else sorted(set(ports)),
            # Imports and nvidia-smi run in parallel on the host; leave room for the rest.
            "import_timeout": max(1.0, min(120.0, timeout - 20.0)),
            "nvidia_smi_timeout": max(1.0, min(30.0, timeout / 2)),
            "probe": None,
            "settled": settled,
        }
        if probes:
            request["probe"] = {
                "units": [p.model_dump() for p in probes],
                "http_timeout": 5.0,
                "log_lines": 30,
            }
        data = self.call("facts", request, timeout=timeout)
        data["host"] = self.host
        if probes:
            if not isinstance(data.get("probe"), dict):
                problem = (data.get("errors") or {}).get("probe", "no probe in the answer")
                raise AgentError(self.host, f"the facts call did not probe the units: {problem}")
            data["probe"]["action"] = "facts"
            self.per_unit(UnitProbe, data["probe"], [p.name for p in probes])
        return self.validate(HostFacts, data, "facts")

    def gpus(self, workdir: str, timeout: float = 30.0) -> GpuFacts:
        """nvidia-smi alone (after a facts call that skipped it)."""
        request = {"workdir": workdir, "units": [], "http_timeout": timeout, "gpus": True}
        found = self.validate(
            ProbeResult, self.call("probe", request, timeout=timeout + SLACK), "probe"
        )
        if found.gpus is None:
            raise AgentError(self.host, "the probe answered without the GPUs asked for")
        return found.gpus

    def start(
        self,
        workdir: str,
        units: Sequence[tuple[str, int]],
        scripts: dict[str, str] | None = None,
    ) -> dict[str, StartResult]:
        """Start each ``(name, keep_logs)`` unit; returns at once (it never waits for the
        engine). ``scripts``: the sha256 of the launch.sh this run shipped, per unit: the host
        refuses a unit whose launch.sh on disk differs (another actor changed it)."""
        if not units:
            return {}
        shipped = scripts or {}
        request = {
            "workdir": workdir,
            "units": [
                {"name": n, "keep_logs": k, "launch_sha256": shipped.get(n)} for n, k in units
            ],
        }
        data = self.call("start", request, timeout=60.0)
        return self.per_unit(StartResult, data, [n for n, _ in units])

    def stop(
        self,
        workdir: str,
        units: Sequence[tuple[str, float | None]],
        *,
        prune: bool = False,
        gpu_timeout: float = 60.0,
        kill_wait: float = 10.0,
    ) -> dict[str, StopResult]:
        """Stop each ``(name, grace)`` unit (grace None: the one recorded at deploy): TERM to
        all, KILL after each grace, then GPU memory; ``prune`` moves their folders aside."""
        if not units:
            return {}
        request = {
            "workdir": workdir,
            "units": [{"name": n, "grace": g, "prune": prune} for n, g in units],
            "kill_wait": kill_wait,
            "gpu_timeout": gpu_timeout,
        }
        longest = max(g if g is not None else 3600.0 for _, g in units)
        data = self.call("stop", request, timeout=longest + kill_wait + gpu_timeout + SLACK)
        return self.per_unit(StopResult, data, [n for n, _ in units])

    def probe(
        self,
        workdir: str,
        probes: Sequence[ProbeSpec],
        *,
        http_timeout: float = 5.0,
        log_lines: int = 30,
    ) -> dict[str, UnitProbe]:
        """Process state, health, identity, banner (and a dead unit's log tail) for every unit."""
        if not probes:
            return {}
        request = {
            "workdir": workdir,
            "units": [p.model_dump() for p in probes],
            "http_timeout": http_timeout,
            "log_lines": log_lines,
        }
        data = self.call("probe", request, timeout=http_timeout + SLACK)
        names = [p.name for p in probes]
        self.per_unit(UnitProbe, data, names)  # every unit answered, each valid
        return self.validate(ProbeResult, data, "probe").units

    def observe(
        self, workdir: str, probes: Sequence[ProbeSpec], *, http_timeout: float = 5.0
    ) -> ProbeResult:
        """What `top` shows of a host in one call: every unit's probe (metrics included) and
        nvidia-smi, with the host's clock."""
        request = observe_request(workdir, probes, http_timeout)
        data = self.call("probe", request, timeout=http_timeout + SLACK)
        self.per_unit(UnitProbe, data, [p.name for p in probes])
        return self.validate(ProbeResult, data, "probe")

    def tail(
        self,
        workdir: str,
        unit: str,
        lines: int = 100,
        offset: int | None = None,
        log: str | None = None,
    ) -> TailResult:
        """The last ``lines`` of the unit's current log; with ``offset`` (and the ``log`` it
        came with) what was written since, to follow a log by polling."""
        request = {"workdir": workdir, "unit": unit, "lines": lines, "offset": offset, "log": log}
        return self.validate(TailResult, self.call("tail", request, timeout=60.0), "tail")

    def write(
        self, workdir: str, files: Sequence[tuple[bytes, str, int]], timeout: float = 600.0
    ) -> None:
        """Write (data, absolute path, mode) files in ONE round trip, each verified on the
        host; none is renamed unless all arrived intact (TransferError says why)."""
        if not files:
            return
        manifest = [
            {
                "path": path,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "mode": mode,
            }
            for data, path, mode in files
        ]
        paths = ", ".join(p for _, p, _ in files)
        try:
            data = self.call(
                "write",
                {"workdir": workdir, "files": manifest},
                data=b"".join(d for d, _, _ in files),
                timeout=timeout,
            )
        except HostError as exc:
            why = exc.message_for(self.host)
            raise TransferError(
                self.host, f"shipping {paths} failed, previous versions left in place: {why}"
            ) from None
        result = self.validate(WriteResult, data, "write")
        if not result.ok:
            raise TransferError(
                self.host, f"shipping failed, previous versions left in place: {result.error}"
            )
        if result.written != [p for _, p, _ in files]:
            raise TransferError(
                self.host,
                f"the host did not confirm the files it was sent (got {result.written!r})",
            )


def observe_request(
    workdir: str, probes: Sequence[ProbeSpec], http_timeout: float
) -> dict[str, Any]:
    return {
        "workdir": workdir,
        "units": [p.model_dump() for p in probes],
        "http_timeout": http_timeout,
        "log_lines": 0,
        "gpus": True,
    }
