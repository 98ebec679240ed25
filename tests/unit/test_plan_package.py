"""The plan as a package, and one place that says which protocol an engine speaks (a leaf
module: test_standing_limits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dflashops
from dflashops.config.playbook import PlaybookFile
from dflashops.engines import identity, metrics
from dflashops.engines.protocol import DEFAULT_PORTS, MODEL_ENGINES, protocol

PACKAGE = Path(dflashops.__file__).parent


def test_the_plan_is_a_package() -> None:
    """Its modules' sizes and imports are held to the standing limits (test_standing_limits.py)."""
    assert (PACKAGE / "plan" / "__init__.py").is_file()
    assert len(list((PACKAGE / "plan").glob("*.py"))) > 1


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
