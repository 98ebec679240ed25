"""Provider inventories: a host named by its RunPod pod or its Vast.ai instance instead of an
address (DESIGN.md "Nothing lost when a node is lost" 6). The one part of config/ that talks to
a network, and only when something reads a provider host's address or port to connect.

One API call lists every pod of the account, so one call serves every provider host of a run:
the first host that needs its address asks, the others (in their own threads) wait for that
answer. The answer is kept for at most MAX_AGE seconds, in memory and in the project's state
folder (``.dflashops/providers/NAME.json`` beside the inventory, 0600), so back-to-back commands
ask once. An answer read from that file (another run's) is checked before it is used: when the
host's recorded endpoint has no SSH server answering, or does not name the host at all, the API
is asked again at once; that is how a pod that came back on a new port is followed within a
run. What the file keeps is the few fields used here, never the pods' env (it holds secrets).

The file also records each named pod's id: a new id for the same name means the pod was
re-provisioned (``pod_ids``). The API key is read from the controller's environment at the call
and goes nowhere else: never into the file, an object's repr or a message (an error body that
echoes it is redacted).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

from dflashops.config.types import ADDRESS_RE
from dflashops.errors import HostError
from dflashops.output import inert, shorten, some, trace

MAX_AGE = 60.0  # seconds an answer is used for, by any process
TIMEOUT = 10.0  # the API's time to answer
FAILED_AGE = 10.0  # a failed call is said again to every host for this long, not repeated
MIN_REFRESH = 5.0  # an answer this young is not asked again on an unreachable host
PROBE_TIMEOUT = 3.0  # a cached endpoint whose sshd does not greet in this long is stale
ANSWER_LIMIT = 32 << 20  # bytes: an account's pods are far fewer
CACHE_SCHEMA = 1  # of the cache file: raised when its shape changes

Phase = Literal["up", "starting", "down"]


@dataclass(frozen=True)
class Machine:
    """One pod or instance as the API lists it: the fields used here, nothing else."""

    key: str | None  # what the inventory names it by: a pod's name, an instance's id
    id: str
    status: str  # the provider's own word: RUNNING, EXITED, loading...
    phase: Phase
    address: str | None  # public IP
    port: int | None  # the public port that reaches 22
    mapped: tuple[str, ...] = ()  # every private port that has a public one


@dataclass(frozen=True)
class Kind:
    """What differs between providers: where to ask, and how to read the answer."""

    name: str  # the inventory's key: runpod
    what: str  # pod | instance
    default_url: str
    path: str  # appended to api_url
    start: str  # how a person starts a stopped one
    expose: str  # how a person maps port 22
    read: Callable[[Any], list[Machine]]  # raises ValueError on an answer of another shape


def _text(value: Any) -> str | None:
    return value.strip() or None if isinstance(value, str) else None


def _port(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    return None


def _runpod(data: Any) -> list[Machine]:
    """``GET /pods``: a list of pods with id, name, desiredStatus, publicIp, portMappings."""
    if not isinstance(data, list):
        raise ValueError("not a list of pods")
    out = []
    for pod in data:
        if not isinstance(pod, dict) or not isinstance(pod.get("id"), str):
            continue
        status = _text(pod.get("desiredStatus")) or "UNKNOWN"
        ports = pod.get("portMappings")
        ports = ports if isinstance(ports, dict) else {}
        out.append(
            Machine(
                key=_text(pod.get("name")),
                id=pod["id"],
                status=status,
                phase="down" if status in ("EXITED", "TERMINATED") else "up",
                address=_text(pod.get("publicIp")),
                port=_port(ports.get("22")),
                mapped=tuple(sorted(str(p) for p in ports)),
            )
        )
    return out


VAST_STARTING = frozenset({"provisioning", "created", "scheduling", "loading", "rebooting"})


def _vast(data: Any) -> list[Machine]:
    """``GET /instances/?owner=me``: {"instances": [{id, actual_status, public_ipaddr,
    ports: {"22/tcp": [{"HostPort": "41234"}]}}]}."""
    rows = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError('not {"instances": [...]}')
    out = []
    for row in rows:
        ident = row.get("id") if isinstance(row, dict) else None
        if not isinstance(ident, int) or isinstance(ident, bool):
            continue
        status = _text(row.get("actual_status")) or "provisioning"
        ports = row.get("ports")
        ports = ports if isinstance(ports, dict) else {}
        ssh = ports.get("22/tcp")
        first = ssh[0] if isinstance(ssh, list) and ssh and isinstance(ssh[0], dict) else {}
        phase: Phase = (
            "up" if status == "running" else "starting" if status in VAST_STARTING else "down"
        )
        out.append(
            Machine(
                key=str(ident),
                id=str(ident),
                status=status,
                phase=phase,
                address=_text(row.get("public_ipaddr")),
                port=_port(first.get("HostPort")),
                mapped=tuple(sorted(str(p).split("/")[0] for p in ports)),
            )
        )
    return out


KINDS = {
    "runpod": Kind(
        "runpod",
        "pod",
        "https://rest.runpod.io/v1",
        "/pods",
        "in the RunPod console",
        "the pod's Expose TCP Ports: 22",
        _runpod,
    ),
    "vast": Kind(
        "vast",
        "instance",
        "https://console.vast.ai/api/v0",
        "/instances/?owner=me",
        "`vastai start instance ID` or the Vast.ai console",
        "an ssh launch mode, or -p 22:22 in the instance's docker options",
        _vast,
    ),
}


@dataclass(frozen=True)
class Endpoint:
    """Where a provider host is reached now."""

    address: str
    port: int
    id: str  # the pod's id
    status: str


@dataclass(frozen=True)
class Answer:
    machines: tuple[Machine, ...]
    fetched: float  # time.time() of the call
    live: bool  # asked by this process (False: read from the cache file, another run's)


@dataclass(frozen=True)
class PodIds:
    """A named pod's id now and, when it changed (re-provisioned), the one before."""

    current: str
    previous: str | None = None
    changed: float | None = None  # time.time() when the new id was first seen


