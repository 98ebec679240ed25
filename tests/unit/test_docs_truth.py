"""The README and docs/ against the code: links resolve, every `dflashops COMMAND --flag` they
show is a command and a flag of it, every repo path they name exists, the inventories they show
load (provider inventories too), and the statements issue 21 found false stay true (replica
names in `needs`, the states table against `status --help`, the `status --json` fields table
against the document, the install requirements, the INCIDENTS.md citations). Issue 22's
reference tables follow the code: `keep` and `providers` fields against their models, the
`inventory --list` fields against its document, watch's notices and the fields each carries,
the words watch's lines use, the identity words of `status --json`. Issue 23's: the `rolled
back` row, rollback's refusals and deploy's re-apply line as the code makes them, the history
--json fields, the dashboard's Prometheus series, the `metrics` reference, watch's samples."""

from __future__ import annotations

import io
import json
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from rich.console import Console

from dflashops.agent.history_actions import KeptUnit, Revision
from dflashops.agent.remote import job_metrics as host_metrics
from dflashops.changes import watch
from dflashops.changes.history import pick
from dflashops.changes.identity import IDENTITIES
from dflashops.commands import inventory, status
from dflashops.commands.states import LEGEND
from dflashops.commands.table import COMMANDS, Command, Option
from dflashops.config.inventory import HostSettings, HostSpec, Providers, ProviderSpec
from dflashops.config.job_metrics import JobMetrics
from dflashops.config.load import load_inventory, load_playbook
from dflashops.config.playbook import Keep
from dflashops.config.providers import Endpoint
from dflashops.dashboard.prom import exposition
from dflashops.errors import ConfigError
from dflashops.lifecycle.notices import EVENTS
from dflashops.plan import build_plan
from tests.conftest import REPO, WriteTree
from tests.unit.test_status_json import RESTARTED, judged, uf

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLAYBOOKS = sorted((REPO / "playbooks").glob("*.yaml"))
INCIDENTS = REPO / "docs" / "INCIDENTS.md"
OPERATIONS = REPO / "docs" / "operations.md"
REFERENCE = REPO / "docs" / "playbook-reference.md"
# Shown on purpose with a flag the command lacks: what a wrong flag prints (operations guide).
WRONG_ON_PURPOSE = frozenset({"dflashops deploy --bogus"})
# Written in backticks but not a path of this repository.
NOT_REPO_PATHS = {
    "dflashops/templates/": "where the wheel installs the top-level templates/",
    "playbooks/templates/": "a user's template overrides beside their playbooks",
}
# Every state `status` can show (DESIGN.md, "Operating under pressure" point 5), plus `dead`.
STATES = (
    *("ready", "starting", "restarting", "crashed", "drifted", "outdated", "absent", "stopped"),
    *("waiting", "running", "done", "failed", "orphan", "unreachable", "dead"),
    *("rolled back", "lost", "re-provisioned"),
)

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
# At the start of a code line or of an inline span: `dflashops` inside a comment or a message
# ("only what dflashops started") is prose.
MENTION = re.compile(r"^dflashops\s+([a-z][a-z-]*)((?:\s+[^\s`|;&>#]+)*)")
COMMAND_NAMES = "|".join(sorted((re.escape(c.name) for c in COMMANDS), key=len, reverse=True))
BARE = re.compile(rf"^(?:{COMMAND_NAMES})\s+-")
PATH = re.compile(r"^(?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*(?:::[A-Za-z0-9_]+)?$")
REPO_TOPS = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
PACKAGE_DIRS = {p.name: p for p in (REPO / "dflashops").iterdir() if (p / "__init__.py").exists()}
PACKAGE_DIRS["data"] = REPO / "dflashops" / "data"
PACKAGE_DIRS["remote"] = REPO / "dflashops" / "agent" / "remote"


@dataclass(frozen=True)
class Line:
    path: Path
    number: int
    text: str
    code: bool  # inside a fenced or indented code block

    def where(self) -> str:
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{shown}:{self.number}"


