"""Fixtures for integration tests against real sshd hosts (see fleet.py).

- `fleet4`: session-scoped, hosts h1..h4 (8, 8, 4, 2 GPUs); do not break its hosts.
- `fleet_factory`: a fresh fleet per call, for tests that stop, kill or re-key hosts.
- `ops(fleet, hosts=...)`: a controller (lifecycle_helpers.Ops) whose units are all stopped at
  teardown; the test fails if anything dflashops started is left on a host.
- `sshd_unusable(reason)` / `start_fleet(fleet)` (from fleet.py): skip locally, fail when CI=true.

Every test under tests/integration carries the `sshd` marker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fleet import FLEET4_GPUS, Fleet, FleetFactory, start_fleet
from lifecycle_helpers import Ops

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.sshd)


@pytest.fixture(scope="session")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """h1, h2 (8 GPUs), h3 (4), h4 (2): shared by the whole session (per xdist worker)."""
    fleet = Fleet(tmp_path_factory.mktemp("fleet4"), REPO)
    try:
        for name, gpus in FLEET4_GPUS.items():
            fleet.add(name, gpus=gpus)
        start_fleet(fleet)
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[FleetFactory]:
    """`fleet_factory("a", "b", c={"gpus": 4}, start=True)` -> a new fleet, stopped at teardown.

    Positional names get `Fleet.add` defaults; keyword names map to `Fleet.add` arguments.
    With start=False, add more hosts and call `start_fleet(fleet)` (or `fleet.start()`).
    """
    fleets: list[Fleet] = []

    def make(*names: str, start: bool = True, **specs: Mapping[str, Any]) -> Fleet:
        fleet = Fleet(tmp_path / f"fleet{len(fleets)}", REPO)
        fleets.append(fleet)
        for name in names:
            fleet.add(name)
        for name, spec in specs.items():
            fleet.add(name, **spec)
        if start:
            start_fleet(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in reversed(fleets):
            fleet.stop()


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated controller: empty HOME (no ~/.ssh/config or known_hosts of the machine's
    user) and dflashops' own known_hosts under tmp_path."""
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(tmp_path / "known_hosts"))
    return tmp_path


@pytest.fixture
def ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Ops]]:
    """`ops(fleet, hosts=...)` -> an Ops controller for the fleet; everything it deployed is
    stopped at teardown, and nothing started by dflashops may be left running."""
    made: list[Ops] = []

    def make(fleet: Fleet, **kw: Any) -> Ops:
        base = tmp_path / f"ctl{len(made)}"
        base.mkdir()
        monkeypatch.setenv("HOME", str(base / "home"))
        monkeypatch.setenv("DFLASHOPS_KNOWN_HOSTS", str(base / "dflashops_known_hosts"))
        controller = Ops(base, fleet, **kw)
        made.append(controller)
        return controller

    yield make
    problems = [p for controller in made for p in controller.cleanup()]
    assert not problems, "\n".join(problems)
