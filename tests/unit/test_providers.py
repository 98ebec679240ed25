"""Provider inventories (issue 22, DESIGN.md "Nothing lost when a node is lost" 6): a host named
by its RunPod pod (or Vast.ai instance) gets its address and SSH port from the provider's API,
asked once for every host, lazily, cached at most 60 s in `.dflashops/` beside the inventory;
every bad answer is one line naming the provider and what to do; `dflashops inventory --list`.

The API is a real HTTP server on 127.0.0.1 (`FakeApi`) answering in the documented shapes
(RunPod REST v1 `GET /pods`: id, name, desiredStatus, publicIp, portMappings {"22": port};
Vast.ai `GET /instances/`: {"instances": [{id, actual_status, public_ipaddr, ports}]})."""

from __future__ import annotations

import contextlib
import json
import socket
import stat
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflashops.cli import main
from dflashops.config import providers
from dflashops.config.inventory import Host
from dflashops.config.load import load_inventory
from dflashops.errors import ConfigError, HostError
from dflashops.lifecycle.fleet import on_hosts
from tests.procs import free_ports

KEY = "rpa_T3STKEY0123456789"
ENV = "RUNPOD_API_KEY"


class FakeApi:
    """A provider API on 127.0.0.1, in a thread: answers ``GET .../pods`` (RunPod) and
    ``GET .../instances/`` (Vast.ai) with what the test set; keeps every request."""

    def __init__(self, key: str = KEY) -> None:
        self.key = key
        self.pods: list[dict[str, Any]] = []  # RunPod's answer
        self.instances: list[dict[str, Any]] = []  # Vast.ai's
        self.status = 200
        self.body: bytes | None = None  # sent instead of the JSON when set
        self.delay = 0.0
        self.requests: list[tuple[str, str | None]] = []  # path, Authorization
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append((self.path, self.headers.get("Authorization")))
                time.sleep(api.delay)
                status, body = api.answer(self.path, self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client gave up (a timeout test)
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def calls(self) -> int:
        return len(self.requests)

    def answer(self, path: str, auth: str | None) -> tuple[int, bytes]:
        if auth != f"Bearer {self.key}":
            return 401, b'{"error": "invalid api key"}'
        if self.body is not None:
            return self.status, self.body
        if path.startswith("/v1/instances/"):
            return self.status, json.dumps({"instances": self.instances}).encode()
        if path == "/v1/pods":
            return self.status, json.dumps(self.pods).encode()
        return 404, b"{}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pod(
    name: str,
    ident: str,
    ip: str = "127.0.0.1",
    port: int | None = 22,
    status: str = "RUNNING",
    **more: Any,
) -> dict[str, Any]:
    """A pod as RunPod's REST API v1 lists it (with fields dflashops must not keep)."""
    return {
        "id": ident,
        "name": name,
        "desiredStatus": status,
        "publicIp": ip,
        "portMappings": {"22": port, "8888": 40000} if port else {},
        "env": {"HF_TOKEN": "hf_pod_secret"},
        "costPerHr": 0.74,
        "image": "runpod/pytorch:2.1.0",
        **more,
    }


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApi]:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV, KEY)
    fake = FakeApi()
    try:
        yield fake
    finally:
        fake.close()


def write_inventory(path: Path, api: FakeApi, hosts: dict[str, Any], **more: Any) -> Path:
    data = {
        "defaults": {"user": "root"},
        "providers": {"runpod": {"api_key": f"env:{ENV}", "api_url": api.url}},
        "hosts": hosts,
        **more,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_inventory(path)
    return [str(p) for p in exc.value.problems]


def refusal(host: Host) -> str:
    with pytest.raises(HostError) as exc:
        _ = host.address
    return str(exc.value)


# ------------------------------------------------------------------------------ the inventory


def test_a_pod_host_with_an_address_or_port_is_an_error_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        "providers:\n"
        "  runpod: {api_key: env:RUNPOD_API_KEY}\n"
        "hosts:\n"
        "  b200:\n"
        "    runpod: {pod: gen-b200}\n"
        "    address: 1.2.3.4\n"
        "    port: 36472\n"
    )
    assert problems_of(path) == [
        f"{path}:6:5: hosts.b200.address: a runpod host's address comes from runpod's API: "
        "remove `address` (or remove `runpod` to use a fixed address)",
        f"{path}:7:5: hosts.b200.port: a runpod host's port comes from runpod's API: "
        "remove `port` (or remove `runpod` to use a fixed address)",
    ]


