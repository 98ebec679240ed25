"""What units stand on, per host: environments and files entries from the playbooks, laid out
and checked. Pure but for reading controller files (their content is part of what is planned,
as a shipped script's is).

A files entry's source is one of: a controller path (relative to its playbook), ``host:/path``
on the same host, ``HOST:/path`` on another inventory host (relayed through the controller),
or ``hf:org/repo@rev``. An environment's content hash covers the interpreter it is made with,
its packages, its requirements file and its wheels; units that use it carry that hash in their
fingerprint, so they restart when it changes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from dflashops.agent.remote import layout, tree
from dflashops.cache import cache_dir, warn_once
from dflashops.config.inventory import Host, Inventory
from dflashops.config.load import Playbook
from dflashops.config.nodestate import HF_RE, Environment, FileEntry
from dflashops.config.yamlsource import PathKey
from dflashops.engines.base import resolve_file
from dflashops.errors import Problem

SourceKind = Literal["controller", "host", "relay", "hf"]
HOST_SRC = re.compile(r"^(?P<host>[a-z0-9][a-z0-9-]*):(?P<path>/.*)$")


def local_scan(path: Path) -> dict[str, Any]:
    """tree.scan of a controller path with its hash cache in the user's cache folder."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    cache = cache_dir() / "trees" / f"{key}.json"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        warn_once(str(exc))
        return tree.scan(str(path))
    return tree.scan(str(path), str(cache))


