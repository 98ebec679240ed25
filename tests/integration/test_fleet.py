"""The sshd fleet itself: real connections with paramiko, strict host keys, no mocks."""

from __future__ import annotations

import json
import shlex
import socket
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fleet as fleet_module
import paramiko
import pytest
import yaml
from fleet import (
    FLEET4_GPUS,
    Fleet,
    FleetFactory,
    FleetHost,
    FleetStartError,
    FleetUnsupported,
    loopback_addresses_supported,
)

from tests.procs import wait_for

REPO = Path(__file__).resolve().parents[2]


def ssh(host: FleetHost, known_hosts: Path, key: Path, timeout: float = 5.0) -> paramiko.SSHClient:
    """A plain paramiko client: RejectPolicy and only the given known_hosts file."""
    return host.connect(known_hosts, timeout, key)


def run(client: paramiko.SSHClient, command: str) -> tuple[int, str]:
    _, out, _ = client.exec_command(command, timeout=10)
    text = out.read().decode()
    return out.channel.recv_exit_status(), text


def fleet_ssh(fleet: Fleet, name: str) -> paramiko.SSHClient:
    return ssh(fleet[name], fleet.known_hosts_path, fleet.client_key_path)


def remote_env(client: paramiko.SSHClient) -> dict[str, str]:
    rc, out = run(client, "env")
    assert rc == 0
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def report(capsys: pytest.CaptureFixture[str], message: str) -> None:
    with capsys.disabled():
        print(f"\n[fleet timing] {message}")


