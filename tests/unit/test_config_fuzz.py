"""Property-based tests: whatever text or structure reaches the config loaders, the outcome is a
valid model or a located ConfigError; whatever validates can be planned and rendered without an
exception, every rendered script parses, and configured values reach the process verbatim (no
shell injection)."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflashops.config.inventory import HostSettings, HostSpec, Inventory, InventoryFile
from dflashops.config.load import Playbook, load_inventory, load_playbook, validate
from dflashops.config.playbook import (
    CommandService,
    Job,
    Launcher,
    PlaybookFile,
    Ready,
    SglangService,
    StubService,
    VllmService,
)
from dflashops.config.yamlsource import parse_yaml
from dflashops.engines.render import render_plan, template_dirs
from dflashops.errors import ConfigError, Problem
from dflashops.plan import build_plan
from dflashops.preflight.bash_syntax import bash_n, shape
from dflashops.preflight.offline import bash_syntax, engine_flags

MODELS = [
    InventoryFile,
    HostSettings,
    HostSpec,
    PlaybookFile,
    SglangService,
    VllmService,
    StubService,
    CommandService,
    Job,
    Ready,
    Launcher,
]
FIELD_NAMES = sorted({name for model in MODELS for name in model.model_fields})

# Values a person (or an attacker editing a playbook) might put where data is expected.
NASTY = [
    "; rm -rf /",
    "$(touch /tmp/dflashops-pwned)",
    "`id`",
    "'",
    '"',
    "\\",
    "a\nb",
    "\r",
    "\t",
    "\x00",
    "$HOME",
    "${IFS}",
    "&& reboot",
    "| cat",
    "> /etc/passwd",
    "*",
    "~",
    "~root/x",
    "-rf",
    "--help",
    "-oProxyCommand=sh",
    "{port}",
    "{replica}",
    "{{ host }}",
    "{{ host_gpus }}",
    "{{ playbook_dir }}",
    "{{ undefined_var }}",
    "{{ host_gpus // 0 }}",
    "{{",
    "}}",
    "{% if %}",
    "host:/etc/passwd",
    "dflashops:stub_engine",
    "dflashops:no_such_payload",
    "../../etc/passwd",
    "/dev/shm/model",
    "30s",
    "20m",
    "auto",
    "sglang",
    "vllm",
    "stub",
    "command",
    "é中文🙂",
    "\u2028",
    "\x85",
    "\ud800",  # a lone surrogate: YAML's "\uD800" escape produces one
    "",
]
ENGINES = ["sglang", "vllm", "stub", "command"]
UNIT_NAMES = ["a", "b", "sglang", "gen", "x-1"]

nasty_text = st.one_of(
    st.sampled_from(NASTY),
    st.lists(st.sampled_from(NASTY) | st.text(max_size=4), min_size=1, max_size=4).map("".join),
    st.text(max_size=16),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    nasty_text,
    st.dates(),
    st.binary(max_size=6),
)
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.sampled_from(NASTY), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(keys, children, max_size=5),
    ),
    max_leaves=20,
)


def dump(doc: Any, allow_unicode: bool = True) -> str:
    return yaml.safe_dump(doc, allow_unicode=allow_unicode, sort_keys=False)


class Fields:
    """Adds optional fields to a mapping. A clean document gets plausible values only (most of
    them validate, so planning and rendering get exercised); a dirty one also gets anything at all
    and unknown keys."""

    def __init__(self, draw: st.DrawFn, dirty: bool) -> None:
        self.draw = draw
        self.dirty = dirty

    def maybe(self, out: dict[str, Any], key: str, valid: st.SearchStrategy[Any]) -> None:
        choice = self.draw(st.integers(0, 7 if self.dirty else 5))
        if choice <= 2:
            out[key] = self.draw(valid)
        elif choice >= 6:
            out[key] = self.draw(values)

    def junk(self, out: dict[str, Any]) -> None:
        if self.dirty and self.draw(st.booleans()):
            out[self.draw(keys)] = self.draw(values)

    def pick(self, valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> Any:
        return self.draw(valid | anything if self.dirty else valid)


names = st.one_of(
    st.sampled_from(UNIT_NAMES), st.from_regex(r"[a-z0-9][a-z0-9-]{0,8}", fullmatch=True)
)
env_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
flag_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,8}", fullmatch=True)
# Text that validation accepts in Text fields (no NUL) and in paths (also no newline, not empty).
clean_text = nasty_text.map(lambda t: t.replace("\x00", ""))
clean_path = clean_text.map(lambda t: t.replace("\n", " ").replace("\r", " ") or "p")
arg_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    clean_text,
    st.lists(st.one_of(clean_text, st.integers(-5, 99)), max_size=3),
    st.dictionaries(st.text(max_size=5), values, max_size=3),
)
args = st.dictionaries(flag_names, arg_values, max_size=4)
durations = st.sampled_from(["30s", "20m", "1h30m", "0.5s", 5, 2.5])
gpu_lists = st.lists(st.integers(0, 4), max_size=4)
job_scripts = st.sampled_from(
    [
        "job.py",
        "job.sh",
        "tool",
        "missing.py",
        "sub/../job.py",
        "dflashops:stub_engine",
        "dflashops:no_such_payload",
        "host:/opt/tools/run.py",
        "host:/opt/tools/run.sh",
        "host:{{ playbook_dir }}/job.py",
    ]
)
ready = st.fixed_dictionaries(
    {},
    optional={
        "timeout": durations,
        "interval": durations,
        "path": st.sampled_from(["/health", "/v1/models", "/x?y=1"]),
    },
)


@st.composite
def services(draw: st.DrawFn, dirty: bool) -> dict[str, Any]:
    f = Fields(draw, dirty)
    engine = f.pick(st.sampled_from(ENGINES), nasty_text)
    svc: dict[str, Any] = {"name": f.pick(names, nasty_text), "engine": engine}
    if engine == "command":
        svc["command"] = f.pick(st.lists(clean_text, min_size=1, max_size=3), values)
        f.maybe(svc, "gpus_per_replica", st.integers(0, 2))
    else:
        svc["model"] = f.pick(
            st.sampled_from(["/dev/shm/m", "org/model", "{{ model }}"]) | clean_path, values
        )
        f.maybe(svc, "tp", st.integers(1, 2))
        f.maybe(svc, "dp", st.integers(1, 2))
    if engine == "vllm":
        f.maybe(svc, "allow_dp", st.booleans())
        f.maybe(
            svc, "launcher", st.fixed_dictionaries({"script": job_scripts}, optional={"args": args})
        )
    f.maybe(svc, "replicas", st.integers(1, 3))
    f.maybe(svc, "port", st.sampled_from([8000, 30000, 31000, 65534, 65535]))
    f.maybe(svc, "gpus", st.just("auto") | gpu_lists)
    f.maybe(svc, "bind", st.sampled_from(["0.0.0.0", "127.0.0.1", "::"]) | clean_text)
    f.maybe(svc, "args", args)
    f.maybe(svc, "env", st.dictionaries(env_names, clean_text | st.integers(), max_size=3))
    f.maybe(svc, "secret_env", st.dictionaries(env_names, env_names, max_size=2))
    f.maybe(svc, "ready", ready)
    f.maybe(svc, "stop_grace", durations)
    f.junk(svc)
    return svc


@st.composite
def jobs(draw: st.DrawFn, dirty: bool) -> dict[str, Any]:
    f = Fields(draw, dirty)
    job: dict[str, Any] = {"name": f.pick(names, nasty_text)}
    if draw(st.booleans()):
        job["script"] = f.pick(job_scripts, nasty_text)
    else:
        job["command"] = f.pick(st.lists(clean_text, min_size=1, max_size=3), values)
    f.maybe(job, "args", args)
    f.maybe(job, "needs", st.lists(names, max_size=3))
    f.maybe(job, "servers", names)
    f.maybe(job, "restart_with", st.lists(names, max_size=2))
    f.maybe(job, "gpus", st.integers(0, 3) | gpu_lists)
    f.maybe(job, "env", st.dictionaries(env_names, clean_text, max_size=3))
    f.maybe(job, "secret_env", st.dictionaries(env_names, env_names, max_size=2))
    f.maybe(job, "stop_grace", durations)
    f.junk(job)
    return job


@st.composite
def playbooks(draw: st.DrawFn) -> dict[str, Any]:
    dirty = draw(st.integers(0, 3)) == 0
    f = Fields(draw, dirty)
    doc: dict[str, Any] = {
        "name": f.pick(names, nasty_text),
        "hosts": f.pick(st.sampled_from(["h", "g", "both", ["h", "g"], "nowhere"]), values),
    }
    f.maybe(
        doc, "vars", st.dictionaries(st.sampled_from(["model", "n", "host"]), values, max_size=3)
    )
    doc["services"] = draw(st.lists(services(dirty), max_size=3))
    f.maybe(doc, "jobs", st.lists(jobs(dirty), max_size=3))
    f.junk(doc)
    return doc


@st.composite
def inventories(draw: st.DrawFn) -> dict[str, Any]:
    f = Fields(draw, dirty=draw(st.integers(0, 3)) == 0)

    def host() -> dict[str, Any]:
        h: dict[str, Any] = {}
        f.maybe(h, "connection", st.sampled_from(["ssh", "local"]))
        f.maybe(
            h, "address", st.sampled_from(["10.0.0.1", "gpu-box", "[::1]", "-oProxyCommand=sh"])
        )
        f.maybe(h, "port", st.integers(1, 65535))
        f.maybe(h, "user", st.sampled_from(["root", "ubuntu", "svc$", "a b"]))
        f.maybe(h, "gpus", st.integers(0, 64))
        f.maybe(h, "workdir", st.sampled_from(["/workspace/d", "~/d", "rel/d"]) | clean_path)
        f.maybe(h, "python", clean_path)
        f.maybe(h, "key_file", clean_path)
        f.maybe(h, "gpu_type", clean_text)
        f.maybe(h, "host_key_policy", st.sampled_from(["strict", "accept-new", "off"]))
        f.maybe(
            h, "host_key", st.sampled_from(["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5", "ssh-rsa !!", "x"])
        )
        f.maybe(h, "env", st.dictionaries(env_names, clean_text, max_size=2))
        f.maybe(h, "vars", st.dictionaries(keys, values, max_size=2))
        f.junk(h)
        return h

    doc: dict[str, Any] = {"hosts": {draw(names): host() for _ in range(draw(st.integers(0, 3)))}}
    if draw(st.booleans()):
        doc["defaults"] = host()
    f.maybe(doc, "groups", st.dictionaries(names, st.lists(names, max_size=3), max_size=2))
    f.junk(doc)
    return doc


yaml_texts = st.one_of(
    st.text(max_size=200),
    st.lists(
        st.sampled_from(
            [
                *NASTY,
                ":",
                "- ",
                "  ",
                "\n",
                "{",
                "}",
                "[",
                "]",
                "&a ",
                "*a",
                "!!binary ",
                "<<: ",
                "? ",
                "---\n",
                "name: ",
                "hosts:\n",
                "services:\n",
                "  - ",
            ]
        ),
        max_size=30,
    ).map("".join),
    values.map(dump),
    playbooks().map(dump),
    inventories().map(dump),
    # Deep nesting: a clear error, not a RecursionError.
    st.integers(1, 2000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 2000).map(lambda n: "a: " + "{a: " * n + "1" + "}" * n),
)


def check_config_error(exc: ConfigError, file: str) -> None:
    assert exc.problems, "a ConfigError must carry at least one problem"
    for p in exc.problems:
        assert isinstance(p, Problem)
        assert p.message.strip(), f"empty message in {p!r}"
        assert p.file == file, f"problem names {p.file!r}, not {file!r}"
        assert str(p)


def problems_ok(problems: list[Problem], files: set[str]) -> None:
    for p in problems:
        assert p.message.strip(), f"empty message in {p!r}"
        assert p.file in files, f"problem names {p.file!r}, expected one of {files}"


_counter = itertools.count()


def fresh(root: Path, stem: str) -> Path:
    return root / f"{stem}-{next(_counter)}.yaml"


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A playbooks folder with the files fuzzed jobs refer to, and a fixed inventory beside it."""
    base = tmp_path_factory.mktemp("fuzz")
    books = base / "playbooks"
    (books / "sub").mkdir(parents=True)
    (books / "job.py").write_text("print('job')\n")
    (books / "job.sh").write_text("echo job\n")
    (books / "tool").write_text("#!/bin/sh\necho tool\n")
    (base / "inventory.yaml").write_text(
        dump(
            {
                "defaults": {"python": "python3", "env": {"SITE": "a b; c"}},
                "hosts": {
                    "h": {
                        "connection": "local",
                        "gpus": 4,
                        "workdir": str(base / "wd-h"),
                        "vars": {"model": "/dev/shm/host-model"},
                    },
                    "g": {"connection": "local", "gpus": 2, "workdir": str(base / "wd-g")},
                },
                "groups": {"both": ["h", "g"]},
            }
        )
    )
    return base


