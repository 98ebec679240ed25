"""Samples of the fleet in SQLite: ``.dflashops/samples.sqlite`` beside the inventory.

One row per unit per sample in ``points`` (WITHOUT ROWID, keyed by time then series, so a
window of time is one range of the table and the age limit one range delete). Plots over
long windows read coarser copies made as time passes (``LEVELS``: 10 s, 1 min, 5 min, 30 min):
averages of the numbers, a state seen in the bucket, the most restarts. A plot asks for about
``POINTS`` points per unit and reads the coarsest copy fine enough for that, then the finer
ones for the time since that copy's last bucket, so it reaches now. Full resolution (and the
10 s copy) is kept for a day (``RAW_S``, or less with a shorter ``keep``); the other copies
and the events for ``keep`` (7 days by default). Several writers (dashboard, watch) may share
the file: WAL mode, a busy timeout, and every write idempotent (INSERT OR REPLACE). Jobs' own
metrics (one row per job, metric and sample: ``job_points``) are kept the same way, with one
coarse copy (minute averages, ``job_m1``) for ``keep``.

A file that is not a database, or is damaged, or stays locked past the busy timeout, is moved
aside (``samples.sqlite.corrupt-UTC``, with its -wal and -shm) and a new one is started;
``notes`` says so in one line.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from dflashops.dashboard.sample import Event, Sample, UnitSample

FILE = "samples.sqlite"
STORE_SCHEMA = 1  # PRAGMA user_version: another one is started anew (moved aside)
RAW_S = 86400.0  # full resolution kept this long (at most ``keep``)
BUSY_MS = 5000
# Numbers kept per unit and sample, in UnitSample's names; `state` and `restarts` too.
NUMBERS = ("tok_s", "running", "queued", "kv", "gpu", "gpu_mem", "done", "total", "rate", "eta")
POINTS = 300  # a plot's points per unit, about
# Coarse copies, finest first: (table, bucket in seconds, the table it is made from, kept only
# as long as full resolution).
LEVELS = (
    ("s10", 10, "points", True),
    ("m1", 60, "s10", False),
    ("m5", 300, "m1", False),
    ("m30", 1800, "m5", False),
)
COLUMNS = ("t", "series", "state", "restarts", *NUMBERS)
# Jobs' own metrics (UnitSample.metrics): full resolution in `job_points` for the day, like
# `points`; one coarse copy (minute averages) for ``keep``.
JOB_COARSE, JOB_BUCKET = "job_m1", 60

TABLE = """CREATE TABLE IF NOT EXISTS {name} (
    t INTEGER NOT NULL, series INTEGER NOT NULL, state TEXT, restarts INTEGER,
    {numbers},
    PRIMARY KEY (t, series)) WITHOUT ROWID"""
SCHEMA_SQL = (
    """CREATE TABLE IF NOT EXISTS series (
        id INTEGER PRIMARY KEY, host TEXT NOT NULL, unit TEXT NOT NULL, kind TEXT,
        engine TEXT, UNIQUE (host, unit))""",
    *(
        TABLE.format(name=n, numbers=", ".join(f"{c} REAL" for c in NUMBERS))
        for n in ("points", *(level[0] for level in LEVELS))
    ),
    """CREATE TABLE IF NOT EXISTS events (
        t REAL NOT NULL, host TEXT NOT NULL, unit TEXT, what TEXT NOT NULL, text TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_t ON events (t)",
    *(
        f"""CREATE TABLE IF NOT EXISTS {name} (
            t INTEGER NOT NULL, series INTEGER NOT NULL, name TEXT NOT NULL, value REAL NOT NULL,
            PRIMARY KEY (t, series, name)) WITHOUT ROWID"""
        for name in ("job_points", JOB_COARSE)
    ),
)


class Point(NamedTuple):
    """One unit at one time, as a plot reads it (averaged over its bucket). A tuple: a week's
    plot reads thousands (a frozen dataclass took 7 us each to make, a tuple 1)."""

    t: float  # seconds
    host: str
    unit: str
    kind: str | None
    engine: str | None
    state: str | None
    restarts: int | None
    tok_s: float | None = None
    running: float | None = None
    queued: float | None = None
    kv: float | None = None
    gpu: float | None = None
    gpu_mem: float | None = None
    done: float | None = None
    total: float | None = None
    rate: float | None = None
    eta: float | None = None


