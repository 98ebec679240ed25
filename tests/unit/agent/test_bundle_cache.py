"""The bundle's compiled-code cache on the host (``agent/bundle.py``, its bootstrap).

Compiling the agent's modules is most of a call's own cost, so the bootstrap keeps their code
objects in ``~/.cache/dflashops-agent/<cache_tag>/<crc32>.bin`` (marshal of (text, {module:
marshalled code})). What must hold, since the host runs whatever that file says: an entry is
used only when its text is the text being run (another version's or a colliding entry never
runs), it is written atomically, and a cache that cannot be read or written only makes the call
slower, never wrong and never noisy. The real bundle is run here the way the controller runs it
(``command()``: ``python -S -c LOADER`` reading the bundle, then the request line, on stdin)
with real interpreters and HOME in a tmp folder.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import marshal
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dflashops.agent.bundle import bundle, command, sources
from tests.conftest import SYSTEM_PYTHON, interpreters, unless

REPO = Path(__file__).resolve().parents[3]
PYTHONS = interpreters()
ANY_PYTHON = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
PLANTED = "planted-by-the-test"
# Appended to facts.py to make the planted code's answers tell themselves apart.
PLANT_CODE = f"""
_real_run = run
def run(request):
    answer = _real_run(request)
    answer["hostname"] = {PLANTED!r}
    return answer
"""
# Run by the interpreter under test (its own marshal format): replace one module's code in
# an entry, keeping the entry's text ("same") or giving it another text ("other").
PLANT = r"""
import marshal, sys
path, module, source_file, extra, mode = sys.argv[1:]
with open(path, "rb") as f:
    text, codes = marshal.loads(f.read())
with open(source_file, encoding="utf-8") as f:
    source = f.read()
code = compile(source + extra, "<dflashops-agent>/%s.py" % module, "exec")
codes[module] = marshal.dumps(code)
with open(path, "wb") as f:
    f.write(marshal.dumps((text if mode == "same" else text + "\n# another version", codes)))
"""
# What an entry holds, read by the interpreter that wrote it.
INSPECT = r"""
import hashlib, json, marshal, sys
with open(sys.argv[1], "rb") as f:
    text, codes = marshal.loads(f.read())
modules = {name: marshal.loads(code).co_filename for name, code in codes.items()}
print(json.dumps({"text_sha256": hashlib.sha256(text.encode()).hexdigest(), "modules": modules}))
"""


def bundle_text() -> str:
    """``_S + _B`` of the bundle: the modules and the loader."""
    values = {}
    for node in ast.parse(bundle().decode()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return str(values["_S"]) + str(values["_B"])


BUNDLE_TEXT = bundle_text()


@functools.cache
def cached_text(python: str) -> str:
    """The text an entry must hold to be used: the bundle's and the interpreter's exact build."""
    version = subprocess.run(
        [python, "-S", "-c", "import sys; sys.stdout.write(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return BUNDLE_TEXT + version


def entry_name(python: str) -> str:
    return f"{zlib.crc32(cached_text(python).encode()):08x}.bin"


def cache_tag(python: str) -> str:
    return subprocess.run(
        [python, "-S", "-c", "import sys; print(sys.implementation.cache_tag or 'python')"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()


def entry_path(python: str, cache_home: Path) -> Path:
    return cache_home / "dflashops-agent" / cache_tag(python) / entry_name(python)


def env_for(home: Path, xdg: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    if xdg is not None:
        env["XDG_CACHE_HOME"] = xdg
    return env


def request(workdir: Path) -> bytes:
    return json.dumps({"action": "facts", "workdir": str(workdir)}).encode() + b"\n"


def start(
    python: str, home: Path, workdir: Path, xdg: str | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["bash", "-c", command(python)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env_for(home, xdg),
    )


def answer(proc: subprocess.Popen[bytes], workdir: Path, hostname: str | None = None) -> None:
    """The call succeeded, quietly, with the answer the agent's real code gives."""
    out, err = proc.communicate(bundle() + request(workdir), timeout=60)
    assert err == b"" and proc.returncode == 0, err.decode(errors="replace")
    data = json.loads(out)
    assert data["schema"] == 2 and data["action"] == "facts"
    assert data["hostname"] == (hostname or socket.gethostname())
    assert data["workdir"] == str(workdir) and data["workdir_exists"] is False
    assert data["errors"] == {}


def call(
    python: str, home: Path, workdir: Path, *, xdg: str | None = None, hostname: str | None = None
) -> None:
    answer(start(python, home, workdir, xdg), workdir, hostname)