def test_the_api_key_is_env_name_only_and_never_repeated(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        "providers:\n"
        f"  runpod: {{api_key: {KEY}, api_url: ftp://x}}\n"
        "hosts:\n"
        "  b200: {runpod: {pod: gen}}\n"
    )
    got = problems_of(path)
    assert got == [
        f"{path}:2:12: providers.runpod.api_key: the API key is a secret: write env:NAME, the "
        "environment variable that holds it (never the key itself)",
        f"{path}:2:44: providers.runpod.api_url: api_url is an http:// or https:// URL",
    ]
    assert KEY not in "\n".join(got)


def test_unknown_keys_a_missing_provider_and_two_pods_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        "providers:\n"
        "  runpod: {api_key: env:K, region: eu}\n"
        "hosts:\n"
        "  a: {runpod: {pod: x, name: y}}\n"
        "  b: {vast: {instance: 7}}\n"
        "  c: {runpod: {pod: x}, vast: {instance: 8}}\n"
        "  d: {connection: local, runpod: {pod: z}}\n"
    )
    assert problems_of(path) == [
        f"{path}:2:28: providers.runpod.region: unknown key 'region'; allowed here: api_key, "
        "api_url",
        f"{path}:4:24: hosts.a.runpod.name: unknown key 'name'; allowed here: pod",
        f"{path}:5:7: hosts.b.vast: a vast host needs `providers: {{vast: {{api_key: "
        "env:NAME}}` in the inventory",
        f"{path}:6:25: hosts.c.vast: a host is one pod: keep `runpod` or `vast`",
        f"{path}:7:26: hosts.d.runpod: a local host has no runpod pod; remove `runpod`",
    ]


def test_loading_and_offline_preflight_never_call_the_api(
    api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.pods = [pod("gen-b200", "p1")]
    inv = write_inventory(
        tmp_path / "inventory.yaml", api, {"b200": {"runpod": {"pod": "g"}, "gpus": 1}}
    )
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "web.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "web",
                "hosts": "b200",
                "services": [{"name": "web", "engine": "stub", "model": "/m", "port": 30000}],
            }
        )
    )
    host = load_inventory(inv).hosts["b200"]
    assert host.provider is not None and host.given_address is None
    assert main(["preflight", "-i", str(inv)]) == 0, capsys.readouterr().out
    assert main(["render", "-i", str(inv)]) == 0, capsys.readouterr().out
    assert api.calls == 0
    assert not (tmp_path / ".dflashops").exists()


# ------------------------------------------------------------------------------ resolution


def test_every_pod_host_resolves_from_one_call_with_the_bearer_key(
    api: FakeApi, tmp_path: Path
) -> None:
    api.delay = 0.3  # every host's thread asks while the first call is under way
    names = [f"n{i}" for i in range(8)]
    api.pods = [pod(f"pod-{n}", f"id-{n}", port=20000 + i) for i, n in enumerate(names)]
    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml", api, {n: {"runpod": {"pod": f"pod-{n}"}} for n in names}
        )
    )
    outcomes = on_hosts(list(inv.hosts.values()), lambda h: (h.address, h.port), 8)
    assert {n: o.value for n, o in outcomes.items()} == {
        n: ("127.0.0.1", 20000 + i) for i, n in enumerate(names)
    }
    assert api.requests == [("/v1/pods", f"Bearer {KEY}")]
    assert providers.pod_id(inv.hosts["n3"]) == "id-n3"


