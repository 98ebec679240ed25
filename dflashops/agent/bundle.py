"""The host agent as one self-contained file: every module of ``dflashops.agent.remote``,
compressed, behind a small bootstrap that imports them from memory (Ansible's and Mitogen's
lesson: helpers live in one place, and each remote call is still one stdlib file).

The file is ``_S = '<modules>'``, ``_B = '<bootstrap>'``, ``exec(_B)``. It is piped to the
host's python on stdin, ahead of the request (``command``), so nothing is installed on the host
and the command line stays short. On the host the package is ``dflashops_agent``; the bootstrap
also rebuilds the file's exact text so ``start`` can leave a copy for supervisors to run from.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import threading
import zlib
from functools import cache
from importlib import resources

from dflashops.hosts.connection import host_word

PACKAGE = "dflashops_agent"
CACHE_KEEP = 8  # code cache entries kept per interpreter tag (a host sees many versions)

# Runs on the host (Python 3.9+), and runs on every call, so it stays cheap: C-speed decoding
# (base64's b85 is pure Python), no importlib.abc (it drags in importlib.resources). Compiling
# the modules is most of a call's own cost, so their code objects are kept in the host's cache
# (~/.cache/dflashops-agent/<python tag>/<crc>.bin, marshal of (sources blob, {module: marshalled
# code}), each module's code unmarshalled only when imported):
# an entry is used only when its text equals this bundle's, so a stale or colliding entry is
# never run; a cache that cannot be read or written is only slower. A miss writes an entry and
# keeps only the newest CACHE_KEEP (entries are read whole at a call's start: deleting one never
# disturbs a running call; it only makes an old controller's next call compile again).
BOOTSTRAP = r"""
import sys
def _dflashops_agent():
    import binascii, json, marshal, os, zlib
    from importlib.machinery import ModuleSpec
    box = []
    def texts():  # decoded only for a compile or a traceback's lines: a cache hit needs none
        if not box:
            box.append(json.loads(zlib.decompress(binascii.a2b_base64(_S)).decode("utf-8")))
        return box[0]
    top = "PACKAGE"
    codes = None
    def prune(folder, now):  # after a miss: the newest KEEP entries stay, and no stale part
        found = []
        for name in os.listdir(folder):
            try:
                p = os.path.join(folder, name)
                mtime = os.stat(p).st_mtime
                if name.endswith(".bin"):
                    found.append((mtime, p))
                elif name.endswith(".part") and now - mtime > 3600:
                    os.unlink(p)  # left by a call killed while writing
            except OSError:
                pass
        for _, p in sorted(found, reverse=True)[KEEP:]:
            try:
                os.unlink(p)
            except OSError:
                pass
    tag = sys.implementation.cache_tag or "python"
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    # The modules, this loader and the exact interpreter build (builds that share a cache tag
    # may not share bytecode): an entry made for anything else never matches.
    me = _S + _B + sys.version
    path = os.path.join(home, "dflashops-agent", tag, "%08x.bin" % zlib.crc32(me.encode()))
    try:
        with open(path, "rb") as f:
            blob, found = marshal.loads(f.read())
        if blob == me:
            codes = found
    except Exception:
        pass
    if codes is None:
        codes = {}
        for name, text in texts().items():
            code = compile(text, "<dflashops-agent>/%s.py" % name, "exec")
            codes[name] = marshal.dumps(code)
        part = "%s.%d.part" % (path, os.getpid())
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(part, "wb") as f:
                f.write(marshal.dumps((me, codes)))
            os.replace(part, path)
        except Exception:
            try:
                os.unlink(part)
            except Exception:
                pass
        else:
            prune(os.path.dirname(path), os.stat(path).st_mtime)
    def key(name):
        return "__init__" if name == top else name[len(top) + 1:]
    class Finder:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if (name == top or name.startswith(top + ".")) and key(name) in codes:
                return ModuleSpec(name, cls, is_package=name == top)
            return None
        @classmethod
        def create_module(cls, spec):
            return None
        @classmethod
        def get_source(cls, fullname):  # what tracebacks show (linecache asks the loader)
            return texts()[key(fullname)]
        @classmethod
        def exec_module(cls, module):
            name = key(module.__name__)
            try:
                code = marshal.loads(codes[name])
            except Exception:  # a damaged entry whose text matched: compile this once more
                code = compile(texts()[name], "<dflashops-agent>/%s.py" % name, "exec")
            exec(code, module.__dict__)
    sys.meta_path.insert(0, Finder)
    import dflashops_agent
    dflashops_agent.BUNDLE = "_S = %r\n_B = %r\nexec(_B)\n" % (_S, _B)
    from dflashops_agent.main import main
    return main(sys.argv[1:])
sys.exit(_dflashops_agent())
""".replace("PACKAGE", PACKAGE).replace("KEEP", str(CACHE_KEEP))

# The command line: read exactly the bundle from stdin and run it; the request follows it.
LOADER = "import sys;exec(compile(sys.stdin.buffer.read({size}),'<dflashops-agent>','exec'))"


def sources() -> dict[str, str]:
    folder = resources.files("dflashops.agent.remote")
    return {
        entry.name.removesuffix(".py"): entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".py")
    }


_building = threading.Lock()


def bundle() -> bytes:
    """The agent file's bytes, built once per controller process: every host thread asks for it
    at once on a deploy's first call, and ``functools.cache`` alone let each of them compress
    the sources again (up to 15 of 16 threads did, 0.4 s of controller CPU)."""
    with _building:
        return _bundle()


@cache
def _bundle() -> bytes:
    packed = zlib.compress(json.dumps(sources(), sort_keys=True).encode(), 9)
    blob = base64.b64encode(packed).decode()
    # Byte for byte what the bootstrap rebuilds on the host ("_S = %r\n_B = %r\n...").
    text = f"_S = {blob!r}\n_B = {BOOTSTRAP!r}\nexec(_B)\n"
    return text.encode()


def digest() -> str:
    return hashlib.sha256(bundle()).hexdigest()


def command(python: str) -> str:
    # -S: no site module (the agent is stdlib only): a few ms less per call, paid on every call.
    return f"{host_word(python)} -S -c {shlex.quote(LOADER.format(size=len(bundle())))}"
