"""The package's standing limits (STYLE.md 8, issue 20), checked over the whole package: no
import cycle between its modules (imports under TYPE_CHECKING and inside functions count: each
one is a dependency someone has to keep in mind), at most 8 plain modules at its top level, and
outside builtins/ no module over 600 lines and no function over 80."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dflashops

PACKAGE = Path(dflashops.__file__).parent
TOP_LEVEL_MODULES = 8
MODULE_LINES = 600
FUNCTION_LINES = 80


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every dflashops module ``name`` imports anywhere in its body (under TYPE_CHECKING and
    inside functions too); ``from m import x`` counts as m.x where x is a module, else m."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        wanted: list[str] = []
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
            wanted = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in wanted:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("dflashops") and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def limited() -> list[Path]:
    """The modules the size limits apply to: all but the shipped builtins/ files."""
    return sorted(
        p for p in PACKAGE.rglob("*.py") if "builtins" not in p.relative_to(PACKAGE).parts
    )


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """The check below can fail: a cycle closed only by an import inside a function counts."""
    (tmp_path / "dflashops").mkdir()
    (tmp_path / "dflashops" / "a.py").write_text("from dflashops.b import x\n")
    (tmp_path / "dflashops" / "b.py").write_text("def x():\n    from dflashops import a\n")
    (tmp_path / "dflashops" / "c.py").write_text("import dflashops.a\n")
    known = {f"dflashops.{m}": tmp_path / "dflashops" / f"{m}.py" for m in "abc"}
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph["dflashops.b"] == {"dflashops.a"}
    assert cycles(graph) == [["dflashops.a", "dflashops.b"]]


FIRST_IMPORT = """
import importlib, os, sys
import fabric, invoke, jinja2, paramiko, pydantic, rich.console, rich.table, yaml  # noqa: E401
# third-party first, once: each fork then pays for dflashops alone, two at a time.
names, running, failed = sys.argv[1:], {}, 0
while names or running:
    if names and len(running) < 2:
        name = names.pop()
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
                os._exit(1)
            os._exit(0)
        running[pid] = name
        continue
    pid, status = os.wait()
    failed += bool(status)
    running.pop(pid)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_when_it_is_imported_first() -> None:
    """The cycle check above reads modules; this one runs them: each module imported first in
    a fresh process. A package's __init__ runs before its submodule, so hosts.connection ->
    events -> output -> hosts.inert once failed here (hosts/__init__ -> hosts.base ->
    hosts.connection, half imported) while every command, importing hosts first, worked."""
    names = sorted(module_names())
    assert len(names) > 100
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT, *names], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100  # the graph is read, not empty
    assert cycles(graph) == []


def test_the_protocol_module_is_a_leaf() -> None:
    """The plan takes default ports from it while the engines' launch code takes the plan's
    units: it must import nothing of dflashops."""
    assert import_graph()["dflashops.engines.protocol"] == set()


def test_at_most_eight_plain_modules_at_the_top_level() -> None:
    plain = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(plain) <= TOP_LEVEL_MODULES, plain


def test_no_module_outside_builtins_is_over_600_lines() -> None:
    sizes = {
        str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines())
        for p in limited()
    }
    assert len(sizes) > 50
    assert {p: n for p, n in sizes.items() if n > MODULE_LINES} == {}


def test_no_function_outside_builtins_is_over_80_lines() -> None:
    long = {}
    for path in limited():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_no_two_test_files_share_a_name() -> None:
    """The test folders are not packages: two test_x.py stop the whole run at collection
    ("import file mismatch"), which a run of one folder never shows."""
    tests = PACKAGE.parent / "tests"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) > 50
    assert sorted({n for n in names if names.count(n) > 1}) == []