def lines(path: Path) -> Iterator[Line]:
    """Each line, marked code or prose (fenced blocks; 4-space blocks after a blank line)."""
    fenced = indented = False
    previous_blank = True
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(text):
            fenced = not fenced
            yield Line(path, number, text, True)
            continue
        if not fenced:
            indented = text.startswith("    ") and (previous_blank or indented)
        yield Line(path, number, text, fenced or indented)
        previous_blank = not text.strip()


def prose(line: Line) -> str:
    """The line without its inline code spans (empty for a code line)."""
    return "" if line.code else INLINE.sub(" ", line.text)


def spans(line: Line) -> list[str]:
    return [m.group(2).strip() for m in INLINE.finditer(line.text)]


def mentions(line: Line) -> list[str]:
    """`dflashops COMMAND ...` as typed: a code line, or any inline code span."""
    texts = spans(line)
    if line.code:
        texts.append(re.sub(r"^\s*(?:\$\s+)?", "", line.text))
    found = [m.group(0).strip() for m in map(MENTION.match, texts) if m]
    # `stop --unit NAME`, `logs --raw`: a command with its flags, written without `dflashops`.
    found += [f"dflashops {t}" for t in spans(line) if BARE.match(t)]
    return found


def flags_of(command: Command) -> dict[str, Option]:
    """Every flag on the command line: its options, and -v where it talks to hosts."""
    return {flag: o for o in command.arguments for flag in o.flags}


COMMAND_BY_NAME = {c.name: c for c in COMMANDS}


def mention_problems(line: Line, mention: str) -> list[str]:
    words = mention.split()
    command = COMMAND_BY_NAME.get(words[1])
    if command is None:
        return [f"{line.where()}: `{mention}`: no command {words[1]!r}"]
    if mention in WRONG_ON_PURPOSE:
        return []
    known = flags_of(command)
    problems = []
    for i, word in enumerate(words[2:], 2):
        if not word.startswith("-") or word == "-" or word == "--" or word[1:2].isdigit():
            continue
        name = word.split("=", 1)[0].rstrip(".,:)")
        if name in ("-h", "--help"):
            continue
        option = known.get(name)
        if option is None:
            problems.append(f"{line.where()}: `{mention}`: {command.name} has no {name}")
            continue
        optional = option.const is not None  # `status --json`: its value may be left out
        takes_value = option.kind != "bool" and not optional and "=" not in word
        following = words[i + 1] if i + 1 < len(words) else None
        bare = following is None or (following.startswith("-") and following != "-")
        if takes_value and bare:
            problems.append(f"{line.where()}: `{mention}`: {name} needs a value")
    return problems


def all_lines() -> Iterator[Line]:
    for path in DOCS:
        yield from lines(path)


