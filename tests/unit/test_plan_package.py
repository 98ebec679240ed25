"""The plan as a package: each module small, no import cycle through it (type-only and
function-level imports count), and one place that says which protocol an engine speaks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflashops
from dflashops.config.playbook import PlaybookFile
from dflashops.engines import identity, metrics
from dflashops.engines.protocol import DEFAULT_PORTS, MODEL_ENGINES, protocol

PACKAGE = Path(dflashops.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every dflashops module ``name`` imports anywhere in its body (under TYPE_CHECKING and
    inside functions too)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_no_import_cycle_runs_through_the_plan_package() -> None:
    known = _module_names()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    for start in [n for n in graph if n.startswith("dflashops.plan")]:
        stack: list[tuple[str, tuple[str, ...]]] = [(start, (start,))]
        seen: set[str] = set()
        while stack:
            name, trail = stack.pop()
            for nxt in graph[name]:
                assert nxt != start, " -> ".join([*trail, nxt])
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))


def test_the_plan_is_a_package_of_small_modules() -> None:
    modules = sorted((PACKAGE / "plan").glob("*.py"))
    assert len(modules) > 1
    for path in modules:
        source = path.read_text()
        assert len(source.splitlines()) <= 600, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path}: {node.name}"


def test_the_protocol_module_is_a_leaf() -> None:
    """The plan takes default ports from it while the engines' launch code takes the plan's
    units: it must import nothing of dflashops."""
    known = _module_names()
    assert (
        _imports("dflashops.engines.protocol", known["dflashops.engines.protocol"], known) == set()
    )


@pytest.mark.parametrize(
    ("engine", "speaks"),
    [
        ("sglang", "sglang"),
        ("stub", "sglang"),
        ("vllm", "vllm"),
        ("command", None),
        ("job", None),
        ("ray", None),
    ],
)
def test_which_protocol_each_engine_speaks(engine: str, speaks: str | None) -> None:
    assert protocol(engine) == speaks
    assert (engine in MODEL_ENGINES) == (speaks is not None)


def test_the_engine_schema_and_the_protocols_name_the_same_model_engines() -> None:
    """Adding an engine to the playbook schema without saying what it speaks is caught here."""
    schema = PlaybookFile.model_json_schema()
    engines = {
        e
        for definition in schema["$defs"].values()
        for e in [definition.get("properties", {}).get("engine", {}).get("const")]
        if e is not None
    }
    assert set(MODEL_ENGINES) == engines - {"command"}


def test_the_stub_is_probed_read_and_port_numbered_as_sglang() -> None:
    assert identity.identity_paths("stub") == identity.identity_paths("sglang") != []
    assert identity.identity_paths("command") == []
    assert DEFAULT_PORTS["stub"] == DEFAULT_PORTS["sglang"] != DEFAULT_PORTS["vllm"]
    text = "sglang:gen_throughput 12.5\nsglang:num_running_reqs 3\n"
    assert metrics.parse("stub", text, at=1.0).tok_s == 12.5
    assert metrics.parse("command", text, at=1.0).tok_s is None
