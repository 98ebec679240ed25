"""The inventory file: which machines exist, how to reach them, what they hold."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from dflashops.config.providers import KINDS, PodRef, Provider, state_path
from dflashops.config.types import (
    Address,
    Env,
    HostKey,
    Name,
    NetIf,
    PathStr,
    Port,
    Text,
    User,
)

HostKeyPolicy = Literal["strict", "accept-new"]
ConnectionKind = Literal["ssh", "local"]


class StrictModel(BaseModel):
    """Base for user input: unknown keys are errors, values are not coerced between types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Notify(StrictModel):
    """Where the host reports restarts and give-ups, on its own (the controller may be off)."""

    webhook: Annotated[
        Text,
        Field(
            description="An http(s) URL the host POSTs JSON to, or env:NAME (read from the "
            "controller's environment at deploy time). Kept 0600 on the host, never printed."
        ),
    ]

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: str) -> str:
        if value.startswith("env:"):
            if not re.fullmatch(r"^env:[A-Za-z_][A-Za-z0-9_]*$", value):
                raise ValueError("env:NAME names an environment variable ([A-Za-z_][A-Za-z0-9_]*)")
        elif not re.fullmatch(r"^https?://[^\s]+$", value):
            raise ValueError("the webhook is an http:// or https:// URL, or env:NAME")
        return value


ENV_REF = re.compile(r"^env:[A-Za-z_][A-Za-z0-9_]*$")


def _secret_ref(value: Any) -> str:
    # The value itself is never repeated in the message: it may be the key.
    if not isinstance(value, str) or not ENV_REF.fullmatch(value):
        raise ValueError(
            "the API key is a secret: write env:NAME, the environment variable that holds it "
            "(never the key itself)"
        )
    return value


def _api_url(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"^https?://[^\s]+$", value):
        raise ValueError("api_url is an http:// or https:// URL")
    return value


class ProviderSpec(StrictModel):
    """A provider account whose API says where its pods are."""

    api_key: Annotated[
        str,
        BeforeValidator(_secret_ref),
        Field(
            description="env:NAME: the controller's environment variable holding the API key "
            "(read when an address is needed; never written anywhere, never printed)."
        ),
    ]
    api_url: Annotated[
        str | None,
        BeforeValidator(_api_url),
        Field(
            description="The API's base URL (default: RunPod https://rest.runpod.io/v1, "
            "Vast.ai https://console.vast.ai/api/v0); for tests and proxies."
        ),
    ] = None


class Providers(StrictModel):
    """Provider accounts, for hosts named by their pod instead of an address."""

    runpod: Annotated[ProviderSpec | None, Field(description="RunPod (REST API v1).")] = None
    vast: Annotated[ProviderSpec | None, Field(description="Vast.ai (API v0).")] = None


class RunpodPod(StrictModel):
    """A RunPod pod: its public IP and the public port of its 22 come from RunPod's API."""

    pod: Annotated[
        Text,
        Field(min_length=1, max_length=191, description="The pod's name, as RunPod shows it."),
    ]


class VastInstance(StrictModel):
    """A Vast.ai instance: its public IP and the public port of its 22 come from Vast's API."""

    instance: Annotated[
        int, Field(ge=1, description="The instance's id (`vastai show instances`).")
    ]


class HostSettings(StrictModel):
    """Fields that may be set per host or once in `defaults`."""

    user: Annotated[
        User | None,
        Field(description="SSH login user (default: ~/.ssh/config, else the local user)."),
    ] = None
    port: Annotated[
        Port | None, Field(description="SSH port (default: ~/.ssh/config, else 22).")
    ] = None
    key_file: Annotated[
        PathStr | None,
        Field(description="Private key file for SSH; '~' is expanded on the controller."),
    ] = None
    connection: Annotated[
        ConnectionKind | None,
        Field(description="'ssh' (default) or 'local' (run on this machine without SSH)."),
    ] = None
    gpus: Annotated[
        int | None, Field(ge=0, le=64, description="Number of GPUs on the host (default 0).")
    ] = None
    gpu_type: Annotated[
        str | None, Field(description="GPU model, informational (e.g. 'B200').")
    ] = None
    workdir: Annotated[
        PathStr | None,
        Field(
            description="Directory on the host that holds everything dflashops keeps there "
            "(default '~/dflashops'). For local hosts a relative path is relative to the inventory file."
        ),
    ] = None
    python: Annotated[
        PathStr | None,
        Field(
            description="Interpreter on the host for engines and shipped Python payloads (default 'python3')."
        ),
    ] = None
    host_key_policy: Annotated[
        HostKeyPolicy | None,
        Field(
            description="'strict' (default): the key must be pinned or known. 'accept-new': record on first contact."
        ),
    ] = None
    env: Annotated[
        Env,
        Field(description="Environment for every unit on the host (merged with defaults.env)."),
    ] = Field(default_factory=dict)
    vars: Annotated[
        dict[Name | str, Any],
        Field(
            description="Template variables, usable as {{ name }} in playbook strings (override playbook vars)."
        ),
    ] = Field(default_factory=dict)
    notify: Annotated[
        Notify | None, Field(description="Webhook for restarts and give-ups, posted by the host.")
    ] = None
    net_if: Annotated[
        NetIf | None,
        Field(
            description="Network interface the ranks of a multi-node unit talk over; rendered as "
            "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for them (default: the libraries' own choice)."
        ),
    ] = None