def test_every_dflashops_command_and_flag_the_docs_show_exists() -> None:
    seen = 0
    problems = []
    for line in [*all_lines(), *(ln for p in PLAYBOOKS for ln in lines(p))]:
        for mention in mentions(line):
            seen += 1
            problems += mention_problems(line, mention)
    assert seen > 50, "the scan found almost no commands: is the pattern broken?"
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_wrong_command_flag_and_missing_value(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `dflashops deploi --host b200`.\n\n"
        "    dflashops status --prune\n\n"
        "```console\n$ dflashops logs sglang-0 --lines\n```\n"
        "Fine: `dflashops status --json s.json`, `dflashops trust --host pro6000 --yes`.\n"
        "Also checked without the prefix: `stop --prune`; not `watch --heal crashed`.\n"
    )
    found = [p for ln in lines(page) for m in mentions(ln) for p in mention_problems(ln, m)]
    assert len(found) == 4, found
    assert "no command 'deploi'" in found[0]
    assert "status has no --prune" in found[1]
    assert "--lines needs a value" in found[2]
    assert "stop has no --prune" in found[3]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in lines(path):
        if not line.code and line.text.startswith("#"):
            base = slug(line.text.lstrip("#"))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def test_every_relative_link_resolves() -> None:
    problems = []
    for line in all_lines():
        for _, target in LINK.findall(prose(line)):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (line.path.parent / file).resolve() if file else line.path
            if not resolved.exists():
                problems.append(f"{line.where()}: {target}: no such file")
            elif anchor and anchor not in anchors(resolved):
                problems.append(f"{line.where()}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def repo_path(text: str) -> Path | None:
    """The file a backticked path names, or None when it is not a path of this repository."""
    if not PATH.match(text) or text in NOT_REPO_PATHS:
        return None
    first = text.split("/", 1)[0]
    if first in REPO_TOPS:
        return REPO / text.split("::")[0]
    if first in PACKAGE_DIRS:
        return PACKAGE_DIRS[first].parent / text.split("::")[0]
    return None


def test_every_repo_path_the_docs_name_exists() -> None:
    problems = []
    checked = 0
    for line in [*all_lines(), *(ln for p in PLAYBOOKS for ln in lines(p))]:
        for text in spans(line):
            path = repo_path(text)
            if path is None:
                continue
            checked += 1
            if not path.exists():
                problems.append(f"{line.where()}: `{text}`: {path.relative_to(REPO)} is missing")
            elif "::" in text and f"def {text.split('::')[1]}(" not in path.read_text():
                problems.append(f"{line.where()}: `{text}`: no such test in {path.name}")
    assert checked > 40, "the scan found almost no paths: is the pattern broken?"
    assert not problems, "\n".join(problems)


def test_incidents_citations_resolve_to_docs_incidents() -> None:
    """Prose that cites INCIDENTS.md links to docs/INCIDENTS.md; playbook comments name the
    path from the repo root (code blocks quote messages, which are left as they are)."""
    assert INCIDENTS.is_file()
    problems = []
    for line in all_lines():
        text = prose(line)
        for label, target in LINK.findall(text):
            if (line.path.parent / target.partition("#")[0]).resolve() == INCIDENTS:
                text = text.replace(f"[{label}]({target})", " ")
        if "INCIDENTS.md" in text and line.path != INCIDENTS:
            problems.append(f"{line.where()}: cites INCIDENTS.md without a link to it")
    for path in PLAYBOOKS:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            for prefix in re.findall(r"(\S*)INCIDENTS\.md", text):
                if not (REPO / f"{prefix.lstrip('(`')}INCIDENTS.md").is_file():
                    problems.append(f"{path.relative_to(REPO)}:{n}: cite docs/INCIDENTS.md")
    assert not problems, "\n".join(problems)


def yaml_blocks(path: Path) -> Iterator[tuple[int, str]]:
    block: list[str] | None = None
    start = 0
    for line in lines(path):
        if FENCE.match(line.text):
            if block is None and line.text.strip() in ("```yaml", "~~~yaml"):
                block, start = [], line.number
            elif block is not None:
                yield start, "\n".join(block)
                block = None
        elif block is not None:
            block.append(line.text)


def test_every_whole_inventory_the_docs_show_loads(tmp_path: Path) -> None:
    """A yaml block with `hosts:` as a mapping of hosts is an inventory: it must load (a
    provider inventory too: loading it asks no API)."""
    checked = []
    providers = []
    for path in DOCS:
        for start, text in yaml_blocks(path):
            data = yaml.safe_load(text)
            if not isinstance(data, dict) or not isinstance(data.get("hosts"), dict):
                continue
            file = tmp_path / f"{path.stem}-{start}.yaml"
            file.write_text(text)
            try:
                inv = load_inventory(file)
            except ConfigError as exc:
                pytest.fail(f"{path.relative_to(REPO)}:{start}: {exc}")
            checked.append(f"{path.name}:{start}")
            if any(h.provider is not None for h in inv.hosts.values()):
                providers.append(path.name)
    assert any(c.startswith("README.md") for c in checked), checked
    assert {"README.md", "playbook-reference.md"} <= set(providers), providers
    assert not (tmp_path / ".dflashops").exists()  # nothing was asked of a provider


def test_install_section_matches_pyproject() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    [python] = re.findall(r'requires-python = ">=([0-9.]+)"', pyproject)
    [script] = re.findall(r'^(\S+) = "dflashops\.cli:main"', pyproject, re.M)
    readme = (REPO / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"Python {python}+" in install
    assert "pip install ." in install and "pip wheel" in install
    assert f"{script} --help" in install


def test_replica_names_in_needs_are_accepted_as_the_reference_says(write_tree: WriteTree) -> None:
    root = write_tree(
        {
            "inventory.yaml": "hosts:\n  b200: {address: 127.0.0.1, gpus: 2}\n",
            "playbooks/p.yaml": """
            name: p
            hosts: b200
            services:
              - {name: sglang, engine: sglang, model: /m, replicas: 2}
            jobs:
              - {name: one, command: [x], needs: [sglang-1]}
              - {name: all, command: [x], needs: [sglang]}
            """,
        }
    )
    plan = build_plan(
        load_inventory(root / "inventory.yaml"), [load_playbook(root / "playbooks/p.yaml")], None
    )
    assert [p.message for p in plan.problems] == []
    units = {u.name: u for u in plan.hosts["b200"].units}
    assert units["one"].needs == ("sglang-1",)
    assert units["all"].needs == ("sglang-0", "sglang-1")
    reference = (REPO / "docs" / "playbook-reference.md").read_text()
    [row] = [r for r in reference.splitlines() if r.startswith("| `needs` |")]
    assert "`sglang-0`" in row and "not accepted" not in row


def section(path: Path, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading."""
    text = path.read_text()
    assert f"\n{heading}\n" in text, f"{path.name} has no heading {heading!r}"
    return re.split(r"^#+ ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1, flags=re.M)[0]


def table_keys(text: str) -> list[str]:
    """The first cells of a table's rows, when they are one code span."""
    return re.findall(r"^\| `([^`]+)` \|", text, re.M)


def states_table() -> list[str]:
    return table_keys(section(OPERATIONS, "### States"))


def test_the_operations_guide_explains_every_state() -> None:
    assert sorted(states_table()) == sorted(STATES)


def test_the_operations_guide_explains_the_states_status_help_lists() -> None:
    legend = LEGEND.split("states", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^  (\S+(?: \S+)?)\s{2,}", legend, re.M)
    assert len(listed) >= len(STATES), legend
    assert sorted(listed) == sorted(states_table()), "status --help and the guide differ"


def status_document(root: Path) -> dict[str, Any]:
    """What `dflashops status --json FILE` writes for a job on a `connection: local` host."""
    host = {"connection": "local", "gpus": 1, "workdir": str(root / "w"), "python": "python3"}
    (root / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"local": host}}))
    (root / "playbooks").mkdir()
    job = {"name": "gen", "command": ["true"], "gpus": 1}
    (root / "playbooks" / "p.yaml").write_text(
        yaml.safe_dump({"name": "p", "hosts": "local", "jobs": [job]})
    )
    path = root / "status.json"
    people = Console(file=io.StringIO())
    assert status.status(people, inventory=str(root / "inventory.yaml"), json_path=str(path)) == 0
    return cast(dict[str, Any], json.loads(path.read_text()))


def unit_rows() -> list[dict[str, Any]]:
    """Rows as status makes them: a restarted server (its last exit kept), a job with progress."""
    server = judged("web-0", uf("web-0", "running", **RESTARTED), {})
    job = judged("gen", uf("gen", "running", progress={"done": 1, "total": 2}), None)
    return [server.as_json(), job.as_json()]


def test_the_status_json_table_has_every_field_of_the_document(tmp_path: Path) -> None:
    """One row per field of the document, of its hosts and of its units, and none it lacks; a
    field that holds an object (or a list of them) names each of that object's keys."""
    doc = status_document(tmp_path)
    units = unit_rows()
    assert units[0]["last_exit"] and units[1]["progress"] and units[0]["gpus"], units
    table = section(OPERATIONS, "### `status --json`")
    rows = {key: line for line in table.splitlines() for key in table_keys(line)}
    fields = {key for key in doc if key not in ("hosts", "units")}
    fields |= {f"hosts[].{key}" for key in doc["hosts"][0]}
    fields |= {f"units[].{key}" for unit in [*doc["units"], *units] for key in unit}
    assert sorted(fields - set(rows)) == [], "fields of the document the table leaves out"
    assert sorted(set(rows) - fields) == [], "rows for fields the document does not have"
    for unit in units:
        for key, value in unit.items():
            inner = value[0] if isinstance(value, list) and value else value
            if isinstance(inner, dict):
                row = rows[f"units[].{key}"]
                assert [k for k in inner if f"`{k}`" not in row] == [], row


# -- issue 22: keep, providers, inventory --list, watch --------------------------------------


def test_the_keep_and_provider_tables_have_every_field_of_their_models() -> None:
    keep = table_keys(section(REFERENCE, "### `keep`: outputs kept off the node"))
    assert keep == list(Keep.model_fields)
    providers = section(REFERENCE, "### `providers`: hosts named by their pod")
    assert sorted(table_keys(providers)) == sorted(
        [*Providers.model_fields, *ProviderSpec.model_fields]
    )
    host_only = table_keys(section(REFERENCE, "### Host-only fields"))
    assert sorted(host_only) == sorted(set(HostSpec.model_fields) - set(HostSettings.model_fields))


def test_the_inventory_list_table_has_every_field_of_its_document(tmp_path: Path) -> None:
    """The rows of the `--list` table against what `inventory --list` prints for a pod host and
    a host with an address (the document built as the command builds it; no API is asked)."""
    path = tmp_path / "inventory.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "providers": {"runpod": {"api_key": "env:NO_SUCH_KEY", "api_url": "http://x/v1"}},
                "hosts": {"pod": {"runpod": {"pod": "gen"}}, "fixed": {"address": "10.0.0.5"}},
                "groups": {"gpu": {"hosts": ["pod", "fixed"], "vars": {"model": "/m"}}},
            }
        )
    )
    inv = load_inventory(path)
    where = Endpoint("203.0.113.50", 40123, "pod-1", "RUNNING")
    seen = {
        "pod": inventory.Seen(inv.hosts["pod"], endpoint=where),
        "fixed": inventory.Seen(inv.hosts["fixed"]),
    }
    doc = inventory.listing(inv, seen)
    table = section(REFERENCE, "### `dflashops inventory`")
    rows = {key: line for line in table.splitlines() for key in table_keys(line)}
    fields = {f"hosts.NAME.{k}" for entry in doc["hosts"].values() for k in entry}
    fields |= {f"groups.NAME.{k}" for group in doc["groups"].values() for k in group}
    assert sorted(fields) == sorted(rows)
    provider = doc["hosts"]["pod"]["provider"]
    assert [k for k in provider if f"`{k}`" not in rows["hosts.NAME.provider"]] == []
    assert doc["hosts"]["fixed"]["provider"] is None and provider["pod_id"] == "pod-1"


