"""Errors keep their structure (issue 20): a HostError keeps its host, detail and next step, and
each host's outcome keeps what was raised, so a line that names the host shows the rest without
cutting text; the messages themselves are what they were."""

from __future__ import annotations

from dflashops.config.inventory import Host
from dflashops.errors import ConfigError, HostError, Problem
from dflashops.lifecycle.fleet import on_hosts


def host(name: str) -> Host:
    return Host(name, "local", None, None, None, None, 0, None, "~/w", "python3", None, "strict")


def test_a_host_error_keeps_its_parts_and_its_text() -> None:
    plain = HostError("gpu1", "disk full")
    assert (plain.host, plain.detail, plain.next_step) == ("gpu1", "disk full", None)
    assert str(plain) == "[gpu1] disk full"
    told = HostError("gpu1", "authentication failed", "Check `user` in the inventory.")
    assert told.next_step == "Check `user` in the inventory."
    assert str(told) == "[gpu1] authentication failed. Check `user` in the inventory."
    assert told.reason == "authentication failed. Check `user` in the inventory."


def test_a_line_that_names_the_host_shows_the_rest_and_a_peer_keeps_its_name() -> None:
    exc = HostError("gpu1", "disk full", "free some space")
    assert exc.message_for("gpu1") == "disk full. free some space"
    assert exc.message_for("gpu2") == "[gpu1] disk full. free some space"  # a peer's failure
    config = ConfigError([Problem("inventory.yaml", "bad", line=3)])
    assert config.message_for("gpu1") == "inventory.yaml:3: bad"


def test_each_outcome_keeps_what_was_raised() -> None:
    own = HostError("a", "connection refused")
    peer = HostError("c", "relay source is gone")
    bug = ValueError("oops")
    raised = {"a": own, "b": peer, "c": bug}

    def fail(h: Host) -> None:
        raise raised[h.name]

    outcomes = on_hosts([host("a"), host("b"), host("c")], fail, forks=1)
    assert [o.exception for o in outcomes.values()] == [own, peer, bug]
    assert outcomes["a"].error == "[a] connection refused"  # the text is what it was
    assert outcomes["a"].reason == "connection refused"
    assert outcomes["b"].reason == "[c] relay source is gone"
    assert outcomes["c"].reason == outcomes["c"].error == "internal error (ValueError: oops)"
    assert outcomes["c"].unexpected
