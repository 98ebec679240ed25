"""Per-engine command lines: SGLang, vLLM, the stub stand-in, plain commands, and jobs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops.config.playbook import CommandService, Job, ModelService, VllmService
from dflashops.engines import secrets
from dflashops.engines.base import (
    HOST_PREFIX,
    BesideTool,
    EnvPython,
    HostPath,
    Launch,
    ShippedFile,
    Token,
    WorkPath,
    resolve_file,
    to_flags,
)

if TYPE_CHECKING:
    from dflashops.plan import Unit


def launch_for(unit: Unit) -> Launch:
    """The argv and files of a unit. Problems (a missing script) come back in ``Launch.problems``.
    Its secret_args reach the engine through a 0600 file, never as values in argv."""
    launch = _launch(unit)
    launch.secrets = secrets.split(unit)
    hidden = secrets.flags(unit, launch.secrets)
    if hidden:
        # After the unit's own flags (a job's --servers stays last); vLLM's launcher passes
        # everything after its `--` on to vLLM.
        tail = len(unit.servers) + 1 if isinstance(unit.spec, Job) and unit.servers else 0
        at = len(launch.argv) - tail
        launch.argv[at:at] = hidden
        launch.engine_args += secrets.checked_flags(unit, launch.secrets)
    if launch.secrets.config and "config" in getattr(unit.spec, "args", {}):
        launch.problems.append(
            unit.problem(
                "`args: config` and secret_args both need the engine's one --config file: move "
                "the settings of that file into `args`",
                "args",
                "config",
            )
        )
    return launch


def _launch(unit: Unit) -> Launch:
    spec = unit.spec
    python: Token = EnvPython(unit.env.path) if unit.env else HostPath(unit.host.python)
    if isinstance(spec, Job):
        return _job(unit, spec, python)
    if isinstance(spec, CommandService):
        argv: list[Token] = [
            a.replace("{port}", str(unit.port)).replace("{replica}", str(unit.replica))
            for a in spec.command
        ]
        launch = Launch([*argv, *to_flags(spec.args)], health_path=spec.ready.path)
        if unit.port is None and any("{port}" in a for a in spec.command):
            launch.problems.append(
                unit.problem("the command uses {port} but the service has no `port`", "command")
            )
        return launch
    assert isinstance(spec, ModelService)
    port = str(unit.port)
    if spec.engine == "sglang":
        flags = [*_sglang_core(spec, port if unit.port is not None else None), *_nodes(unit)]
        flags += to_flags(spec.args)
        return Launch(
            [python, "-m", "sglang.launch_server", *flags],
            flags,
            health_path=spec.ready.path or "/health",
            env=_node_env(unit),
        )
    if spec.engine == "stub":
        stub = ShippedFile.of(resolve_file("dflashops:stub_engine", Path()))
        flags = [*_sglang_core(spec, port), *to_flags(spec.args)]
        return Launch(
            [python, WorkPath(stub.remote), *flags],
            flags,
            files=[stub],
            health_path=spec.ready.path or "/health",
        )
    assert isinstance(spec, VllmService)
    if unit.engine == "ray":
        return _ray_node(unit, python)
    vllm_args = [
        "--host",
        spec.bind,
        *(["--port", port] if unit.port is not None else []),
        "--tensor-parallel-size",
        str(spec.tp),
        "--data-parallel-size",
        str(spec.dp),
        # Only when set: fingerprints of the units that never had it stay what they were.
        *(["--pipeline-parallel-size", str(spec.pp)] if spec.pp > 1 else []),
        *_vllm_nodes(unit),
        *to_flags(spec.args),
    ]
    health = spec.ready.path or "/health"
    if unit.cluster:
        return _vllm_on_ray(unit, spec, python, vllm_args, health)
    if spec.launcher is None:
        env = _node_env(unit)
        if unit.multi_node:
            env["VLLM_HOST_IP"] = unit.host.dial_address  # what the other nodes reach it at
        return Launch(
            [python, "-m", "vllm.entrypoints.cli.main", "serve", spec.model, *vllm_args],
            vllm_args,
            health_path=health,
            env=env,
        )
    launch = Launch([], vllm_args, health_path=health)
    script = _ship(unit, spec.launcher.script, launch, ("launcher", "script"))
    launch.argv = [python, script, spec.model, *to_flags(spec.launcher.args), "--", *vllm_args]
    return launch


def _sglang_core(spec: ModelService, port: str | None) -> list[str]:
    """``port`` None: a worker rank of a multi-node service, which serves no HTTP."""
    return [
        "--model-path",
        spec.model,
        "--host",
        spec.bind,
        *(["--port", port] if port is not None else []),
        "--tp-size",
        str(spec.tp),
        "--dp-size",
        str(spec.dp),
    ]


def _nodes(unit: Unit) -> list[str]:
    """SGLang's own multi-node launch: every rank dials the head's rendezvous port."""
    if not unit.multi_node:
        return []
    return [
        "--nnodes",
        str(len(unit.nodes)),
        "--node-rank",
        str(unit.rank),
        "--dist-init-addr",
        f"{unit.head}:{unit.dist_port}",
    ]


def _vllm_nodes(unit: Unit) -> list[str]:
    """vLLM's native multi-node launch: the first node serves the API, the others are
    --headless engine ranks that dial its master port."""
    if not unit.multi_node:
        return []
    flags = [
        "--nnodes",
        str(len(unit.nodes)),
        "--node-rank",
        str(unit.rank),
        "--master-addr",
        str(unit.head),
        "--master-port",
        str(unit.dist_port),
    ]
    return [*flags, "--headless"] if unit.rank else flags


def _ray_node(unit: Unit, python: Token) -> Launch:
    """A node of a Ray cluster: ``ray start --block`` as the unit's process (stop TERMs it and
    it ends its own raylet, GCS and workers; ``ray stop`` would end every Ray on the machine).
    The head (rank 0) listens on ``dist_port``; the others join it there."""
    assert isinstance(python, (HostPath, EnvPython))
    where = (
        ["--head", "--port", str(unit.dist_port)]
        if unit.rank == 0
        else ["--address", f"{unit.head}:{unit.dist_port}"]
    )
    argv: list[Token] = [
        BesideTool(python, "ray"),
        "start",
        "--block",
        *where,
        "--node-ip-address",
        unit.host.dial_address,
        "--num-gpus",
        str(len(unit.gpus)),
        # Its own folder: two nodes of two clusters on one machine never share /tmp/ray. Short,
        # because Ray puts AF_UNIX sockets under it (at most 107 bytes a path).
        "--temp-dir",
        ray_temp_dir(unit),
        "--disable-usage-stats",
    ]
    env = {**_node_env(unit), "VLLM_HOST_IP": unit.host.dial_address}  # Ray's vLLM workers
    return Launch(argv, health_path=None, env=env, stop_leader=True)


def ray_temp_dir(unit: Unit) -> str:
    key = "\0".join((unit.host.name, unit.host.workdir, unit.name)).encode()
    return f"/tmp/dflashops-ray-{hashlib.sha256(key).hexdigest()[:12]}"


def _vllm_on_ray(
    unit: Unit, spec: VllmService, python: Token, vllm_args: list[str], health: str
) -> Launch:
    """The API server of a vLLM service over Ray, on the head node: dflashops' ray_cluster
    payload waits until the cluster shows every node with its GPUs, then execs ``vllm serve``
    (same process, so the unit's pid and log stay), which joins the cluster at RAY_ADDRESS."""
    from dflashops.plan import gpus_of  # plan imports no engine code: no cycle, run time only

    wait = ShippedFile.of(resolve_file("dflashops:ray_cluster", Path()))
    address = f"{unit.cluster[0]}:{unit.dist_port}"
    flags = [*vllm_args, "--distributed-executor-backend", "ray"]
    nodes = [a for ip in unit.cluster for a in ("--node", ip)]
    argv: list[Token] = [
        python,
        WorkPath(wait.remote),
        "--address",
        address,
        *nodes,
        "--gpus",
        str(gpus_of(spec)),
        "--timeout",
        f"{spec.ready.timeout:g}",
        "--",
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        spec.model,
        *flags,
    ]
    env = {"RAY_ADDRESS": address, "VLLM_HOST_IP": unit.cluster[0]}
    return Launch(argv, flags, files=[wait], health_path=health, env=env)


def _node_env(unit: Unit) -> dict[str, str]:
    """The interface NCCL and Gloo use between the nodes, when the inventory names one."""
    if not unit.multi_node or unit.host.net_if is None:
        return {}
    return {"NCCL_SOCKET_IFNAME": unit.host.net_if, "GLOO_SOCKET_IFNAME": unit.host.net_if}


def _job(unit: Unit, job: Job, python: Token) -> Launch:
    launch = Launch([])
    if job.command is not None:
        head: list[Token] = list(job.command)
    else:
        assert job.script is not None
        script = _ship(unit, job.script, launch, ("script",))
        suffix = Path(job.script.removeprefix(HOST_PREFIX)).suffix
        head = (
            [python, script]
            if suffix == ".py" or job.script.startswith("dflashops:")
            else (["bash", script] if suffix == ".sh" else [script])
        )
    servers: list[Token] = ["--servers", *unit.servers] if unit.servers else []
    if job.launcher == "torchrun":
        assert isinstance(python, (HostPath, EnvPython))
        head = [BesideTool(python, "torchrun"), *_torchrun(unit, job), *head[1:]]
        launch.env = _node_env(unit)
    launch.argv = [*head, *to_flags(job.args), *servers]
    return launch


def _torchrun(unit: Unit, job: Job) -> list[str]:
    """torchrun's own rendezvous: every node dials the first node's master port."""
    per_node = job.nproc_per_node or max(1, len(unit.gpus))
    return [
        "--nnodes",
        str(max(1, len(unit.nodes))),
        "--node-rank",
        str(unit.rank or 0),
        "--master-addr",
        unit.head or "127.0.0.1",
        "--master-port",
        str(job.dist_port),
        "--nproc-per-node",
        str(per_node),
    ]


def _ship(unit: Unit, ref: str, launch: Launch, field_path: tuple[str, ...]) -> Token:
    if ref.startswith(HOST_PREFIX):
        return ref[len(HOST_PREFIX) :]  # already on the host (e.g. inside an installed package)
    try:
        path = resolve_file(ref, unit.playbook.path.parent)
        exists = path.is_file()
    except (OSError, RuntimeError) as exc:  # ~nosuchuser, names too long for the filesystem
        launch.problems.append(unit.problem(f"file {ref!r} cannot be used: {exc}", *field_path))
        return ref
    if not exists:
        hint = (
            " (built-in workloads live in dflashops/builtins/)"
            if ref.startswith("dflashops:")
            else ""
        )
        launch.problems.append(unit.problem(f"file {ref!r} not found at {path}{hint}", *field_path))
        return ref
    shipped = ShippedFile.of(path)
    launch.files.append(shipped)
    return WorkPath(shipped.remote)