def notice_fields() -> dict[str, list[str]]:
    """Each notice watch sends and the fields it carries, as changes/watch.py writes them."""
    source = (REPO / "dflashops" / "changes" / "watch.py").read_text()
    found = re.findall(r'Notice\(\s*"(\w+)",\s*\{([^}]*)\}', source)
    return {event: re.findall(r'"(\w+)":', body) for event, body in found}


def test_the_notices_table_names_every_notice_and_its_fields() -> None:
    fields = notice_fields()
    assert sorted(fields) == sorted(EVENTS), "a notice changes/watch.py sends is not in EVENTS"
    table = section(OPERATIONS, "### Notices")
    rows = {key: line for line in table.splitlines() for key in table_keys(line)}
    assert sorted(rows) == sorted(EVENTS)
    for event, keys in fields.items():
        assert keys and [k for k in keys if f"`{k}`" not in rows[event]] == [], rows[event]
    for why in ("drift", "rebooted", "re-provisioned", "crashed"):  # redeployed's why
        assert f"`{why}`" in rows["redeployed"]


def test_the_watch_section_explains_every_word_its_lines_use() -> None:
    text = " ".join(section(OPERATIONS, "## `dflashops watch`").split())
    words = typing.get_args(watch.Word)
    said = {w: watch.LABELS.get(w, w) for w in words if w not in ("running", "done")}
    assert [label for label in said.values() if f"`{label}`" not in text] == []
    assert watch.SPANS in text
    assert str(watch.refusal(60.0, 30.0)) in text


