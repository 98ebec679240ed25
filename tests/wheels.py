"""Tiny real wheels for environment tests: pip and uv install them with --no-index, so no test
needs a package index (there is none on the test hosts)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def build_wheel(
    folder: Path,
    name: str,
    version: str = "1.0",
    code: str = "",
    scripts: dict[str, str] | None = None,
) -> Path:
    """``folder/<name>-<version>-py3-none-any.whl``: a pure-Python package ``name`` whose
    ``__version__`` is ``version`` (plus ``code``); ``scripts`` are its ``console_scripts``
    entry points (command -> ``module:function``), which the installer turns into scripts in
    the environment's bin/ with the environment's python in their shebang."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n{code}",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: dflashops-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if scripts:
        lines = "".join(f"{cmd} = {target}\n" for cmd, target in scripts.items())
        files[f"{dist}/entry_points.txt"] = f"[console_scripts]\n{lines}"
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel
