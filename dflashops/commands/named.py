"""The commands that act on the hosts ``--host`` names, one at a time and asking first (trust,
unlock): which hosts, and whether any failed. A host that fails is shown; the others still run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

from dflashops.config.inventory import Host
from dflashops.config.load import load_inventory
from dflashops.errors import DflashopsError
from dflashops.output import escape
from dflashops.project import expand_hosts, find_inventory, split_names

Confirm = Callable[[str], bool]  # a question to a person: True to go on (tests answer it)
# One host's turn: out, the host, --yes, the confirm callback; True when that host is done.
OneHost = Callable[[Console, Host, bool, Confirm | None], bool]


@dataclass(frozen=True)
class OnNamed:
    """A command run as ``command(out, inventory=, hosts=, yes=, confirm=)``: 0 when every
    named host is done, else 1."""

    need: str  # the error when no host is named: says which command and what it acts on
    one: OneHost

    def __call__(
        self,
        out: Console,
        *,
        inventory: str | None = None,
        hosts: list[str] | str | None = None,
        yes: bool = False,
        confirm: Confirm | None = None,
    ) -> int:
        failed = 0
        for host in self.named(inventory, hosts):
            try:
                failed += not self.one(out, host, yes, confirm)
            except DflashopsError as exc:
                out.print(f"[red]failed:[/] {escape(str(exc))}")
                failed += 1
        return 1 if failed else 0

    def named(self, inventory: str | None, hosts: list[str] | str | None) -> list[Host]:
        """The hosts --host/--limit names (groups and patterns expanded, an unknown name with
        the nearest known one): these commands act on named hosts only."""
        inv = load_inventory(find_inventory(inventory))
        names = split_names(hosts)
        if not names:
            raise DflashopsError(self.need)
        return [inv.hosts[name] for name in expand_hosts(inv, names)]
