"""Names a person types -> the units they mean. Pure.

A unit's own name means that unit; a service's name (the playbook entry) means all its units:
its replicas ``NAME-i``, or its parts over several hosts, or its Ray part. One rule for every
command that takes unit names (deploy, restart-servers, stop and render ``--unit``, status,
``logs UNIT``), and one "did you mean" for unit, host and group names alike.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from dflashops.errors import DflashopsError

if TYPE_CHECKING:
    from dflashops.plan.model import Unit

# How the planner names a service's units (plan/units.py): a replica NAME-i, a Ray part
# NAME-ray. Only for units a host knows and no playbook defines (orphans), whose service is
# not recorded anywhere else.
_PART = re.compile(r"^(?P<service>.+)-(?:\d+|ray)$")
LISTED = 24  # known names an error lists before it counts the rest


class UnknownNames(DflashopsError):
    """Names that match no unit or service: each one with its nearest known name."""

    def __init__(self, unknown: list[str], known: Mapping[str, str], where: str) -> None:
        self.unknown = unknown
        self.known = dict(known)
        services = sorted({s for s in known.values()} | set(known))
        named = ", ".join(f"{n!r}{did_you_mean(n, services)}" for n in unknown)
        what = "no unit or service named" if len(unknown) == 1 else "no units or services named"
        where = f" {where}" if where else ""
        super().__init__(f"{what} {named}{where}; known: {listing(known) or 'none'}")


def service_of(unit: str, kind: str | None) -> str:
    """The service of a unit only a host knows (``kind`` from its unit.json): ``echo`` for a
    service's ``echo-1``; a job, or any other name, is its own."""
    found = _PART.match(unit) if kind == "service" else None
    return found.group("service") if found else unit


def of_units(units: Iterable[Unit]) -> dict[str, str]:
    """unit name -> its service's name, for planned units (a unit of several hosts once)."""
    return {u.name: u.service for u in units}


def of_host(kinds: Mapping[str, str | None]) -> dict[str, str]:
    """unit name -> its service's name, for the units a host records (name -> the kind its
    unit.json says, if any): orphans included."""
    return {unit: service_of(unit, kind) for unit, kind in kinds.items()}


def partition(names: Iterable[str], known: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the units ``names`` mean, the names that match nothing). The units come in the order
    the names are given (a service's in ``known``'s order), each once; ``known``: unit name
    -> its service's name. A unit's own name wins over a service of the same name."""
    out: list[str] = []
    unknown: list[str] = []
    for name in names:
        found = [name] if name in known else [u for u, s in known.items() if s == name]
        if not found and name not in unknown:
            unknown.append(name)
        out.extend(u for u in found if u not in out)
    return out, unknown


def resolve(names: Iterable[str], known: Mapping[str, str], where: str = "") -> list[str]:
    """The units ``names`` mean (see ``partition``). Raises UnknownNames naming every name
    that matches nothing; ``where`` ends its first clause (``on h1, h2``)."""
    out, unknown = partition(names, known)
    if unknown:
        raise UnknownNames(unknown, known, where)
    return out


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'echo'?)``, or nothing when no candidate is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def listing(known: Mapping[str, str]) -> str:
    """``echo (echo-0, echo-1), gen``: a service with its units, a lone unit by its name; the
    first LISTED names, then how many more."""
    groups: dict[str, list[str]] = {}
    for unit, service in known.items():
        groups.setdefault(service, []).append(unit)
    shown = [
        s if units == [s] else f"{s} ({', '.join(units)})" for s, units in sorted(groups.items())
    ]
    more = len(shown) - LISTED
    return ", ".join(shown[:LISTED]) + (f" and {more} more" if more > 0 else "")
