"""``bash -n`` on every rendered launch script, at fleet scale.

A fleet's scripts differ mostly in numbers: host ``gpu0417``, port ``30003``, GPU ``5``, the
fingerprint. Those differences cannot change whether a script parses, so each script is checked
in a *shape* where they are gone, and scripts of one shape are checked once. 1,000 hosts x 8
replicas of one service are one ``bash -n``, not 8,000.

The shape turns every digit into ``0`` and the unit's fingerprint into a constant. Digit for
digit keeps all that bash's grammar sees of a word: its length (line and column numbers stay),
whether it can be a name (assignments, ``NAME=(...)``, function names: the first character
stays a letter or a digit), whether it is all digits (a file-descriptor number before ``>``),
and whether it is a reserved word or a ``[[`` operator (those have no digits). The fingerprint
(hex) becomes a constant of its length, first-character class and digits-only-ness. A script
with a here-document (``<<``, whose delimiter is matched by *equality*) is checked as it is.

Results are kept by shape (see memo.py), the shapes not known are checked in parallel, one
``bash -n`` each, and a failing shape is re-checked on one real script for bash's exact message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflashops.preflight.memo import Passed, key

_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)")


def _fingerprint_constant(digest: str) -> str:
    """Same length, same first-character class, all digits exactly when the digest is."""
    if digest.isdigit():
        return "0" * len(digest)
    head = "a" if digest[0].isalpha() else "0"
    return head + "0" * (len(digest) - 2) + "a"


def shape(script: str, fingerprint: str = "") -> bytes:
    """The text checked in place of ``script`` (the script itself when a here-document is in
    it). Two scripts of one shape both parse or both fail."""
    # `in` first: the regex's look-behind makes it scan slowly, and most scripts have no `<<`.
    if "<<" in script and _HEREDOC.search(script):
        return script.encode()
    if fingerprint:
        script = script.replace(fingerprint, _fingerprint_constant(fingerprint))
    return script.encode().translate(_DIGITS)  # bytes: ~50x faster than str.translate


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str = ""  # bash's message (first line of stderr, without "bash: ")


def bash_identity() -> str:
    """Which bash decides: a new bash (path, size, mtime) is a new key for every result."""
    path = shutil.which("bash") or "bash"
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def bash_n(script: str) -> Verdict:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
    # bash -n exits 0 on some syntax errors (a malformed `[[ x ]`, say) and only prints them:
    # anything on stderr is a failure too.
    if proc.returncode == 0 and not proc.stderr.strip():
        return Verdict(True)
    return Verdict(False, proc.stderr.strip().replace("bash: ", "", 1))


def check_scripts(
    scripts: Sequence[tuple[str, str]], passed: Passed, workers: int | None = None
) -> list[Verdict]:
    """A verdict per (script, fingerprint), in order: one ``bash -n`` per shape not already
    known to pass, spread over the cores."""
    identity = bash_identity()
    shapes: dict[bytes, list[int]] = {}
    for i, (script, fingerprint) in enumerate(scripts):
        shapes.setdefault(shape(script, fingerprint), []).append(i)
    keys = {s: key("bash-syntax", identity, s) for s in shapes}
    todo = [s for s in shapes if keys[s] not in passed]
    found: dict[bytes, Verdict] = {}
    if todo:
        with ThreadPoolExecutor(max(1, min(workers or os.cpu_count() or 1, len(todo)))) as pool:
            texts = (t.decode() for t in todo)
            found = dict(zip(todo, pool.map(bash_n, texts), strict=True))
    verdicts: list[Verdict] = [Verdict(True)] * len(scripts)
    for s, members in shapes.items():
        got = found.get(s)
        if got is None or got.ok:
            passed.add(keys[s])
            continue
        # The shape failed: bash's words for one real script (its tokens, not the shape's).
        exact = bash_n(scripts[members[0]][0])
        if exact.ok:  # cannot happen if the shape is right; never pass on a doubt
            exact = Verdict(False, f"{got.detail} (in its normalized form)")
        for i in members:
            verdicts[i] = exact
    return verdicts
