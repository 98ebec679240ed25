"""The run's secrets, read from the controller's environment once: the variables the units'
``secret_env`` and ``secret_args`` name, the files entries' ``secret_env`` (a hub token), and the
host's webhook (``notify: env:NAME``, or a URL, which is a secret too). Their values are
registered for redaction here, once; everything else receives the resolved values (the probe's
Bearer header, the 0600 files a unit runs with, the start blockers, the hub download), and
never reads ``os.environ`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dflashops.config.inventory import Host
from dflashops.engines.render import Rendered
from dflashops.plan.nodestate import NodeState


@dataclass(frozen=True)
class Secrets:
    values: dict[str, str] = field(default_factory=dict)  # variable -> value, the set ones
    webhook: str | None = None  # the host's webhook URL (None: no notify, or its variable unset)
    webhook_unset: str | None = None  # notify: env:NAME with NAME not set on the controller

    def missing(self, names: Iterable[str]) -> list[str]:
        """The variables among ``names`` the controller does not set, sorted."""
        return sorted({n for n in names if n not in self.values})

    def redacted(self) -> list[str]:
        """What no output may show."""
        return [*self.values.values(), *([self.webhook] if self.webhook else [])]


def needed(rendered: Iterable[Rendered], node: NodeState) -> set[str]:
    """The controller variables the units and the files entries of one host name."""
    names: set[str] = set()
    for r in rendered:
        names.update(r.unit.spec.secret_env.values())
        names.update(r.launch.secrets.sources())
    for f in node.files:
        names.update(f.entry.secret_env.values())
    return names


def resolve(
    host: Host, rendered: Iterable[Rendered], node: NodeState, environ: Mapping[str, str]
) -> Secrets:
    """What ``environ`` (the controller's environment) holds of what the host's run needs."""
    values = {n: environ[n] for n in needed(rendered, node) if n in environ}
    spec = host.webhook
    if spec is None or not spec.startswith("env:"):
        return Secrets(values, webhook=spec)
    url = environ.get(spec[4:])
    if not url:
        return Secrets(values, webhook_unset=spec[4:])
    return Secrets(values, webhook=url)