def test_the_identity_words_are_the_ones_status_json_gives() -> None:
    table = section(OPERATIONS, "### `status --json`")
    [row] = [line for line in table.splitlines() if line.startswith("| `hosts[].identity` |")]
    assert [word for word in IDENTITIES if f"`{word}`" not in row] == []


# -- issue 23: history, rollback, job metrics, Prometheus, the dashboard -----------------------


def test_the_rolled_back_row_says_what_status_and_deploy_say() -> None:
    [row] = [r for r in section(OPERATIONS, "### States").splitlines() if "| `rolled back` |" in r]
    legend = " ".join(LEGEND.split("rolled back", 1)[1].split("\n  lost", 1)[0].split())
    assert "playbooks differ" in legend and "re-applies" in legend
    assert "revision 1, playbooks differ" in row and "re-applies" in row, row
    assert "dflashops deploy --check" in row


def test_the_history_section_quotes_the_refusals_and_the_reapply_line_as_the_code_makes_them() -> (
    None
):
    text = section(OPERATIONS, "## History and rollback")
    kept = [Revision(revision=n, scripts=n >= 4) for n in range(13, 0, -1)]
    pruned = pick(kept, 2, "local")
    unknown = pick([Revision(revision=n, scripts=True) for n in (3, 2, 1)], 7, "local")
    assert isinstance(pruned, str) and isinstance(unknown, str)
    assert f"{pruned}; nothing was done" in text
    assert f"{unknown}; nothing was done" in text
    deploy_source = (REPO / "dflashops" / "lifecycle" / "deploy.py").read_text()
    reapply = "the playbooks to what `dflashops rollback` left: "
    assert reapply in deploy_source and f"would re-apply {reapply}" in text
    for field in [*Revision.model_fields, *KeptUnit.model_fields]:
        assert f"`{field}`" in text, f"history --json field {field} is not explained"


def test_the_prometheus_table_has_every_series_the_dashboard_serves() -> None:
    served = re.findall(r"^# TYPE (\S+) ", exposition(lambda: None).decode(), re.M)
    table = table_keys(section(OPERATIONS, "## Prometheus"))
    assert len(served) == 4 and sorted(table) == sorted(served)


def test_the_metrics_reference_has_every_field_and_the_jobs_table_names_it() -> None:
    text = section(REFERENCE, "### `metrics`: a job's own numbers")
    assert table_keys(text) == list(JobMetrics.model_fields)
    assert f"{host_metrics.MAX_BYTES // 1024} KiB" in text
    assert "metrics" in table_keys(section(REFERENCE, "### Jobs"))


def test_the_dashboard_section_says_watch_keeps_samples_and_shows_the_screenshot() -> None:
    text = section(OPERATIONS, "## The dashboard")
    assert "`dflashops watch` keeps samples in the same file" in text
    assert "](img/dashboard.png)" in text and (REPO / "docs/img/dashboard.png").is_file()
    watch_source = (REPO / "dflashops" / "commands" / "watch.py").read_text()
    assert "Samples(path, events)" in watch_source  # what the sentence above stands on