STATE_DIR = ".dflashops"  # the project's state folder, beside the inventory


def state_path(inventory_path: Path) -> Path:
    """The project's state folder, ``.dflashops/`` beside the inventory, defined once here (the
    lowest layer that needs it; project.state_dir makes it), made only when written to."""
    return inventory_path.resolve().parent / STATE_DIR


class Provider:
    """One provider account of one inventory: its API, its answer, its cache file."""

    def __init__(self, kind: Kind, api_url: str, key_env: str, cache: Path) -> None:
        self.kind = kind
        self.api_url = api_url.rstrip("/")
        self.key_env = key_env  # the variable's name: the key is read at the call
        self.cache = cache
        self.keys: set[str] = set()  # the pods the inventory names (their ids are recorded)
        self._lock = threading.Lock()
        self._answer: Answer | None = None
        self._failed: tuple[float, str, str] | None = None  # monotonic, detail, next step
        self._endpoints: dict[str, Endpoint] = {}  # per key, for the current answer
        self._ids: dict[str, PodIds] | None = None  # loaded with the cache file

    def __repr__(self) -> str:
        return f"Provider({self.kind.name}, {self.api_url})"

    def __getstate__(self) -> dict[str, Any]:
        # A Host may be pickled (pre-flight's forked children send results back): its copy
        # takes no lock and no answer along, and asks anew if it is ever asked.
        return {k: self.__dict__[k] for k in ("kind", "api_url", "key_env", "cache", "keys")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["kind"], state["api_url"], state["key_env"], state["cache"])  # type: ignore[misc]
        self.keys = state["keys"]

    def endpoint(self, host: str, key: str) -> Endpoint:
        """Where ``host`` (the pod ``key``) is reached; HostError (naming the provider and
        what to do) when it cannot be, for this host alone."""
        answer = self.answer(host)
        known = self._endpoints.get(key)
        if known is not None:
            return known
        try:
            found = find(self.kind, key, answer.machines, host)
            stale = not answer.live and not answers_ssh(found.address, found.port)
        except HostError:
            if answer.live:
                raise
            stale = True  # another run's answer: the pod may have changed since
        if stale:
            answer = self.refresh(host, answer)
            found = find(self.kind, key, answer.machines, host)
        with self._lock:
            if self._answer is answer:
                self._endpoints[key] = found
        return found

    def answer(self, host: str) -> Answer:
        """The account's pods: remembered, else from the cache file, else asked (once, for
        every thread that wants them now)."""
        with self._lock:
            now = time.time()
            if self._answer is not None and 0 <= now - self._answer.fetched < MAX_AGE:
                return self._answer
            self._raise_failed(host)
            key = self._key(host)
            cached = self._read(now, key)
            if cached is not None:
                self._use(cached)
                return cached
            return self._fetch(host, key)

    def refresh(self, host: str, seen: Answer | None = None) -> Answer:
        """Ask the API again (``seen``: the answer found wanting), unless another thread just
        did or the answer is younger than MIN_REFRESH."""
        with self._lock:
            current = self._answer
            if current is not None and current.live:
                if seen is not None and current is not seen:
                    return current  # asked again by another host's thread meanwhile
                if time.time() - current.fetched < MIN_REFRESH:
                    return current
            self._raise_failed(host)
            return self._fetch(host, self._key(host))

    def ids(self, host: str, key: str) -> PodIds | None:
        """What was recorded for the pod ``key``: its id and, if it changed, the one before."""
        self.answer(host)
        with self._lock:
            return (self._ids or {}).get(key)

    # -- the call ---------------------------------------------------------------------------

    def _key(self, host: str) -> str:
        key = os.environ.get(self.key_env, "")
        if not key.strip():
            self._fail(
                host,
                f"api_key env:{self.key_env} is not set in this environment",
                f"Export {self.key_env} with the {self.kind.name} API key, then retry",
            )
        return key.strip()

    def _fetch(self, host: str, key: str) -> Answer:
        url = self.api_url + self.kind.path
        started = time.monotonic()
        status, body, problem = _get(url, key)
        trace(self.kind.name, f"GET {url} -> {status or problem}", time.monotonic() - started)
        if problem is not None:
            self._fail(host, f"the API at {url} {problem}", "Retry in a minute")
        if status in (401, 403):
            self._fail(
                host,
                f"the API refused the key in env:{self.key_env} (HTTP {status})",
                f"Check that {self.key_env} holds a valid {self.kind.name} API key that may "
                "read pods",
            )
        if status != 200:
            said = _redact(shorten(inert(body.decode("utf-8", "replace")), 120), key)
            self._fail(host, f"the API at {url} answered HTTP {status}: {said}", "Retry later")
        try:
            machines = self.kind.read(json.loads(body))
        except ValueError as exc:  # JSONDecodeError is one
            self._fail(
                host,
                f"the API at {url} answered with something else than expected ({exc})",
                "Check api_url in the inventory's providers",
            )
        answer = Answer(tuple(machines), time.time(), live=True)
        self._record_ids(answer)
        self._use(answer)
        self._write(answer, key)
        return answer

    def _fail(self, host: str, detail: str, next_step: str) -> NoReturn:
        detail = f"{self.kind.name}: {detail}"
        self._failed = (time.monotonic(), detail, next_step)
        raise HostError(host, detail, next_step)

    def _raise_failed(self, host: str) -> None:
        if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_AGE:
            raise HostError(host, self._failed[1], self._failed[2])
        self._failed = None

    def _use(self, answer: Answer) -> None:
        self._answer = answer
        self._endpoints = {}

    def _record_ids(self, answer: Answer) -> None:
        ids = self._load_ids()
        for key in sorted(self.keys):
            try:
                found = pick(self.kind, key, answer.machines, "")
            except HostError:
                continue  # not there, or not one: nothing to record
            old = ids.get(key)
            if old is None:
                ids[key] = PodIds(found.id)
            elif old.current != found.id:
                ids[key] = PodIds(found.id, old.current, answer.fetched)

    # -- the cache file ---------------------------------------------------------------------

    def _account(self, key: str) -> str:
        # Which account an answer is for, so that another key or URL never uses it; a hash
        # of the key (64 of its bits cannot give it back).
        return hashlib.sha256(f"{self.api_url}\n{key}".encode()).hexdigest()[:16]

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.cache.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("schema") == CACHE_SCHEMA else {}

    def _load_ids(self) -> dict[str, PodIds]:
        if self._ids is None:
            self._ids = {}
            raw = self._load().get("ids")
            for name, rec in (raw if isinstance(raw, dict) else {}).items():
                with contextlib.suppress(TypeError, ValueError):
                    self._ids[str(name)] = PodIds(**rec)
        return self._ids

    def _read(self, now: float, key: str) -> Answer | None:
        data = self._load()
        self._load_ids()
        fetched = data.get("fetched")
        if data.get("account") != self._account(key) or not isinstance(fetched, (int, float)):
            return None
        if not 0 <= now - fetched < MAX_AGE:
            return None
        try:
            machines = tuple(
                Machine(**{**m, "mapped": tuple(m.get("mapped", ()))}) for m in data["machines"]
            )
        except (KeyError, TypeError, ValueError):
            return None
        return Answer(machines, float(fetched), live=False)

    def _write(self, answer: Answer, key: str) -> None:
        data = {
            "schema": CACHE_SCHEMA,
            "provider": self.kind.name,
            "account": self._account(key),
            "fetched": answer.fetched,
            "machines": [asdict(m) for m in answer.machines],
            "ids": {k: asdict(v) for k, v in sorted(self._load_ids().items())},
        }
        try:
            write_private(self.cache, json.dumps(data, indent=1) + "\n")
        except OSError as exc:
            _warn_once(f"{self.kind.name}: {self.cache} not written ({exc}): each run asks the API")


