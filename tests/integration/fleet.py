"""Real OpenSSH hosts on loopback addresses standing in for GPU hosts.

A `Fleet` runs one `/usr/sbin/sshd -D -e -f CONFIG` per host, each on its own address
(127.0.0.2, 127.0.0.3, ...; 127.0.0.1 only if the kernel refuses the others) and its own free
port. Every host has its own host key, HOME, PATH (`<host>/bin`, then `tests/fakes/bin`),
PYTHONPATH (`tests/fakes/pylib`), dflashops workdir and fake GPU state (`FAKE_GPU_STATE`).
One client key (root) is authorised on every host; `known_hosts_path` pins every host key.

Layout under `base`::

    client/id_ed25519[.pub]   authorized_keys   known_hosts
    <name>/hostkey[.pub] sshd_config sshd.pid sshd.log bin/ home/ workdir/
    <name>/gpu/config.json gpu/procs/ gpu/held/

Processes: each listener is a child of the process that called `start()`; it gets SIGTERM if
that thread dies (PR_SET_PDEATHSIG), so start fleets from a long-lived thread. `stop()` (and an
atexit fallback) stops listeners, their per-connection sshd processes and any process left
running with this host's `FAKE_GPU_STATE` in its environment; nothing else is ever signalled.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Protocol

import paramiko
import yaml

from tests import procs

SSHD = "/usr/sbin/sshd"
HOST_PYTHON = "/usr/bin/python3"
PRIVSEP_DIR = Path("/run/sshd")
READY_TIMEOUT = 10.0
INSTALL_HINT = "bash dev/ensure-sshd.sh"

FLEET4_GPUS = {"h1": 8, "h2": 8, "h3": 4, "h4": 2}  # the `fleet4` fixture's hosts

_SSHD_EXES = frozenset({"sshd", "sshd-session", "sshd-auth"})
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BIND_RETRIES = 5

ProcRef = tuple[int, int]  # (pid, start time in clock ticks): a pid is never signalled if reused


class FleetError(RuntimeError):
    """Base error of the fleet."""


class FleetUnsupported(FleetError):
    """This machine cannot run the fleet, or a requested feature of it (e.g. tmpfs)."""


class FleetStartError(FleetError):
    """An sshd did not come up; the message carries sshd's own stderr."""


class FleetFactory(Protocol):
    """Type of the `fleet_factory` fixture: `fleet_factory("a", b={"gpus": 4}, start=True)`."""

    def __call__(self, *names: str, start: bool = True, **specs: Mapping[str, Any]) -> Fleet: ...


# --------------------------------------------------------------------------- processes


def _ref(pid: int) -> ProcRef | None:
    st = procs.stat(pid)
    return None if st is None else (pid, int(st[procs.START_TIME]))


def _alive(ref: ProcRef) -> bool:
    st = procs.stat(ref[0])
    return st is not None and int(st[procs.START_TIME]) == ref[1] and st[procs.STATE] != "Z"