@pytest.fixture(scope="module")
def inventory(root: Path) -> Inventory:
    return load_inventory(root / "inventory.yaml")


# -- (a) parse + validate: a model or a ConfigError, nothing else --------------------------------


FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(text=yaml_texts)
@example(text="[" * 1000 + "]" * 1000)
def test_parse_and_validate_only_config_errors(text: str) -> None:
    try:
        doc = parse_yaml(text, "fuzz.yaml")
    except ConfigError as exc:
        check_config_error(exc, "fuzz.yaml")
        return
    for model, what in ((InventoryFile, "inventory"), (PlaybookFile, "playbook")):
        try:
            result = validate(doc, model, what)
        except ConfigError as exc:
            check_config_error(exc, "fuzz.yaml")
        else:
            assert isinstance(result, model)


@FUZZ
@given(text=yaml_texts)
@example(text="a: " + "{a: " * 1000 + "1" + "}" * 1000)
def test_loaders_only_config_errors(root: Path, text: str) -> None:
    for stem, loader in (("inventory", load_inventory), ("playbook", load_playbook)):
        path = fresh(root / "loaded", stem)
        path.parent.mkdir(exist_ok=True)
        # Lone surrogates become bytes that are not UTF-8: a broken file the loader must refuse.
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            loader(path)
        except ConfigError as exc:
            check_config_error(exc, str(path))


