"""Orphans against the sshd fleet (DESIGN.md "Orphans"): units dflashops started that no
project playbook defines for their host any more are listed, named, block only what they
hold, and go with `deploy --prune` or `stop`; another playbook's units are never orphans.
Also: a host whose python is `~/venv/bin/python3` deploys, probes and stops."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet import FleetFactory, FleetHost
from lifecycle_helpers import (
    Ops,
    Result,
    gpu_procs,
    sglang,
    stub,
    unit_dir,
    unit_pid,
    unit_processes,
)

from tests.procs import alive, free_ports, wait_for

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def orphan_lines(res: Result) -> dict[str, str]:
    return {e["unit"]: e["message"] for e in res.events if e["status"] == "orphan"}


def status_json(ctl: Ops, playbooks: list[str] | None = None) -> dict[str, dict[str, Any]]:
    res = ctl.run("status", playbooks=playbooks)
    rows = res.rows()
    assert rows, res.explain()
    return rows


def pruned(host: FleetHost) -> list[Path]:
    return sorted((host.workdir / "units" / ".pruned").glob("*"))


def test_removed_service_is_named_listed_and_pruned_with_its_gpus_freed(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(o={"gpus": 4})
    host = fleet["o"]
    ctl = ops(fleet)
    port = free_ports(3)
    aux = stub("aux", port + 2, gpus=[3])  # explicit: its layout does not move when sglang goes
    ctl.playbook("serve", {"hosts": "o", "services": [sglang(port), aux]})
    assert ctl.run("deploy").code == 0
    engine_gpus = {p["pid"] for p in gpu_procs(host)}
    assert len(engine_gpus) == 2  # two fake SGLang engines hold GPU memory

    # The sglang service goes from the playbook: its two replicas are orphans now.
    ctl.playbook("serve", {"hosts": "o", "services": [aux]})
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()  # they hold nothing aux needs
    lines = orphan_lines(res)
    assert sorted(lines) == ["sglang-0", "sglang-1"], res.explain()
    assert "running (pid" in lines["sglang-0"] and f"port {port}" in lines["sglang-0"]
    assert "deploy --prune" in lines["sglang-0"] and "stop --unit sglang-0" in lines["sglang-0"]
    assert "orphan: [o] sglang-0" in res.out and "orphans=2" in res.out

    rows = status_json(ctl)
    assert rows["sglang-1"]["state"] == "orphan" and rows["sglang-1"]["pid"]
    assert rows["sglang-1"]["port"] == port + 1 and rows["aux-0"]["state"] == "ready"
    assert "orphan" in ctl.run("status", json_events=False).out

    check = ctl.run("deploy", "--prune", "--check")
    assert check.code == 0 and "--prune would stop it" in orphan_lines(check)["sglang-0"]
    assert alive(unit_pid(host, "sglang-0"))  # --check changes nothing

    res = ctl.run("deploy", "--prune")
    assert res.code == 0, res.explain()
    prunes = {e["unit"]: e["message"] for e in res.of(action="prune")}
    assert sorted(prunes) == ["sglang-0", "sglang-1"]
    assert "GPU memory released" in prunes["sglang-0"]
    assert "units/.pruned/sglang-0-" in prunes["sglang-0"]
    assert not (gpu_procs(host) and {p["pid"] for p in gpu_procs(host)} & engine_gpus)
    moved = pruned(host)
    assert [p.name.rsplit("-", 1)[0] for p in moved] == ["sglang-0", "sglang-1"]
    assert list((moved[0] / "logs").glob("2*.log")), "the logs went with the folder"
    assert not unit_dir(host, "sglang-0").exists()
    again = ctl.run("deploy")
    assert again.code == 0 and not orphan_lines(again)


def test_renamed_service_on_the_same_port_and_gpus_is_blocked_until_its_orphan_stops(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(r={"gpus": 2})
    host = fleet["r"]
    ctl = ops(fleet)
    port = free_ports(1)
    ctl.playbook("p", {"hosts": "r", "services": [sglang(port, replicas=1, name="old")]})
    assert ctl.run("deploy").code == 0
    old_pid = unit_pid(host, "old-0")

    ctl.playbook("p", {"hosts": "r", "services": [sglang(port, replicas=1, name="new")]})
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    (failed,) = res.of("new-0", status="failed")
    assert f"port {port} and GPU 0 held by orphan old-0" in failed["message"]
    assert "dflashops deploy --prune" in failed["message"]
    assert "dflashops stop --unit old-0" in failed["message"]
    assert alive(old_pid) and not unit_dir(host, "new-0").joinpath("pid").exists()

    stopped = ctl.run("stop", "--unit", "old-0")
    assert stopped.code == 0, stopped.explain()
    assert not alive(old_pid)
    res = ctl.run("deploy")
    assert res.code == 0 and res.of("new-0", action="ready", status="changed"), res.explain()
    assert orphan_lines(res) == {"old-0": orphan_lines(res)["old-0"]}
    assert "not running" in orphan_lines(res)["old-0"]  # its folder stays until --prune


def test_lowered_replicas_orphan_the_rest_and_stop_without_names_stops_everything(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(l={"gpus": 4})
    host = fleet["l"]
    ctl = ops(fleet)
    port = free_ports(3)
    ctl.playbook("p", {"hosts": "l", "services": [sglang(port, replicas=3)]})
    assert ctl.run("deploy").code == 0
    ctl.playbook("p", {"hosts": "l", "services": [sglang(port, replicas=1)]})
    res = ctl.run("deploy")
    assert res.code == 0 and sorted(orphan_lines(res)) == ["sglang-1", "sglang-2"], res.explain()
    assert len(unit_processes(host)) == 6  # 3 supervisors + 3 engines

    stopped = ctl.run("stop")
    assert stopped.code == 0, stopped.explain()
    assert {e["unit"] for e in stopped.of(action="stop", status="changed")} == {
        "sglang-0",
        "sglang-1",
        "sglang-2",
    }
    assert unit_processes(host) == [] and gpu_procs(host) == []


def test_an_orphan_holding_the_gpu_a_new_unit_wants_blocks_only_that_unit(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(g={"gpus": 2})
    ctl = ops(fleet)
    port = free_ports(4)
    ctl.playbook("p", {"hosts": "g", "services": [sglang(port, replicas=2)]})
    assert ctl.run("deploy").code == 0
    # One replica fewer; a new service takes the freed GPU 1 on another port.
    ctl.playbook(
        "p",
        {
            "hosts": "g",
            "services": [sglang(port, replicas=1), sglang(port + 2, replicas=1, name="draft")],
        },
    )
    res = ctl.run("deploy")
    assert res.code == 2, res.explain()
    (failed,) = res.of("draft-0", status="failed")
    assert "GPU 1 held by orphan sglang-1" in failed["message"], failed
    assert f"port {port + 2}" not in failed["message"].split("held by")[0]
    assert res.of("sglang-0", status="ok"), res.explain()  # the rest carries on
    res = ctl.run("deploy", "--prune")
    assert res.code == 0 and res.of("draft-0", action="ready", status="changed"), res.explain()


def test_prune_of_an_orphan_that_ignores_term_uses_the_grace_it_was_started_with(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(t={"gpus": 0})
    host = fleet["t"]
    ctl = ops(fleet)
    stubborn = {
        "name": "stubborn",
        "engine": "command",
        "command": ["/usr/bin/python3", "-c", IGNORES_TERM],
        "stop_grace": "1s",
    }
    ctl.playbook("p", {"hosts": "t", "services": [stubborn]})
    assert ctl.run("deploy").code == 0
    pid = unit_pid(host, "stubborn-0")
    ctl.playbook("p", {"hosts": "t", "services": []})
    started = time.monotonic()
    res = ctl.run("deploy", "--prune")
    took = time.monotonic() - started
    assert res.code == 0, res.explain()
    (line,) = res.of("stubborn-0", action="prune")
    assert "SIGKILL after the grace period" in line["message"], line
    assert took < 20, f"the default 30 s grace was used, not the recorded 1 s ({took:.1f}s)"
    assert not alive(pid) and [p.name.startswith("stubborn-0-") for p in pruned(host)] == [True]


def test_another_playbooks_units_are_not_orphans_when_p_selects_one(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(m={"gpus": 4})
    host = fleet["m"]
    ctl = ops(fleet)
    port = free_ports(2)
    ctl.playbook("one", {"hosts": "m", "services": [stub("first", port)]})
    ctl.playbook("two", {"hosts": "m", "services": [stub("second", port + 1)]})
    assert ctl.run("deploy").code == 0
    res = ctl.run("deploy", "--prune", playbooks=["one"])
    assert res.code == 0 and not orphan_lines(res) and not res.of(action="prune"), res.explain()
    assert alive(unit_pid(host, "second-0"))
    rows = status_json(ctl, playbooks=["one"])
    assert set(rows) == {"first-0"}
    # stop -p one stops that playbook's units (and orphans, of which there are none) only.
    assert ctl.run("stop", playbooks=["one"]).code == 0
    assert alive(unit_pid(host, "second-0"))


def test_a_python_given_as_tilde_path_deploys_probes_and_stops(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(v={"gpus": 1})
    host = fleet["v"]
    venv = host.home_dir / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to("/usr/bin/python3")
    ctl = ops(fleet, hosts={"v": {"python": "~/venv/bin/python3"}})
    port = free_ports(1)
    ctl.playbook("p", {"hosts": "v", "services": [stub("web", port)]})
    res = ctl.run("deploy")
    assert res.code == 0 and res.of("web-0", action="ready", status="changed"), res.explain()
    script = (unit_dir(host, "web-0") / "launch.sh").read_text()
    assert '"$HOME"/venv/bin/python3' in script
    assert status_json(ctl)["web-0"]["state"] == "ready"
    assert ctl.run("stop").code == 0
    wait_for("web-0 to stop", lambda: not unit_processes(host), timeout=10)