def inspect(python: str, path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [python, "-S", "-c", INSPECT, str(path)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    got: dict[str, Any] = json.loads(out)
    return got


def assert_valid_entry(python: str, path: Path) -> None:
    """``path`` holds this bundle's text and every module's code, compiled under its name."""
    assert sorted(os.listdir(path.parent)) == [entry_name(python)]  # no .part left beside it
    got = inspect(python, path)
    assert got["text_sha256"] == hashlib.sha256(cached_text(python).encode()).hexdigest()
    assert got["modules"] == {name: f"<dflashops-agent>/{name}.py" for name in sources()}


def plant(python: str, path: Path, mode: str) -> None:
    source = REPO / "dflashops" / "agent" / "remote" / "facts.py"
    subprocess.run(
        [python, "-S", "-c", PLANT, str(path), "facts", str(source), PLANT_CODE, mode],
        check=True,
        timeout=30,
    )


def identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


@pytest.fixture
def home(tmp_path: Path) -> Path:
    folder = tmp_path / "home"
    folder.mkdir()
    return folder


# ------------------------------------------------------------------------------ a good cache


@pytest.mark.parametrize("python", PYTHONS)
def test_first_run_writes_the_entry(python: str, home: Path, tmp_path: Path) -> None:
    path = entry_path(python, home / ".cache")
    assert not (home / ".cache").exists()
    call(python, home, tmp_path / "wd")
    assert_valid_entry(python, path)


@pytest.mark.parametrize("python", PYTHONS)
def test_later_runs_read_the_entry(python: str, home: Path, tmp_path: Path) -> None:
    """A second run leaves the entry as it is (same inode: not rewritten), and the code it
    runs is the entry's: code planted in an entry with the right text is what answers."""
    path = entry_path(python, home / ".cache")
    call(python, home, tmp_path / "wd")
    written = identity(path)
    call(python, home, tmp_path / "wd")
    assert identity(path) == written
    plant(python, path, "same")
    planted = identity(path)
    call(python, home, tmp_path / "wd", hostname=PLANTED)
    assert identity(path) == planted


@pytest.mark.parametrize("python", PYTHONS)
def test_entry_of_another_text_is_not_used(python: str, home: Path, tmp_path: Path) -> None:
    """Same file name (a crc32 collision, or a damaged text), other text: its code is never
    run, and the entry is replaced by a good one."""
    path = entry_path(python, home / ".cache")
    call(python, home, tmp_path / "wd")
    plant(python, path, "other")
    stale = identity(path)
    call(python, home, tmp_path / "wd")
    assert identity(path)[0] != stale[0]  # replaced (os.replace: a new inode)
    assert_valid_entry(python, path)
    call(python, home, tmp_path / "wd")


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\xffnot marshal at all\x13\x37" * 10,
        b"TRUNCATED",  # replaced below by the first half of a real entry
        marshal.dumps(42),  # not a pair
        marshal.dumps(("x",)),  # a tuple, not a pair
        marshal.dumps(["another text", {"main": b"not code"}]),  # a pair, of another text
    ],
    ids=["empty", "garbage", "truncated", "int", "short-tuple", "other-text"],
)
def test_broken_entry_is_ignored_and_replaced(
    python: str, content: bytes, home: Path, tmp_path: Path
) -> None:
    path = entry_path(python, home / ".cache")
    if content == b"TRUNCATED":
        call(python, home, tmp_path / "wd")
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    call(python, home, tmp_path / "wd")
    assert_valid_entry(python, path)


# ------------------------------------------------------------------------------ no cache


@pytest.mark.parametrize("python", PYTHONS)
def test_unwritable_cache_location(python: str, tmp_path: Path) -> None:
    """HOME under a regular file: the cache folder cannot be made; the call is only slower."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder\n")
    home = blocker / "home"
    for _ in range(2):
        call(python, home, tmp_path / "wd")
    assert blocker.read_text() == "not a folder\n"
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_unwritable_xdg_cache_home(tmp_path: Path, home: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    call(ANY_PYTHON, home, tmp_path / "wd", xdg=str(blocker / "cache"))
    assert list(home.iterdir()) == []  # no fallback to ~/.cache either


def test_entry_path_taken_by_a_folder(tmp_path: Path, home: Path) -> None:
    """The entry can be neither read nor replaced: answers are still right, and quiet."""
    path = entry_path(ANY_PYTHON, home / ".cache")
    path.mkdir(parents=True)
    for _ in range(2):
        call(ANY_PYTHON, home, tmp_path / "wd")
    assert path.is_dir()
    assert sorted(os.listdir(path.parent)) == [path.name]  # no .part left by a failed write


# Cut one module's code in an entry whose text is right (a disk error, a partial copy).
DAMAGE = r"""
import marshal, sys
path = sys.argv[1]
with open(path, "rb") as f:
    text, codes = marshal.loads(f.read())
