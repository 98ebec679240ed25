"""Hostile host answers against a local host (issue 19, DESIGN.md "Trust boundary" 1-2): the
path checker, inert host text, bounded answers, and a real agent behind a python that rewrites
what it says (tests/hostile.py). The same wrapper on sshd hosts: tests/integration/test_hostile.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflashops.agent import Agent
from dflashops.agent.reading import Frames
from dflashops.agent.remote import tree
from dflashops.agent.transfer import listing, pull
from dflashops.engines.identity import vllm_args
from dflashops.errors import DflashopsError, TransferError
from dflashops.hosts.local import LocalConnection
from dflashops.hosts.untrusted import (
    DEPTH_LIMIT,
    HostileHost,
    TooDeep,
    check_listing,
    depth,
    loads,
    path_problem,
)
from dflashops.output import inert
from tests.hostile import hostile_python

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

# -- inert ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b]0;pwned\x07title kept", "title kept"),
        ("\x1b[31mRED\x1b[0m plain", "RED plain"),
        ("a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\b", "alinkb"),
        ("\x9b31mC1 CSI\x9b0m", "C1 CSI"),
        ("\x1bPdcs string\x1b\\after", "after"),
        ("bell\x07 nul\x00 del\x7f c1\x85 cr\r", "bell nul del c1 cr"),
        ("tabs\tand\nnewlines stay", "tabs\tand\nnewlines stay"),
        ("\x1b]0;unterminated\nnext line", "\nnext line"),
        ("lone ESC at the end\x1b", "lone ESC at the end"),
        ("\x1b7saved\x1b8 \x1b(Bcharset", "saved charset"),
    ],
)
def test_inert_removes_escape_sequences_and_keeps_the_text_around_them(
    raw: str, shown: str
) -> None:
    assert inert(raw) == shown


@given(st.text())
def test_inert_leaves_no_control_character_but_newline_and_tab(text: str) -> None:
    out = inert(text)
    assert CONTROL.search(out) is None
    assert inert(out) == out  # idempotent


@given(st.text(alphabet=st.characters(exclude_categories=("Cc",))))
def test_inert_keeps_text_without_controls_as_it_is(text: str) -> None:
    assert inert(text) == text


@given(st.text(alphabet=st.characters(exclude_categories=("Cc",))), st.text())
def test_inert_text_after_a_terminated_sequence_stays(text: str, params: str) -> None:
    digits = "".join(c for c in params if c in "0123456789;")[:8]
    assert inert(f"\x1b[{digits}m{text}") == text
    assert inert(f"\x1b]0;{CONTROL.sub('', params)}\x07{text}").endswith(text)


# -- paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/.", "a\0b", "a/", "x" * 256]
)
def test_unsafe_paths_are_named_and_fail_the_host_as_hostile(rel: str) -> None:
    assert path_problem(rel) is not None
    with pytest.raises(HostileHost) as err:
        check_listing("h1", ["ok.txt", rel])
    assert f"host h1 sent an unsafe path {rel!r} in its file list" in str(err.value)
    assert "refusing to write anything from it" in str(err.value)


@pytest.mark.parametrize("rel", ["", "a", "a/b/c.safetensors", "..a", "a..", ".hidden", "é/\x1b"])
def test_plain_relative_paths_pass(rel: str) -> None:
    assert path_problem(rel) is None


def test_a_listing_naming_a_path_as_file_and_folder_or_the_root_with_more_is_refused() -> None:
    with pytest.raises(HostileHost, match="both as a file and as a folder"):
        check_listing("h", ["a", "a/b"])
    with pytest.raises(HostileHost, match="the destination itself"):
        check_listing("h", ["", "a"])
    check_listing("h", ["a/b", "a/c", "ab"])


@given(st.lists(st.text(min_size=1), max_size=5))
def test_every_path_the_checker_passes_stays_under_the_destination(parts: list[str]) -> None:
    rel = "/".join(parts)
    if path_problem(rel) is None and rel:
        joined = os.path.normpath(os.path.join("/dest", rel))
        assert joined.startswith("/dest/")


# -- JSON ----------------------------------------------------------------------------------------


def test_json_nested_too_deep_is_refused_and_strings_do_not_count() -> None:
    assert depth('{"a": [1, {"b": "[[[[[[["}]}') == 3
    with pytest.raises(TooDeep):
        loads("[" * 200_000)
    with pytest.raises(TooDeep):
        loads("[" * (DEPTH_LIMIT + 1) + "]" * (DEPTH_LIMIT + 1))
    assert loads("[" * DEPTH_LIMIT + "]" * DEPTH_LIMIT) is not None
    assert loads('{"k": "' + "[" * 5000 + '"}') == {"k": "[" * 5000}


@pytest.mark.parametrize("line", ["{[]: 1}", "{{}: 1}", "{'a': {[]: 2}}"])
def test_a_malformed_vllm_args_line_is_no_crash(line: str) -> None:
    assert vllm_args(line) is None  # the launch banner stands in, as for any unreadable line


# -- a local connection whose sink fails ---------------------------------------------------------


def test_a_local_command_whose_output_handler_fails_ends_at_once() -> None:
    seen: list[int] = []

    def sink(data: bytes) -> None:
        seen.append(len(data))
        raise HostileHost("loc", "enough")

    conn = LocalConnection("loc")
    # `yes` never ends by itself: before, the call hung until its timeout (CommandTimeout).
    with pytest.raises(HostileHost, match="enough"):
        conn.run("yes", timeout=30, check=False, stdout=sink)
    assert len(seen) == 1


# -- a hostile agent on a local host -------------------------------------------------------------


def agent(python: str, keep: bool = False) -> Agent:
    return Agent(LocalConnection("loc"), python, keep=keep)


@pytest.mark.parametrize("keep", [False, True], ids=["call", "session"])
def test_a_flood_fails_the_host_with_one_clear_line(tmp_path: Path, keep: bool) -> None:
    python = hostile_python(tmp_path / "bin", on="facts", flood=200 << 20)
    with pytest.raises(HostileHost) as err:
        agent(python, keep).facts(str(tmp_path / "wd"), timeout=120)
    text = str(err.value)
    assert text.startswith("[loc] ") and "passed 64 MiB" in text and "\n" not in text, text


@pytest.mark.parametrize("keep", [False, True], ids=["call", "session"])
def test_nesting_200000_deep_is_a_clear_host_error(tmp_path: Path, keep: bool) -> None:
    python = hostile_python(tmp_path / "bin", on="facts", nest=200_000)
    with pytest.raises(HostileHost, match=r"nested \d+ deep \(at most 100\)"):
        agent(python, keep).facts(str(tmp_path / "wd"), timeout=120)


def scanned(a: Agent, root: Path) -> dict[str, Any]:
    found = a.scan(str(root.parent / "wd"), str(root)).tree
    assert found is not None and found.exists
    return dict(listing(found.files))


def test_a_traversal_name_in_a_fetch_listing_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "ab").mkdir(parents=True)
    (src / "ab" / "x").write_text("owned\n")
    (src / "keep.txt").write_text("fine\n")
    # Same length both ways: the real agent is asked for ab/x, the controller is told ../x.
    python = hostile_python(
        tmp_path / "bin", replace_out=[('"ab/x"', '"../x"')], replace_in=[('"../x"', '"ab/x"')]
    )
    a = agent(python)
    src_listing = scanned(a, src)
    assert "../x" in src_listing  # the lie reached the controller
    dest = tmp_path / "dest"
    with pytest.raises(HostileHost, match=re.escape("sent an unsafe path '../x' in its file")):
        pull(a, str(tmp_path / "wd"), str(src), src_listing, dest, timeout=60)
    assert not (tmp_path / "x").exists()
    assert not dest.exists() or not any(dest.rglob("*"))  # nothing at all from that list


def test_an_absolute_path_in_a_fetch_listing_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "cfg").write_text("owned\n")
    target = str(tmp_path / "abs-target")
    python = hostile_python(
        tmp_path / "bin", replace_out=[('"cfg"', f'"{target}"')], replace_in=[(target, "cfg")]
    )
    a = agent(python)
    with pytest.raises(HostileHost, match="it is absolute"):
        pull(a, str(tmp_path / "wd"), str(src), scanned(a, src), tmp_path / "dest", timeout=60)
    assert not Path(target).exists()


def test_a_symlink_inside_the_destination_is_never_written_through(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "file").write_text("data\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    a = agent(sys.executable)
    with pytest.raises(TransferError, match="sub is a symbolic link: refusing to write"):
        pull(a, str(tmp_path / "wd"), str(src), scanned(a, src), dest, timeout=60)
    assert not any(outside.iterdir())


def test_a_symlink_planted_as_the_partial_file_is_not_followed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 1000)
    a = agent(sys.executable)
    got = scanned(a, src)
    sha = got["w.bin"][1]
    dest = tmp_path / "dest"
    dest.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (dest / f".w.bin{tree.PART_MARK}{sha[:16]}").symlink_to(victim)
    with pytest.raises(DflashopsError, match="symbolic link is never written through"):
        pull(a, str(tmp_path / "wd"), str(src), got, dest, timeout=60)
    assert victim.read_text() == "untouched"


def test_a_malformed_or_unasked_file_header_fails_the_host() -> None:
    frames = Frames(lambda header: pytest.fail("nothing may be opened"), "h")
    with pytest.raises(HostileHost, match="malformed file header"):
        frames.feed(b'{"rel": "a", "size": "big", "offset": 0}\n')
    frames = Frames(lambda header: pytest.fail("nothing may be opened"), "h")
    with pytest.raises(HostileHost, match="malformed file header"):
        frames.feed(b'{"rel": "a", "size": 5, "offset": 9}\n')