@dataclass(frozen=True)
class EnvPlan:
    name: str
    host: Host
    playbook: Playbook
    spec: Environment
    source: PathKey
    requirements: Path | None = None
    wheels: Path | None = None

    @property
    def path(self) -> str:
        return self.spec.path.rstrip("/")

    @property
    def python(self) -> str:
        """The interpreter that creates it."""
        return self.spec.python or self.host.python

    @cached_property
    def inputs(self) -> dict[str, tuple[int, str]]:
        """rel (under the env's inputs folder on the host) -> (size, sha256) of what is
        shipped for the build: requirements.txt and wheels/..."""
        out: dict[str, tuple[int, str]] = {}
        if self.requirements is not None:
            found = local_scan(self.requirements)["files"]
            out["requirements.txt"] = tuple(found[""])
        if self.wheels is not None:
            for rel, entry in local_scan(self.wheels)["files"].items():
                out[f"wheels/{rel}"] = tuple(entry)
        return out

    @cached_property
    def hash(self) -> str:
        body = {
            "python": self.python,
            "packages": self.spec.packages,
            "inputs": {rel: sha for rel, (_, sha) in sorted(self.inputs.items())},
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def inputs_dir(self, workdir: str) -> str:
        return f"{layout.env_dir(workdir, self.name)}/inputs-{self.hash[:16]}"

    def problem(self, message: str, *path: str | int) -> Problem:
        return self.playbook.doc.problem(
            (*self.source, *path), f"[{self.host.name}] environment {self.name}: {message}"
        )


@dataclass(frozen=True)
class FilePlan:
    key: str  # the entry's name, or "<playbook>/files[i]"
    host: Host
    playbook: Playbook
    entry: FileEntry
    source: PathKey
    kind: SourceKind
    src: str  # controller: absolute path; host, relay: the path there; hf: the repo
    src_host: str | None = None  # relay
    revision: str | None = None  # hf
    local: Path | None = None  # controller

    @property
    def dest(self) -> str:
        return self.entry.dest.rstrip("/") or "/"

    @property
    def label(self) -> str:
        return f"files {self.entry.name or self.entry.src}"

    def problem(self, message: str, *path: str | int) -> Problem:
        return self.playbook.doc.problem(
            (*self.source, *path), f"[{self.host.name}] {self.label}: {message}"
        )


@dataclass
class NodeState:
    envs: dict[str, EnvPlan] = field(default_factory=dict)
    files: list[FilePlan] = field(default_factory=list)

    def file(self, key: str) -> FilePlan | None:
        return next((f for f in self.files if f.key == key), None)

    def by_dest(self, path: str) -> FilePlan | None:
        path = path.rstrip("/")
        return next((f for f in self.files if f.dest == path), None)


def plan_node(
    inventory: Inventory,
    host: Host,
    entries: list[tuple[Playbook, list[tuple[str, Environment]], list[FileEntry]]],
    problems: list[Problem],
) -> NodeState:
    """Environments and files of every playbook placed on ``host``, checked."""
    node = NodeState()
    for book, envs, files in entries:
        base = book.path.parent
        for name, spec in envs:
            env = EnvPlan(
                name,
                host,
                book,
                spec,
                ("environments", name),
                _existing(
                    book,
                    base,
                    spec.requirements,
                    ("environments", name, "requirements"),
                    problems,
                    host,
                ),
                _existing(
                    book,
                    base,
                    spec.wheels,
                    ("environments", name, "wheels"),
                    problems,
                    host,
                    folder=True,
                ),
            )
            other = node.envs.get(name)
            if other is not None and other.spec != spec:
                problems.append(
                    env.problem(f"is also declared, differently, by {other.playbook.path}")
                )
            node.envs.setdefault(name, env)
        for i, entry in enumerate(files):
            fp = _file_plan(inventory, host, book, entry, i, problems)
            if fp is None:
                continue
            clash = node.by_dest(fp.dest)
            if clash is not None:
                problems.append(
                    fp.problem(f"dest {fp.dest} is also the dest of {clash.label}", "dest")
                )
                continue
            node.files.append(fp)
    return node


def _existing(
    book: Playbook,
    base: Path,
    ref: str | None,
    where: PathKey,
    problems: list[Problem],
    host: Host,
    folder: bool = False,
) -> Path | None:
    if ref is None:
        return None
    path = resolve_file(ref, base)
    ok = path.is_dir() if folder else path.is_file()
    if not ok:
        kind = "folder" if folder else "file"
        problems.append(
            book.doc.problem(where, f"[{host.name}] {kind} {ref!r} not found at {path}")
        )
        return None
    return path


def _file_plan(
    inventory: Inventory,
    host: Host,
    book: Playbook,
    entry: FileEntry,
    index: int,
    problems: list[Problem],
) -> FilePlan | None:
    where: PathKey = ("files", index)
    key = entry.name or f"{book.name}/files[{index}]"

    def make(kind: SourceKind, src: str, **kw: Any) -> FilePlan:
        return FilePlan(key, host, book, entry, where, kind, src, **kw)

    if (
        entry.after is not None
        and entry.after_parts
        and entry.after_parts[0] not in inventory.hosts
    ):
        problems.append(
            book.doc.problem(
                (*where, "after"),
                f"[{host.name}] after names unknown host {entry.after_parts[0]!r}",
            )
        )
    src = entry.src
    if src.startswith("hf:"):
        m = HF_RE.fullmatch(src)
        assert m is not None  # validated by the model
        return make("hf", m.group("repo"), revision=m.group("rev"))
    if src.startswith("host:"):
        path = src[len("host:") :].rstrip("/") or "/"
        if not path.startswith(("/", "~/")):
            problems.append(
                book.doc.problem(
                    (*where, "src"), f"[{host.name}] {src!r}: host: takes an absolute path"
                )
            )
            return None
        return make("host", path)
    m = HOST_SRC.fullmatch(src)
    if m is not None and m.group("host") in inventory.hosts:
        path = m.group("path").rstrip("/") or "/"
        if m.group("host") == host.name:
            return make("host", path)
        return make("relay", path, src_host=m.group("host"))
    local = resolve_file(src, book.path.parent)
    if not local.exists():
        hint = ""
        if m is not None:
            hint = f" (if {m.group('host')!r} is a host, add it to the inventory)"
        problems.append(
            book.doc.problem((*where, "src"), f"[{host.name}] {src!r} not found at {local}{hint}")
        )  # kept in the plan all the same: units that need it are not also "unknown"
    return make("controller", str(local), local=local)
