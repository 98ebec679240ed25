"""The two front ends as a person meets them (issue 21): the real `invoke --help TASK` for every
command, the subcommand's own usage on a bad flag, `--limit`, `--unit`, `-v`, `status --json`
with or without a value, the commands' details under their help; names -> units
(plan/names.py) and "did you mean" for hosts and units. No host: render and the parsers only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from invoke.parser import Parser

import dflashops.output
from dflashops.cli import main, parser
from dflashops.commands import execute
from dflashops.commands.named import OnNamed
from dflashops.commands.table import COMMANDS, Command, Option
from dflashops.errors import DflashopsError
from dflashops.plan.names import LISTED, UnknownNames, listing, partition, resolve, service_of
from dflashops.project import select
from dflashops.tasks import TableArgument, keywords, namespace

REPO = Path(__file__).resolve().parents[2]
BY_NAME = {c.name: c for c in COMMANDS}
DESIGN_STATES = [  # DESIGN.md, "Operating under pressure" 5
    *("ready", "starting", "restarting", "crashed", "drifted", "outdated", "absent", "stopped"),
    *("waiting", "running", "done", "failed", "orphan", "unreachable", "rolled back", "lost"),
    "re-provisioned",
]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """h1, h2 and group gpu; on h1 a service echo (2 replicas), a service other, a job
    client that needs echo. Nothing here is ever contacted: render only."""
    (tmp_path / "playbooks").mkdir()
    inventory = {
        "hosts": {
            "h1": {"address": "127.0.0.1", "gpus": 4},
            "h2": {"address": "127.0.0.1", "gpus": 2},
        },
        "groups": {"gpu": ["h1", "h2"]},
    }
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    book = {
        "name": "p",
        "hosts": "gpu",
        "services": [
            {"name": "echo", "engine": "stub", "model": "m", "replicas": 2, "port": 18000},
            {"name": "other", "engine": "command", "command": ["sleep", "100"]},
        ],
        "jobs": [{"name": "client", "command": ["true"], "needs": ["echo"]}],
    }
    (tmp_path / "playbooks" / "p.yaml").write_text(yaml.safe_dump(book))
    return tmp_path / "inventory.yaml"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own exit (usage errors, --help)
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def invoke_kwargs(argv: list[str]) -> dict[str, Any]:
    """``argv`` through invoke's own parser, as `invoke ARGV` parses it, then to keywords."""
    (context,) = Parser(contexts=namespace.to_contexts()).parse_argv(argv)
    return keywords(BY_NAME[str(context.name)], context.as_kwargs)


def argparse_kwargs(argv: list[str]) -> dict[str, Any]:
    args = vars(parser().parse_args(argv))
    args.pop("command"), args.pop("_command")
    return args


def sample_argv(command: Command, alias: bool = False) -> list[str]:
    """Every option of ``command`` given once, with a value of its kind (the last long name
    with ``alias``)."""
    argv = [command.name]
    for opt in command.arguments:
        if opt.positional:
            argv.append(f"{opt.dest}-value")
            continue
        flag = f"--{opt.longs[-1] if alias else opt.longs[0]}"
        if opt.kind == "bool":
            argv.append(flag)
        elif opt.kind == "int":
            argv += [flag, "3"]
        elif opt.choices:
            argv += [flag, opt.choices[-1]]
        else:
            argv += [flag, "a,b"]
    return argv


# ------------------------------------------------------------------------------ invoke