class HostSpec(HostSettings):
    """One machine."""

    address: Annotated[
        Address | None,
        Field(description="Host name, IP address or ~/.ssh/config alias; required for ssh hosts."),
    ] = None
    host_key: Annotated[
        HostKey | None,
        Field(description="Pinned public host key ('ssh-ed25519 AAAA...'); beats known_hosts."),
    ] = None
    internal_address: Annotated[
        Address | None,
        Field(
            description="Address other hosts dial to reach this one (the rendezvous of a "
            "multi-node unit whose head it is); default: address."
        ),
    ] = None
    runpod: Annotated[
        RunpodPod | None,
        Field(
            description="Instead of address and port: the RunPod pod this host is "
            "(needs `providers: runpod`)."
        ),
    ] = None
    vast: Annotated[
        VastInstance | None,
        Field(
            description="Instead of address and port: the Vast.ai instance this host is "
            "(needs `providers: vast`)."
        ),
    ] = None


class GroupSpec(StrictModel):
    """A group with template variables for its hosts (the list form is a group without)."""

    hosts: Annotated[list[Name], Field(description="The group's hosts.")]
    vars: Annotated[
        dict[Name | str, Any],
        Field(
            description="Template variables for every host of the group: they beat defaults.vars "
            "and the playbook's vars, the host's own vars beat them. Two groups of one host "
            "that set the same variable to different values are an error (set it on the host)."
        ),
    ] = Field(default_factory=dict)


def _group_form(value: Any) -> str | None:
    if isinstance(value, list):
        return "group[list]"
    if isinstance(value, dict):
        return "group[mapping]"
    return None  # neither: the discriminator's own error, said in words below


# `[` in the tags: config/load.py drops them from error paths like pydantic's other tags.
Group = Annotated[
    Annotated[list[Name], Tag("group[list]")] | Annotated[GroupSpec, Tag("group[mapping]")],
    Discriminator(
        _group_form,
        custom_error_type="group_form",
        custom_error_message="a group is a list of hosts, or a mapping with `hosts` "
        "(a list) and `vars`",
    ),
]


class InventoryFile(StrictModel):
    """inventory.yaml: hosts, defaults applied to every host, and named groups of hosts."""

    defaults: Annotated[
        HostSettings, Field(description="Applied to every host unless the host overrides it.")
    ] = Field(default_factory=HostSettings)
    hosts: Annotated[dict[Name, HostSpec], Field(description="Machines by name.", min_length=1)]
    groups: Annotated[
        dict[Name, Group],
        Field(
            description="Named groups of hosts: a list of hosts, or {hosts: [...], vars: {...}}. "
            "Playbooks and --host target hosts or groups; `all` is every host (unless a group "
            "is named `all`), and shell-style globs ('h100-*') match host and group names."
        ),
    ] = Field(default_factory=dict)
    providers: Annotated[
        Providers,
        Field(
            description="Provider accounts (runpod, vast) for hosts named by their pod: "
            "their address and SSH port are asked of the provider's API when needed."
        ),
    ] = Field(default_factory=Providers)

    def members(self) -> dict[str, list[str]]:
        """Each group's hosts, whichever form it was written in."""
        return {
            name: list(g.hosts if isinstance(g, GroupSpec) else g)
            for name, g in self.groups.items()
        }


