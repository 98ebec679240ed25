"""What units stand on, declared in playbooks: Python environments and files (DESIGN.md, "Node
state: environments and files"). Deploy makes them so before any unit starts."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from dflashops.config.inventory import StrictModel
from dflashops.config.types import EnvName, Name, PathStr, Text

REQUIREMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~*; @:/+'\"]*$")
HF_RE = re.compile(
    r"^hf:(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[A-Za-z0-9._/-]+))?$"
)
AFTER_RE = re.compile(r"^(?P<host>[a-z0-9][a-z0-9-]*)/(?P<job>[a-z0-9][a-z0-9-]*)$")
MODE_RE = re.compile(r"^0?[0-7]{3}$")


def _host_path(value: str) -> str:
    if not value.startswith(("/", "~/")):
        raise ValueError(f"{value!r} is not an absolute path on the host (start with / or ~/)")
    if any(part == ".." for part in value.split("/")):
        raise ValueError(f"{value!r} contains '..': name the place itself")
    return value


HostPath = Annotated[PathStr, Field(description="An absolute path on the host (/... or ~/...).")]


class Environment(StrictModel):
    """A Python environment on the host that units run in (`environment: NAME`)."""

    path: Annotated[
        HostPath,
        Field(
            description="Where the environment is on the host. dflashops keeps builds beside it "
            "(PATH.builds/<hash>/) and makes PATH a link to the current one."
        ),
    ]
    python: Annotated[
        Text | None,
        Field(description="Interpreter that creates it (default: the host's `python`)."),
    ] = None
    packages: Annotated[
        list[Text],
        Field(description="Requirement specifiers, pinned: ['sglang[all]==0.5.11']."),
    ] = Field(default_factory=list)
    requirements: Annotated[
        PathStr | None,
        Field(description="A controller requirements/lock file (relative to the playbook)."),
    ] = None
    wheels: Annotated[
        PathStr | None,
        Field(
            description="A controller folder of wheels (relative to the playbook): shipped, and "
            "then the only package index used (for hosts without one)."
        ),
    ] = None

    _path = field_validator("path")(_host_path)

    @field_validator("packages")
    @classmethod
    def _specifiers(cls, value: list[str]) -> list[str]:
        for spec in value:
            if spec.startswith("-") or not REQUIREMENT_RE.fullmatch(spec):
                raise ValueError(
                    f"{spec!r} is not a requirement specifier (like 'vllm==0.33.0'); "
                    "installer options have no place here"
                )
        return value

    @model_validator(mode="after")
    def _something_to_install(self) -> Environment:
        if not self.packages and self.requirements is None:
            raise ValueError("an environment needs `packages` or `requirements`")
        return self


class FileEntry(StrictModel):
    """Content that must be on the host: a controller file or folder, a path on the same host
    (`host:/...`), another inventory host's path (`HOST:/...`, relayed through the controller),
    or a hub repository (`hf:org/repo@revision`, downloaded on the host)."""

    src: Annotated[
        Text,
        Field(
            description="'path' (controller, relative to the playbook), 'host:/abs' (this host), "
            "'HOST:/abs' (another inventory host) or 'hf:org/repo@rev'. A trailing / on a "
            "folder changes nothing: the folder's content goes to dest."
        ),
    ]
    dest: Annotated[HostPath, Field(description="Where it goes on the host.")]
    name: Annotated[
        Name | None,
        Field(description="Lets units say `needs: [NAME]` (they wait for this entry)."),
    ] = None
    after: Annotated[
        Text | None,
        Field(description="'HOST/JOB': copy only once that job on that host is done."),
    ] = None
    delete: Annotated[
        bool,
        Field(description="Also remove files under dest that src does not have (never others)."),
    ] = False
    mode: Annotated[
        Text | None, Field(description="File mode for every file written ('0644').")
    ] = None
    secret_env: Annotated[
        dict[EnvName, EnvName],
        Field(description="VAR_ON_HOST: VAR_ON_CONTROLLER, for hub downloads (HF_TOKEN)."),
    ] = Field(default_factory=dict)

    _dest = field_validator("dest")(_host_path)

    @field_validator("after")
    @classmethod
    def _after(cls, value: str | None) -> str | None:
        if value is not None and not AFTER_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not HOST/JOB (an inventory host and a job on it)")
        return value

    @field_validator("mode")
    @classmethod
    def _mode(cls, value: str | None) -> str | None:
        if value is not None and not MODE_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not an octal file mode like '0644'")
        return value

    @field_validator("src")
    @classmethod
    def _src(cls, value: str) -> str:
        if value.startswith("hf:") and not HF_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not 'hf:org/repo' or 'hf:org/repo@revision'")
        if "\n" in value:
            raise ValueError("paths may not contain newlines")
        return value

    @property
    def mode_bits(self) -> int | None:
        return int(self.mode, 8) if self.mode else None

    @property
    def after_parts(self) -> tuple[str, str] | None:
        m = AFTER_RE.fullmatch(self.after or "")
        return (m.group("host"), m.group("job")) if m else None