@FUZZ
@given(doc=inventories())
def test_structured_inventories(root: Path, doc: dict[str, Any]) -> None:
    path = fresh(root / "inv", "inventory")
    path.parent.mkdir(exist_ok=True)
    path.write_text(dump(doc), encoding="utf-8")
    try:
        inv = load_inventory(path)
    except ConfigError as exc:
        check_config_error(exc, str(path))
        return
    assert set(inv.hosts) == set(doc["hosts"])
    for host in inv.hosts.values():
        assert host.connection in ("ssh", "local")
        assert host.connection == "local" or host.address


# -- (b) what validates can be planned and rendered; every script parses --------------------------


@settings(FUZZ, max_examples=300)
@given(doc=playbooks())
@example(
    doc={
        "name": "p",
        "hosts": "h",
        "services": [{"name": "s", "engine": "command", "command": ["{{ 1/0 }}"]}],
    }
)
@example(
    doc={
        "name": "p",
        "hosts": "h",
        "services": [
            {
                "name": "s",
                "engine": "command",
                "command": ["x"],
                "args": {"cfg": {"d": datetime.date(2020, 1, 1)}},
            }
        ],
    }
)
@example(doc={"name": "p", "hosts": "h", "jobs": [{"name": "j", "script": "~nosuchuser/x.py"}]})
@example(doc={"name": "p", "hosts": "h", "jobs": [{"name": "j", "script": "a" * 300 + ".py"}]})
@example(
    doc={
        "name": "p",
        "hosts": "h",
        "services": [{"name": "s", "engine": "command", "command": ["echo", "\ud800"]}],
    }
)
def test_valid_playbooks_plan_and_render(
    root: Path, inventory: Inventory, doc: dict[str, Any]
) -> None:
    path = fresh(root / "playbooks", "book")
    path.write_text(dump(doc), encoding="utf-8")
    try:
        book = load_playbook(path)
    except ConfigError as exc:
        check_config_error(exc, str(path))
        return
    plan = build_plan(inventory, [book])
    problems_ok(plan.problems, {str(path)})
    rendered, problems = render_plan(plan, template_dirs([path]))
    problems_ok(problems, {str(path)})
    for r in rendered:
        # pre-flight's own check: `bash -n` on the script as it would be shipped, and on the
        # shape pre-flight checks in its place (it must parse exactly when the script does).
        check = bash_syntax(r, bash_n(r.script))
        assert check.ok, f"{check.message}\n{r.script}"
        assert bash_n(shape(r.script, r.fingerprint).decode()).ok, r.script
        for flags in engine_flags(r):
            assert flags.message or flags.ok


