"""The dashboard's page assets ship in the wheel (package data), and an installed wheel serves
them: the page works offline, from the package alone."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.unit.test_packaging import REPO, wheel  # noqa: F401 - the wheel fixture

ASSETS = sorted(p.name for p in (REPO / "dflashops" / "dashboard" / "static").iterdir())


def test_the_wheel_ships_the_dashboards_page(wheel: Path) -> None:  # noqa: F811
    names = set(zipfile.ZipFile(wheel).namelist())
    assert ASSETS == ["app.js", "index.html", "style.css"]
    assert {f"dflashops/dashboard/static/{a}" for a in ASSETS} <= names


def test_installed_from_the_wheel_it_serves_them(wheel: Path, tmp_path: Path) -> None:  # noqa: F811
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from dflashops.dashboard import page\n"
        "for name in page.STATIC:\n"
        "    data, kind = page.static(name)\n"
        "    print(name, len(data), kind)\n"
        "print(page.__file__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site)], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith(str(site))  # the wheel's copy, not the repo's
    assert [line.split()[0] for line in lines[:-1]] == ["index.html", "app.js", "style.css"]
    assert all(int(line.split()[1]) > 100 for line in lines[:-1])