def test_a_starting_pod_is_its_host_alone_and_says_so(api: FakeApi, tmp_path: Path) -> None:
    api.pods = [pod("gen", "p1", port=23001), pod("boot", "p2", ip="", port=None)]
    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml",
            api,
            {"a": {"runpod": {"pod": "gen"}}, "b": {"runpod": {"pod": "boot"}}},
        )
    )
    assert refusal(inv.hosts["b"]) == (
        "[b] runpod: pod 'boot' (id p2) is starting (no public IP/port yet). Retry when it is "
        "up (a pod that stays so has no public IP: give it one)"
    )
    assert (inv.hosts["a"].address, inv.hosts["a"].port) == ("127.0.0.1", 23001)
    assert api.calls == 1


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        (
            [pod("gen-b200", "p1"), pod("train", "p2")],
            "[h] runpod: no pod is named 'gen-b20'; did you mean 'gen-b200'? (it has gen-b200, "
            "train). Fix the host's `runpod:` entry in the inventory",
        ),
        (
            [{**pod("gen-b20", "p1"), "portMappings": {"8888": 40001}}],
            "[h] runpod: pod 'gen-b20' (id p1) has no public port for SSH: 22 is not among its "
            "mapped ports (8888). Map 22/tcp (the pod's Expose TCP Ports: 22), then retry",
        ),
        (
            [pod("gen-b20", "p1", status="EXITED")],
            "[h] runpod: pod 'gen-b20' (id p1) is EXITED. Start it (in the RunPod console), "
            "then retry",
        ),
        (
            [pod("gen-b20", "p1"), pod("gen-b20", "p2")],
            "[h] runpod: 2 pods are named 'gen-b20' (ids p1, p2). Rename all but one in runpod, "
            "or stop the others",
        ),
        (
            [pod("gen-b20", "p1", ip="-oProxyCommand=sh")],
            "[h] runpod: pod 'gen-b20' (id p1): the API gives '-oProxyCommand=sh' as its "
            "public IP, which is not an address",
        ),
    ],
    ids=["no-such-pod", "no-port-22", "exited", "two-of-one-name", "hostile-address"],
)
def test_a_pod_that_cannot_be_reached_is_one_line(
    api: FakeApi, tmp_path: Path, pods: list[dict[str, Any]], message: str
) -> None:
    api.pods = pods
    inv = load_inventory(
        write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen-b20"}}})
    )
    assert refusal(inv.hosts["h"]) == message


def test_of_two_pods_of_one_name_the_one_not_stopped_is_used(api: FakeApi, tmp_path: Path) -> None:
    api.pods = [pod("gen", "old", status="EXITED", port=1), pod("gen", "new", port=2)]
    inv = load_inventory(
        write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen"}}})
    )
    assert inv.hosts["h"].port == 2


def test_a_refused_key_names_the_variable_never_the_key(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "rpa_WRONGKEY_987654")
    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml",
            api,
            {"a": {"runpod": {"pod": "x"}}, "b": {"runpod": {"pod": "y"}}},
        )
    )
    said = [refusal(inv.hosts["a"]), refusal(inv.hosts["b"])]
    assert said[0] == (
        "[a] runpod: the API refused the key in env:RUNPOD_API_KEY (HTTP 401). Check that "
        "RUNPOD_API_KEY holds a valid runpod API key that may read pods"
    )
    assert said[1].startswith("[b] runpod: the API refused the key")
    assert api.calls == 1  # the second host is told, not asked again
    monkeypatch.delenv(ENV)
    inv = load_inventory(tmp_path / "inventory.yaml")
    assert refusal(inv.hosts["a"]) == (
        "[a] runpod: api_key env:RUNPOD_API_KEY is not set in this environment. Export "
        "RUNPOD_API_KEY with the runpod API key, then retry"
    )


def test_an_error_body_that_echoes_the_key_is_redacted(api: FakeApi, tmp_path: Path) -> None:
    api.status = 500
    api.body = f"internal error for token {KEY}".encode()
    inv = load_inventory(
        write_inventory(tmp_path / "inventory.yaml", api, {"a": {"runpod": {"pod": "x"}}})
    )
    said = refusal(inv.hosts["a"])
    assert said == (
        f"[a] runpod: the API at {api.url}/pods answered HTTP 500: internal error for token "
        "***. Retry later"
    )


def test_an_api_that_is_down_or_slow_is_one_line(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(providers, "TIMEOUT", 0.5)
    api.delay = 2.0
    path = write_inventory(tmp_path / "inventory.yaml", api, {"a": {"runpod": {"pod": "x"}}})
    started = time.monotonic()
    said = refusal(load_inventory(path).hosts["a"])
    assert time.monotonic() - started < 1.8
    assert (
        said
        == f"[a] runpod: the API at {api.url}/pods did not answer within 0.5s. Retry in a minute"
    )
    closed = free_ports(1)
    down = f"http://127.0.0.1:{closed}/v1"
    path.write_text(path.read_text().replace(api.url, down))
    said = refusal(load_inventory(path).hosts["a"])
    assert said.startswith(f"[a] runpod: the API at {down}/pods cannot be reached (")
    assert said.endswith("). Retry in a minute")


def test_an_answer_of_another_shape_says_so(api: FakeApi, tmp_path: Path) -> None:
    api.body = b'{"pods": []}'
    inv = load_inventory(
        write_inventory(tmp_path / "inventory.yaml", api, {"a": {"runpod": {"pod": "x"}}})
    )
    assert refusal(inv.hosts["a"]) == (
        f"[a] runpod: the API at {api.url}/pods answered with something else than expected "
        "(not a list of pods). Check api_url in the inventory's providers"
    )


def test_vast_instances_resolve_in_the_same_shape(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VAST_API_KEY", KEY)
    ssh = {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "41234"}], "8080/tcp": []}
    api.instances = [
        {"id": 123, "actual_status": "running", "public_ipaddr": "127.0.0.1\n", "ports": ssh},
        {"id": 456, "actual_status": "loading", "public_ipaddr": "", "ports": {}},
        {"id": 789, "actual_status": "stopped", "public_ipaddr": "127.0.0.1", "ports": ssh},
    ]
    path = tmp_path / "inventory.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "providers": {"vast": {"api_key": "env:VAST_API_KEY", "api_url": api.url}},
                "hosts": {f"v{i}": {"vast": {"instance": i}} for i in (123, 456, 789, 5)},
            }
        )
    )
    inv = load_inventory(path)
    assert (inv.hosts["v123"].address, inv.hosts["v123"].port) == ("127.0.0.1", 41234)
    assert refusal(inv.hosts["v456"]).startswith(
        "[v456] vast: instance '456' (id 456) is starting (no public IP/port yet)."
    )
    assert refusal(inv.hosts["v789"]).startswith(
        "[v789] vast: instance '789' (id 789) is stopped. Start it (`vastai start instance ID`"
    )
    assert refusal(inv.hosts["v5"]).startswith("[v5] vast: no instance is named '5'")
    assert api.requests == [("/v1/instances/?owner=me", f"Bearer {KEY}")]