class Store:
    """``Store(path).add(sample)``; ``points(since, until)`` for plots, ``events(n)`` for the
    page. One connection, used under a lock (the sampler writes, the server's threads read).
    ``keep``: seconds of samples kept (older ones are deleted once a minute)."""

    def __init__(self, path: Path, keep: float = 7 * 86400.0) -> None:
        self.path = path
        self.keep = keep
        self.notes: list[str] = []  # what happened to the file, one line each (said once)
        self.lock = threading.Lock()
        self.series: dict[tuple[str, str], int] = {}
        self.pruned = 0.0  # when old rows were last deleted (monotonic)
        self.db = self._open()

    # -- opening ---------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            return self._connect()
        except sqlite3.DatabaseError as exc:
            aside = self._move_aside(exc)
            self.notes.append(
                f"{self.path}: {describe(exc)}: moved aside to {aside.name}; samples start "
                "anew in a new file (plots begin now)"
            )
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=BUSY_MS / 1000, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, STORE_SCHEMA):
                raise sqlite3.DatabaseError(
                    f"schema {version}, this dflashops writes {STORE_SCHEMA}"
                )
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal mode {mode} where WAL was asked")
            db.execute("PRAGMA synchronous = NORMAL")  # WAL: a crash loses the last writes only
            with db:
                for statement in SCHEMA_SQL:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {STORE_SCHEMA}")
            db.execute("SELECT count(*) FROM series").fetchone()  # a damaged file fails here
            for sid, host, unit in db.execute("SELECT id, host, unit FROM series"):
                self.series[(host, unit)] = sid
        except BaseException:
            db.close()
            raise
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o600)  # what hosts said is in it
        return db

    def _move_aside(self, exc: sqlite3.DatabaseError) -> Path:
        why = "locked" if "locked" in str(exc) else "corrupt"
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.{why}-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
        self.series.clear()
        return aside

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- writing ---------------------------------------------------------------------------

    def add(self, sample: Sample, events: Iterable[Event] = ()) -> None:
        """Keep ``sample`` (and ``events``); once a minute, make the coarse copies of the
        minutes that ended and delete what is older than ``keep``."""
        t = ms(sample.time)
        with self.lock, self.db:
            rows = [(t, self._series(u), *row_of(u)) for u in sample.units]
            marks = ", ".join("?" * len(COLUMNS))
            self.db.executemany(
                f"INSERT OR REPLACE INTO points ({', '.join(COLUMNS)}) VALUES ({marks})", rows
            )
            self.db.executemany(
                "INSERT OR REPLACE INTO job_points (t, series, name, value) VALUES (?, ?, ?, ?)",
                [(t, self._series(u), k, v) for u in sample.units for k, v in u.metrics.items()],
            )
            self.db.executemany(
                "INSERT INTO events (t, host, unit, what, text) VALUES (?, ?, ?, ?, ?)",
                [(e.time, e.host, e.unit, e.what, e.text) for e in events],
            )
            if time.monotonic() - self.pruned >= 60.0 or not self.pruned:
                self.pruned = time.monotonic()
                self._roll_up(sample.time)
                self._prune(sample.time)

    def _series(self, u: UnitSample) -> int:
        sid = self.series.get((u.host, u.unit))
        if sid is None:
            self.db.execute(
                "INSERT OR IGNORE INTO series (host, unit, kind, engine) VALUES (?, ?, ?, ?)",
                (u.host, u.unit, u.kind, u.engine),
            )
            row = self.db.execute(
                "SELECT id FROM series WHERE host = ? AND unit = ?", (u.host, u.unit)
            ).fetchone()
            sid = self.series[(u.host, u.unit)] = int(row[0])
        return sid

    def _roll_up(self, now: float) -> None:
        """The buckets of each coarse level that ended since it was last made (from the level
        below it); a bucket made again comes out the same."""
        for table, bucket, source, _ in LEVELS:
            size = bucket * 1000
            last = self.db.execute(f"SELECT max(t) FROM {table}").fetchone()[0]
            start = (last if last is not None else 0) // size * size
            end = ms(now) // size * size  # the bucket under way is not made yet
            if end <= start and last is not None:
                continue
            averages = ", ".join(f"avg({c})" for c in NUMBERS[:6]) + ", max(done), max(total)"
            self.db.execute(
                f"""INSERT OR REPLACE INTO {table} ({", ".join(COLUMNS)})
                SELECT (t / {size}) * {size} AS b, series, state, max(restarts), {averages},
                       avg(rate), min(eta)
                FROM {source} WHERE t >= ? AND t < ? GROUP BY b, series""",
                (start, end),
            )
        self._roll_up_jobs(now)

    def _roll_up_jobs(self, now: float) -> None:
        size = JOB_BUCKET * 1000
        last = self.db.execute(f"SELECT max(t) FROM {JOB_COARSE}").fetchone()[0]
        start = (last if last is not None else 0) // size * size
        self.db.execute(
            f"""INSERT OR REPLACE INTO {JOB_COARSE} (t, series, name, value)
            SELECT (t / {size}) * {size} AS b, series, name, avg(value) FROM job_points
            WHERE t >= ? AND t < ? GROUP BY b, series, name""",
            (start, ms(now) // size * size),
        )

    def _prune(self, now: float) -> None:
        cutoff = ms(now - self.keep)
        short = ms(now - min(self.keep, RAW_S))
        self.db.execute("DELETE FROM points WHERE t < ?", (short,))
        for table, _, _, brief in LEVELS:
            self.db.execute(f"DELETE FROM {table} WHERE t < ?", (short if brief else cutoff,))
        self.db.execute("DELETE FROM events WHERE t < ?", (now - self.keep,))
        self.db.execute("DELETE FROM job_points WHERE t < ?", (short,))
        self.db.execute(f"DELETE FROM {JOB_COARSE} WHERE t < ?", (cutoff,))

    # -- reading ---------------------------------------------------------------------------

    def points(
        self,
        since: float,
        until: float,
        bucket: float = 0.0,
        units: Collection[tuple[str, str]] | None = None,
    ) -> list[Point]:
        """The points of ``units`` ((host, unit) pairs; None: every unit) from ``since`` to
        ``until`` (seconds), averaged per bucket of at least ``bucket`` seconds, from the copy
        ``level`` picks, then the finer ones for the time after its last bucket (so a long
        plot reaches now)."""
        with self.lock:
            ids = None if units is None else [self.series[k] for k in units if k in self.series]
            if ids is not None and not ids:
                return []
            rows, step = self._rows(since, until, bucket, ids)
            averages = ", ".join(f"avg(p.{c})" for c in NUMBERS[:6])
            query = f"""SELECT (p.t / {step}) * {step} AS b, s.host, s.unit, s.kind, s.engine,
                    p.state, max(p.restarts), {averages}, max(p.done), max(p.total),
                    avg(p.rate), min(p.eta)
                FROM ({rows[0]}) AS p JOIN series AS s ON s.id = p.series
                GROUP BY b, p.series ORDER BY b"""
            found = self.db.execute(query, rows[1]).fetchall()
        return [Point(r[0] / 1000, *r[1:]) for r in found]

    def job_metrics(
        self,
        since: float,
        until: float,
        bucket: float = 0.0,
        units: Collection[tuple[str, str]] | None = None,
    ) -> dict[tuple[str, str], dict[str, list[tuple[float, float]]]]:
        """The jobs' own metrics of ``units`` ((host, unit) pairs; None: every one) from
        ``since`` to ``until``: {(host, unit): {name: [(t, value averaged per bucket)]}}.
        Past the day of full resolution, the minute copy, then full resolution after it."""
        out: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
        with self.lock:
            ids = None if units is None else [self.series[k] for k in units if k in self.series]
            if ids is not None and not ids:
                return out
            only = "" if ids is None else f" AND series IN ({', '.join(str(int(i)) for i in ids)})"
            step = max(1, ms(max(bucket, (until - since) / POINTS)))
            parts, params, start = [], [], ms(since)
            if since < until - min(self.keep, RAW_S) - 1:
                last = self.db.execute(f"SELECT max(t) FROM {JOB_COARSE}").fetchone()[0]
                end = (
                    start if last is None else min(max(start, last + JOB_BUCKET * 1000), ms(until))
                )
                parts.append(f"SELECT * FROM {JOB_COARSE} WHERE t >= ? AND t < ?{only}")
                params += [start, end]
                start = end
            parts.append(f"SELECT * FROM job_points WHERE t >= ? AND t <= ?{only}")
            params += [start, ms(until)]
            query = f"""SELECT (p.t / {step}) * {step} AS b, s.host, s.unit, p.name, avg(p.value)
                FROM ({" UNION ALL ".join(parts)}) AS p JOIN series AS s ON s.id = p.series
                GROUP BY b, p.series, p.name ORDER BY b"""
            found = self.db.execute(query, params).fetchall()
        for b, host, unit, name, value in found:
            out.setdefault((host, unit), {}).setdefault(name, []).append((b / 1000, value))
        return out

    def fleet(self, since: float, until: float, bucket: float = 0.0) -> list[tuple[float, float]]:
        """The fleet's throughput: (time, tok/s summed over every server's average in that
        bucket), made by SQLite (one row a bucket, however many servers)."""
        with self.lock:
            services = "SELECT id FROM series WHERE coalesce(kind, 'service') = 'service'"
            ids = [r[0] for r in self.db.execute(services)]
            if not ids:
                return []
            rows, step = self._rows(since, until, bucket, ids)
            query = f"""SELECT b, sum(a) FROM (
                    SELECT (t / {step}) * {step} AS b, avg(tok_s) AS a FROM ({rows[0]})
                    WHERE tok_s IS NOT NULL GROUP BY b, series)
                GROUP BY b ORDER BY b"""
            found = self.db.execute(query, rows[1]).fetchall()
        return [(b / 1000, float(v)) for b, v in found]

    def _rows(
        self, since: float, until: float, bucket: float, ids: list[int] | None
    ) -> tuple[tuple[str, list[int]], int]:
        """((the rows of the window, as one SELECT, and its parameters), the bucket in ms)."""
        table, size = self.level(since, until, bucket)
        columns = ", ".join(COLUMNS)
        only = "" if ids is None else f" AND series IN ({', '.join(str(int(i)) for i in ids)})"
        chain = [(t, w) for t, w, _, _ in LEVELS if table != "points" and w <= size][::-1]
        parts, params, start = [], [], ms(since)
        for name, width in chain:
            last = self.db.execute(f"SELECT max(t) FROM {name}").fetchone()[0]
            end = start if last is None else min(max(start, last + width * 1000), ms(until))
            parts.append(f"SELECT {columns} FROM {name} WHERE t >= ? AND t < ?{only}")
            params += [start, end]
            start = end
        parts.append(f"SELECT {columns} FROM points WHERE t >= ? AND t <= ?{only}")
        params += [start, ms(until)]
        return (" UNION ALL ".join(parts), params), max(1, int(size * 1000))

    def level(self, since: float, until: float, bucket: float) -> tuple[str, float]:
        """(table, bucket seconds): the coarsest copy whose rows are not much wider than the
        bucket that gives a window ``POINTS`` points per unit, of those that still hold its
        start (full resolution and the 10 s copy: the last day only)."""
        want = max(bucket, max(0.0, until - since) / POINTS)
        recent = since >= until - min(self.keep, RAW_S) - 1
        choices = [("points", 0.0)] if recent else []
        choices += [(t, float(w)) for t, w, _, brief in LEVELS if recent or not brief]
        table, size = choices[0]
        for name, width in choices:
            if width <= want * 1.25:
                table, size = name, width
        if table == "points" and bucket > 0:
            # Whole samples per bucket (a sample every 2 s in 3 s buckets would zigzag).
            return table, bucket * math.ceil(want / bucket - 1e-9)
        return table, max(size, want)

    def first(self) -> float | None:
        """When the oldest sample kept was taken (seconds; None: none yet)."""
        with self.lock:
            found = [
                self.db.execute(f"SELECT min(t) FROM {table}").fetchone()[0]
                for table in ("points", *(level[0] for level in LEVELS))
            ]
        times = [t for t in found if t is not None]
        return min(times) / 1000 if times else None

    def events(self, limit: int = 50) -> list[Event]:
        """The newest ``limit`` events, newest first."""
        with self.lock:
            rows = self.db.execute(
                "SELECT t, host, unit, what, text FROM events ORDER BY t DESC LIMIT ?", (limit,)
            ).fetchall()
        return [Event(*r) for r in rows]

    def size(self) -> int:
        """Bytes on disk (the database and its WAL)."""
        return sum(
            os.path.getsize(f"{self.path}{s}")
            for s in ("", "-wal")
            if os.path.exists(f"{self.path}{s}")
        )

    @contextlib.contextmanager
    def batch(self) -> Iterator[sqlite3.Connection]:
        """The connection under the lock, in one transaction (benchmarks synthesize days)."""
        with self.lock, self.db:
            yield self.db


def row_of(u: UnitSample) -> tuple[object, ...]:
    return (u.state, u.restarts, *(getattr(u, n) for n in NUMBERS))


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def describe(exc: sqlite3.DatabaseError) -> str:
    text = str(exc) or type(exc).__name__
    if "locked" in text:
        return f"{text} (another process holds it past {BUSY_MS // 1000}s)"
    return text


assert set(Point._fields) >= set(NUMBERS)  # a plot reads every number kept
