"""The SSH layer against real sshd hosts: host keys, errors, commands, verified transfer."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet import Fleet, FleetFactory, FleetUnsupported

from dflashops.agent import Agent, AgentError
from dflashops.config.inventory import Host
from dflashops.config.load import load_inventory
from dflashops.errors import HostError, TransferError
from dflashops.hosts.connection import CommandError, CommandTimeout
from dflashops.hosts.hostkeys import ChangedHostKey, UnknownHostKey
from dflashops.hosts.ssh import SshConnection

HOST_PYTHON = "/usr/bin/python3"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty controller HOME (no ~/.ssh/config, no known_hosts) and own known_hosts file."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(tmp_path / "dflashops_known_hosts"))
    return home


def host_of(fleet: Fleet, name: str, tmp_path: Path, **overrides: Any) -> Host:
    path = tmp_path / f"inventory-{name}.yaml"
    path.write_text(yaml.safe_dump({"hosts": {name: fleet[name].inventory_entry(**overrides)}}))
    return load_inventory(path).hosts[name]


def trust_fleet(fleet: Fleet, home: Path) -> None:
    shutil.copy(fleet.known_hosts_path, home / ".ssh" / "known_hosts")


def test_commands_with_known_host(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    trust_fleet(fleet4, home)
    conn = SshConnection(host_of(fleet4, "h1", tmp_path))
    try:
        result = conn.run(["printf", "%s|", "a b", "$(x)"])
        assert result.out == "a b|$(x)|"
        echo = conn.run("cat; echo done >&2", input=b"payload\x00bytes")
        assert echo.stdout == b"payload\x00bytes" and echo.err == "done\n"
        with pytest.raises(CommandError) as exc:
            conn.run("echo before; echo broken >&2; exit 3")
        message = str(exc.value)
        assert (
            "[h1] command failed with exit code 3" in message
            and "broken" in message
            and "before" in message
        )
        assert conn.run("exit 4", check=False).exit_code == 4
        with pytest.raises(CommandTimeout, match="timed out after 1s"):
            conn.run("sleep 5", timeout=1)
        assert conn.run("echo still usable").out == "still usable\n"
        # The fake host's environment: its own PATH with a fake nvidia-smi.
        assert "GPU 7:" in conn.run("nvidia-smi -L").out
    finally:
        conn.close()


def test_unknown_host_key_is_refused_under_strict(
    fleet4: Fleet, home: Path, tmp_path: Path
) -> None:
    conn = SshConnection(host_of(fleet4, "h2", tmp_path))
    with pytest.raises(UnknownHostKey) as exc:
        conn.run("touch /tmp/should-not-happen")
    message = str(exc.value)
    h2 = fleet4["h2"]
    assert f"[h2] host key of [{h2.address}]:{h2.port} is unknown" in message
    assert h2.fingerprint() in message and "dflashops trust --host h2" in message


def test_pinned_host_key_beats_known_hosts(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    h3 = fleet4["h3"]
    conn = SshConnection(host_of(fleet4, "h3", tmp_path, host_key=h3.host_key_line()))
    assert conn.run("echo pinned").out == "pinned\n"
    conn.close()
    wrong = fleet4["h1"].host_key_line()
    bad = SshConnection(host_of(fleet4, "h3", tmp_path, host_key=wrong))
    with pytest.raises(ChangedHostKey) as exc:
        bad.run("echo no")
    message = str(exc.value)
    assert "CHANGED" in message and "the inventory's host_key" in message
    assert h3.fingerprint() in message and fleet4["h1"].fingerprint() in message


def test_accept_new_records_then_refuses_a_changed_key(
    fleet_factory: FleetFactory, home: Path, tmp_path: Path
) -> None:
    fleet = fleet_factory("node")
    node = fleet["node"]
    host = host_of(fleet, "node", tmp_path, host_key_policy="accept-new")
    conn = SshConnection(host)
    assert conn.run("echo first").out == "first\n"
    conn.close()
    recorded = (tmp_path / "dflashops_known_hosts").read_text()
    assert f"[{node.address}]:{node.port} ssh-ed25519" in recorded
    old = node.fingerprint()
    node.rotate_host_key()  # the node is re-provisioned
    again = SshConnection(host)
    with pytest.raises(ChangedHostKey) as exc:
        again.run("echo second")
    message = str(exc.value)
    assert f"[node] host key of [{node.address}]:{node.port} CHANGED" in message
    assert old in message and node.fingerprint() in message
    assert "dflashops trust --host node" in message


def test_connection_errors_are_specific(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    trust_fleet(fleet4, home)
    h1 = fleet4["h1"]
    free_port = h1.port + 1 if h1.port < 65000 else h1.port - 1
    refused = SshConnection(host_of(fleet4, "h1", tmp_path, port=free_port))
    with pytest.raises(
        HostError, match=rf"connection refused at {h1.address}:{free_port}.*port right"
    ):
        refused.run("true")
    other_key = tmp_path / "other_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True
    )
    denied = SshConnection(host_of(fleet4, "h1", tmp_path, key_file=str(other_key)))
    with pytest.raises(
        HostError,
        match=rf"authentication failed for root@{h1.address}:{h1.port} with key\(s\) {other_key}",
    ):
        denied.run("true")
    dns = SshConnection(host_of(fleet4, "h1", tmp_path, address="no-such-host.invalid"))
    with pytest.raises(HostError, match=r"cannot resolve 'no-such-host\.invalid'"):
        dns.run("true")


def test_ssh_config_alias_and_proxyjump(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    trust_fleet(fleet4, home)
    h1, h2 = fleet4["h1"], fleet4["h2"]
    key = fleet4.client_key_path
    (home / ".ssh" / "config").write_text(
        f"Host gpu-a\n  HostName {h1.address}\n  Port {h1.port}\n  User root\n  IdentityFile {key}\n\n"
        f"Host gpu-b\n  HostName {h2.address}\n  Port {h2.port}\n  User root\n  IdentityFile {key}\n"
        "  ProxyJump gpu-a\n"
    )
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  a: {address: gpu-a}\n  b: {address: gpu-b}\n")
    hosts = load_inventory(inv).hosts
    a = SshConnection(hosts["a"])
    assert a.run("echo $FAKE_GPU_STATE").out.strip() == str(h1.gpu_dir)
    b = SshConnection(hosts["b"])
    assert b.run("echo $FAKE_GPU_STATE").out.strip() == str(h2.gpu_dir)
    a.close()
    b.close()


def agent(conn: SshConnection, python: str = HOST_PYTHON) -> Agent:
    return Agent(conn, python)


def test_write_is_verified_atomic_and_keeps_prev(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    trust_fleet(fleet4, home)
    conn = SshConnection(host_of(fleet4, "h4", tmp_path))
    workdir = str(fleet4["h4"].workdir)
    target = fleet4["h4"].workdir / "put-test" / "launch.sh"
    first = b"#!/bin/sh\necho one\n"
    agent(conn).write(workdir, [(first, str(target), 0o755)])
    assert target.read_bytes() == first and target.stat().st_mode & 0o777 == 0o755
    agent(conn).write(workdir, [(b"two\n", str(target), 0o644)])
    assert (
        target.read_bytes() == b"two\n" and (target.parent / "launch.sh.prev").read_bytes() == first
    )
    assert conn.get(str(target)) == b"two\n"
    with pytest.raises(CommandError, match="No such file"):
        conn.get(str(target.parent / "missing"))
    assert sorted(p.name for p in target.parent.iterdir()) == ["launch.sh", "launch.sh.prev"]
    assert conn.commands == 4  # two writes, two gets: one round trip each
    conn.close()


def corrupting_python(host_dir: Path) -> str:
    """A host python whose stdin is altered on the way: the last byte (the end of the last file
    sent) is flipped, as a corrupted transfer would deliver it."""
    wrapper = host_dir / "bin" / "python-corrupting"
    wrapper.write_text(
        "#!/bin/sh\n"
        "exec /usr/bin/python3 -c 'import sys; d = sys.stdin.buffer.read(); "
        'sys.stdout.buffer.write(d[:-1] + bytes([d[-1] ^ 1]))\' | /usr/bin/python3 "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def test_corrupted_transfer_is_caught(
    fleet_factory: FleetFactory, home: Path, tmp_path: Path
) -> None:
    fleet = fleet_factory("liar")
    trust_fleet(fleet, home)
    liar = fleet["liar"]
    target = liar.workdir / "f.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"old\n")
    conn = SshConnection(host_of(fleet, "liar", tmp_path))
    with pytest.raises(TransferError) as exc:
        agent(conn, corrupting_python(liar.dir)).write(
            str(liar.workdir), [(b"new\n", str(target), 0o644)]
        )
    assert "sha256 mismatch on the host" in str(exc.value)
    assert "previous versions left in place" in str(exc.value)
    assert target.read_bytes() == b"old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.txt"]
    agent(conn).write(str(liar.workdir), [(b"new\n", str(target), 0o644)])
    assert target.read_bytes() == b"new\n"


def test_full_disk_keeps_old_file(fleet_factory: FleetFactory, home: Path, tmp_path: Path) -> None:
    try:
        fleet = fleet_factory(tiny={"workdir_size_mib": 2})
    except FleetUnsupported as exc:
        pytest.fail(f"this machine cannot mount a small tmpfs for the full-disk test: {exc}")
    trust_fleet(fleet, home)
    workdir = str(fleet["tiny"].workdir)
    target = fleet["tiny"].workdir / "payloads" / "big.bin"
    conn = SshConnection(host_of(fleet, "tiny", tmp_path))
    agent(conn).write(workdir, [(b"small\n", str(target), 0o644)])
    with pytest.raises(TransferError) as exc:
        agent(conn).write(workdir, [(b"x" * (4 << 20), str(target), 0o644)])
    assert "No space left on device" in str(exc.value) or "disk full" in str(exc.value)
    assert target.read_bytes() == b"small\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["big.bin"]


def test_silent_port_times_out(fleet4: Fleet, home: Path, tmp_path: Path) -> None:
    """A port that accepts TCP but never answers (a wedged sshd, the wrong service)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        host = host_of(fleet4, "h1", tmp_path, address="127.0.0.1", port=silent.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(HostError, match=r"cannot connect to|timed out"):
            SshConnection(host, timeout=1).run("true")
        assert time.monotonic() - started < 10
    finally:
        silent.close()


@pytest.mark.parametrize(
    ("python", "message"),
    [
        ("/bin/true", "printed nothing"),
        ("/bin/echo", "not a JSON answer"),
        ("/nonexistent/python3", "not found on the host"),
    ],
)
def test_agent_failures_are_errors_not_empty_hosts(
    fleet4: Fleet, home: Path, tmp_path: Path, python: str, message: str
) -> None:
    trust_fleet(fleet4, home)
    conn = SshConnection(host_of(fleet4, "h2", tmp_path))
    with pytest.raises(AgentError) as exc:
        agent(conn, python).facts(str(fleet4["h2"].workdir))
    assert "[h2]" in str(exc.value) and message in str(exc.value)
    conn.close()


def test_write_over_ssh_survives_a_dropped_connection(
    fleet_factory: FleetFactory, home: Path, tmp_path: Path
) -> None:
    """sshd's sessions killed mid-stream: none of the files is renamed, no temporary file is
    left, and the next call works."""
    fleet = fleet_factory("flaky")
    trust_fleet(fleet, home)
    flaky = fleet["flaky"]
    small, big = flaky.workdir / "units" / "u" / "unit.json", flaky.workdir / "payloads" / "big.bin"
    small.parent.mkdir(parents=True)
    small.write_bytes(b"{}\n")
    conn = SshConnection(host_of(fleet, "flaky", tmp_path))
    conn.run("true")
    errors: list[BaseException] = []

    def ship() -> None:
        try:
            agent(conn).write(
                str(flaky.workdir),
                [(b'{"new": 1}\n', str(small), 0o644), (b"z" * (64 << 20), str(big), 0o644)],
            )
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=ship)
    worker.start()
    deadline = time.monotonic() + 10
    while not big.parent.is_dir() or not any(
        ".dflashops-tmp." in p.name for p in big.parent.iterdir()
    ):
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.005)
    flaky.kill_sessions()
    worker.join(30)
    assert errors and isinstance(errors[0], HostError), errors
    assert small.read_bytes() == b"{}\n"  # none renamed: the first file waited for the second
    deadline = time.monotonic() + 5
    while any(".dflashops-tmp." in p.name for d in (small.parent, big.parent) for p in d.iterdir()):
        assert time.monotonic() < deadline, (
            f"temporary files left behind: {[p for d in (small.parent, big.parent) for p in d.iterdir()]} {errors}"
        )
        time.sleep(0.05)
    rerun = SshConnection(host_of(fleet, "flaky", tmp_path))
    agent(rerun).write(str(flaky.workdir), [(b'{"new": 1}\n', str(small), 0o644)])
    assert small.read_bytes() == b'{"new": 1}\n'
