"""Job metrics for plotting (issue 23, DESIGN fleet-page 2): numbers from a job's log lines
(a regex with named groups) or its JSON-lines file, read from the end on the host; the
regex checked at pre-flight, at its own line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dflashops.agent.job_metrics import MAX_NAMES, MetricsAnswer, job_metrics
from dflashops.agent.remote import job_metrics as host
from tests.conftest import WriteTree, run_cli

ROOT = Path(__file__).resolve().parents[2]
FAKE_TRAIN_LINE = "fake-train: step {step}/40 loss {loss:.4f}"  # tests/fixtures/.../fake_train.py


def train_regex() -> str:
    book = yaml.safe_load((ROOT / "playbooks" / "train-dflash.yaml").read_text())
    (train,) = [j for j in book["jobs"] if j["name"] == "train"]
    return str(train["metrics"]["log"])


def test_the_training_playbook_reads_the_trainers_loss_in_each_way_it_is_written() -> None:
    regex = train_regex()
    lines = [FAKE_TRAIN_LINE.format(step=s, loss=4.0 / (1 + s)) for s in range(1, 6)]
    assert host.from_log("\n".join(lines), regex) == {"loss": pytest.approx(4.0 / 6, abs=1e-4)}
    for line in ("step 9 loss=0.125 lr=1e-4", "{'loss': 0.125}", "loss: 1.25e-1 grad 3"):
        assert host.from_log(f"noise\n{line}\n", regex) == {"loss": 0.125}, line


def test_log_regex_takes_the_newest_number_of_each_group() -> None:
    text = "loss=2 acc=0.5\nloss=1.5\nwarmup done\nacc=0.7\n"
    regex = r"(?:loss=(?P<loss>[0-9.]+))|(?:acc=(?P<acc>[0-9.]+))"
    assert host.from_log(text, regex) == {"loss": 1.5, "acc": 0.7}
    assert host.from_log("loss=nan\n", r"loss=(?P<loss>\w+)") == {}  # not a finite number
    assert host.from_log("", regex) == {}


def test_json_lines_skip_and_count_garbage() -> None:
    text = "\n".join(
        [
            json.dumps({"step": 1, "loss": 3.0}),
            "Traceback (most recent call last):",
            json.dumps([1, 2]),
            json.dumps({"step": 2, "loss": 2.5, "tag": "x", "ok": True}),
            "",
            '{"step": 3, "lo',
        ]
    )
    values, skipped = host.from_lines(text)
    assert values == {"step": 2.0, "loss": 2.5}  # strings and booleans are not numbers
    assert skipped == 3


def test_the_host_reads_only_the_end_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10_000)))
    end = host.end_of(str(path), 1000)
    assert len(end.encode()) <= 1000 and end.startswith('{"i"')  # the cut line is dropped
    assert host.from_lines(end) == ({"i": 9999.0}, 0)
    assert host.end_of(str(tmp_path / "absent"), 1000) == ""


def test_the_action_answers_per_unit_and_job_metrics_reads_it(tmp_path: Path) -> None:
    unit = tmp_path / "units" / "train"
    (unit / "logs").mkdir(parents=True)
    (unit / "logs" / "run-1.log").write_text("step 1 loss 0.5\nstep 2 loss 0.25\n")
    (unit / "logs" / "current.log").symlink_to("run-1.log")
    (unit / "m.jsonl").write_text('{"reward": 1}\nnot json\n')
    request = {
        "workdir": str(tmp_path),
        "units": [{"name": "train", "log": r"loss (?P<loss>[0-9.]+)"}],
    }
    host.check(request)
    got = host.run(request)
    assert job_metrics(got, "train") == {"loss": 0.25}
    request = {"workdir": str(tmp_path), "units": [{"name": "train", "file": "m.jsonl"}]}
    host.check(request)
    answer = MetricsAnswer.model_validate(host.run(request))
    assert job_metrics(answer, "train") == {"reward": 1.0}
    assert answer.units["train"].skipped == 1
    assert job_metrics(answer, "other") == {} and job_metrics(None, "train") == {}


def test_job_metrics_keeps_a_few_names_and_finite_numbers_only() -> None:
    """A JSON-lines file may carry any number of keys: the dashboard plots each, so it is
    bounded (MAX_NAMES, sorted: the same ones each look)."""
    values = {f"k{i:02d}": float(i) for i in range(40)}
    values["inf"] = float("inf")
    values["x" * 200] = 1.0
    got = job_metrics({"units": {"t": {"values": values}}}, "t")
    assert list(got) == [f"k{i:02d}" for i in range(MAX_NAMES)]


BOOK = """
name: t
hosts: l
jobs:
  - name: a
    command: [sleep, "1"]
    metrics:
      log: {regex}
"""


@pytest.mark.parametrize(
    ("regex", "said"),
    [
        ("'loss=([0-9.]+)'", "the regex has no named group"),
        ("'loss=(?P<loss>[0-9.]+'", "the regex does not compile"),
    ],
)
def test_a_bad_metrics_regex_is_a_preflight_error_at_its_line(
    regex: str, said: str, write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, workdir: wd}\n",
            "playbooks/t.yaml": BOOK.replace("{regex}", regex),
        }
    )
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and said in fails[0], out
    assert re.search(r"playbooks/t\.yaml:7:\d+: jobs\[0\]\.metrics\.log", fails[0]), fails


def test_metrics_takes_one_of_log_or_file(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  l: {connection: local, workdir: wd}\n",
            "playbooks/t.yaml": BOOK.replace("{regex}", "'(?P<x>1)'\n      file: m.jsonl"),
        }
    )
    code, out = run_cli(["preflight"], root, capsys)
    assert code == 1 and "exactly one of `log` (a regex) or `file`" in out, out
