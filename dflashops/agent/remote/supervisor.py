"""The unit's supervisor: session leader of the unit, runs ``launch.sh``, records how it ended,
and heals it on the host (DESIGN.md "Days of running"), with no controller needed.

Run as ``python -S WORKDIR/agent/<sha>.py supervise UNIT_DIR KEEP_LOGS`` by ``start``. Its pid is
the recorded pid and pgid, which makes the unit's process group provable. It reads its policy
from ``unit.json`` (``supervise``: restart, backoff, limit, liveness, stop_grace):

- When launch.sh ends (or liveness fails) and the policy says so, the crash is recorded, the
  unit's other processes are ended (they are in its group), and after the backoff (doubling from
  ``initial`` to ``max``) and once nvidia-smi no longer lists the crashed processes, launch.sh
  runs again with a new log. More than ``limit.count`` restarts within ``limit.window``: the
  unit is ``crashed`` and stays down.
- Liveness: once the unit has answered its probe path once, ``failures`` failed probes in a
  row end it as a crash would be ended (TERM, grace, KILL) and it restarts.
- ``stop`` writes ``stop-requested`` before it signals: the supervisor never starts the unit
  again after that, whatever it was doing (waiting out a backoff, or seeing a crash).
- Each restart and the give-up are posted to the host's webhook (WORKDIR/notify.json, 0600),
  with the log's last lines and no secret in them; a webhook that fails is logged, never waited on.

Its TERM/INT/HUP handlers do nothing, so the group-wide TERM of stop does not end it before it
has recorded how the engine ended. Handlers, unlike SIG_IGN, are reset by exec, so bash and the
engine still die on TERM. KILL takes everything down; stop then records the stop itself.
State for ``status`` is in ``supervisor.json``: state, child, restarts, the last crashes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

from . import gpu, layout, logpump, logs, procfs, web
from .common import SMALL_FILE_MAX, Json, describe, now_iso, read_json_object, write_json_atomic

TYPE_CHECKING = False  # see common.py
if TYPE_CHECKING:
    from typing import Any

STOP_MARK = "stop-requested"
HISTORY = 20
TAIL_LINES = 30
NOTIFY_TIMEOUT = 10.0
GPU_TIMEOUT = 60.0
PUMP_WAIT = 2.0  # s for a run's output to be copied once it ended
RETRY_S = 5.0  # s between tries of records a full disk refused
FINAL_RETRY_S = 60.0  # s the supervisor keeps trying them once the unit ended


UNSAID_MAX = 50
_unsaid: list[bytes] = []  # lines a full disk refused: said first once it takes them


def say(line: str, who: str = "supervisor: ") -> None:
    """A line into the unit's log (fd 1). A full disk never ends the supervisor: the line waits
    (the last UNSAID_MAX do) and is written with the next one that gets through."""
    _unsaid.append(f"[dflashops] {who}{line}\n".encode())
    try:
        while _unsaid:
            logpump.write_fd(1, _unsaid[0])
            _unsaid.pop(0)
    except OSError:
        del _unsaid[:-UNSAID_MAX]


class Supervisor:
    def __init__(self, folder: str, keep_logs: int) -> None:
        self.folder = folder
        self.keep_logs = keep_logs
        record = read_json_object(os.path.join(folder, layout.UNIT_RECORD)) or {}
        self.name = str(record.get("unit") or os.path.basename(folder))
        self.policy: Json = record.get("supervise") or {}
        self.term_leader = record.get("stop_signal_to") == "leader"  # see stop.leader_to_term
        self.restarts = 0
        self.streak = 0  # crashes in a row (a run longer than the backoff's max ends a streak)
        self.history: list[Json] = []
        self.child: subprocess.Popen[bytes] | None = None
        self.liveness_failed = threading.Event()
        self.notices: list[threading.Thread] = []
        self.pump = logpump.Pump(folder, keep_logs, logpump.max_bytes(self.policy))
        self.unsaved: dict[str, Json] = {}  # records a full disk refused, written again later

    # -- state -------------------------------------------------------------------------------

    def stop_requested(self) -> bool:
        return os.path.exists(os.path.join(self.folder, STOP_MARK))

    def state(self, state: str, **extra: Any) -> None:
        body = {
            "state": state,
            "since": now_iso(),
            "child_pid": self.child.pid if self.child is not None else None,
            "restarts": self.restarts,
            "history": self.history[-HISTORY:],
            **extra,
        }
        self.save(layout.SUPERVISOR, body)

    def save(self, filename: str, body: Json) -> None:
        """Write a record of the unit; when the disk refuses (full), supervise on, say so once,
        and write it again later (``retry``): the child is never left for a record."""
        try:
            write_json_atomic(os.path.join(self.folder, filename), body)
        except OSError as exc:
            if filename not in self.unsaved:
                say(f"cannot write {filename} ({describe(exc)}); supervising on, retrying")
            self.unsaved[filename] = body
            return
        if self.unsaved.pop(filename, None) is not None:
            say(f"{filename} written again")

    def retry(self) -> None:
        for filename, body in list(self.unsaved.items()):
            if self.unsaved.get(filename) is body:
                self.save(filename, body)

    # -- one run of launch.sh ----------------------------------------------------------------

    def run_once(self) -> Json:
        record: Json = {"code": None, "signal": None, "finished_at": None, "child_pid": None}
        out = self.pump.open()  # the run's output goes through the supervisor: see logpump
        child = None
        try:
            child = subprocess.Popen(
                ["bash", layout.LAUNCH],
                cwd=self.folder,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        except OSError as exc:
            say(f"cannot run launch.sh: {exc}")
            record["code"] = 127
        finally:
            os.close(out)  # held by the unit's processes alone: the pipe ends when they do
        if child is not None:
            self.child = child
            record["child_pid"] = child.pid
            self.state("running")
            self.liveness_failed.clear()
            watch = self.watch_liveness()
            rc = self.wait_child(child)
            if watch is not None:
                watch.set()
            self.pump.join(PUMP_WAIT)  # its last lines before ours (unless it left writers)
            if rc < 0:
                try:
                    record["signal"] = signal.Signals(-rc).name
                except ValueError:
                    record["signal"] = f"SIG{-rc}"
                record["code"] = 128 - rc
            else:
                record["code"] = rc
        record["finished_at"] = now_iso()
        if self.liveness_failed.is_set():
            record["reason"] = "liveness"
        return record

    def retry_until_saved(self) -> None:
        """Before the supervisor ends: records a full disk refused get a while more (without
        them, status cannot tell how the unit ended), unless stop asks it to go."""
        deadline = time.monotonic() + FINAL_RETRY_S
        while self.unsaved and time.monotonic() < deadline and not self.stop_requested():
            time.sleep(1.0)
            self.retry()
        if self.unsaved:
            say(f"gave up writing {' '.join(sorted(self.unsaved))}: the disk is still full")

    def wait_child(self, child: subprocess.Popen[bytes]) -> int:
        """Its exit code; records a full disk refused are written again meanwhile."""
        while True:
            try:
                return child.wait(RETRY_S)
            except subprocess.TimeoutExpired:
                self.retry()

    def watch_liveness(self) -> threading.Event | None:
        spec = self.policy.get("liveness")
        if not spec or not spec.get("port"):
            return None
        done = threading.Event()
        threading.Thread(target=self._liveness, args=(spec, done), daemon=True).start()
        return done

    def probe_headers(self, spec: Json) -> Json:
        """The probe's headers; secret_args' api-key read from the unit's own 0600 file (each
        probe: a deploy may have rotated it), never from unit.json."""
        headers = dict(spec.get("headers") or {})
        bearer = spec.get("bearer")
        if isinstance(bearer, dict) and bearer.get("file") in layout.SECRET_FILES:
            key = secret_file(self.folder, bearer["file"]).get(str(bearer.get("name")))
            if key:
                headers["Authorization"] = f"Bearer {key}"
        return headers

    def _liveness(self, spec: Json, done: threading.Event) -> None:
        """Probe once the unit has answered once; `failures` in a row end it."""
        answered, failures = False, 0
        while not done.wait(float(spec["interval"]) if answered else 1.0):
            got = web.request(
                spec.get("host") or "127.0.0.1",
                int(spec["port"]),
                spec["path"],
                timeout=float(spec["timeout"]),
                headers=self.probe_headers(spec),
            )
            ok = got["status"] == 200
            if ok:
                answered, failures = True, 0
                continue
            if not answered:
                continue  # still starting: readiness is deploy's business, not liveness'
            failures += 1
            say(
                f"liveness {spec['path']} failed ({got['error'] or got['status']}), {failures} of {spec['failures']}"
            )
            if failures >= int(spec["failures"]):
                self.liveness_failed.set()
                self.notify("liveness_failed", {"code": None, "signal": None})
                self.end_child(float(self.policy.get("stop_grace") or 30))
                return

    # -- ending what is left -------------------------------------------------------------------

    def others(self) -> list[int]:
        """Live processes of the unit's group (the supervisor's), but the supervisor."""
        me = os.getpid()
        groups, _ = procfs.scan({me}, set())
        return [pid for pid, _, _ in groups.get(me, []) if pid != me]

    def end_child(self, grace: float) -> None:
        """TERM the unit's processes, KILL what is left after the grace: never ourselves."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            pids = self.others()
            child = self.child.pid if self.child is not None else None
            if sig == signal.SIGTERM and self.term_leader and child in pids:
                pids = [child]  # it ends its own children in order
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while self.others() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.others():
                return

    # -- notices -----------------------------------------------------------------------------

    def notify(self, event: str, record: Json) -> None:
        """POST the event to the host's webhook in the background; failures are logged."""
        try:
            target = (
                read_json_object(
                    os.path.join(os.path.dirname(os.path.dirname(self.folder)), layout.NOTIFY)
                )
                or {}
            )
        except (OSError, ValueError):
            target = {}
        url = target.get("webhook")
        if not url:
            return
        secrets = [url, *secret_values(self.folder)]
        tail = logs.tail_lines(self.folder, TAIL_LINES) or []
        body = {
            "host": target.get("host"),
            "unit": self.name,
            "event": event,
            "exit_code": record.get("code"),
            "signal": record.get("signal"),
            "restarts": self.restarts,
            "at": now_iso(),
            "log_tail": redact_lines(tail, secrets),
        }
        thread = threading.Thread(target=self._post, args=(url, body), daemon=True)
        thread.start()
        self.notices.append(thread)

    def _post(self, url: str, body: Json) -> None:
        got = web.post_json(url, body, NOTIFY_TIMEOUT)
        if got["status"] is None or not 200 <= int(got["status"]) < 300:
            why = got["error"] or f"HTTP {got['status']}"
            say(f"webhook for {body['event']} failed: {why} (the unit is not held up by it)")
            line = json.dumps({"at": now_iso(), "event": body["event"], "error": why})
            with open(os.path.join(self.folder, "notify.log"), "a") as f:
                f.write(line + "\n")

    # -- the loop --------------------------------------------------------------------------------

    def backoff(self, ran: float) -> float:
        """initial, doubling with each crash in a row, at most max."""
        initial, top = (float(x) for x in self.policy.get("backoff") or (10.0, 300.0))
        self.streak = 1 if ran > top else self.streak + 1
        return float(min(top, initial * 2 ** (self.streak - 1)))

    def gave_up(self) -> bool:
        """More crashes within the window than restarts allowed."""
        count, window = self.policy.get("limit") or (5, 3600.0)
        now = time.time()
        return sum(1 for h in self.history if now - h["t"] <= float(window)) > int(count)

    def should_restart(self, record: Json) -> bool:
        policy = self.policy.get("restart") or "no"
        if self.stop_requested() or policy == "no":
            return False
        return policy == "always" or record.get("reason") == "liveness" or record["code"] != 0

    def wait(self, seconds: float) -> bool:
        """Sleep, but stop waiting at once when stop asks; True when it did."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_requested():
                return True
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.stop_requested()

    def run(self) -> int:
        while True:
            started = time.monotonic()
            record = self.run_once()
            how = f"killed by {record['signal']}, " if record["signal"] else ""
            reason = " after failing liveness" if record.get("reason") == "liveness" else ""
            say(
                f"launch.sh ended ({how}exit code {record['code']}){reason} at {record['finished_at']} after {time.monotonic() - started:.1f}s",
                who="",
            )
            self.save(layout.EXIT, record)
            if not self.should_restart(record):
                break
            seen = {record["child_pid"], *self.others()} - {None}
            self.end_child(float(self.policy.get("stop_grace") or 30))
            self.history.append({**record, "t": time.time(), "at": record["finished_at"]})
            if self.gave_up():
                count, window = self.policy.get("limit") or (5, 3600)
                say(f"more than {count} restarts within {window:g}s: crashed, no more restarts")
                self.state("crashed")
                self.save("crashed", {"at": now_iso(), "restarts": self.restarts, "last": record})
                self.notify("gave_up", record)
                break
            delay = self.backoff(time.monotonic() - started)
            self.state("backoff", next_start_in=delay)
            say(f"restarting in {delay:g}s")
            if self.wait(delay):
                break
            self.state("waiting-gpu")
            freed = gpu.wait_released({int(p) for p in seen}, GPU_TIMEOUT, self.stop_requested)
            if freed["freed"] is False:
                say(
                    f"GPU memory still held after {GPU_TIMEOUT:g}s: {gpu.held_text(freed['held'])}; restarting anyway"
                )
            if self.stop_requested():
                break
            self.pump.finish(PUMP_WAIT)  # the previous run's output stays in its log
            name = self.pump.new_log(carry=False)
            self.restarts += 1
            where = f"this log is logs/{name}" if name else "no new log (disk full?): same log"
            say(f"restart {self.restarts} (the previous run's log is kept); {where}")
            self.notify("restarted", record)
        crashed = "crashed" in self.unsaved or os.path.exists(os.path.join(self.folder, "crashed"))
        self.state("crashed" if crashed else "ended")
        self.pump.finish(PUMP_WAIT)
        self.retry_until_saved()
        for thread in self.notices:
            thread.join(NOTIFY_TIMEOUT + 1)
        return 0


def secret_file(folder: str, name: str) -> Json:
    """NAME -> value in one of the unit's secret files ({} when absent or not ours to read):
    shell assignments (a quoted value may span lines), or the engine's --config in JSON form."""
    import shlex
    import stat

    try:
        # Not a FIFO left in its place (opening one would hang), not a link out of the folder.
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        text = f.read(SMALL_FILE_MAX).decode("utf-8", "replace")
    if name.endswith(".yaml"):
        try:
            data = json.loads(text)
        except ValueError:
            return {}
        return (
            {str(k): v for k, v in data.items() if isinstance(v, str)}
            if isinstance(data, dict)
            else {}
        )
    out: Json = {}
    try:
        words = shlex.split(text)  # the whole file: one value over several lines stays whole
    except ValueError:  # a damaged file: what each line still gives
        words = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                words.extend(shlex.split(line))
    for word in words:
        key, eq, value = word.partition("=")
        if eq:
            out[key] = value
    return out