def find(kind: Kind, key: str, machines: tuple[Machine, ...], host: str) -> Endpoint:
    """The endpoint of the pod ``key``; HostError with what is wrong with it and what to do."""
    m = pick(kind, key, machines, host)
    label = f"{kind.name}: {kind.what} {key!r} (id {m.id})"
    if m.phase == "down":
        raise HostError(host, f"{label} is {m.status}", f"Start it ({kind.start}), then retry")
    if m.phase == "starting" or not m.address or (m.port is None and not m.mapped):
        raise HostError(
            host,
            f"{label} is starting (no public IP/port yet)",
            "Retry when it is up (a pod that stays so has no public IP: give it one)",
        )
    if m.port is None:
        raise HostError(
            host,
            f"{label} has no public port for SSH: 22 is not among its mapped ports "
            f"({some(list(m.mapped))})",
            f"Map 22/tcp ({kind.expose}), then retry",
        )
    if not ADDRESS_RE.fullmatch(m.address):
        shown = shorten(inert(repr(m.address)), 60)
        raise HostError(
            host, f"{label}: the API gives {shown} as its public IP, which is not an address"
        )
    return Endpoint(m.address, m.port, m.id, m.status)


def pick(kind: Kind, key: str, machines: tuple[Machine, ...], host: str) -> Machine:
    """The one machine the inventory's ``key`` names (of several with one name: the only one
    not stopped)."""
    found = [m for m in machines if m.key == key]
    if len(found) > 1:
        alive = [m for m in found if m.phase != "down"]
        found = alive if len(alive) == 1 else found
    if len(found) == 1:
        return found[0]
    if found:
        raise HostError(
            host,
            f"{kind.name}: {len(found)} {kind.what}s are named {key!r} "
            f"(ids {some([m.id for m in found])})",
            f"Rename all but one in {kind.name}, or stop the others",
        )
    names = sorted({m.key for m in machines if m.key})
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    has = f"it has {some(names)}" if names else f"it has no {kind.what}s"
    raise HostError(
        host,
        f"{kind.name}: no {kind.what} is named {key!r}{hint} ({has})",
        f"Fix the host's `{kind.name}:` entry in the inventory",
    )


