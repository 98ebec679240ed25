"""Environments that dflashops builds work from their `path` like a venv made there by hand
(DESIGN.md "Real parts" 1): console scripts, pip, `activate`, pyvenv.cfg name the build's
own folder. A killed build is cleaned by the next deploy, two builds of one environment wait
for each other, and an environment whose interpreter was upgraded under it is rebuilt."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet import FleetFactory, FleetHost
from lifecycle_helpers import Ops, Result, job, stub, unit_dir, unit_pid

from dflashops.agent import Agent
from dflashops.agent.answers import BuildResult
from dflashops.config.load import load_inventory
from dflashops.hosts.ssh import SshConnection
from tests.conftest import missing
from tests.procs import alive, free_ports, wait_for
from tests.wheels import build_wheel

TMP = ".dflashops-tmp."
# A console script that says where it runs: the shebang the installer wrote decides that.
TOOL = (
    "import json, sys\n"
    "def main():\n"
    "    print(json.dumps({'prefix': sys.prefix, 'executable': sys.executable}))\n"
)


def with_uv(host: FleetHost) -> None:
    uv = Path(sys.executable).parent / "uv"
    found = uv if uv.exists() else Path(str(shutil.which("uv")))
    assert found.exists(), "uv comes with the dev extras"
    (host.bin_dir / "uv").symlink_to(found)


def wheels(ctl: Ops) -> None:
    """dfotool (a console script `dfotool`) and dfotest (no console script at all)."""
    build_wheel(ctl.base / "wheels", "dfotool", "1.0", TOOL, scripts={"dfotool": "dfotool:main"})
    build_wheel(ctl.base / "wheels", "dfotest", "1.0")
    build_wheel(ctl.base / "wheels", "dfotest", "2.0")


def env_spec(path: Path, *packages: str, **extra: Any) -> dict[str, Any]:
    return {"path": str(path), "packages": list(packages), "wheels": "../wheels", **extra}


def env_event(res: Result) -> dict[str, Any]:
    (found,) = [e for e in res.events if e["action"] == "environment"]
    return found


def job_exit(host: FleetHost, name: str) -> dict[str, Any]:
    exit_file = unit_dir(host, name) / "exit"
    wait_for(f"job {name} to end", exit_file.exists, timeout=60)
    return dict(json.loads(exit_file.read_text()))


def no_temporary_names(*texts: str) -> None:
    for text in texts:
        assert TMP not in text, text


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_a_built_environment_works_from_its_path_like_a_venv_made_there(
    fleet_factory: FleetFactory, ops: Callable[..., Ops], installer: str
) -> None:
    fleet = fleet_factory(e={"gpus": 0})
    host = fleet["e"]
    if installer == "uv":
        with_uv(host)
    ctl = ops(fleet)
    wheels(ctl)
    path, out = host.dir / "venv", host.dir / "out"
    out.mkdir()
    # The unit runs the script by the environment's path, by PATH, and through `activate`, as
    # someone logged in on the node would.
    script = (
        f"set -e; {path}/bin/dfotool > {out}/direct.json; dfotool > {out}/on-path.json; "
        f"python -c 'import dfotest; print(dfotest.__version__)' > {out}/plain.txt; "
        f'. {path}/bin/activate; echo "$VIRTUAL_ENV" > {out}/activate.txt; '
        f"dfotool > {out}/activated.json"
    )
    if installer == "pip":
        script += f"; {path}/bin/pip --version > {out}/pip.txt"
        script += f"; {path}/bin/pip list --format=freeze > {out}/pip-list.txt"
    book = {
        "hosts": "e",
        "environments": {"tools": env_spec(path, "dfotool==1.0", "dfotest==1.0")},
        "jobs": [job("use", script, environment="tools")],
    }
    ctl.playbook("p", book)
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    assert f"built with {installer}" in env_event(res)["message"], res.explain()
    ended = job_exit(host, "use")
    log = (unit_dir(host, "use") / "logs" / "current.log").read_text()
    assert ended["code"] == 0, log

    build = Path(os.path.realpath(path))  # the kept build folder PATH links to
    assert build.parent == host.dir / "venv.builds" and (build / ".dflashops-env.json").is_file()
    for name in ("direct.json", "on-path.json", "activated.json"):
        ran = json.loads((out / name).read_text())
        assert Path(ran["prefix"]) == build, (name, ran)
    assert (out / "plain.txt").read_text().strip() == "1.0"
    assert (out / "activate.txt").read_text().strip() in (str(path), str(build))
    shebang = (build / "bin" / "dfotool").read_text().splitlines()[0]
    assert shebang == f"#!{build}/bin/python", shebang
    cfg = (build / "pyvenv.cfg").read_text()
    activate = (build / "bin" / "activate").read_text()
    no_temporary_names(cfg, activate, shebang)
    if installer == "pip":
        assert f"-m venv {build}\n" in cfg, cfg  # venv's `command` names the folder it made
        assert str(build) in (out / "pip.txt").read_text()
        listed = (out / "pip-list.txt").read_text().splitlines()
        assert "dfotool==1.0" in listed and "dfotest==1.0" in listed
    assert sorted(p.name for p in (host.dir / "venv.builds").iterdir()) == sorted(
        [build.name, ".dflashops-lock"]
    )


def test_a_killed_build_is_cleaned_and_built_again_by_the_next_deploy(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    fleet = fleet_factory(k={"gpus": 0})
    host = fleet["k"]
    with_uv(host)  # three builds: uv's seconds, not pip's
    ctl = ops(fleet)
    wheels(ctl)
    path = host.dir / "venv"
    builds = host.dir / "venv.builds"
    book: dict[str, Any] = {"hosts": "k", "environments": {"tools": {}}}

    def deploy(*packages: str) -> Result:
        book["environments"]["tools"] = env_spec(path, "dfotool==1.0", *packages)
        ctl.playbook("p", book)
        res = ctl.run("deploy")
        assert res.code == 0, res.explain()
        return res

    deploy("dfotest==1.0")
    first = os.readlink(path)
    deploy("dfotest==2.0")
    second = os.readlink(path)
    assert first != second and (host.dir / first).is_dir()  # the previous build is kept
    # A deploy of the first content was killed while it built that again: its folder is
    # half-made (no completion marker), with gigabytes in it as far as anyone knows.
    half = host.dir / first
    (half / ".dflashops-env.json").unlink()
    (half / "bin" / "dfotool").unlink()
    (half / "half-written.bin").write_bytes(os.urandom(1 << 20))
    # And what older agents and other killed builds left: a temporary build folder whose
    # writer is gone, and an unfinished build of some other content.
    leftover = builds / f".0123456789abcdef{TMP}999999999"  # above any pid_max: gone
    (leftover / "lib").mkdir(parents=True)
    (leftover / "lib" / "big.bin").write_bytes(os.urandom(1 << 20))
    unfinished = builds / "fedcba9876543210"
    (unfinished / "bin").mkdir(parents=True)

    res = deploy("dfotest==1.0")
    message = env_event(res)["message"]
    assert "built with uv" in message and "a killed build" in message, message
    assert os.readlink(path) == first
    assert (half / ".dflashops-env.json").is_file() and not (half / "half-written.bin").exists()
    ran = subprocess.run([path / "bin" / "dfotool"], capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout)["prefix"] == str(half)
    left = sorted(p.name for p in builds.iterdir())
    assert left == sorted([Path(first).name, Path(second).name, ".dflashops-lock"]), left


def test_two_builds_of_one_environment_at_once_wait_for_each_other(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """Two deploys' agents build the same environment at the same time: one builds, the other
    waits for the lock and finds the build done; neither breaks the other's folder."""
    fleet = fleet_factory(c={"gpus": 0})
    host = fleet["c"]
    ctl = ops(fleet)
    wheels(ctl)
    path = host.dir / "venv"
    spec = {
        "name": "tools",
        "path": str(path),
        "hash": "ab" * 32,
        "python": "/usr/bin/python3",
        "packages": ["dfotool==1.0", "dfotest==1.0"],
        "wheels": str(ctl.base / "wheels"),  # one machine: the controller's folder is there
    }
    inventory = load_inventory(ctl.inventory)
    results: dict[str, BuildResult] = {}

    def build(who: str) -> None:
        conn = SshConnection(inventory.hosts["c"])
        try:
            agent = Agent(conn, inventory.hosts["c"].python)
            results[who] = agent.build(str(host.workdir), [spec], timeout=300)["tools"]
        finally:
            conn.close()

    first = threading.Thread(target=build, args=("first",))
    first.start()
    builds = host.dir / "venv.builds"
    # The second starts once the first is at work (its folder exists, whatever it is called).
    wait_for(
        "the first build to be under way",
        lambda: builds.is_dir() and [p for p in builds.iterdir() if p.is_dir()],
        timeout=60,
        every=0.01,
    )
    second = threading.Thread(target=build, args=("second",))
    second.start()
    first.join(300)
    second.join(300)
    assert set(results) == {"first", "second"}
    assert all(r.ok for r in results.values()), results
    assert sorted(r.built for r in results.values()) == [False, True], results
    waited = next(r for r in results.values() if not r.built)
    assert waited.note is None or "another deploy built it meanwhile" in waited.note, waited
    ran = subprocess.run([path / "bin" / "dfotool"], capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout)["prefix"] == os.path.realpath(path)
    assert sorted(p.name for p in builds.iterdir()) == [".dflashops-lock", ("ab" * 32)[:16]]