# ------------------------------------------------------------------------------ the cache


class Greeter:
    """A port where an sshd would be: greets every connection with an SSH version line (or,
    with ``ssh=False``, with something else: the port now maps to another service)."""

    def __init__(self, ssh: bool = True) -> None:
        self.greeting = b"SSH-2.0-OpenSSH_9.2\r\n" if ssh else b"HTTP/1.0 400 Bad Request\r\n\r\n"
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port: int = self.sock.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(self.greeting)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.sock.close()

    def __enter__(self) -> Greeter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done.is_set():
            self.close()


def test_the_answer_is_kept_60s_in_the_state_folder_without_secrets(
    api: FakeApi, tmp_path: Path
) -> None:
    with Greeter() as sshd:
        api.pods = [pod("gen", "p1", port=sshd.port)]
        path = write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen"}}})
        assert load_inventory(path).hosts["h"].port == sshd.port
        cache = tmp_path / ".dflashops" / "providers" / "runpod.json"
        assert stat.S_IMODE(cache.stat().st_mode) == 0o600
        assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o700
        text = cache.read_text()
        assert KEY not in text and "hf_pod_secret" not in text and "HF_TOKEN" not in text
        api.pods = [pod("gen", "p1", port=sshd.port + 1)]
        assert load_inventory(path).hosts["h"].port == sshd.port  # another run, within 60 s
        assert api.calls == 1
        data = json.loads(text)
        data["fetched"] -= providers.MAX_AGE + 1
        cache.write_text(json.dumps(data))
        assert load_inventory(path).hosts["h"].port == sshd.port + 1  # expired: asked again
        assert api.calls == 2


@pytest.mark.parametrize("then", ["closed", "not-ssh"])
def test_a_cached_endpoint_without_its_sshd_is_asked_again_at_once(
    api: FakeApi, tmp_path: Path, then: str
) -> None:
    with Greeter() as old, Greeter() as new, Greeter(ssh=False) as other:
        api.pods = [pod("gen", "p1", port=old.port)]
        path = write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen"}}})
        assert load_inventory(path).hosts["h"].port == old.port
        old.close()  # the pod came back elsewhere
        if then == "not-ssh":  # and its old port now leads to something else
            cache = tmp_path / ".dflashops" / "providers" / "runpod.json"
            data = json.loads(cache.read_text())
            data["machines"][0]["port"] = other.port
            cache.write_text(json.dumps(data))
        api.pods = [pod("gen", "p1", port=new.port)]
        assert load_inventory(path).hosts["h"].port == new.port
        assert api.calls == 2


