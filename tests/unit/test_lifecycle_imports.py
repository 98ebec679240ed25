"""The lifecycle package's shape (issue 20; STYLE.md "Standing limits"): the read-only commands
load a host session, never the deploy executor, and no lifecycle module is part of an import
cycle (imports under TYPE_CHECKING and inside functions count)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dflashops"
EXECUTOR = ("dflashops.lifecycle.deploy", "dflashops.lifecycle.stage", "dflashops.agent.transfer")


def test_read_only_commands_never_load_the_deploy_executor() -> None:
    # A fresh interpreter: this test run's own imports must not hide what the commands load.
    code = (
        "import json, sys\n"
        "import dflashops.commands.status, dflashops.commands.top, dflashops.commands.logs\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dflashops'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = set(json.loads(proc.stdout))
    assert "dflashops.stage" not in loaded
    assert not loaded & set(EXECUTOR), sorted(loaded & set(EXECUTOR))
    assert "dflashops.lifecycle.session" in loaded  # what they use instead


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every dflashops module ``path`` imports, wherever the import statement stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(part)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_lifecycle_module_is_in_an_import_cycle() -> None:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if "builtins" not in p.parts}
    graph = {name: imports_of(path, set(files)) for name, path in files.items()}
    assert any(m.startswith("dflashops.lifecycle") for m in graph)
    tangled = [
        sorted(c)
        for c in cycles(graph)
        if any(m.startswith("dflashops.lifecycle") or m == "dflashops.stage" for m in c)
    ]
    assert not tangled
