"""Write several files on a host in one round trip, each verified and atomic (stdlib, 3.9+).

Run as `PYTHON -c "$(this source)" MANIFEST_JSON` with the files' bytes, concatenated in
manifest order, on stdin. MANIFEST_JSON: [{"path", "size", "sha256", "mode"}, ...].

Every file lands first in a temporary file in its own directory; only when ALL of them arrived
with the right sha256 are they renamed into place (keeping the previous version as NAME.prev).
If stdin ends early (a dropped connection), a hash differs or a write fails (a full disk),
nothing is renamed, every temporary file is removed, and the exit status says why:
3 bad manifest, 4 write failed, 5 input ended early or hash mismatch, 6 rename failed.
Prints {"ok": true, "written": [paths]} on success.
"""

import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile


class Stop(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


INTERRUPTED = []


def _raise_on_signal(signum, _frame):
    # Default handlers would end the process without cleaning up its temporary files. Raise only
    # once: an exception raised by a later signal could land inside the cleanup and abort it.
    if not INTERRUPTED:
        INTERRUPTED.append(signum)
        raise Stop(5, f"interrupted by signal {signum}")


def receive(entry, src, tmps):
    path = entry["path"]
    folder = os.path.dirname(path) or "."
    prefix = "." + os.path.basename(path) + ".dflashops-tmp."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    except OSError as exc:
        raise Stop(4, f"cannot write in {folder}: {exc}") from None
    tmps.append(tmp)
    digest = hashlib.sha256()
    left = int(entry["size"])
    try:
        with os.fdopen(fd, "wb") as out:
            while left:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    raise Stop(5, f"input ended {left} bytes early in {path} (connection lost?)")
                out.write(chunk)
                digest.update(chunk)
                left -= len(chunk)
        os.chmod(tmp, int(entry["mode"]))
    except OSError as exc:
        raise Stop(4, f"writing {path} failed (disk full?): {exc}") from None
    got = digest.hexdigest()
    if got != entry["sha256"]:
        raise Stop(5, f"sha256 mismatch on the host for {path}: got {got}, sent {entry['sha256']}")
    return tmp


def install(entry, tmp):
    path = entry["path"]
    try:
        if os.path.exists(path):
            prev = path + ".prev"
            if os.path.lexists(prev):
                os.unlink(prev)
            os.link(path, prev)
        os.replace(tmp, path)
    except OSError as exc:
        raise Stop(6, f"installing {path} failed: {exc}") from None


def main(argv):
    # SIGPIPE stays ignored (Python's default): a write to a dropped connection raises
    # BrokenPipeError where it happens instead of an exception at an arbitrary later point.
    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_on_signal)
    tmps = []
    try:
        try:
            manifest = json.loads(argv[1])
            if not isinstance(manifest, list):
                raise ValueError("manifest is not a list")
        except (IndexError, ValueError) as exc:
            raise Stop(3, f"bad manifest: {exc}") from None
        src = sys.stdin.buffer
        received = [receive(entry, src, tmps) for entry in manifest]
        for entry, tmp in zip(manifest, received):
            install(entry, tmp)
            tmps.remove(tmp)
        sys.stdout.write(json.dumps({"ok": True, "written": [e["path"] for e in manifest]}) + "\n")
        return 0
    except Stop as exc:
        with contextlib.suppress(OSError):  # nobody may be listening any more
            sys.stderr.write(f"putmany: {exc}\n")
            sys.stderr.flush()
        return exc.code
    finally:
        INTERRUPTED.append(0)  # from here on, signals no longer raise
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