def test_a_changed_pod_id_for_the_name_is_recorded(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.pods = [pod("gen", "first")]
    path = write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen"}}})
    host = load_inventory(path).hosts["h"]
    assert providers.pod_ids(host) == providers.PodIds("first")
    api.pods = [pod("gen", "second")]  # re-provisioned: a new pod of the same name
    providers.refresh(host)  # an unreachable host, but the answer is too young to ask again
    assert providers.pod_id(host) == "first" and api.calls == 1
    monkeypatch.setattr(providers, "MIN_REFRESH", 0.0)
    providers.refresh(host)
    assert providers.pod_id(host) == "second" and api.calls == 2
    ids = providers.pod_ids(host)
    assert ids is not None and (ids.current, ids.previous) == ("second", "first")
    assert ids.changed is not None and abs(ids.changed - time.time()) < 30
    assert providers.pod_ids(load_inventory(path).hosts["h"]) == ids  # the next run: the file


def test_an_unwritable_state_folder_is_one_warning(
    api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.pods = [pod("gen", "p1", port=2)]
    path = write_inventory(tmp_path / "inventory.yaml", api, {"h": {"runpod": {"pod": "gen"}}})
    (tmp_path / ".dflashops").write_text("a file where the folder goes")
    assert load_inventory(path).hosts["h"].port == 2
    assert "not written" in capsys.readouterr().err


# ------------------------------------------------------------------------------ inventory --list


def test_inventory_list_is_the_resolved_inventory_as_json(
    api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.pods = [pod("gen-b200", "p1", port=36472), pod("boot", "p2", ip="", port=None)]
    path = write_inventory(
        tmp_path / "inventory.yaml",
        api,
        {
            "b200": {"runpod": {"pod": "gen-b200"}, "gpus": 7, "vars": {"shard": 1}},
            "boot": {"runpod": {"pod": "boot"}},
            "fixed": {
                "address": "10.0.0.5",
                "port": 2222,
                "env": {"HF_TOKEN": "hf_env_secret"},
                "notify": {"webhook": "https://hooks.example/secret-path"},
            },
        },
        groups={"gen": {"hosts": ["b200", "fixed"], "vars": {"model": "/m"}}, "all2": ["boot"]},
    )
    assert main(["inventory", "-i", str(path), "--list"]) == 2  # boot has no address yet
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["hosts"]["b200"] == {
        "connection": "ssh",
        "address": "127.0.0.1",
        "port": 36472,
        "user": "root",
        "workdir": "~/dflashops",
        "gpus": 7,
        "python": "python3",
        "provider": {
            "name": "runpod",
            "pod": "gen-b200",
            "pod_id": "p1",
            "status": "RUNNING",
            "problem": None,
        },
        "vars": {"model": "/m", "shard": 1},
    }
    assert doc["hosts"]["boot"]["address"] is None
    assert doc["hosts"]["boot"]["provider"]["problem"].startswith(
        "runpod: pod 'boot' (id p2) is starting (no public IP/port yet)."
    )
    assert doc["hosts"]["fixed"]["provider"] is None and doc["hosts"]["fixed"]["port"] == 2222
    assert doc["groups"] == {
        "gen": {"hosts": ["b200", "fixed"], "vars": {"model": "/m"}},
        "all2": {"hosts": ["boot"], "vars": {}},
    }
    for secret in (KEY, "hf_env_secret", "secret-path", "hf_pod_secret"):
        assert secret not in out + err
    assert "unreachable: [boot] runpod: pod 'boot' (id p2) is starting" in err
    assert api.calls == 1

    assert main(["inventory", "-i", str(path), "--list", "--host", "gen"]) == 0
    narrowed = json.loads(capsys.readouterr().out)
    assert list(narrowed["hosts"]) == ["b200", "fixed"] and list(narrowed["groups"]) == ["gen"]
    assert main(["inventory", "-i", str(path), "--host", "b200"]) == 0
    table = capsys.readouterr().out
    assert "127.0.0.1:36472" in table and "runpod 'gen-b200' (id p1)" in table


def test_status_says_why_a_starting_pod_is_unreachable_and_looks_at_the_rest(
    api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.pods = [pod("boot", "p2", ip="", port=None)]
    path = write_inventory(
        tmp_path / "inventory.yaml",
        api,
        {
            "boot": {"runpod": {"pod": "boot"}},
            "here": {"connection": "local", "workdir": str(tmp_path / "wd")},
        },
    )
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "j.yaml").write_text(
        yaml.safe_dump(
            {"name": "j", "hosts": ["boot", "here"], "jobs": [{"name": "j", "command": ["true"]}]}
        )
    )
    code = main(["status", "-i", str(path), "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert code == 2, out
    doc = json.loads((tmp_path / "s.json").read_text())
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts["here"]["state"] == "ok"
    assert hosts["boot"]["state"] == "unreachable"
    assert hosts["boot"]["error"] == (
        "[boot] runpod: pod 'boot' (id p2) is starting (no public IP/port yet). Retry when it "
        "is up (a pod that stays so has no public IP: give it one)"
    )
    assert "unreachable: [boot] runpod: pod 'boot' (id p2) is starting" in out