codes["facts"] = codes["facts"][: len(codes["facts"]) // 2]
with open(path, "wb") as f:
    f.write(marshal.dumps((text, codes)))
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_damaged_code_in_an_entry_with_the_right_text_is_compiled_again(
    python: str, home: Path, tmp_path: Path
) -> None:
    path = entry_path(python, home / ".cache")
    call(python, home, tmp_path / "wd")
    subprocess.run([python, "-S", "-c", DAMAGE, str(path)], check=True, timeout=30)
    for _ in range(2):  # every call, not only the first, answers right
        call(python, home, tmp_path / "wd")


def test_xdg_cache_home_is_used(tmp_path: Path, home: Path) -> None:
    xdg = tmp_path / "xdg"
    call(ANY_PYTHON, home, tmp_path / "wd", xdg=str(xdg))
    assert_valid_entry(ANY_PYTHON, entry_path(ANY_PYTHON, xdg))
    assert list(home.iterdir()) == []
    call(ANY_PYTHON, home, tmp_path / "wd", xdg="")  # empty: as if unset
    assert_valid_entry(ANY_PYTHON, entry_path(ANY_PYTHON, home / ".cache"))


# ------------------------------------------------------------------------------ several at once


def test_concurrent_first_runs(home: Path, tmp_path: Path) -> None:
    """Four agents racing to write the same entry: all answer, one whole entry is left."""
    procs = [start(ANY_PYTHON, home, tmp_path / "wd") for _ in range(4)]
    for proc in procs:
        answer(proc, tmp_path / "wd")
    assert_valid_entry(ANY_PYTHON, entry_path(ANY_PYTHON, home / ".cache"))


@unless(os.path.exists(SYSTEM_PYTHON), "no /usr/bin/python3")
def test_each_cache_tag_has_its_own_folder(home: Path, tmp_path: Path) -> None:
    """Two interpreters on one host: an entry per cache tag (one shared when the tags are
    the same, as for two builds of one Python version)."""
    pythons = [sys.executable, SYSTEM_PYTHON]
    for python in pythons:
        call(python, home, tmp_path / "wd")
    for python in pythons:
        call(python, home, tmp_path / "wd")
    files = {p.relative_to(home) for p in home.rglob("*") if p.is_file()}
    assert files == {entry_path(p, home / ".cache").relative_to(home) for p in pythons}


# Loads the bundle as the host does (serve, with no request: it returns at once), then raises
# inside one of its modules and prints the traceback.
TRACEBACK = r"""
import io, sys, traceback
data = sys.stdin.buffer.read()
sys.argv = ["-c"]
sys.stdin = io.TextIOWrapper(io.BytesIO(b'{"action": "serve"}\n'))
scope = {"__name__": "__main__"}
try:
    exec(compile(data, "<dflashops-agent>", "exec"), scope)
except SystemExit:
    pass
from dflashops_agent import common
try:
    common.integer("x", "units[0].port")
except Exception:
    print(traceback.format_exc())
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_tracebacks_show_the_agents_source_lines_on_a_hit_and_a_miss(
    python: str, home: Path
) -> None:
    """The sources are decoded only when asked (a cache hit needs none): tracebacks still
    show each line, from the loader's get_source."""
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    for _ in ("miss", "hit"):
        out = subprocess.run(
            [python, "-S", "-c", TRACEBACK],
            input=bundle(),
            capture_output=True,
            check=True,
            timeout=30,
            env=env,
        ).stdout.decode()
        assert 'File "<dflashops-agent>/common.py"' in out, out
        assert 'raise BadRequest(f"{what} must be an integer >= {minimum}")' in out, out
        assert "units[0].port must be an integer >= 0" in out
    assert (home / ".cache" / "dflashops-agent").is_dir()  # the second run was a hit


def test_the_bundle_is_built_once_when_every_host_thread_asks_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deploy's first agent call comes from every host thread together: one of them builds
    (compresses the sources), the others wait for its bytes."""
    from dflashops.agent import bundle as bundling

    built = []
    real = bundling.sources

    def counted() -> dict[str, str]:
        built.append(threading.get_ident())
        time.sleep(0.05)  # long enough that the other threads arrive while it builds
        return real()

    monkeypatch.setattr(bundling, "sources", counted)
    bundling._bundle.cache_clear()
    try:
        with ThreadPoolExecutor(16) as pool:
            got = set(pool.map(lambda _: bundling.bundle(), range(16)))
    finally:
        bundling._bundle.cache_clear()
    assert len(built) == 1 and len(got) == 1
