"""put/get for every connection kind, built on `run`, so both kinds share one verified path."""

from __future__ import annotations

import hashlib
import shlex
from abc import ABC, abstractmethod

from dflashops.errors import TransferError
from dflashops.hosts.connection import Command, CommandError, Result

# Runs on the host under sh. The content arrives on stdin and lands in a temporary file in the
# target's own directory (so the final rename is atomic on one filesystem). The trap removes the
# temporary file on every exit path: a dropped connection ends stdin early, the hash then differs
# and nothing is renamed. The previous version is kept as NAME.prev (hard link: no copy).
PUT_SCRIPT = r"""
set -u
dst=$1; want=$2; mode=$3
dir=$(dirname -- "$dst"); base=$(basename -- "$dst")
mkdir -p -- "$dir" || { echo "cannot create directory $dir" >&2; exit 3; }
tmp=$(mktemp "$dir/.$base.dflashops-tmp.XXXXXX") || { echo "cannot create a temporary file in $dir" >&2; exit 3; }
trap 'rm -f -- "$tmp"' EXIT
trap 'exit 129' HUP INT TERM PIPE
cat > "$tmp" || { echo "writing $tmp failed (disk full?)" >&2; exit 4; }
got=$(sha256sum -- "$tmp" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "sha256 mismatch on the host: got ${got:-nothing}, sent $want" >&2; exit 5; }
chmod "$mode" "$tmp" || exit 6
if [ -e "$dst" ]; then ln -f -- "$dst" "$dst.prev" 2>/dev/null || cp -p -- "$dst" "$dst.prev" || exit 7; fi
mv -f -- "$tmp" "$dst" || exit 8
trap - EXIT
echo "ok $got"
"""


class BaseConnection(ABC):
    host: str
    commands: int = 0  # remote commands run: the round trips that tests and benchmarks count

    @abstractmethod
    def run(
        self,
        command: Command,
        *,
        input: bytes | None = None,
        timeout: float | None = 60.0,
        check: bool = True,
    ) -> Result: ...

    @abstractmethod
    def close(self) -> None: ...

    def put(self, data: bytes, path: str, mode: int = 0o644, timeout: float | None = 300.0) -> str:
        """Write ``data`` to ``path`` on the host, verified and atomic; returns the sha256.

        Either the new content is in place with the right hash, or the old file is untouched,
        no temporary file is left, and TransferError says why."""
        want = hashlib.sha256(data).hexdigest()
        command = (
            f"sh -c {shlex.quote(PUT_SCRIPT)} dflashops-put {shlex.quote(path)} {want} {mode:o}"
        )
        try:
            result = self.run(command, input=data, timeout=timeout)
        except CommandError as exc:
            raise TransferError(
                self.host,
                f"shipping {path} failed, previous version left in place: {exc.result.err.strip() or exc}",
            ) from None
        if result.out.strip() != f"ok {want}":
            raise TransferError(
                self.host,
                f"shipping {path}: the host did not confirm the write (got {result.out.strip()!r})",
            )
        return want

    def get(self, path: str, timeout: float | None = 120.0) -> bytes:
        """Read a file from the host (checked: a missing file raises, it does not return b'')."""
        return self.run(["cat", "--", path], timeout=timeout).stdout