def secret_values(folder: str) -> list[str]:
    """The unit's secret values (secret_env's and secret_args'): never in a notice."""
    return [
        v for name in layout.SECRET_FILES for v in secret_file(folder, name).values() if len(v) >= 4
    ]


def redact_lines(lines: list[str], secrets: list[str]) -> list[str]:
    """The lines with every secret taken out whole, one spanning lines too; each line of a
    multi-line secret also goes on its own (the tail may begin inside the value)."""
    text = "\n".join(lines)
    pieces = set(secrets)
    for secret in secrets:
        parts = secret.splitlines()
        if len(parts) > 1:
            pieces.add("\n".join(parts))  # as the lines were split: \r\n reads as \n
            pieces.update(p for p in parts if len(p) >= 4)
    for piece in sorted(pieces, key=len, reverse=True):
        if piece:
            text = text.replace(piece, "***")
    return text.split("\n")


def main(folder: str, keep_logs: int = 20) -> int:
    def ignore(signum: int, frame: Any) -> None:
        pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, ignore)
    try:
        return Supervisor(folder, keep_logs).run()
    except Exception as exc:  # the unit's own records must say what happened to it
        say(f"failed: {describe(exc)}")
        with contextlib.suppress(OSError):  # a full disk: the log line above is what is left
            write_json_atomic(
                os.path.join(folder, layout.EXIT),
                {
                    "code": 70,
                    "signal": None,
                    "finished_at": now_iso(),
                    "child_pid": None,
                    "reason": describe(exc),
                },
            )
        return 70
