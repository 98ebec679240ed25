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
import zlib
from functools import cache
from importlib import resources

from dflashops.hosts.connection import host_word

PACKAGE = "dflashops_agent"

# Runs on the host (Python 3.9+). Modules are compiled only when imported, so a call pays for
# the code it uses; their source is registered with linecache so tracebacks show it.
BOOTSTRAP = r"""
import sys
def _dflashops_agent():
    import base64, importlib.abc, importlib.util, json, linecache, zlib
    sources = json.loads(zlib.decompress(base64.b85decode(_S)).decode("utf-8"))
    top = "PACKAGE"
    def key(name):
        return "__init__" if name == top else name[len(top) + 1:]
    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if (name == top or name.startswith(top + ".")) and key(name) in sources:
                return importlib.util.spec_from_loader(name, self, is_package=name == top)
            return None
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            text = sources[key(module.__name__)]
            filename = "<dflashops-agent>/%s.py" % key(module.__name__)
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
            exec(compile(text, filename, "exec"), module.__dict__)
    sys.meta_path.insert(0, Finder())
    import dflashops_agent
    dflashops_agent.BUNDLE = "_S = %r\n_B = %r\nexec(_B)\n" % (_S, _B)
    from dflashops_agent.main import main
    return main(sys.argv[1:])
sys.exit(_dflashops_agent())
""".replace("PACKAGE", PACKAGE)

# The command line: read exactly the bundle from stdin and run it; the request follows it.
LOADER = "import sys;exec(compile(sys.stdin.buffer.read({size}),'<dflashops-agent>','exec'))"


def sources() -> dict[str, str]:
    folder = resources.files("dflashops.agent.remote")
    return {
        entry.name.removesuffix(".py"): entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".py")
    }


@cache
def bundle() -> bytes:
    """The agent file's bytes (built once per controller process)."""
    packed = zlib.compress(json.dumps(sources(), sort_keys=True).encode(), 9)
    blob = base64.b85encode(packed).decode()
    # Byte for byte what the bootstrap rebuilds on the host ("_S = %r\n_B = %r\n...").
    text = f"_S = {blob!r}\n_B = {BOOTSTRAP!r}\nexec(_B)\n"
    return text.encode()


def digest() -> str:
    return hashlib.sha256(bundle()).hexdigest()


def command(python: str) -> str:
    return f"{host_word(python)} -c {shlex.quote(LOADER.format(size=len(bundle())))}"
