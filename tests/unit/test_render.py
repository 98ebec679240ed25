"""Rendering: quoting by construction, fingerprints, template overrides, no shell injection."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from jinja2 import TemplateError

from dflashops.config.load import load_inventory, load_playbook
from dflashops.engines.render import Rendered, make_environment, render_plan, template_dirs
from dflashops.plan import build_plan
from tests.conftest import WriteTree

INVENTORY = "hosts:\n  h: {address: 127.0.0.1, gpus: 4, python: /usr/bin/python3, env: {HOST_WIDE: 'yes'}}\n"
ECHO_ARGV = ["python3", "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]


def render(
    write_tree: WriteTree, playbook: str, extra: dict[str, str] | None = None
) -> dict[str, Rendered]:
    root = write_tree({"inventory.yaml": INVENTORY, "playbooks/p.yaml": playbook, **(extra or {})})
    books = [load_playbook(root / "playbooks/p.yaml")]
    plan = build_plan(load_inventory(root / "inventory.yaml"), books)
    assert plan.problems == []
    rendered, problems = render_plan(plan, template_dirs(b.path for b in books))
    assert problems == []
    return {r.unit.name: r for r in rendered}


def run_script(tmp_path: Path, r: Rendered) -> subprocess.CompletedProcess[str]:
    """Run a launch script from the host layout it expects (WORKDIR/units/NAME/launch.sh)."""
    unit_dir = tmp_path / "workdir" / "units" / r.unit.name
    unit_dir.mkdir(parents=True)
    script = unit_dir / "launch.sh"
    script.write_text(r.script)
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=30, check=False
    )


def test_sglang_script_shape(write_tree: WriteTree) -> None:
    units = render(
        write_tree,
        """
        name: p
        hosts: h
        services:
          - name: sglang
            engine: sglang
            model: /dev/shm/Qwen3.6-27B
            replicas: 2
            tp: 2
            port: 30000
            args: {mem-fraction-static: 0.88, speculative-algorithm: NEXTN, enable-metrics: true, log-requests: false}
            env: {SGLANG_ENABLE_JIT_DEEPGEMM: "1"}
            secret_env: {HF_TOKEN: MY_HF_TOKEN}
        """,
    )
    script = units["sglang-1"].script
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail\n" in script
    assert "export CUDA_VISIBLE_DEVICES=2,3\n" in script
    assert (
        "export SGLANG_ENABLE_JIT_DEEPGEMM=1\nexport HOST_WIDE=yes\n" not in script
    )  # sorted, host env merged
    assert "export HOST_WIDE=yes\nexport SGLANG_ENABLE_JIT_DEEPGEMM=1\n" in script
    assert (
        "exec /usr/bin/python3 -m sglang.launch_server --model-path /dev/shm/Qwen3.6-27B --host 127.0.0.1 "
        "--port 30001 --tp-size 2 --dp-size 1 --mem-fraction-static 0.88 --speculative-algorithm NEXTN "
        "--enable-metrics\n"
    ) in script
    assert f"sglang-1 {units['sglang-1'].fingerprint} sglang 2 1 30001 2,3" in script
    # The secret's name appears (to say what is missing); its value and source never do.
    assert "secrets.env" in script and "MY_HF_TOKEN" not in script
    assert units["sglang-0"].fingerprint != units["sglang-1"].fingerprint


def test_fingerprint_tracks_everything_that_defines_the_unit(
    write_tree: WriteTree, tmp_path: Path
) -> None:
    base = "name: p\nhosts: h\njobs:\n  - {name: j, script: ../scripts/job.py, args: {n: 1}}\n"
    first = render(write_tree, base, {"scripts/job.py": "print(1)\n"})["j"]
    again = render(write_tree, base, {"scripts/job.py": "print(1)\n"})["j"]
    assert first.fingerprint == again.fingerprint and first.script == again.script
    changed_file = render(write_tree, base, {"scripts/job.py": "print(2)\n"})["j"]
    assert changed_file.fingerprint != first.fingerprint
    changed_args = render(
        write_tree, base.replace("n: 1", "n: 2"), {"scripts/job.py": "print(1)\n"}
    )["j"]
    assert changed_args.fingerprint != first.fingerprint
    with_secret = render(
        write_tree,
        base.replace("args: {n: 1}", "args: {n: 1}, secret_env: {T: T}"),
        {"scripts/job.py": "print(1)\n"},
    )["j"]
    assert with_secret.fingerprint != first.fingerprint


def test_job_script_runs_with_host_python_and_gets_server_urls(write_tree: WriteTree) -> None:
    units = render(
        write_tree,
        """
        name: p
        hosts: h
        services:
          - {name: stub, engine: stub, model: m, replicas: 2, port: 31000}
        jobs:
          - {name: gen, script: "dflashops:stub_engine", servers: stub, args: {concurrency: 8}}
        """,
    )
    gen = units["gen"]
    assert gen.files[0].name == "stub_engine.py"
    remote = gen.files[0].remote
    assert (
        f'exec /usr/bin/python3 "${{DFLASHOPS_WORKDIR}}"/{remote} --concurrency 8 --servers http://127.0.0.1:31000 http://127.0.0.1:31001\n'
        in gen.script
    )
    assert "export CUDA_VISIBLE_DEVICES=''\n" in gen.script  # a CPU job sees no GPU
    assert "STAND-IN" in units["stub-0"].script


def test_values_with_shell_metacharacters_run_no_injected_command(
    write_tree: WriteTree, tmp_path: Path
) -> None:
    canary = tmp_path / "pwned"
    nasty = [
        f"; touch {canary}",
        f"$(touch {canary})",
        f"`touch {canary}`",
        'it\'s "quoted"',
        f"line one\ntouch {canary}",
        "$HOME ${PATH} * ? [a] ~ & | > <",
    ]
    command = json.dumps([*ECHO_ARGV, *nasty])
    env = json.dumps({f"V{i}": v for i, v in enumerate(nasty)})
    units = render(
        write_tree,
        f"""
        name: p
        hosts: h
        jobs:
          - name: j
            command: {command}
            env: {env}
            args: {{flag: {json.dumps(nasty[1])}}}
        """,
    )
    r = units["j"]
    assert subprocess.run(["bash", "-n"], input=r.script, text=True, check=False).returncode == 0
    proc = run_script(tmp_path, r)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.strip().splitlines()[-1]
    assert json.loads(printed) == [*nasty, "--flag", nasty[1]]
    assert not canary.exists()


def test_banner_and_workdir_detection(write_tree: WriteTree, tmp_path: Path) -> None:
    units = render(
        write_tree,
        f"name: p\nhosts: h\njobs:\n  - {{name: j, command: {json.dumps(['bash', '-c', 'echo wd=$DFLASHOPS_WORKDIR cwd=$PWD'])}}}\n",
    )
    proc = run_script(tmp_path, units["j"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(
        f"[dflashops] unit=j fingerprint={units['j'].fingerprint} engine=job tp=1 dp=1 port=- gpus=- started="
    )
    workdir = (tmp_path / "workdir").resolve()
    assert lines[-1] == f"wd={workdir} cwd={workdir / 'units' / 'j'}"


def test_missing_secrets_file_stops_the_script(write_tree: WriteTree, tmp_path: Path) -> None:
    units = render(
        write_tree,
        "name: p\nhosts: h\njobs:\n  - {name: j, command: [echo, ran], secret_env: {HF_TOKEN: HF_TOKEN}}\n",
    )
    proc = run_script(tmp_path, units["j"])
    assert proc.returncode == 78
    assert "secrets.env is missing" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert "ran" not in proc.stdout


def test_user_template_overrides_builtin(write_tree: WriteTree) -> None:
    override = '{% extends "_unit.sh.j2" %}\n{% block prelude %}\nulimit -n 65536\necho {{ unit.name|q }}\n{% endblock %}\n'
    units = render(
        write_tree,
        "name: p\nhosts: h\nservices:\n  - {name: s, engine: sglang, model: /m}\n",
        {"templates/sglang.sh.j2": override},
    )
    assert "ulimit -n 65536\necho s-0\n" in units["s-0"].script


def test_unquoted_value_in_a_template_is_refused() -> None:
    env = make_environment([])
    with pytest.raises(TemplateError, match="unquoted value"):
        env.from_string("echo {{ value }}").render(value="$(reboot)")
    assert env.from_string("echo {{ value|q }}").render(value="$(reboot)") == "echo '$(reboot)'"


def test_vllm_launcher_puts_vllm_args_after_double_dash(write_tree: WriteTree) -> None:
    units = render(
        write_tree,
        """
        name: p
        hosts: h
        services:
          - name: vllm
            engine: vllm
            model: /models/Qwen3.6-27B
            tp: 2
            launcher:
              script: host:/workspace/speculators/scripts/launch_vllm.py
              args: {hidden-states-path: /hs, target-layer-ids: [2, 32, 61]}
            args: {speculative-config: {method: eagle3, num_speculative_tokens: 3}}
        """,
    )
    assert (
        "exec /usr/bin/python3 /workspace/speculators/scripts/launch_vllm.py /models/Qwen3.6-27B "
        "--hidden-states-path /hs --target-layer-ids 2 32 61 -- --host 127.0.0.1 --port 8000 "
        "--tensor-parallel-size 2 --data-parallel-size 1 "
        '--speculative-config \'{"method":"eagle3","num_speculative_tokens":3}\'\n'
    ) in units["vllm-0"].script
