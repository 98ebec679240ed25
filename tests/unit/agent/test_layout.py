"""The workdir layout, the unit.json format and the agent's schema are each defined once
(``agent/remote/layout.py``, ``agent/remote/main.py``): no other module of the package spells a
layout file name or a path under the workdir itself, on the host or on the controller."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import signal
from pathlib import Path

import dflashops
from dflashops.agent.answers import UnitRecord
from dflashops.agent.remote import layout, receive
from dflashops.agent.remote.main import SCHEMA

PACKAGE = Path(dflashops.__file__).parent
NAMES = {
    layout.LAUNCH,
    layout.UNIT_RECORD,
    layout.SUPERVISOR,
    layout.PROGRESS,
    layout.CURRENT_LOG,
    layout.DEPLOY_LOCK,
    layout.LOCK_HOLDER,
    layout.NOTIFY,
    *layout.SECRET_FILES,
}


def docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def spelled(path: Path) -> list[str]:
    """The string constants (f-string parts included) that name a layout file or path."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            pathish = ("/units/", "units/", "payloads/", "/envs/", "logs/")
            if (
                text in NAMES
                or text.lstrip("/") in NAMES
                or text.startswith(pathish)
                or "/units/" in text
                or any(text.endswith("/" + n) for n in NAMES)
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {text!r}")
    return found


def test_the_layout_is_spelled_only_in_layout_py() -> None:
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "agent" / "remote" / "layout.py" and "builtins" not in path.parts
        for hit in spelled(path)
    ]
    assert found == []


def test_the_agent_schema_is_defined_once() -> None:
    """Only main.py assigns SCHEMA: the controller compares answers to that same number."""
    owners = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "SCHEMA" for t in node.targets
            ):
                owners.append(str(path.relative_to(PACKAGE)))
    assert owners == ["agent/remote/main.py"]
    from dflashops.agent import client

    assert client.SCHEMA == SCHEMA


def test_unit_records_carry_their_format() -> None:
    """A unit.json the controller writes says which format it is; the model reads it, and an
    older record without it still reads."""
    from dflashops.changes import verdicts

    source = (PACKAGE / "changes" / "verdicts.py").read_text(encoding="utf-8")
    assert "layout.UNIT_SCHEMA" in source and hasattr(verdicts, "unit_record")
    record = UnitRecord.model_validate({"unit_schema": layout.UNIT_SCHEMA, "unit": "web"})
    assert record.unit_schema == layout.UNIT_SCHEMA
    assert UnitRecord.model_validate(json.loads('{"unit": "old"}')).unit_schema is None


def test_the_controller_and_the_host_name_the_same_unit_folder(tmp_path: Path) -> None:
    assert layout.unit_dir(str(tmp_path), "web") == str(tmp_path / "units" / "web")
    assert layout.unit_file(str(tmp_path), "web", layout.LAUNCH) == str(
        tmp_path / "units" / "web" / "launch.sh"
    )
    assert layout.payload("ab" * 32, "x.py") == "payloads/abababababababab/x.py"


def test_receive_puts_the_signal_handlers_back(tmp_path: Path) -> None:
    """The one verified writer's signal guard ends with the call: receive left its own handler
    installed before (write did not), so a later SIGTERM raised into whatever ran next."""

    def mine(_signum: int, _frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        data = b"hello\n"
        request = {
            "workdir": str(tmp_path / "w"),
            "dest": str(tmp_path / "dest"),
            "files": [
                {
                    "rel": "a.txt",
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "offset": 0,
                    "mode": 0o644,
                }
            ],
            "delete": [],
            "need_bytes": 0,
        }
        receive.check(request)
        out = receive.run(request, io.BytesIO(data))
        assert out["ok"] is True and (tmp_path / "dest" / "a.txt").read_bytes() == data
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