@pytest.fixture(scope="module")
def ops_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ops repo as a user has one: a tasks.py that re-exports the namespace."""
    root = tmp_path_factory.mktemp("opsrepo")
    (root / "tasks.py").write_text((REPO / "tasks.py").read_text())
    return root


def real_invoke(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "invoke", *argv],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_invoke_help_works_for_every_task_and_lists_every_flag(
    ops_repo: Path, command: Command
) -> None:
    """Was: `invoke --help deploy` -> ValueError: '--hosts' is not a valid flag."""
    proc = real_invoke(ops_repo, "--help", command.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for opt in command.arguments:
        for long in opt.longs:
            assert f"--{long}" in proc.stdout, (command.name, long, proc.stdout)
        if opt.short:
            assert f"-{opt.short}" in proc.stdout, (command.name, opt.short)
    for line in command.details.splitlines():
        assert line.strip() in proc.stdout, (command.name, line)


def test_invoke_list_names_every_task(ops_repo: Path) -> None:
    proc = real_invoke(ops_repo, "--list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines()[1:] if line.startswith("  ")}
    assert {c.name for c in COMMANDS} <= listed, proc.stdout


def test_invoke_arguments_carry_the_tables_keyword() -> None:
    """What test_commands.py compares as ``dest``: invoke names an argument as its flag."""
    for command in COMMANDS:
        task = namespace[command.name]
        dests = [a.dest for a in task.get_arguments() if isinstance(a, TableArgument)]
        assert sorted(dests) == sorted(o.dest for o in command.arguments), command.name


@pytest.mark.parametrize("alias", [False, True], ids=["names", "aliases"])
def test_both_front_ends_pass_the_same_keywords_for_every_option(alias: bool) -> None:
    for command in COMMANDS:
        argv = sample_argv(command, alias)
        cli, tasks = argparse_kwargs(argv), invoke_kwargs(argv)
        assert cli == tasks, (argv, cli, tasks)
        assert set(cli) == {o.dest for o in command.arguments}


# ------------------------------------------------------------------------------ argparse usage


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_a_bad_flag_prints_the_commands_own_usage(
    capsys: pytest.CaptureFixture[str], command: Command
) -> None:
    """Was: `usage: dflashops [-h] [--version] COMMAND ...` for any command."""
    code, _, err = run_cli(capsys, command.name, *required(command.name), "--bogus", "7")
    assert code == 2, err
    assert err.startswith(f"usage: dflashops {command.name} "), err
    assert f"dflashops {command.name}: error: unrecognized arguments: --bogus 7" in err, err


def test_a_stray_word_after_logs_unit_is_the_logs_usage_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "logs", "echo", "extra")
    assert code == 2 and err.startswith("usage: dflashops logs "), err
    assert "unrecognized arguments: extra" in err


def test_the_subcommand_usage_from_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dflashops.cli", "deploy", "--bogus"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: dflashops deploy [-h] [-i FILE] [--host NAMES]")
    assert proc.stderr.rstrip().endswith("dflashops deploy: error: unrecognized arguments: --bogus")


# ------------------------------------------------------------------------------ --limit, -v


def test_limit_is_an_alias_of_host_wherever_host_is() -> None:
    with_host = [c for c in COMMANDS if any(o.dest == "hosts" for o in c.options)]
    assert {c.name for c in with_host} >= {"deploy", "status", "logs", "stop", "trust", "fetch"}
    for command in with_host:
        (opt,) = [o for o in command.options if o.dest == "hosts"]
        assert opt.longs == ("host", "limit"), command.name
    argv = ["deploy", "--limit", "h1", "--host", "gpu", "--limit", "h*,all"]
    assert argparse_kwargs(argv)["hosts"] == invoke_kwargs(argv)["hosts"] == ["h1", "gpu", "h*,all"]


def test_verbose_is_on_every_command_that_touches_hosts() -> None:
    touching = {c.name for c in COMMANDS if c.touches_hosts}
    assert touching == {
        "deploy",
        "restart-servers",
        "stop",
        "status",
        "top",
        "logs",
        "preflight",
        "trust",
        "unlock",
        "fetch",
        "watch",
        "dashboard",
        "history",
        "rollback",
    }
    for name in touching:
        assert argparse_kwargs([name, *required(name), "-v"])["verbose"] is True
    assert invoke_kwargs(["status", "-v"])["verbose"] is True


def required(name: str) -> list[str]:
    command = BY_NAME[name]
    argv = [o.dest for o in command.options if o.positional]
    return argv + [a for o in command.options if o.required and o.flags for a in (o.flags[0], "x")]


SEEN: list[tuple[dict[str, Any], bool]] = []


def quiet_command(out: Any, *, name: str | None = None) -> int:
    """A command that does not take ``verbose``: it must not get it."""
    SEEN.append(({"name": name}, dflashops.output.verbose()))
    return 0


def chatty_command(out: Any, *, verbose: bool = False) -> int:
    SEEN.append(({"verbose": verbose}, dflashops.output.verbose()))
    return 0


def test_execute_takes_verbose_and_passes_it_only_to_who_asks() -> None:
    quiet = Command(
        "quiet",
        "h",
        f"{__name__}:quiet_command",
        (Option("name", ("--name",), "n"),),
        touches_hosts=True,
    )
    chatty = Command("chatty", "h", f"{__name__}:chatty_command", touches_hosts=True)
    SEEN.clear()
    try:
        assert execute(quiet, {"name": "x", "verbose": True}) == 0
        assert execute(chatty, {"verbose": True}) == 0
        assert execute(quiet, {"name": "y", "verbose": False}) == 0
    finally:
        dflashops.output.set_verbose(False)
    assert SEEN == [({"name": "x"}, True), ({"verbose": True}, True), ({"name": "y"}, False)]


# ------------------------------------------------------------------------------ status --json


@pytest.mark.parametrize(
    ("given", "path"),
    [([], None), (["--json"], "-"), (["--json", "-"], "-"), (["--json", "s.json"], "s.json")],
)
def test_status_json_takes_an_optional_file_in_both(given: list[str], path: str | None) -> None:
    argv = ["status", *given, "--limit", "h1"]
    cli, tasks = argparse_kwargs(argv), invoke_kwargs(argv)
    assert cli["json_path"] == tasks["json_path"] == path
    assert cli["hosts"] == tasks["hosts"] == ["h1"]


def test_other_commands_json_still_needs_its_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "deploy", "--json")
    assert code == 2 and "argument --json: expected one argument" in err, err


def test_status_help_explains_every_state(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "status", "--help")
    assert code == 0
    legend = out[out.index("states") :]
    for state in DESIGN_STATES:
        assert f"\n  {state} " in legend, state
    # The details keep their line breaks (RawDescriptionHelpFormatter).
    assert BY_NAME["status"].details.splitlines()[1] in out


# ------------------------------------------------------------------------------ names -> units

KNOWN = {"echo-0": "echo", "echo-1": "echo", "other-0": "other", "client": "client"}


def test_a_service_name_means_all_its_units_and_a_unit_name_itself() -> None:
    assert resolve(["echo"], KNOWN) == ["echo-0", "echo-1"]
    assert resolve(["client", "echo-1", "echo"], KNOWN) == ["client", "echo-1", "echo-0"]
    assert resolve(["other", "echo-0", "echo"], KNOWN) == ["other-0", "echo-0", "echo-1"]
    # A unit's own name wins over a service of that name.
    assert resolve(["a"], {"a": "a", "a-0": "a"}) == ["a"]


def test_unknown_names_say_did_you_mean_and_what_there_is() -> None:
    with pytest.raises(UnknownNames) as caught:
        resolve(["ecoh", "echo", "zzz"], KNOWN, "on h1")
    message = str(caught.value)
    assert message == (
        "no units or services named 'ecoh' (did you mean 'echo'?), 'zzz' on h1; "
        "known: client, echo (echo-0, echo-1), other (other-0)"
    )
    assert caught.value.unknown == ["ecoh", "zzz"]
    assert isinstance(caught.value, DflashopsError)
    assert partition(["ecoh", "client"], KNOWN) == (["client"], ["ecoh"])


def test_the_known_list_stays_short_on_a_big_fleet() -> None:
    known = {f"job{i:04d}": f"job{i:04d}" for i in range(500)}
    text = listing(known)
    assert text.endswith(f"and {500 - LISTED} more") and text.count(",") == LISTED - 1


def test_a_unit_only_a_host_records_belongs_to_its_service_by_name() -> None:
    assert service_of("echo-1", "service") == "echo"
    assert service_of("big-ray", "service") == "big"
    assert service_of("train-2", "job") == "train-2"  # a job keeps its name
    assert service_of("odd", None) == "odd"


# ------------------------------------------------------------------------------ render --unit


def scripts(out: str) -> list[str]:
    return [line.split()[2] for line in out.splitlines() if line.startswith("# ---- ")]


def test_render_unit_narrows_to_the_units_named(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "render", "-i", str(project), "--unit", "echo,client")
    assert code == 0, err
    assert scripts(out) == [
        f"{h}/{u}" for h in ("h1", "h2") for u in ("echo-0", "echo-1", "client")
    ]
    code, out, _ = run_cli(
        capsys, "render", "-i", str(project), "--unit", "other-0", "--limit", "h2"
    )
    assert scripts(out) == ["h2/other-0"]


def test_render_unknown_unit_is_one_line_and_renders_nothing(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "render", "-i", str(project), "--unit", "ecoh")
    assert code == 1 and not scripts(out)
    assert err.strip() == (
        "error: no unit or service named 'ecoh' (did you mean 'echo'?) in the playbooks for "
        "h1, h2; known: client, echo (echo-0, echo-1), other (other-0)"
    )


# ------------------------------------------------------------------------------ host names


def test_limit_values_reach_the_inventory_unchanged(project: Path) -> None:
    assert select(project, [], ["all"]).hosts == ["h1", "h2"]
    assert select(project, [], ["h*"]).hosts == ["h1", "h2"]
    assert select(project, [], ["gpu"]).hosts == ["h1", "h2"]
    assert select(project, [], ["h2"]).hosts == ["h2"]


def test_an_unknown_host_says_did_you_mean(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(DflashopsError) as caught:
        select(project, [], ["h10"])
    assert str(caught.value) == (
        f"--host 'h10' is not in {project} (did you mean 'h1'?); it has: gpu, h1, h2"
    )
    code, _, err = run_cli(capsys, "render", "-i", str(project), "--limit", "gpus")
    assert code == 1 and "--host 'gpus' is not in" in err and "did you mean 'gpu'?" in err


def test_named_host_commands_say_did_you_mean(project: Path) -> None:
    named = OnNamed("give --host", lambda *_: True)
    assert [h.name for h in named.named(str(project), ["gpu"])] == ["h1", "h2"]
    with pytest.raises(DflashopsError, match=r"--host 'h11' is not in .*did you mean 'h1'\?"):
        named.named(str(project), ["h11"])