def our_sshd_pids(fleet: Fleet) -> list[int]:
    """Live processes whose command line names this fleet's directory (its sshd listeners)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "sshd" in cmdline and f"{fleet.base}/" in cmdline and _running(int(entry.name)):
                found.append(int(entry.name))
    return found


# --------------------------------------------------------------------------- fleet4


def test_fleet4_layout(fleet4: Fleet) -> None:
    assert [h.name for h in fleet4] == list(FLEET4_GPUS)
    assert len({(h.address, h.port) for h in fleet4}) == 4
    assert len({h.port for h in fleet4}) == 4
    if loopback_addresses_supported():
        assert [h.address for h in fleet4] == ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    known = fleet4.known_hosts_path.read_text().splitlines()
    for host in fleet4:
        assert host.gpus == FLEET4_GPUS[host.name]
        assert host.running and host.pid == int(host.pid_path.read_text())
        assert stat.S_IMODE(host.hostkey_path.stat().st_mode) == 0o600
        for d in (host.bin_dir, host.home_dir, host.workdir, host.gpu_dir / "procs"):
            assert d.is_dir()
        assert (host.gpu_dir / "held").is_dir()
        gpu = json.loads((host.gpu_dir / "config.json").read_text())
        assert gpu == {"count": host.gpus, "name": "NVIDIA B200", "memory_total_mib": 183359}
        line = f"[{host.address}]:{host.port} {host.host_key_line()}"
        assert line in known
        assert host.host_key_line().startswith("ssh-ed25519 AAAA")
        keygen = subprocess.run(
            ["ssh-keygen", "-lf", f"{host.hostkey_path}.pub"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert keygen.stdout.split()[1] == host.fingerprint()


def test_each_host_accepts_client_key(fleet4: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    for host in fleet4:
        t0 = time.perf_counter()
        with fleet_ssh(fleet4, host.name) as client:
            connect_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            rc, out = run(client, "echo ok; id -u")
            round_trip_s = time.perf_counter() - t1
        assert (rc, out) == (0, "ok\n0\n")
        if host.name == "h1":
            report(
                capsys,
                f"fleet4 start {fleet4.start_seconds:.3f}s; "
                f"connect+auth {connect_s * 1000:.0f} ms; "
                f"one command round trip {round_trip_s * 1000:.0f} ms",
            )


def test_session_env_is_per_host(fleet4: Fleet) -> None:
    for host in fleet4:
        with fleet_ssh(fleet4, host.name) as client:
            env = remote_env(client)
            assert env["PATH"] == (
                f"{host.bin_dir}:{REPO}/tests/fakes/bin:/usr/local/bin:/usr/bin:/bin"
            )
            assert env["HOME"] == str(host.home_dir)
            assert env["PYTHONPATH"] == f"{REPO}/tests/fakes/pylib"
            assert env["FAKE_GPU_STATE"] == str(host.gpu_dir)
            assert env == {**env, **host.env()}
            rc, out = run(client, "cd && pwd && /usr/bin/python3 -c 'import sys; print(sys.path)'")
            assert rc == 0
            assert out.splitlines()[0] == str(host.home_dir)
            assert f"{REPO}/tests/fakes/pylib" in out


def test_fake_nvidia_smi_on_path(fleet4: Fleet) -> None:
    fake = REPO / "tests/fakes/bin/nvidia-smi"
    for host in fleet4:
        with fleet_ssh(fleet4, host.name) as client:
            rc, out = run(client, "command -v nvidia-smi && nvidia-smi -L")
        assert rc == 0, out
        lines = out.splitlines()
        assert lines[0] == str(fake)
        gpus = [line for line in lines[1:] if line.startswith("GPU ")]
        assert len(gpus) == host.gpus
        assert all("NVIDIA B200" in line for line in gpus)


def test_host_helpers_and_sftp(fleet4: Fleet) -> None:
    host = fleet4["h3"]
    assert host.run("echo $FAKE_GPU_STATE") == (0, f"{host.gpu_dir}\n", "")
    with host.connect() as client, client.open_sftp() as sftp:
        target = f"{host.workdir}/sftp-probe.txt"
        with sftp.open(target, "w") as f:
            f.write("hello")
        assert Path(target).read_text() == "hello"
        sftp.remove(target)


def test_unknown_host_key_is_rejected(fleet4: Fleet, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        ssh(fleet4["h1"], empty, fleet4.client_key_path)


def test_unauthorised_client_key_is_refused(fleet4: Fleet, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
        check=True,
        capture_output=True,
    )
    with pytest.raises(paramiko.AuthenticationException):
        ssh(fleet4["h2"], fleet4.known_hosts_path, other)


def test_inventory(fleet4: Fleet, tmp_path: Path) -> None:
    inv = fleet4.inventory(groups={"generation": ["h1", "h2"]}, defaults={"user": "root"})
    assert inv["defaults"] == {"user": "root"}
    assert inv["groups"] == {"generation": ["h1", "h2"]}
    assert list(inv["hosts"]) == ["h1", "h2", "h3", "h4"]
    h3 = fleet4["h3"]
    assert inv["hosts"]["h3"] == {
        "address": h3.address,
        "port": h3.port,
        "user": "root",
        "key_file": str(fleet4.client_key_path),
        "gpus": 4,
        "workdir": str(h3.workdir),
        "python": "/usr/bin/python3",
    }
    some = fleet4.inventory(hosts={"h4": {"host_key": fleet4["h4"].host_key_line()}})
    assert list(some["hosts"]) == ["h4"]
    assert some["hosts"]["h4"]["host_key"].startswith("ssh-ed25519 ")
    path = fleet4.write_inventory(tmp_path / "inventory.yaml", hosts=["h1", fleet4["h2"]])
    assert yaml.safe_load(path.read_text()) == fleet4.inventory(hosts=["h1", "h2"])


# --------------------------------------------------------------------------- fresh fleets


def test_per_host_bin_comes_first(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory("b1", "b2")
    for host in fleet:
        tool = host.bin_dir / "whoami-host"
        tool.write_text(f"#!/bin/sh\necho {host.name}\n")
        tool.chmod(0o755)
    for host in fleet:
        assert host.run("whoami-host")[:2] == (0, f"{host.name}\n")


def test_rotated_host_key_is_refused(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory("r1")
    host = fleet["r1"]
    with fleet_ssh(fleet, "r1") as client:
        assert run(client, "true")[0] == 0
    old_fp, pinned = host.fingerprint(), fleet.known_hosts_path.read_text()
    port = host.port
    host.rotate_host_key()
    assert host.fingerprint() != old_fp
    assert host.port == port
    assert fleet.known_hosts_path.read_text() == pinned
    with pytest.raises(paramiko.BadHostKeyException):
        fleet_ssh(fleet, "r1")
    fleet.refresh_known_hosts()
    with fleet_ssh(fleet, "r1") as client:
        assert run(client, "true")[0] == 0


def test_stop_refuses_then_start_serves_again(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory("s1", "s2")
    host = fleet["s1"]
    port, key = host.port, host.host_key_line()
    host.stop()
    assert not host.running and host.pid is None
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError):
        fleet_ssh(fleet, "s1")
    with fleet_ssh(fleet, "s2") as client:  # the others are untouched
        assert run(client, "true")[0] == 0
    host.start()
    assert (host.port, host.host_key_line()) == (port, key)
    with fleet_ssh(fleet, "s1") as client:
        assert run(client, "echo back") == (0, "back\n")


def test_kill_keeps_live_sessions_until_kill_sessions(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory("k1")
    host = fleet["k1"]
    live = fleet_ssh(fleet, "k1")
    try:
        host.kill()
        with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError):
            fleet_ssh(fleet, "k1")
        assert run(live, "echo still") == (0, "still\n")  # sessions outlive the listener
        assert host.kill_sessions() >= 1
        with pytest.raises((paramiko.SSHException, EOFError, OSError)):
            run(live, "echo gone")
    finally:
        live.close()
    host.start()
    assert host.run("echo up")[:2] == (0, "up\n")


def test_stop_reaps_sessions_and_their_processes(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory("p1")
    host = fleet["p1"]
    live = fleet_ssh(fleet, "p1")
    rc, out = run(live, "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!")
    assert rc == 0
    sleeper = int(out)
    # Its environ is readable once it has exec'd: a look in between finds nothing yet.
    wait_for("the sleeper seen", lambda: [r[0] for r in host.leftover_processes()] == [sleeper])
    assert our_sshd_pids(fleet)
    fleet.stop()
    live.close()
    assert our_sshd_pids(fleet) == []
    assert not _running(sleeper)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sixteen_hosts_start_and_answer(
    fleet_factory: FleetFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = fleet_factory(*[f"n{i:02d}" for i in range(16)])
    assert len({h.port for h in fleet}) == 16

    def echo(host: FleetHost) -> str:
        with fleet_ssh(fleet, host.name) as client:
            return run(client, "echo $FAKE_GPU_STATE")[1].strip()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(echo, fleet))
    all_answer_s = time.perf_counter() - t0
    assert answers == [str(h.gpu_dir) for h in fleet]
    report(
        capsys,
        f"fleet16 start {fleet.start_seconds:.3f}s; 16 connect+command (8 threads) "
        f"{all_answer_s:.3f}s",
    )
    fleet.stop()
    assert our_sshd_pids(fleet) == []


def test_fresh_port_race_is_retried(
    fleet_factory: FleetFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not loopback_addresses_supported():
        fleet_module.sshd_unusable("this kernel refuses 127.0.0.2, which the port-race test needs")
    squatter = socket.socket()
    squatter.bind(("127.0.0.2", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = fleet_module._reserve_free_port
    handed: list[int] = []

    def first_taken(address: str) -> int:
        port = taken if not handed else real(address)
        handed.append(port)
        return port

    monkeypatch.setattr(fleet_module, "_reserve_free_port", first_taken)
    try:
        fleet = fleet_factory("race")
    finally:
        squatter.close()
    host = fleet["race"]
    assert handed[0] == taken and host.port != taken
    assert "Address already in use" in host.log_text()
    assert host.run("true")[0] == 0


def test_start_failure_carries_sshd_stderr(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(start=False)
    host = fleet.add("broken")
    host.hostkey_path.write_text("not a key\n")
    host.hostkey_path.chmod(0o600)
    Path(f"{host.hostkey_path}.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 x\n")
    with pytest.raises(FleetStartError, match="broken") as err:
        fleet.start()
    assert "sshd" in str(err.value)
    assert not host.running


def test_tmpfs_workdir_fills_up(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(start=False)
    try:
        host = fleet.add("disk", workdir_size_mib=4)
    except FleetUnsupported as exc:
        fleet_module.sshd_unusable(f"no size-limited tmpfs here: {exc}")
    fleet_module.start_fleet(fleet)
    workdir = shlex.quote(str(host.workdir))
    rc, out, _ = host.run(f"df -m --output=size,fstype {workdir} | tail -1")
    assert rc == 0 and out.split() == ["4", "tmpfs"]
    rc, _, err = host.run(f"head -c 8M /dev/zero > {workdir}/big")
    assert rc != 0 and "No space left on device" in err
    fleet.stop()
    mounts = Path("/proc/mounts").read_text()
    assert f" {host.workdir} " not in mounts


def test_sshd_unusable_fails_on_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no sshd here"):
        fleet_module.sshd_unusable("no sshd here")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"ensure-sshd\.sh"):
        fleet_module.sshd_unusable("no sshd here")