def _signal(ref: ProcRef, sig: int) -> bool:
    if not _alive(ref):
        return False
    try:
        os.kill(ref[0], sig)
    except ProcessLookupError:
        return False
    return True


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in procs.all_pids():
        st = procs.stat(pid)
        if st is not None:
            children.setdefault(int(st[procs.PPID]), []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_sshd(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return os.path.basename(exe.removesuffix(" (deleted)")) in _SSHD_EXES


def _kill_and_wait(refs: Iterable[ProcRef], *, grace: float = 0.0, timeout: float = 5.0) -> int:
    """TERM (if grace > 0) then KILL `refs`; wait until gone. Returns how many were signalled."""
    live = [r for r in refs if _alive(r)]
    if not live:
        return 0
    if grace > 0:
        for r in live:
            _signal(r, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(r) for r in live):
            time.sleep(0.01)
    for r in live:
        _signal(r, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(r) for r in live):
        time.sleep(0.01)
    return len(live)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent_preexec(parent: int) -> Any:
    libc = _libc()  # loaded before fork: no dlopen in the child

    def preexec() -> None:
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


# --------------------------------------------------------------------------- environment


def sshd_unavailable_reason() -> str | None:
    """Why this machine cannot run sshd test hosts, or None when it can."""
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not installed (openssh-client)"
    if not PRIVSEP_DIR.is_dir():
        try:
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            return f"sshd needs {PRIVSEP_DIR} and it cannot be created: {exc}"
    return None


def sshd_unusable(reason: str) -> NoReturn:
    """sshd hosts cannot be used: pytest.fail under CI=true, else pytest.skip with a hint."""
    import pytest

    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"sshd test hosts unavailable: {reason}", pytrace=False)
    pytest.skip(f"sshd test hosts unavailable: {reason} (try: {INSTALL_HINT})")


def start_fleet(fleet: Fleet) -> Fleet:
    """Start `fleet` for a test; on failure stop it and bail out through `sshd_unusable`."""
    reason = sshd_unavailable_reason()
    if reason is None:
        try:
            fleet.start()
            return fleet
        except (FleetUnsupported, FleetStartError) as exc:
            reason = str(exc)
    fleet.stop()
    sshd_unusable(reason)


@functools.cache
def _sshd_version() -> tuple[int, int]:
    out = subprocess.run([SSHD, "-V"], capture_output=True, text=True, check=False)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", out.stderr + out.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.cache
def loopback_addresses_supported() -> bool:
    """True when 127.0.0.2+ can be bound (Linux: the whole of 127/8 is local)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
                return False
            raise
    return True


_PORTS_LOCK = threading.Lock()
_PORTS_IN_USE: set[int] = set()  # ports held by live hosts of any fleet in this process


def _reserve_free_port(address: str) -> int:
    """A port free on every address now, unused by any fleet host of this process."""
    port = procs.free_port()
    with _PORTS_LOCK:
        _PORTS_IN_USE.add(port)
    return port


def _release_port(port: int) -> None:
    with _PORTS_LOCK:
        _PORTS_IN_USE.discard(port)


def _keygen(path: Path, comment: str) -> None:
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    keygen = shutil.which("ssh-keygen") or "ssh-keygen"
    cmd = [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if r.returncode != 0:
        raise FleetError(f"ssh-keygen failed for {path}: {r.stderr.strip()}")
    path.chmod(0o600)


def _key_line(pub: Path) -> str:
    kind, blob = pub.read_text().split()[:2]
    return f"{kind} {blob}"


_LIVE_LOCK = threading.Lock()
_LIVE: set[Fleet] = set()


@atexit.register
def _stop_live_fleets() -> None:
    with _LIVE_LOCK:
        fleets = list(_LIVE)
    for fleet in fleets:
        with contextlib.suppress(Exception):
            fleet.stop()


# --------------------------------------------------------------------------- hosts


@dataclass(eq=False)
class FleetHost:
    """One sshd standing in for a GPU host."""

    fleet: Fleet = field(repr=False)
    name: str
    address: str
    dir: Path
    gpus: int
    gpu_name: str
    memory_total_mib: int
    workdir_size_mib: int | None = None
    port: int = 0
    pid: int | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log_offset: int = field(default=0, repr=False)
    _port_pinned: bool = field(default=False, repr=False)
    _pinned_key_line: str | None = field(default=None, repr=False)
    _orphans: list[ProcRef] = field(default_factory=list, repr=False)
    _mounted: bool = field(default=False, repr=False)

    @property
    def workdir(self) -> Path:
        return self.dir / "workdir"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def home_dir(self) -> Path:
        return self.dir / "home"

    @property
    def gpu_dir(self) -> Path:
        return self.dir / "gpu"

    @property
    def hostkey_path(self) -> Path:
        return self.dir / "hostkey"

    @property
    def config_path(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def pid_path(self) -> Path:
        return self.dir / "sshd.pid"

    @property
    def log_path(self) -> Path:
        return self.dir / "sshd.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def host_key_line(self) -> str:
        """The current host key as `ssh-ed25519 AAAA...`."""
        return _key_line(self.hostkey_path.with_name("hostkey.pub"))

    def fingerprint(self) -> str:
        """The current host key's `SHA256:...` fingerprint (as ssh-keygen -l shows it)."""
        blob = base64.b64decode(self.host_key_line().split()[1])
        return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")

    def known_hosts_line(self) -> str:
        """The known_hosts line the fleet pinned for this host (its key at first start)."""
        return f"[{self.address}]:{self.port} {self._pinned_key_line or self.host_key_line()}"

    def env(self) -> dict[str, str]:
        """The environment every ssh session on this host gets (sshd `SetEnv`)."""
        repo = self.fleet.repo
        path = [self.bin_dir, repo / "tests/fakes/bin", "/usr/local/bin", "/usr/bin", "/bin"]
        return {
            "PATH": ":".join(str(p) for p in path),
            "HOME": str(self.home_dir),
            "PYTHONPATH": str(repo / "tests/fakes/pylib"),
            "FAKE_GPU_STATE": str(self.gpu_dir),
            # No package index for environments built on test hosts: only the tests' wheels.
            "PIP_NO_INDEX": "1",
            "UV_OFFLINE": "1",
            # No hub either: the real `hf` reads a cache the tests lay out in the hub's layout.
            "HF_HUB_OFFLINE": "1",
        }

    def log_text(self) -> str:
        """sshd's stderr, all runs."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start (again) with the same host key and port; no-op when running."""
        if not self.running:
            self.fleet._start_hosts([self])

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the listener (TERM, then KILL) and drop every live connection to this host.

        The workdir (and its tmpfs, if any) is kept: restarting sshd does not wipe a disk.
        """
        self.kill_sessions()  # first, so that the listener reaps them (no zombies)
        if self._proc is not None:
            proc = self._proc
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._proc = None
        self.pid = None
        self.kill_sessions()  # any accepted in the meantime

    def kill(self) -> None:
        """SIGKILL the listener only, like a crash: new connections are refused.

        Established connections live on in their own per-connection sshd processes (they are
        not the listener's to end). To drop live connections too, call `kill_sessions()`.
        (Those sessions are orphaned to pid 1; an init that does not reap leaves zombies.)
        """
        self._track_sessions()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        self.pid = None

    def kill_sessions(self) -> int:
        """SIGKILL this host's per-connection sshd processes, dropping every live connection.

        They are found as the sshd descendants of this host's listener (also after `kill()`,
        which records them first). Commands those sessions started are not signalled.
        Returns how many processes were killed.
        """
        self._track_sessions()
        refs, self._orphans = self._orphans, []
        return _kill_and_wait(refs)

    def leftover_processes(self) -> list[ProcRef]:
        """Processes whose environment carries this host's FAKE_GPU_STATE (started over ssh)."""
        marker = f"FAKE_GPU_STATE={self.gpu_dir}".encode()
        found: list[ProcRef] = []
        me = os.getpid()
        for pid in procs.all_pids():
            if pid == me:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                ref = _ref(pid)
                if ref is not None and _alive(ref):
                    found.append(ref)
        return found

    def rotate_host_key(self) -> str:
        """Replace the host key (restarting sshd if it runs). known_hosts is NOT updated."""
        was_running = self.running
        if was_running:
            self.stop()
        _keygen(self.hostkey_path, f"fleet-{self.name}")
        if was_running:
            self.start()
        return self.host_key_line()

    # -- inventory and clients ---------------------------------------------------------------

    def inventory_entry(self, **overrides: Any) -> dict[str, Any]:
        """This host as a dflashops inventory host entry (overrides win)."""
        entry: dict[str, Any] = {
            "address": self.address,
            "port": self.port,
            "user": "root",
            "key_file": str(self.fleet.client_key_path),
            "gpus": self.gpus,
            "workdir": str(self.workdir),
            "python": HOST_PYTHON,
        }
        entry.update(overrides)
        return entry

    def connect(
        self, known_hosts: Path | None = None, timeout: float = 5.0, key: Path | None = None
    ) -> paramiko.SSHClient:
        """A paramiko client logged in as root, strict host keys (RejectPolicy)."""
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.load_host_keys(str(known_hosts or self.fleet.known_hosts_path))
        try:
            client.connect(
                self.address,
                port=self.port,
                username="root",
                key_filename=str(key or self.fleet.client_key_path),
                look_for_keys=False,
                allow_agent=False,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
            )
        except BaseException:
            client.close()
            raise
        return client

    def run(self, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
        """Run one command over a fresh connection: (exit status, stdout, stderr)."""
        with self.connect() as client:
            _, out, err = client.exec_command(command, timeout=timeout)
            stdout = out.read().decode()
            stderr = err.read().decode()
            return out.channel.recv_exit_status(), stdout, stderr

    # -- internals ---------------------------------------------------------------------------

    def _track_sessions(self) -> None:
        """Record the listener's sshd descendants (they outlive a killed listener)."""
        if self.pid is None:
            return
        known = set(self._orphans)
        for pid in _descendants(self.pid):
            ref = _ref(pid)
            if ref is not None and ref not in known and _is_sshd(pid):
                self._orphans.append(ref)
        self._orphans = [r for r in self._orphans if _alive(r)]

    def _write_config(self) -> None:
        fleet = self.fleet
        env = " ".join(f"{k}={v}" for k, v in self.env().items())
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            f"HostKey {self.hostkey_path}",
            f"PidFile {self.pid_path}",
            f"AuthorizedKeysFile {fleet.authorized_keys_path}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "Subsystem sftp internal-sftp",
            "MaxSessions 64",
            "MaxStartups 64:30:128",
            "LogLevel VERBOSE",
            f"SetEnv {env}",
        ]
        if _sshd_version() >= (9, 8):
            # Probes and refused-key tests must not get 127.0.0.1 penalised and refused.
            lines.append("PerSourcePenalties no")
        self.config_path.write_text("\n".join(lines) + "\n")

    def _prepare(self) -> None:
        """Host key, port and checked config, ready to spawn (runs in a worker thread)."""
        if not self.hostkey_path.exists():
            _keygen(self.hostkey_path, f"fleet-{self.name}")
        if self._pinned_key_line is None:
            self._pinned_key_line = self.host_key_line()
        if not self.port:
            self.port = _reserve_free_port(self.address)
        else:
            with _PORTS_LOCK:
                _PORTS_IN_USE.add(self.port)
        self._write_config()
        r = subprocess.run(
            [SSHD, "-t", "-f", str(self.config_path)], capture_output=True, text=True, check=False
        )
        if r.returncode != 0:
            raise FleetStartError(f"{self.name}: sshd -t rejected {self.config_path}:\n{r.stderr}")

    def _spawn(self) -> None:
        self.pid_path.unlink(missing_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_die_with_parent_preexec(os.getpid())
                if self.fleet.die_with_parent
                else None,
            )
        self.pid = self._proc.pid

    def _new_log(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> str:
        """'ready' once our sshd wrote its pid file and answers an SSH banner; else why not."""
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                return "addrinuse" if "Address already in use" in self._new_log() else "died"
            if self._pid_file_is_ours() and self._banner_ok(deadline):
                return "ready"
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(0.005)

    def _pid_file_is_ours(self) -> bool:
        # sshd writes its PidFile after binding: a banner from a stranger on our port is not ours.
        try:
            return int(self.pid_path.read_text().strip() or 0) == self.pid
        except (OSError, ValueError):
            return False

    def _banner_ok(self, deadline: float) -> bool:
        try:
            with socket.create_connection((self.address, self.port), timeout=1.0) as s:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                data = b""
                while b"\n" not in data and len(data) < 256:
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
                return data.startswith(b"SSH-")
        except OSError:
            return False


# --------------------------------------------------------------------------- fleet


class Fleet:
    """A set of sshd hosts sharing one client key, authorized_keys and known_hosts."""

    def __init__(
        self,
        base: Path,
        repo: Path,
        *,
        ready_timeout: float = READY_TIMEOUT,
        die_with_parent: bool = True,
    ) -> None:
        self.base = Path(base).resolve()
        self.repo = Path(repo).resolve()
        for p in (self.base, self.repo):
            if not _SAFE_PATH.match(str(p)):
                raise ValueError(f"fleet paths must match {_SAFE_PATH.pattern} (sshd_config): {p}")
        self.ready_timeout = ready_timeout
        self.die_with_parent = die_with_parent
        self.hosts: dict[str, FleetHost] = {}
        self.start_seconds: float | None = None  # wall time of the last start()

    # -- paths -------------------------------------------------------------------------------

    @property
    def client_key_path(self) -> Path:
        return self.base / "client" / "id_ed25519"

    @property
    def authorized_keys_path(self) -> Path:
        return self.base / "authorized_keys"

    @property
    def known_hosts_path(self) -> Path:
        return self.base / "known_hosts"

    # -- hosts -------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        gpus: int = 8,
        gpu_name: str = "NVIDIA B200",
        memory_total_mib: int = 183359,
        workdir_size_mib: int | None = None,
    ) -> FleetHost:
        """Declare a host (started by `start()`); `workdir_size_mib` mounts a tmpfs workdir.

        Raises FleetUnsupported when a tmpfs cannot be mounted here.
        """
        if not _HOST_NAME.match(name) or name == "client":
            raise ValueError(f"bad host name {name!r}")
        if name in self.hosts:
            raise ValueError(f"host {name!r} already in the fleet")
        index = len(self.hosts)
        if index > 250:
            raise FleetError("at most 251 hosts per fleet")
        address = f"127.0.0.{2 + index}" if loopback_addresses_supported() else "127.0.0.1"
        host = FleetHost(
            fleet=self,
            name=name,
            address=address,
            dir=self.base / name,
            gpus=gpus,
            gpu_name=gpu_name,
            memory_total_mib=memory_total_mib,
            workdir_size_mib=workdir_size_mib,
        )
        for d in (host.bin_dir, host.home_dir, host.workdir, host.gpu_dir / "procs"):
            d.mkdir(parents=True, exist_ok=True)
        (host.gpu_dir / "held").mkdir(exist_ok=True)
        gpu_config = {"count": gpus, "name": gpu_name, "memory_total_mib": memory_total_mib}
        (host.gpu_dir / "config.json").write_text(json.dumps(gpu_config, indent=2) + "\n")
        if workdir_size_mib is not None:
            self._mount_tmpfs(host, workdir_size_mib)
        self.hosts[name] = host
        return host

    def __getitem__(self, name: str) -> FleetHost:
        return self.hosts[name]

    def __iter__(self) -> Iterator[FleetHost]:
        return iter(self.hosts.values())

    def __len__(self) -> int:
        return len(self.hosts)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start every added host that is not running, in parallel; wait for their banners."""
        t0 = time.monotonic()
        self._start_hosts([h for h in self.hosts.values() if not h.running])
        self.start_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Stop every host and its connections, kill processes left on the hosts, unmount."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.stop()
        leftovers = [r for h in self.hosts.values() for r in h.leftover_processes()]
        _kill_and_wait(leftovers, grace=2.0)
        for host in self.hosts.values():
            if host._mounted:
                self._unmount(host)
            if host.port:
                _release_port(host.port)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- known hosts and inventory -----------------------------------------------------------

    def write_known_hosts(self) -> None:
        """(Re)write known_hosts with each host's pinned key (its key at first start)."""
        lines = [h.known_hosts_line() for h in self.hosts.values() if h.port]
        self.known_hosts_path.write_text("".join(line + "\n" for line in lines))

    def refresh_known_hosts(self) -> None:
        """Pin every host's current key (after `rotate_host_key()`: a deliberate re-trust)."""
        for host in self.hosts.values():
            if host.hostkey_path.exists():
                host._pinned_key_line = host.host_key_line()
        self.write_known_hosts()

    def inventory(
        self,
        hosts: Iterable[str | FleetHost] | Mapping[str, Mapping[str, Any]] | None = None,
        defaults: Mapping[str, Any] | None = None,
        groups: Mapping[str, Iterable[str]] | None = None,
    ) -> dict[str, Any]:
        """A dflashops inventory dict; `hosts` may map names to per-host overrides."""
        if hosts is None:
            chosen: dict[str, Mapping[str, Any]] = {name: {} for name in self.hosts}
        elif isinstance(hosts, Mapping):
            chosen = {str(k): v for k, v in hosts.items()}
        else:
            chosen = {h.name if isinstance(h, FleetHost) else h: {} for h in hosts}
        return {
            "defaults": dict(defaults or {}),
            "hosts": {n: self.hosts[n].inventory_entry(**o) for n, o in chosen.items()},
            "groups": {g: list(members) for g, members in (groups or {}).items()},
        }

    def write_inventory(
        self,
        path: Path,
        hosts: Iterable[str | FleetHost] | Mapping[str, Mapping[str, Any]] | None = None,
        defaults: Mapping[str, Any] | None = None,
        groups: Mapping[str, Iterable[str]] | None = None,
    ) -> Path:
        """Write `inventory(...)` as YAML to `path`; returns the path."""
        path = Path(path)
        data = self.inventory(hosts=hosts, defaults=defaults, groups=groups)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    # -- internals ---------------------------------------------------------------------------

    def _register(self) -> None:
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _ensure_client_key(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        if not self.client_key_path.exists():
            self.client_key_path.parent.mkdir(exist_ok=True)
            _keygen(self.client_key_path, "fleet-client")
        pub = self.client_key_path.with_name("id_ed25519.pub").read_text()
        if not self.authorized_keys_path.exists():
            self.authorized_keys_path.write_text(pub)

    def _start_hosts(self, hosts: list[FleetHost]) -> None:
        reason = sshd_unavailable_reason()
        if reason:
            raise FleetUnsupported(f"{reason}; run `{INSTALL_HINT}`")
        if not hosts:
            return
        self._register()
        self._ensure_client_key()
        for host in hosts:
            if host.workdir_size_mib is not None and not host._mounted:
                self._mount_tmpfs(host, host.workdir_size_mib)
        attempts = dict.fromkeys(hosts, 0)
        failures: list[str] = []
        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            try:
                list(pool.map(FleetHost._prepare, hosts))
                for host in hosts:  # spawned from this thread: PR_SET_PDEATHSIG follows it
                    host._spawn()
                pending = list(hosts)
                while pending:
                    results = list(pool.map(lambda h: h._wait_ready(self.ready_timeout), pending))
                    retry: list[FleetHost] = []
                    for host, result in zip(pending, results, strict=True):
                        if result == "ready":
                            host._port_pinned = True
                            continue
                        if result == "addrinuse" and attempts[host] < _BIND_RETRIES:
                            attempts[host] += 1
                            if host._port_pinned:  # a restart keeps its port: wait for it
                                time.sleep(0.2 * attempts[host])
                            else:  # lost a race for a fresh port: take another
                                _release_port(host.port)
                                host.port = _reserve_free_port(host.address)
                                host._write_config()
                            host._spawn()
                            retry.append(host)
                            continue
                        host.stop()
                        failures.append(
                            f"{host.name} ({host.address}:{host.port}) {result}; "
                            f"sshd stderr ({host.log_path}):\n{host._new_log().strip()}"
                        )
                    pending = retry
            except BaseException:
                for host in hosts:
                    with contextlib.suppress(Exception):
                        host.stop()
                raise
        if failures:
            for host in hosts:
                host.stop()
            raise FleetStartError("sshd did not come up:\n" + "\n".join(failures))
        self.write_known_hosts()

    def _mount_tmpfs(self, host: FleetHost, size_mib: int) -> None:
        if os.geteuid() != 0:
            raise FleetUnsupported("a size-limited tmpfs workdir needs root (mount)")
        mount = shutil.which("mount")
        if mount is None:
            raise FleetUnsupported("a size-limited tmpfs workdir needs mount(8)")
        opts = f"size={int(size_mib)}m,mode=0755"
        cmd = [mount, "-t", "tmpfs", "-o", opts, "tmpfs", str(host.workdir)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise FleetUnsupported(
                f"cannot mount a {size_mib} MiB tmpfs on {host.workdir}: {r.stderr.strip()}"
            )
        host._mounted = True
        self._register()

    def _unmount(self, host: FleetHost) -> None:
        umount = shutil.which("umount") or "umount"
        r = subprocess.run([umount, str(host.workdir)], capture_output=True, check=False)
        if r.returncode != 0:  # busy (a process cwd there): detach it anyway
            subprocess.run([umount, "-l", str(host.workdir)], capture_output=True, check=False)
        host._mounted = False
