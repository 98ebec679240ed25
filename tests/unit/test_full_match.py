"""Names, keys and flags are validated over the whole value: with `re.match` and a `$` anchor,
a trailing newline passed (`$` matches before a final newline), and such a value would then land
in a launch script, an SSH command line or a file name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from dflashops.agent.remote import common, logs
from dflashops.config.inventory import Notify
from dflashops.config.nodestate import Environment, FileEntry
from dflashops.config.playbook import _check_args
from dflashops.config.types import Address, EnvName, Name, NetIf, User
from dflashops.engines.render import TemplateError, env_name


def adapter(kind: Any) -> Callable[[str], object]:
    return TypeAdapter(kind).validate_python


CASES: dict[str, tuple[Callable[[str], object], str]] = {
    "unit name": (adapter(Name), "serve-1"),
    "env name": (adapter(EnvName), "HF_TOKEN"),
    "host address": (adapter(Address), "10.0.0.7"),
    "login name": (adapter(User), "ubuntu"),
    "network interface": (adapter(NetIf), "eth0"),
    "flag name": (lambda v: _check_args({v: 1}), "max-model-len"),
    "webhook env": (lambda v: Notify(webhook=v), "env:HOOK_URL"),
    "webhook url": (lambda v: Notify(webhook=v), "https://example.invalid/hook"),
    "requirement": (lambda v: Environment(path="/opt/env", packages=[v]), "vllm==0.8.0"),
    "after": (lambda v: FileEntry(src="x", dest="/d", after=v), "gen/generate"),
    "mode": (lambda v: FileEntry(src="x", dest="/d", mode=v), "0644"),
}


@pytest.mark.parametrize("what", sorted(CASES))
def test_a_trailing_newline_is_refused(what: str) -> None:
    validate, good = CASES[what]
    validate(good)  # the value itself is fine
    with pytest.raises((ValidationError, ValueError)):
        validate(good + "\n")


def test_template_env_name_refuses_a_trailing_newline() -> None:
    assert env_name("HF_HOME") == "HF_HOME"
    with pytest.raises(TemplateError):
        env_name("HF_HOME\n")


def test_agent_unit_name_refuses_a_trailing_newline() -> None:
    assert common.unit_name("serve", "unit") == "serve"
    with pytest.raises(common.BadRequest):
        common.unit_name("serve\n", "unit")


def test_a_log_name_with_a_trailing_newline_is_not_a_unit_log() -> None:
    assert logs._key("20250101T000000Z.log") == ("20250101T000000Z", 0)
    assert logs._key("20250101T000000Z.log\n") is None
