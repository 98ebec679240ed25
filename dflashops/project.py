"""Where the user's files are and which of them a command works on.

An ops repo looks like this repo's root: ``inventory.yaml`` (or ``inventory.example.yaml``),
``playbooks/*.yaml`` and optionally ``templates/`` overriding the built-in launch templates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflashops.config import reads
from dflashops.config.inventory import Inventory
from dflashops.config.load import Playbook, load_inventory, load_playbook
from dflashops.config.providers import STATE_DIR as STATE_DIR
from dflashops.config.providers import state_path
from dflashops.errors import ConfigError, DflashopsError, Problem
from dflashops.output import some
from dflashops.plan import targets
from dflashops.plan.names import did_you_mean

DEFAULT_INVENTORIES = ("inventory.yaml", "inventory.example.yaml")
PLAYBOOKS = "*.y*ml"  # the project's playbooks: every match in playbooks/ beside the inventory


def state_dir(inventory: Path) -> Path:
    """The project's state folder, ``.dflashops/`` beside the inventory (what the controller
    remembers of its hosts, kept outputs), created 0700 when missing: it may hold what the
    hosts wrote."""
    path = state_path(inventory)
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def find_inventory(given: str | None, cwd: Path | None = None) -> Path:
    if given:
        return Path(given)
    base = cwd or Path(".")
    for name in DEFAULT_INVENTORIES:
        reads.look(base / name)  # which one is found is an input of a recording run too
        if (base / name).is_file():
            return base / name
    raise DflashopsError(
        f"no inventory: neither {' nor '.join(DEFAULT_INVENTORIES)} exists in {base}; "
        "pass -i/--inventory FILE (inventory.example.yaml in the dflashops repo is a start)"
    )


def split_names(value: str | list[str] | None) -> list[str]:
    """`--host a,b --host c` -> [a, b, c]."""
    if not value:
        return []
    items = [value] if isinstance(value, str) else value
    return [n.strip() for item in items for n in item.split(",") if n.strip()]


@dataclass
class Selection:
    """Inventory, the playbooks in play and the hosts they are applied to."""

    inventory: Inventory
    playbooks: list[Playbook]
    hosts: list[str] | None  # None: every host the playbooks target
    problems: list[Problem]
    # Every playbook of the project (playbooks/*.yaml beside the inventory, plus any given with
    # -p), whatever -p selected: what the orphan rule compares against. None when one of them
    # does not load: then nothing can be called an orphan.
    project: list[Playbook] | None = None


def select(inventory_path: Path, playbooks: list[str], hosts: list[str]) -> Selection:
    """Load the inventory and playbooks. Playbook problems are collected (not raised) so that
    pre-flight can report every broken file in one run; inventory problems raise, since nothing
    can be checked without it."""
    inventory = load_inventory(inventory_path)
    host_names = expand_hosts(inventory, hosts) if hosts else None
    explicit = bool(playbooks)
    # A recording run depends on which playbooks there are: one added or removed is a change.
    reads.look(inventory_path.parent / "playbooks", f"glob:{PLAYBOOKS}")
    paths = (
        [Path(p) for p in playbooks]
        if explicit
        else sorted((inventory_path.parent / "playbooks").glob(PLAYBOOKS))
    )
    if not paths:
        raise DflashopsError(
            f"no playbooks: {inventory_path.parent / 'playbooks'} is empty; pass -p/--playbook FILE"
        )
    books: list[Playbook] = []
    problems: list[Problem] = []
    project: list[Playbook] | None = []
    for path in paths:
        try:
            book = load_playbook(path)
        except ConfigError as exc:
            problems.extend(exc.problems)
            project = None
            continue
        if project is not None:
            project.append(book)
        if explicit or host_names is None or _targets_any(inventory, book, host_names):
            books.append(book)
    if explicit and project is not None:
        given = {p.resolve() for p in paths}
        for path in sorted((inventory_path.parent / "playbooks").glob(PLAYBOOKS)):
            if path.resolve() in given:
                continue
            try:
                project.append(load_playbook(path))
            except ConfigError:
                project = None  # its units cannot be told from orphans
                break
    seen: dict[str, Path] = {}
    for book in books:
        if book.name in seen:
            problems.append(
                book.doc.problem(
                    ("name",), f"playbook name {book.name!r} is also used by {seen[book.name]}"
                )
            )
        seen.setdefault(book.name, book.path)
    return Selection(inventory, books, host_names, problems, project)


def expand_hosts(inventory: Inventory, names: list[str]) -> list[str]:
    """--host/--limit names as typed (hosts, groups, and what Inventory.expand takes beside
    them) -> host names; an unknown one is an error with the nearest known name."""
    try:
        return inventory.expand(names)
    except KeyError as exc:
        name = str(exc.args[0])
        known = sorted([*inventory.hosts, *inventory.groups])
        raise DflashopsError(
            f"--host {name!r} is not in {inventory.path}{did_you_mean(name, known)}; "
            f"it has: {some(known, 20)}"
        ) from None


def _targets_any(inventory: Inventory, book: Playbook, hosts: list[str]) -> bool:
    names, problems = targets(inventory, book)
    # A playbook whose targets are broken is kept, so pre-flight reports it.
    return bool(problems) or any(n in hosts for n in names)