# -- (c) values reach the process verbatim: no shell injection ------------------------------------

PROBE = (
    "import sys, json, os; print(json.dumps({'argv': sys.argv[1:], "
    "'env': {k: v for k, v in os.environ.items() if k.startswith('FUZZ_')}}))"
)
PORT = 39999


def injectable(text: str) -> bool:
    """Anything but NUL (refused by validation), '{{' (the start of a playbook template) and lone
    surrogates (no UTF-8 script can hold them; test_valid_playbooks_plan_and_render covers them)."""
    return (
        "\x00" not in text
        and "{{" not in text
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    )


argv_text = st.one_of(
    st.sampled_from([t for t in NASTY if injectable(t)]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24),
    st.lists(st.sampled_from(NASTY), min_size=1, max_size=5).map("".join),
).filter(injectable)


def expected_flags(given_args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in given_args.items():
        if value is True:
            out.append(f"--{key}")
        elif isinstance(value, list):
            out.extend([f"--{key}", *value])
        else:
            out.extend([f"--{key}", value])
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(argv_text, max_size=4),
    given_args=st.dictionaries(
        flag_names,
        st.one_of(argv_text, st.just(True), st.lists(argv_text, min_size=1, max_size=2)),
        max_size=3,
    ),
    env=st.dictionaries(
        st.from_regex(r"FUZZ_[A-Z0-9_]{0,6}", fullmatch=True), argv_text, max_size=3
    ),
)
def test_values_reach_argv_and_env_verbatim(
    root: Path,
    inventory: Inventory,
    words: list[str],
    given_args: dict[str, Any],
    env: dict[str, str],
) -> None:
    doc = {
        "name": "inject",
        "hosts": "h",
        "services": [
            {
                "name": "echo",
                "engine": "command",
                "command": ["python3", "-c", PROBE, *words],
                "port": PORT,
                "args": given_args,
                "env": env,
            }
        ],
    }
    path = fresh(root / "playbooks", "inject")
    # Escaped output: PyYAML's emitter writes a raw NEL (U+0085) that its reader folds to a space.
    path.write_text(dump(doc, allow_unicode=False), encoding="utf-8")
    book: Playbook = load_playbook(path)  # every generated value is valid: no ConfigError
    plan = build_plan(inventory, [book])
    assert plan.problems == []
    rendered, problems = render_plan(plan, template_dirs([path]))
    assert problems == [] and len(rendered) == 1
    r = rendered[0]

    unit_dir = root / "run" / f"w{next(_counter)}" / "units" / r.unit.name
    unit_dir.mkdir(parents=True)
    script = unit_dir / "launch.sh"
    script.write_text(r.script, encoding="utf-8")
    # PATH as usual, with this interpreter's bin first so `python3` is a real one, not a shim.
    bin_dir = str(Path(sys.executable).parent)
    run_env = {
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/bin:/bin")]),
        "HOME": str(root),
        "LANG": "C.UTF-8",
    }
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=run_env, check=False, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want_words = [w.replace("{port}", str(PORT)).replace("{replica}", "0") for w in words]
    assert got["argv"] == [*want_words, *expected_flags(given_args)]
    assert got["env"] == env
