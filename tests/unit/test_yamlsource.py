from __future__ import annotations

from pathlib import Path

import pytest

from dflashops.config.yamlsource import parse_yaml, read_yaml
from dflashops.errors import ConfigError


def test_positions_point_at_keys_and_items() -> None:
    doc = parse_yaml("hosts:\n  b200:\n    port: 36472\n    tags: [a, b]\n", "inv.yaml")
    assert doc.data == {"hosts": {"b200": {"port": 36472, "tags": ["a", "b"]}}}
    assert doc.locate(("hosts", "b200", "port")) == (3, 5)
    assert doc.locate(("hosts", "b200", "tags", 1)) == (4, 15)
    # A path that does not exist is located at its deepest existing parent.
    assert doc.locate(("hosts", "b200", "missing")) == (2, 3)


def test_duplicate_keys_are_errors_not_silently_dropped() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_yaml("hosts:\n  b200: {}\n  b200: {}\n", "inv.yaml")
    assert (
        str(exc.value)
        == "inv.yaml:3:3: hosts.b200: duplicate key 'b200' (an earlier one would be lost)"
    )


def test_malformed_yaml_names_file_line_and_column() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_yaml("name: x\nservices:\n  - name: a\n   engine: b\n", "pb.yaml")
    [problem] = exc.value.problems
    assert (problem.file, problem.line) == ("pb.yaml", 4)
    assert problem.message.startswith("invalid YAML:")


def test_empty_document_is_none() -> None:
    assert parse_yaml("# only a comment\n", "x.yaml").data is None


def test_alias_bomb_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    with pytest.raises(ConfigError, match="more than"):
        parse_yaml("\n".join(lines), "bomb.yaml")


def test_merge_keys_are_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="merge keys"):
        parse_yaml("base: &b {a: 1}\nother:\n  <<: *b\n", "m.yaml")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        read_yaml(tmp_path / "nope.yaml")
    assert str(exc.value) == f"{tmp_path / 'nope.yaml'}: file not found"


def test_bad_timestamp_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid YAML value"):
        parse_yaml("when: 2024-13-45\n", "t.yaml")


def test_a_lone_surrogate_is_a_config_error_with_its_place() -> None:
    with pytest.raises(ConfigError, match="is not valid Unicode") as exc:
        parse_yaml("a: 1\nb: x\ud800\n", "t.yaml")
    assert str(exc.value).startswith("t.yaml:2:5: ")
