"""The installed engine has the last word on a unit's command line (DESIGN "Real parts" 3),
against the sshd fleet: deploy asks it before it stops a running unit whose command line
changed, and `preflight --live` asks it for every unit.

The fleet's hosts carry the fake engines (tests/fakes/pylib), whose parser entry points reject
a wrongly typed value with argparse's own message; one test gives its host the real SGLang of
.venv-parsers as its python instead (skipped locally without it, failing under CI=true).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fleet import FleetFactory
from lifecycle_helpers import Ops, engine_pid, sglang, unit_pid

from tests.conftest import REPO, unless
from tests.procs import alive, free_ports, http_status

PARSERS_PYTHON = REPO / ".venv-parsers" / "bin" / "python"
needs_parsers = unless(
    (REPO / ".venv-parsers" / ".dflashops-spec").is_file(),
    "no .venv-parsers here: `bash dev/parsers-env.sh` builds it",
)


def python_wrapper(path: Path, body: str) -> str:
    """A host python that is a script: the fleet's PYTHONPATH (the fake engines) is set for
    every ssh session, so a host that should see other packages needs its own."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_deploy_leaves_the_running_unit_alone_when_its_engine_rejects_or_cannot_import(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    fleet = fleet_factory("a")
    host = fleet["a"]
    port = free_ports(1)
    ctl = ops(fleet)
    ctl.playbook("serve", {"hosts": ["a"], "services": [sglang(port, replicas=1)]})
    first = ctl.run("deploy")
    assert first.code == 0, first.explain()
    supervisor, engine = unit_pid(host, "sglang-0"), engine_pid(host, "sglang-0")

    # A value SGLang's parser refuses: the unit fails with that message, before any stop.
    bad = sglang(port, replicas=1, args={"mem-fraction-static": "lots"})
    ctl.playbook("serve", {"hosts": ["a"], "services": [bad]})
    second = ctl.run("deploy")
    assert second.code != 0, second.explain()
    (failed,) = second.of("sglang-0", action="check", status="failed")
    assert "argument --mem-fraction-static: invalid float value: 'lots'" in failed["message"]
    assert "not restarted, still running its old process" in failed["message"]
    assert not second.of("sglang-0", action="stop") and not second.of("sglang-0", action="start")
    assert (unit_pid(host, "sglang-0"), engine_pid(host, "sglang-0")) == (supervisor, engine)
    assert alive(engine) and http_status(port, "/health") == 200

    # The same line, but the host's python cannot import the engine any more (a broken
    # install): the unit fails with the import error, and the old server still serves.
    broken = tmp_path / "broken"
    (broken / "sglang").mkdir(parents=True)
    (broken / "sglang" / "__init__.py").write_text(
        'raise ImportError("libcudart.so.13: cannot open shared object file")\n'
    )
    python = python_wrapper(tmp_path / "python", f'PYTHONPATH={broken} exec /usr/bin/python3 "$@"')
    fleet.write_inventory(ctl.inventory, hosts={"a": {"python": python}})
    ctl.playbook("serve", {"hosts": ["a"], "services": [sglang(port, replicas=1)]})
    third = ctl.run("deploy")
    assert third.code != 0, third.explain()
    (failed,) = third.of("sglang-0", action="check", status="failed")
    assert f"cannot import sglang with {python}: ImportError: libcudart.so.13" in failed["message"]
    assert (unit_pid(host, "sglang-0"), engine_pid(host, "sglang-0")) == (supervisor, engine)
    assert http_status(port, "/health") == 200

    # Nothing changed since the first deploy once the python is back: no parser is asked.
    fleet.write_inventory(ctl.inventory, hosts=["a"])
    again = ctl.run("deploy")
    assert again.code == 0, again.explain()
    assert not again.of("sglang-0", action="check")


def test_preflight_live_hears_the_engines_own_message_from_the_fakes(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory("a")
    base = free_ports(2)
    ctl = ops(fleet)
    vllm = {"name": "vllm", "engine": "vllm", "model": "org/model", "port": base + 1}
    vllm["args"] = {"gpu-memory-utilization": "most"}
    ctl.playbook("serve", {"hosts": ["a"], "services": [sglang(base, replicas=1), vllm]})
    report = ctl.base / "report.json"
    res = ctl.run("preflight", "--live", "--json", str(report), json_events=False)
    assert res.code == 1, res.explain()
    checks = {
        c["subject"]: c
        for c in json.loads(report.read_text())["checks"]
        if c["check"] == "live-engine-args"
    }
    assert checks["a/sglang-0"]["ok"], checks
    assert checks["a/sglang-0"]["message"] == "sglang 0.5.23 at /usr/bin/python3"
    assert not checks["a/vllm-0"]["ok"]
    assert checks["a/vllm-0"]["message"] == (
        "[a] vllm-0: vllm 0.33.0 at /usr/bin/python3 rejects the command line: vllm serve: "
        "error: argument --gpu-memory-utilization: invalid float value: 'most'"
    )


@needs_parsers
def test_preflight_live_with_the_real_sglang_on_the_host_rejects_a_wrongly_typed_flag(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    python = python_wrapper(tmp_path / "python", f'unset PYTHONPATH\nexec {PARSERS_PYTHON} "$@"')
    fleet = fleet_factory("a")
    port = free_ports(1)
    ctl = ops(fleet, hosts={"a": {"python": python}})
    model = tmp_path / "model"
    model.mkdir()
    bad = sglang(port, replicas=1, model=str(model), args={"mem-fraction-static": "lots"})
    ctl.playbook("serve", {"hosts": ["a"], "services": [bad]})
    report = ctl.base / "report.json"
    res = ctl.run("preflight", "--live", "--json", str(report), json_events=False)
    assert res.code == 1, res.explain()
    checks = [c for c in json.loads(report.read_text())["checks"] if not c["ok"]]
    assert [c["check"] for c in checks if c["severity"] == "error"] == ["live-engine-args"], checks
    assert checks[-1]["message"] == (
        f"[a] sglang-0: sglang 0.5.23 at {python} rejects the command line: "
        "sglang serve: error: argument --mem-fraction-static: invalid float value: 'lots'"
    )


def test_preflight_live_warns_when_no_parser_entry_point_is_known_and_uses_the_flag_list(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], tmp_path: Path
) -> None:
    """An SGLang of another layout on the host: it imports, its parser is not where dflashops
    looks. Said as a warning, never silently, with the flag list's verdict."""
    other = tmp_path / "other"
    (other / "sglang").mkdir(parents=True)
    (other / "sglang" / "__init__.py").write_text('__version__ = "0.4.0"\n')
    python = python_wrapper(tmp_path / "python", f'PYTHONPATH={other} exec /usr/bin/python3 "$@"')
    fleet = fleet_factory("a")
    ctl = ops(fleet, hosts={"a": {"python": python}})
    model = tmp_path / "model"
    model.mkdir()
    ctl.playbook(
        "serve", {"hosts": ["a"], "services": [sglang(free_ports(1), replicas=1, model=str(model))]}
    )
    report = ctl.base / "report.json"
    res = ctl.run("preflight", "--live", "--json", str(report), json_events=False)
    assert res.code == 0, res.explain()
    (check,) = [
        c for c in json.loads(report.read_text())["checks"] if c["check"] == "live-engine-args"
    ]
    assert (check["ok"], check["severity"]) == (False, "warning"), check
    assert check["message"].startswith(
        "[a] sglang-0: no parser entry point known for sglang 0.4.0: "
    )
    assert check["message"].endswith(
        "; judged by the flag list only: every flag is in SGLang 0.5.23's flag list"
    )
