"""put/get for every connection kind, built on `run`, so both kinds share one verified path."""

from __future__ import annotations

import hashlib
import json
import shlex
from abc import ABC, abstractmethod
from functools import cache
from importlib import resources

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


@cache
def putmany_source() -> str:
    return resources.files("dflashops.payloads").joinpath("putmany.py").read_text()


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

    def put_many(
        self, files: list[tuple[bytes, str, int]], python: str, timeout: float | None = 600.0
    ) -> None:
        """Write several (data, path, mode) files in ONE round trip with the host's python;
        the same promise as ``put`` for each, and none is renamed unless all arrived intact."""
        if not files:
            return
        manifest = [
            {
                "path": path,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "mode": mode,
            }
            for data, path, mode in files
        ]
        command = [python, "-c", putmany_source(), json.dumps(manifest)]
        try:
            result = self.run(
                command, input=b"".join(data for data, _, _ in files), timeout=timeout
            )
        except CommandError as exc:
            paths = ", ".join(p for _, p, _ in files)
            raise TransferError(
                self.host,
                f"shipping {paths} failed, previous versions left in place: {exc.result.err.strip() or exc}",
            ) from None
        answer = result.out.strip().splitlines()[-1:] or [""]
        try:
            written = json.loads(answer[0]).get("written")
        except ValueError:
            written = None
        if written != [p for _, p, _ in files]:
            raise TransferError(
                self.host,
                f"the host did not confirm the files it was sent (got {result.out.strip()[:200]!r})",
            )

    def get(self, path: str, timeout: float | None = 120.0) -> bytes:
        """Read a file from the host (checked: a missing file raises, it does not return b'')."""
        return self.run(["cat", "--", path], timeout=timeout).stdout
