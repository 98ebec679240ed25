"""Shared test helpers: paths to the repo and a way to write small config trees."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from dflashops.cli import main

REPO = Path(__file__).resolve().parent.parent

WriteTree = Callable[[dict[str, str]], Path]


@pytest.fixture
def write_tree(tmp_path: Path) -> WriteTree:
    """Write {relative path: text} under tmp_path (text is dedented) and return tmp_path."""

    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return tmp_path

    return write


def run_cli(args: list[str], cwd: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`dflashops ARGS` run from ``cwd`` (where a user would stand): exit code and output."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(args)
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    return code, captured.out + captured.err
