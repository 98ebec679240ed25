"""The dashboard's samples in SQLite (dflashops/dashboard/store.py): what is kept, read back,
made coarse for long plots, dropped by age; WAL mode; a corrupt or locked file moved aside."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from dflashops.dashboard.sample import Event, HostSample, Sample, UnitSample
from dflashops.dashboard.store import RAW_S, Store

T0 = 1_800_000_000.0  # a fixed clock: 2027-01-15


def sample(t: float, tok: float = 100.0, state: str = "ready", restarts: int = 0) -> Sample:
    return Sample(
        t,
        [HostSample("h1", "ok")],
        [
            UnitSample("h1", "sg-0", "service", "sglang", state, restarts, tok_s=tok, gpu=50.0),
            UnitSample("h1", "gen", "job", "job", "running", done=t - T0, total=1000.0, eta=9.0),
        ],
    )


def test_samples_are_kept_and_read_back(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    for i in range(10):
        store.add(sample(T0 + 2 * i, tok=10.0 * i))
    points = store.points(T0, T0 + 18)
    sg = [p for p in points if p.unit == "sg-0"]
    assert [p.tok_s for p in sg] == [10.0 * i for i in range(10)]
    assert {(p.host, p.kind, p.engine, p.state) for p in sg} == {
        ("h1", "service", "sglang", "ready")
    }
    gen = [p for p in points if p.unit == "gen"]
    assert gen[-1].done == 18 and gen[-1].total == 1000 and gen[-1].eta == 9
    # The fleet's line: servers summed per bucket, by SQLite (the job's numbers are not in it).
    assert store.fleet(T0, T0 + 18, 4.0) == [(T0 + 4 * k, 20.0 * k + 5.0) for k in range(5)]
    assert [p.unit for p in store.points(T0, T0, units={("h1", "gen")})] == ["gen"]
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert (tmp_path / "samples.sqlite").stat().st_mode & 0o777 == 0o600


def test_events_are_kept_newest_first(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    store.add(sample(T0), [Event(T0, "h1", "sg-0", "restart", "restarted (code 137)")])
    store.add(sample(T0 + 2), [Event(T0 + 2, "h1", None, "lost", "unreachable: refused")])
    assert [e.what for e in store.events()] == ["lost", "restart"]
    # A second store on the file (a restart, or watch beside the dashboard) sees them.
    assert [e.text for e in Store(tmp_path / "samples.sqlite").events(1)] == [
        "unreachable: refused"
    ]


def test_a_long_window_reads_the_coarse_copies_made_as_minutes_end(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    for i in range(0, 3600, 2):  # an hour at 2 s
        store.pruned = 0.0  # every add may roll up (it does once a minute of wall time)
        store.add(sample(T0 + i, tok=float(i // 60)))
    minutes = store.db.execute("SELECT count(*) FROM m1").fetchone()[0]
    assert minutes >= 2 * 59  # two units, each minute that ended
    assert store.db.execute("SELECT count(*) FROM s10").fetchone()[0] >= 2 * 354
    assert store.db.execute("SELECT count(*) FROM m30").fetchone()[0] == 2  # the second: under way
    assert store.level(T0 + 3000, T0 + 3600, 2.0) == ("points", 2.0)  # 10 minutes: every sample
    assert store.level(T0 + 2700, T0 + 3600, 2.0) == ("points", 4.0)  # whole samples a bucket
    assert store.level(T0, T0 + 3600, 2.0) == ("s10", 12.0)  # an hour: 300 points
    assert store.level(T0 + 3600 - 86400, T0 + 3600, 2.0) == ("m5", 300.0)
    table, width = store.level(T0 + 3600 - 7 * 86400, T0 + 3600, 2.0)
    assert table == "m30" and width == 7 * 86400 / 300  # 2016 s: wider than the copy
    day = [p for p in store.points(T0 + 3600 - 86400, T0 + 3600, 2.0) if p.unit == "sg-0"]
    assert len(day) <= 300 and day[0].tok_s is not None and day[0].tok_s < 5
    # The five minutes under way are not made yet: they come from the finer copies and the
    # full-resolution rows.
    assert (day[-1].tok_s or 0) > 57 and day[-1].t >= T0 + 3600 - 300


def test_old_samples_go_by_age(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite", keep=600.0)
    store.add(sample(T0))
    store.pruned = 0.0
    store.add(sample(T0 + 900))  # 15 minutes later: the first is past --keep
    times = [p.t for p in store.points(T0 - 10, T0 + 1000)]
    assert T0 not in times and T0 + 900 in times
    assert store.events() == []


def test_full_resolution_is_kept_for_a_day_at_most(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    store.add(sample(T0))
    store.pruned = 0.0
    store.add(sample(T0 + RAW_S + 120))
    raw = store.db.execute("SELECT min(t) FROM points").fetchone()[0]
    assert raw == int((T0 + RAW_S + 120) * 1000)
    assert store.db.execute("SELECT count(*) FROM s10").fetchone()[0] == 0  # a day, like raw
    assert store.db.execute("SELECT count(*) FROM m1").fetchone()[0] > 0  # the coarse copy stays


def test_a_corrupt_file_is_moved_aside_and_said(tmp_path: Path) -> None:
    path = tmp_path / "samples.sqlite"
    path.write_bytes(b"this is not a database, it is what a full disk left" * 200)
    store = Store(path)
    (note,) = store.notes
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("samples.sqlite.corrupt-")]
    assert len(aside) == 1
    assert str(path) in note and aside[0] in note and "start anew" in note
    store.add(sample(T0))
    assert len(store.points(T0, T0)) == 2


def test_a_locked_file_is_moved_aside_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "samples.sqlite"
    Store(path).close()
    monkeypatch.setattr("dflashops.dashboard.store.BUSY_MS", 200)
    holder = sqlite3.connect(path, check_same_thread=False)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")  # another process stuck in a write
    try:
        store = Store(path)
    finally:
        holder.rollback()
        holder.close()
    (note,) = store.notes
    assert "locked" in note and "moved aside" in note
    assert any(p.name.startswith("samples.sqlite.locked-") for p in tmp_path.iterdir())
    store.add(sample(T0))
    assert store.points(T0, T0)


def test_the_sampler_thread_and_the_servers_threads_share_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(50):
                store.points(T0, T0 + 200)
                store.events()
        except BaseException as exc:  # reported below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for r in readers:
        r.start()
    for i in range(100):
        store.add(sample(T0 + i))
    for r in readers:
        r.join()
    assert errors == []
    assert len(store.points(T0, T0 + 200)) == 200


def trained(t: float, loss: float) -> Sample:
    """A job that reports its own metrics (`metrics:` in its playbook), beside one that does not."""
    return Sample(
        t,
        [HostSample("h1", "ok")],
        [
            UnitSample("h1", "gen", "job", "job", "running", metrics={"loss": loss, "lr": 1e-4}),
            UnitSample("h1", "other", "job", "job", "running"),
        ],
    )


def test_jobs_own_metrics_are_kept_and_read_back_per_unit(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    for i in range(10):
        store.add(trained(T0 + 2 * i, 1.0 - 0.1 * i))
    got = store.job_metrics(T0, T0 + 18, units={("h1", "gen"), ("h1", "other")})
    assert set(got) == {("h1", "gen")}  # "other" reports none: nothing kept of it
    assert [v for _, v in got[("h1", "gen")]["loss"]] == pytest.approx(
        [1.0 - 0.1 * i for i in range(10)]
    )
    assert got[("h1", "gen")]["lr"][0] == (T0, 1e-4)
    # Averaged per bucket, and only the window asked for.
    loss = store.job_metrics(T0 + 4, T0 + 11, 4.0)[("h1", "gen")]["loss"]
    assert [t for t, _ in loss] == [T0 + 4, T0 + 8] and loss[0][1] == pytest.approx(0.75)
    assert store.job_metrics(T0, T0 + 18, units={("h9", "gen")}) == {}
    # A second store on the file (the dashboard restarted) reads them too.
    assert ("h1", "gen") in Store(tmp_path / "samples.sqlite").job_metrics(T0, T0 + 18)


def test_jobs_own_metrics_go_by_age_and_a_week_reads_the_minute_copy(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite", keep=7 * 86400.0)
    for i in range(0, 600, 2):  # ten minutes at 2 s
        store.pruned = 0.0
        store.add(trained(T0 + i, float(i // 60)))
    assert store.db.execute("SELECT count(*) FROM job_m1").fetchone()[0] >= 2 * 9
    store.pruned = 0.0
    later = T0 + RAW_S + 1200
    store.add(trained(later, 0.5))  # a day on: full resolution of the first minutes is gone
    raw = store.db.execute("SELECT min(t) FROM job_points").fetchone()[0]
    assert raw == int(later * 1000)
    week = store.job_metrics(later - 2 * 86400, later)[("h1", "gen")]["loss"]
    # The minute copy of the first minutes (averaged in buckets of 2 days / 300), then now's.
    assert week[0][0] <= T0 and 0.0 < week[0][1] < 9.0 and week[-1][1] == 0.5
    store.pruned = 0.0
    store.add(trained(T0 + 8 * 86400, 0.1))  # the first minutes are past keep: gone
    first = store.db.execute("SELECT min(t) FROM job_m1").fetchone()[0]
    assert first == int(later * 1000) // 60000 * 60000  # the minute of `later` stays
    assert [v for _, v in store.job_metrics(T0, T0 + 9 * 86400)[("h1", "gen")]["loss"]] == [
        0.5,
        0.1,
    ]
