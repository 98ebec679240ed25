"""The wheel: built with `pip wheel .`, it carries the launch templates from the repo's
top-level templates/ (one copy in the repo) as dflashops/templates/, every subpackage, and the
host agent; installed from it, dflashops renders with those templates."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (found,) = out.glob("dflashops-*.whl")
    return found


def test_the_wheel_ships_the_top_level_templates(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (REPO / "templates").glob("*.j2"))
    assert templates and {f"dflashops/templates/{t}" for t in templates} <= names
    assert not (REPO / "dflashops" / "templates").exists()  # one copy in the repo
    for module in (REPO / "dflashops" / "agent" / "remote").glob("*.py"):
        assert f"dflashops/agent/remote/{module.name}" in names
    assert "dflashops/builtins/stub_engine.py" in names


def test_the_package_list_is_whole() -> None:
    # (tomllib is 3.11+; the controller supports 3.10)
    block = re.search(r"^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert block is not None
    listed = set(re.findall(r'"([a-z.]+)"', block.group(1)))
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "dflashops").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found | {"dflashops.templates"} == listed


def test_installed_from_the_wheel_it_renders_with_its_own_templates(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from dflashops.engines.render import builtin_templates, make_environment\n"
        "print(builtin_templates())\n"
        "make_environment([]).get_template('sglang.sh.j2')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(site / "dflashops" / "templates")
