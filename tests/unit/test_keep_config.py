"""`keep:` on jobs, as written in a playbook: every mistake located at its file and line, and the
`to` host checked against the inventory (the job's own host refused: the copy would be lost
with it)."""

from __future__ import annotations

import pytest

from dflashops.config.load import load_playbook
from dflashops.config.playbook import Job, Keep, keep_name, keep_target_problem
from dflashops.errors import ConfigError
from tests.conftest import REPO, WriteTree

PLAYBOOK = """\
name: p
hosts: h
jobs:
  - name: gen
    command: [x]
    keep:
{keep}
"""

BAD = [
    ("      paths: []", 7, "jobs[0].keep.paths: List should have at least 1 item"),
    ("      paths: [/]", 7, "'/' names no file or folder to keep"),
    ("      paths: [out/../../etc]", 7, "'out/../../etc' contains '..'"),
    ("      paths: ['~root/x']", 7, "'~root/x': '~' must be followed by '/'"),
    ("      paths: [/a/out, /b/out/]", 7, "two paths would both be kept as 'out'"),
    ("      paths: [out]\n      every: 2s", 8, "jobs[0].keep.every: every must be at least 5s"),
    (
        "      paths: [out]\n      to: h2",
        8,
        "'h2' is neither `controller` nor 'HOST:/absolute/path'",
    ),
    ("      paths: [out]\n      to: 'h2:rel/x'", 8, "neither `controller` nor"),
    ("      paths: [out]\n      to: 'h2:/a/../b'", 8, "neither `controller` nor"),
    ("      paths: [out]\n      limit: 1KiB", 8, "a size must be between 64KiB and 1TiB"),
    ("      paths: [out]\n      evry: 10s", 8, "unknown key 'evry'; did you mean 'every'?"),
]


@pytest.mark.parametrize(("keep", "line", "message"), BAD)
def test_a_bad_keep_is_reported_at_its_line(
    write_tree: WriteTree, keep: str, line: int, message: str
) -> None:
    root = write_tree({"p.yaml": PLAYBOOK.format(keep=keep)})
    with pytest.raises(ConfigError) as err:
        load_playbook(root / "p.yaml")
    got = [str(p) for p in err.value.problems]
    assert any(f"p.yaml:{line}:" in p and message in p for p in got), got


def test_a_good_keep_parses_with_its_defaults(write_tree: WriteTree) -> None:
    keep = "      paths: [/workspace/completions/, logs/run.log]\n      to: 'k:/keep/'"
    root = write_tree({"p.yaml": PLAYBOOK.format(keep=keep)})
    book = load_playbook(root / "p.yaml")
    assert book.spec is not None
    got = book.spec.jobs[0].keep
    assert got is not None
    assert (got.every, got.limit, got.target) == (60.0, None, ("k", "/keep"))
    assert [keep_name(p) for p in got.paths] == ["completions", "run.log"]
    assert Keep(paths=["out"]).target is None  # to: controller


def test_the_to_host_must_be_in_the_inventory_and_not_the_jobs_own() -> None:
    keep = Keep(paths=["out"], to="k:/keep")
    assert keep_target_problem(keep, "g", {"g", "k"}) is None
    assert keep_target_problem(keep, "g", {"g"}) == (
        "keep.to names 'k', which is not a host of the inventory"
    )
    assert "the copy would be lost with it" in str(keep_target_problem(keep, "k", {"g", "k"}))
    assert keep_target_problem(Keep(paths=["out"]), "g", set()) is None


def test_keep_is_for_a_job_on_one_host() -> None:
    with pytest.raises(ValueError, match="not one over several nodes"):
        Job.model_validate(
            {
                "name": "t",
                "script": "t.py",
                "launcher": "torchrun",
                "nodes": ["a", "b"],
                "keep": {"paths": ["out"]},
            }
        )


def test_the_demo_keeps_its_generators_output() -> None:
    """dev/demo.sh shows the kept copy of playbooks/demo.yaml's generator: what it keeps is the
    job's own output folder (units/JOB/OUTPUT-DIR, the job's working directory being its unit's)."""
    book = load_playbook(REPO / "playbooks" / "demo.yaml")
    (job,) = [j for j in book.head.jobs if j["name"] == "generate"]
    keep = Keep.model_validate(job["keep"])
    assert (
        keep.paths == [f"units/generate/{job['args']['output-dir']}/"] and keep.to == "controller"
    )
    assert (
        f".dflashops/keep/local/generate/{keep_name(keep.paths[0])}"
        in (REPO / "dev" / "demo.sh").read_text()
    )
