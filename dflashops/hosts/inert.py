"""Host text made inert before a terminal sees it (DESIGN.md "Trust boundary" 2).

A unit's log, an agent's stderr, a progress file: whatever a host sends may hold escape
sequences that retitle the operator's terminal, rewrite what it shows, or worse. ``inert``
removes control characters other than newline and tab: whole escape sequences (CSI, OSC and
other string sequences, two-character escapes, in their 7-bit and C1 forms), then any C0, DEL
or C1 character left. The printable text around them stays, so a coloured log still reads.
"""

from __future__ import annotations

import re

# A CSI: ESC [ (or C1 CSI), parameter bytes, intermediate bytes, a final byte.
_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
# OSC, DCS, SOS, PM, APC: a string up to its terminator (BEL, ST), or to the end of the line
# when unterminated (a terminal would swallow it; a log's next lines must stay readable).
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
# Any other escape: ESC, intermediate bytes, a final byte (charset switches, cursor saves...).
_OTHER = r"\x1b[ -/]*[0-~]?"
_SEQUENCES = re.compile(f"{_CSI}|{_STRING}|{_OTHER}")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """``text`` without control characters but newline and tab (escape sequences removed whole)."""
    if _CONTROLS.search(text) is None:  # the common case: nothing to do, no copy
        return text
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))
