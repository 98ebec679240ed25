"""`log_max_size` on a unit: parsed as a size, carried to its supervisor in unit.json's
`supervise`, and absent there when not set (so units deployed before keep their fingerprint)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from dflashops.changes.verdicts import unit_record
from dflashops.config.types import Size
from tests.conftest import WriteTree
from tests.unit.test_render import render

BOOK = """
name: p
hosts: h
jobs:
  - {name: quiet, command: [echo, hi]}
  - {name: chatty, command: [echo, hi], log_max_size: 256MiB}
"""


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 << 20),
        ("1G", 1 << 30),
        ("64KiB", 64 << 10),
        ("1.5GB", 3 << 29),
        (1 << 20, 1 << 20),
    ],
)
def test_sizes(text: object, size: int) -> None:
    assert TypeAdapter(Size).validate_python(text) == size


@pytest.mark.parametrize("text", ["1 PB", "12", "lots", "1GiB\n2", True, "0"])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(Size).validate_python(text)


def test_the_size_reaches_the_supervisor_only_when_set(write_tree: WriteTree) -> None:
    units = render(write_tree, BOOK)
    assert unit_record(units["chatty"])["supervise"]["log_max_bytes"] == 256 << 20
    assert "log_max_bytes" not in unit_record(units["quiet"])["supervise"]
