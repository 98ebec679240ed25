"""The agent tests' host: a workdir under tmp_path, whatever a test started there ended after it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.agent.test_units import Host


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "wd")
    try:
        yield h
    finally:
        h.cleanup()