def _get(url: str, key: str) -> tuple[int | None, bytes, str | None]:
    """(HTTP status, body, None), or (None, b"", what went wrong) when there is no answer."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url,
        headers={
            "Authorization": f"Bearer {key}",
            "Accept": "application/json",
            "User-Agent": "dflashops",
        },
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, _read_until(response, deadline), None
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(OSError):
            return exc.code, exc.read(4096), None
        return exc.code, b"", None
    except TimeoutError:
        return None, b"", f"did not answer within {TIMEOUT:g}s"
    except ValueError as exc:  # from _read_until
        return None, b"", f"answered badly ({exc})"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return None, b"", f"did not answer within {TIMEOUT:g}s"
        return None, b"", f"cannot be reached ({_redact(str(reason), key) or type(exc).__name__})"


def _read_until(response: Any, deadline: float) -> bytes:
    body = bytearray()
    while chunk := response.read(1 << 16):
        body += chunk
        if len(body) > ANSWER_LIMIT:
            raise ValueError(f"an answer over {ANSWER_LIMIT >> 20} MiB")
        if time.monotonic() > deadline:
            raise TimeoutError
    return bytes(body)


def _redact(text: str, key: str) -> str:
    return text.replace(key, "***") if len(key) >= 4 else text


def answers_ssh(address: str, port: int) -> bool:
    """Whether an SSH server answers at ``address:port`` (its version line, unasked): a port
    that is closed, or now maps to something else, is not the pod's any more."""
    try:
        with socket.create_connection((address, port), timeout=PROBE_TIMEOUT) as sock:
            return b"SSH-" in sock.recv(256)
    except OSError:
        return False


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` (0600, folders 0700), whole or not at all."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        sys.stderr.write(f"warning: {message}\n")


@dataclass(frozen=True)
class PodRef:
    """A provider host's pod: held by its Host, whose address and port ask it."""

    provider: Provider = field(compare=False, repr=False)
    key: str  # the pod's name (RunPod), the instance's id (Vast.ai)

    @property
    def name(self) -> str:
        return self.provider.kind.name

    def endpoint(self, host: str) -> Endpoint:
        return self.provider.endpoint(host, self.key)


class ProviderHost(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def provider(self) -> PodRef | None: ...


def pod_id(host: ProviderHost) -> str | None:
    """The provider's id of the host's pod now (asking the API as connecting does); None for a
    host with an address of its own. HostError when the pod cannot be reached."""
    return None if host.provider is None else host.provider.endpoint(host.name).id


def pod_ids(host: ProviderHost) -> PodIds | None:
    """The host's pod id as recorded, and the one before it when it changed: a changed id for
    the same name means the pod was re-provisioned (new disk, new host key)."""
    ref = host.provider
    return None if ref is None else ref.provider.ids(host.name, ref.key)


def refresh(host: ProviderHost) -> None:
    """The host was unreachable: ask its provider again (unless asked within MIN_REFRESH s)
    before its address is read next."""
    if host.provider is not None:
        host.provider.provider.refresh(host.name)