def other_python(than: str) -> str | None:
    """An interpreter of another minor version than ``than``'s (3.9 or newer) that can make
    venvs."""
    probe = ["-c", "import sys, ensurepip, venv; print(sys.version_info[1])"]

    def minor(exe: str) -> int | None:
        got = subprocess.run([exe, *probe], capture_output=True, text=True, check=False)
        return int(got.stdout) if got.returncode == 0 and got.stdout.strip().isdigit() else None

    mine = minor(than)
    found = glob.glob("/usr/bin/python3.[0-9]*") + glob.glob("/usr/local/bin/python3.[0-9]*")
    found += glob.glob("/root/.pyenv/versions/3.*/bin/python3.[0-9]*")
    usable = {}
    for exe in sorted(found):
        if re.fullmatch(r"python3\.[0-9]+", os.path.basename(exe)) and os.access(exe, os.X_OK):
            version = minor(exe)
            if version is not None and version >= 9 and version != mine:
                usable.setdefault(version, exe)
    newer = [v for v in usable if mine is None or v > mine]
    return usable[min(newer)] if newer else next(iter(usable.values()), None)


def test_an_environment_whose_interpreter_was_upgraded_under_it_is_rebuilt(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """The host's `python3.x` link is moved to a newer Python (an OS upgrade): the build's
    bin/python now runs a Python whose site-packages it does not have. The next deploy says
    so and builds it again; the old build is set aside, not deleted, while a unit runs on it."""
    newer = other_python("/usr/bin/python3")
    if newer is None:
        missing("needs a second Python 3 version on this machine (any minor but the system's)")
    fleet = fleet_factory(u={"gpus": 1})
    host = fleet["u"]
    with_uv(host)
    ctl = ops(fleet)
    wheels(ctl)
    interpreter = host.bin_dir / "python3-site"  # what the environment is made with
    interpreter.symlink_to("/usr/bin/python3")
    path = host.dir / "venv"
    port = free_ports(1)
    env = env_spec(path, "dfotool==1.0", python=str(interpreter))
    book = {
        "hosts": "u",
        "environments": {"tools": env},
        "services": [stub("web", port, environment="tools")],
    }
    ctl.playbook("p", book)
    assert ctl.run("deploy").code == 0
    running = unit_pid(host, "web-0")
    key = Path(os.readlink(path)).name

    interpreter.unlink()
    interpreter.symlink_to(newer)
    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    message = env_event(res)["message"]
    assert "built with uv" in message and "was upgraded or replaced under it" in message, message
    assert "is now Python" in message, message
    ran = subprocess.run([path / "bin" / "dfotool"], capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout)["prefix"] == str(host.dir / "venv.builds" / key)
    aside = host.dir / "venv.builds" / f".{key}.dflashops-aside.0"
    assert aside.is_dir(), "the broken build is set aside while web-0 runs from it"
    assert alive(running) and unit_pid(host, "web-0") == running
    again = ctl.run("deploy")
    assert again.code == 0 and env_event(again)["status"] == "ok", again.explain()


def test_an_environment_an_older_dflashops_built_and_moved_is_built_again(
    fleet_factory: FleetFactory, ops: Callable[..., Ops]
) -> None:
    """Before builds were made in place, a build was made in `.<key>.dflashops-tmp.<pid>` and
    renamed: complete, but every script names the temporary folder. Such a build in place
    (rewritten here as that agent wrote it) is rebuilt by the next deploy, which says why."""
    fleet = fleet_factory(o={"gpus": 0})
    host = fleet["o"]
    with_uv(host)
    ctl = ops(fleet)
    wheels(ctl)
    path = host.dir / "venv"
    ctl.playbook("p", {"hosts": "o", "environments": {"tools": env_spec(path, "dfotool==1.0")}})
    assert ctl.run("deploy").code == 0
    build = Path(os.path.realpath(path))
    moved_from = build.with_name(f".{build.name}{TMP}4242")
    for name in ("activate", "dfotool"):
        script = build / "bin" / name
        script.write_text(script.read_text().replace(str(build), str(moved_from)))
    with pytest.raises(FileNotFoundError):  # its shebang names a folder that is not there
        subprocess.run([path / "bin" / "dfotool"], capture_output=True, check=False)

    res = ctl.run("deploy")
    assert res.code == 0, res.explain()
    message = env_event(res)["message"]
    assert "built with uv" in message and "built in a temporary folder and moved" in message
    ran = subprocess.run([path / "bin" / "dfotool"], capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout)["prefix"] == str(build)