@dataclass(frozen=True)
class Host:
    """A host with defaults applied: what the rest of dflashops works with."""

    name: str
    connection: ConnectionKind
    given_address: str | None  # the inventory's address (None for a provider host)
    given_port: int | None
    user: str | None
    key_file: str | None
    gpus: int
    gpu_type: str | None
    workdir: str
    python: str
    host_key: str | None
    host_key_policy: HostKeyPolicy
    env: dict[str, str] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    webhook: str | None = None  # a URL or env:NAME, from notify
    internal_address: str | None = None  # what other hosts dial (default: address)
    net_if: str | None = None
    provider: PodRef | None = None  # a provider host: its pod, which knows its address

    # A provider host's address and port are asked of its provider here, when they are first
    # read: by whatever connects (hosts/ssh.py), so nothing that does not connect (offline
    # pre-flight, render) ever calls an API, and every way of connecting gets them.
    @property
    def address(self) -> str | None:
        """Where SSH connects: the inventory's address, or the pod's public IP now."""
        if self.provider is None:
            return self.given_address
        return self.provider.endpoint(self.name).address

    @property
    def port(self) -> int | None:
        """The SSH port: the inventory's, or the pod's public port for 22 now."""
        if self.provider is None:
            return self.given_port
        return self.provider.endpoint(self.name).port

    @property
    def dial_address(self) -> str:
        """Where the other ranks of a multi-node unit reach this host."""
        return self.internal_address or self.address or "127.0.0.1"

    @property
    def is_local(self) -> bool:
        return self.connection == "local"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, Host]
    groups: dict[str, list[str]]
    group_vars: dict[str, dict[str, Any]] = field(default_factory=dict)  # groups' own vars
    providers: dict[str, Provider] = field(default_factory=dict)  # by name: runpod, vast

    def expand(self, names: list[str]) -> list[str]:
        """Host and group names, `all` and shell-style globs (fnmatch: `h100-*`, `node[0-3]`)
        -> host names, in order, without repeats. A name is a group's first, then a host's,
        then `all` (every host, in inventory order); a glob takes the hosts it matches, then
        the members of the groups it matches. A name or glob that matches nothing raises
        KeyError(name)."""
        out: dict[str, None] = {}
        for name in names:
            members = self._members(name)
            if not members:
                raise KeyError(name)
            out.update(dict.fromkeys(members))
        return list(out)

    def _members(self, name: str) -> list[str]:
        if name in self.groups:
            return self.groups[name]
        if name in self.hosts:
            return [name]
        if name == ALL:
            return list(self.hosts)
        if not is_glob(name):
            return []
        hosts = [h for h in self.hosts if fnmatchcase(h, name)]
        groups = [m for g, ms in self.groups.items() if fnmatchcase(g, name) for m in ms]
        return [*hosts, *groups]


ALL = "all"


def is_glob(name: str) -> bool:
    """A host pattern with fnmatch's wildcards (names themselves never hold these)."""
    return any(c in name for c in "*?[")


def resolve_hosts(spec: InventoryFile, inventory_path: Path) -> dict[str, Host]:
    """Apply defaults to every host. Pure: raises ValueError per host on incomplete entries."""
    d = spec.defaults
    from_groups = group_vars(spec)
    providers = make_providers(spec, inventory_path)
    hosts: dict[str, Host] = {}
    for name, h in spec.hosts.items():
        connection = h.connection or d.connection or "ssh"
        workdir = h.workdir or d.workdir or "~/dflashops"
        if connection == "local" and not workdir.startswith(("/", "~")):
            workdir = str((inventory_path.parent / workdir).resolve())
        pod = pod_of(h, providers)
        hosts[name] = Host(
            name=name,
            connection=connection,
            given_address=h.address,
            given_port=None if pod is not None else h.port or d.port,
            user=h.user or d.user,
            key_file=h.key_file or d.key_file,
            gpus=h.gpus if h.gpus is not None else (d.gpus or 0),
            gpu_type=h.gpu_type or d.gpu_type,
            workdir=workdir,
            python=h.python or d.python or "python3",
            host_key=h.host_key,
            host_key_policy=h.host_key_policy or d.host_key_policy or "strict",
            env={**d.env, **h.env},
            vars={**d.vars, **from_groups.get(name, {}), **h.vars},
            webhook=notify.webhook if (notify := h.notify or d.notify) is not None else None,
            internal_address=h.internal_address,
            net_if=h.net_if or d.net_if,
            provider=pod,
        )
    return hosts


def make_providers(spec: InventoryFile, inventory_path: Path) -> dict[str, Provider]:
    """One Provider per account the inventory names: nothing is asked of it yet."""
    out = {}
    for name, kind in KINDS.items():
        given = getattr(spec.providers, name)
        if given is not None:
            cache = state_path(inventory_path) / "providers" / f"{name}.json"
            out[name] = Provider(kind, given.api_url or kind.default_url, given.api_key[4:], cache)
    return out


def pod_of(h: HostSpec, providers: dict[str, Provider]) -> PodRef | None:
    """The pod a host names (its provider told which pods to follow), or None."""
    key = h.runpod.pod if h.runpod else str(h.vast.instance) if h.vast else None
    if key is None:
        return None
    name = "runpod" if h.runpod else "vast"
    if name not in providers:
        raise ValueError(f"a {name} host needs `providers: {name}:` in the inventory")
    providers[name].keys.add(key)
    return PodRef(providers[name], key)


def group_vars(spec: InventoryFile) -> dict[str, dict[str, Any]]:
    """Each host's variables from its groups, in file order (two groups that disagree on one
    are refused when the inventory loads: config/load.py)."""
    out: dict[str, dict[str, Any]] = {}
    for group in spec.groups.values():
        if isinstance(group, GroupSpec) and group.vars:
            for host in group.hosts:
                out.setdefault(host, {}).update(group.vars)
    return out
