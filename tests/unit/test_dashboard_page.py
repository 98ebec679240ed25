"""The dashboard's document, plots, events and Prometheus series, from samples (no host): what
the page is given (dashboard/page.py, plots.py, sample.py, prom.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dflashops.dashboard import page, prom
from dflashops.dashboard.plots import Series, nice_max, plot
from dflashops.dashboard.sample import HostSample, Sample, UnitSample, changes
from dflashops.dashboard.sampler import Sampler
from dflashops.dashboard.store import Store

T0 = 1_800_000_000.0
HOSTILE = "<img src=x onerror=alert(1)>&"


def unit(name: str = "sg-0", **kw: Any) -> UnitSample:
    fields: dict[str, Any] = {"kind": "service", "engine": "sglang", "state": "ready"}
    fields.update(kw)
    return UnitSample("h1", name, **fields)


def a_sampler(store: Store | None) -> Sampler:
    """A sampler whose looks are given by the test (its watch never runs)."""
    said: list[str] = []
    sampler = Sampler(SimpleNamespace(tails=None), store, 2.0, said.append)  # type: ignore[arg-type]
    return sampler


def test_a_plot_names_its_series_in_text_and_escapes_them() -> None:
    html = plot(
        "servers",
        "throughput",
        [Series(f"h1/{HOSTILE}", [(T0, 1.0), (T0 + 2, 3.0), (T0 + 4, 2.0)], "2 tok/s")],
        T0,
        T0 + 4,
    )
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;&amp;" in html
    assert re.search(r'<path class="series" data-points="3" d="M[\d.]+,[\d.]+ L', html)
    caption = re.search(r"<figcaption>(.*)</figcaption>", html)
    assert (
        caption is not None and "h1/&lt;img" in caption.group(1) and "2 tok/s" in caption.group(1)
    )
    assert "<title>throughput</title>" in html


def test_a_gap_in_the_samples_breaks_the_line() -> None:
    points = [(T0, 1.0), (T0 + 2, 1.0), (T0 + 60, 1.0), (T0 + 62, 1.0)]
    html = plot("fleet", "fleet", [Series("fleet", points)], T0, T0 + 62, gap=6.0)
    d = re.search(r'class="series"[^>]* d="([^"]+)"', html)
    assert d is not None and d.group(1).count("M") == 2 and d.group(1).count("L") == 2


def test_an_empty_window_says_so_and_the_axis_is_round() -> None:
    assert "no samples in this window yet" in plot("gpu", "GPU", [], T0, T0 + 60)
    assert [nice_max(v) for v in (0.0, 0.7, 3.0, 420.0, 1000.0)] == [1.0, 1.0, 5.0, 500.0, 1000.0]


def test_what_changed_between_two_looks() -> None:
    before = Sample(T0, [HostSample("h1", "ok"), HostSample("h2", "ok")], [unit(restarts=0)])
    after = Sample(
        T0 + 2,
        [HostSample("h1", "ok", identity="rebooted"), HostSample("h2", "unreachable", "refused")],
        [unit(state="restarting", restarts=1, last_exit="code 137 (SIGKILL) 1s ago")],
    )
    said = {(e.host, e.unit, e.what): e.text for e in changes(before, after)}
    assert said[("h1", "sg-0", "restart")] == "restarted (last exit code 137 (SIGKILL))"
    assert said[("h1", "sg-0", "down")] == "ready -> restarting"
    assert said[("h2", None, "lost")] == "unreachable: refused"
    assert said[("h1", None, "identity")] == "rebooted since last seen"
    back = Sample(T0 + 4, [HostSample("h1", "ok", identity="rebooted"), HostSample("h2", "ok")])
    assert [(e.host, e.what) for e in changes(after, back)] == [("h2", "back")]
    deployed = Sample(T0 + 6, [], [unit(fingerprint="b" * 64)])
    assert [e.what for e in changes(Sample(T0, [], [unit(fingerprint="a" * 64)]), deployed)] == [
        "deploy"
    ]


def test_the_document_has_the_fleet_jobs_events_and_plots(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    sampler = a_sampler(store)
    for i in range(30):
        t = T0 + 2 * i
        job = UnitSample("h1", "gen", "job", "job", "running", done=10.0 * i, total=600.0, eta=60.0)
        look = Sample(t, [HostSample("h1", "ok")], [unit(tok_s=100.0 + i, gpu=40.0), job])
        store.add(look, changes(sampler.latest, look))
        sampler.latest = look
    doc = page.document(sampler, "15m", now=T0 + 60)
    (server,) = doc["servers"]
    assert server["unit"] == "sg-0" and server["state"] == "ready" and server["tok_s"] == "129"
    (job_row,) = doc["jobs"]
    assert job_row["progress"] == "48%" and job_row["eta"] == "1m00s" and job_row["ratio"] > 0.4
    assert doc["fleet"]["tok_s"] == "129" and doc["hosts"][0]["state"] == "ok"
    assert set(doc["plots"]) == {"fleet", "servers", "jobs", "gpu", "job-metrics"}
    assert doc["plots"]["job-metrics"] == ""  # no job reports metrics of its own
    assert "h1/gen" in doc["plots"]["jobs"] and "ETA 1m00s" in doc["plots"]["jobs"]
    assert 'class="projection"' in doc["plots"]["jobs"]  # dashed to 100% at the ETA
    assert 'data-points="30"' in doc["plots"]["fleet"]  # a young dashboard: every sample
    # The axis starts at the first sample (a young dashboard), not 15 minutes back.
    assert 'text-anchor="start">08:00:00</text>' in doc["plots"]["fleet"]  # T0, 08:00:00Z


def test_the_fleets_own_series_parse_with_prometheus_client() -> None:
    look = Sample(
        T0,
        [HostSample("h1", "ok"), HostSample("h2", "unreachable", "timed out")],
        [
            unit(restarts=3),
            unit("sg-1", state="starting"),
            UnitSample("h1", "gen", "job", "job", "running", done=25.0, total=100.0),
        ],
    )
    text = prom.exposition(lambda: look).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert got[("dflashops_host_reachable", (("host", "h1"),))] == 1
    assert got[("dflashops_host_reachable", (("host", "h2"),))] == 0
    assert got[("dflashops_unit_up", (("host", "h1"), ("unit", "sg-0")))] == 1
    assert got[("dflashops_unit_up", (("host", "h1"), ("unit", "sg-1")))] == 0
    assert got[("dflashops_unit_up", (("host", "h1"), ("unit", "gen")))] == 1
    assert got[("dflashops_unit_restarts_total", (("host", "h1"), ("unit", "sg-0")))] == 3
    assert got[("dflashops_job_progress_ratio", (("host", "h1"), ("unit", "gen")))] == 0.25
    assert "python_info" not in text  # a registry of its own: nothing of this process
    assert prom.exposition(lambda: None).startswith(b"# HELP")


def test_the_shipped_assets_are_found_and_only_they() -> None:
    found = page.static("index.html")
    assert found is not None and b"/static/app.js" in found[0] and found[1].startswith("text/html")
    assert page.static("../store.py") is None and page.static("app.js") is not None
    script = page.static("app.js")
    assert script is not None and b"innerHTML" in script[0]
    # Host text is set as text: innerHTML only takes the server's drawn (escaped) plots.
    assert script[0].count(b"innerHTML =") == 1


def test_a_plot_draws_the_busiest_servers_and_counts_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    sampler = a_sampler(store)
    look = Sample(
        T0, [HostSample("h1", "ok")], [unit(f"s{i:02d}", tok_s=float(i)) for i in range(12)]
    )
    store.add(look)
    sampler.latest = look
    servers = page.document(sampler, "1h", now=T0 + 1)["plots"]["servers"]
    assert "and 2 more, not drawn" in servers
    assert "h1/s11" in servers and "h1/s02" in servers and "h1/s01" not in servers


def test_a_job_with_its_own_metrics_has_a_plot_per_metric(tmp_path: Path) -> None:
    store = Store(tmp_path / "samples.sqlite")
    sampler = a_sampler(store)
    for i in range(20):
        values = {"loss": 1.0 - 0.04 * i, "reward": -2.0 + 0.1 * i}
        look = Sample(
            T0 + 2 * i,
            [HostSample("h1", "ok"), HostSample("h2", "ok")],
            [
                UnitSample("h1", "gen", "job", "job", "running", metrics=values),
                UnitSample("h2", "gen", "job", "job", "running", metrics={"loss": 0.9}),
                UnitSample("h1", "plain", "job", "job", "running"),
            ],
        )
        store.add(look)
        sampler.latest = look
    html = page.document(sampler, "15m", now=T0 + 40)["plots"]["job-metrics"]
    figures = re.findall(r'<figure class="plot" id="plot-([^"]+)"><h3>([^<]+)</h3>', html)
    assert figures == [("job-gen-loss", "job gen: loss"), ("job-gen-reward", "job gen: reward")]
    loss = html[: html.index('id="plot-job-gen-reward"')]
    # Each host's series named in text with its newest value, drawn from the kept samples.
    assert "h1/gen <b>0.24</b>" in loss and "h2/gen <b>0.9</b>" in loss
    assert re.search(r'data-points="20" d="M', loss)
    reward = html[html.index('id="plot-job-gen-reward"') :]
    assert ">-2</text>" in reward  # a metric below 0: the axis reaches a round number below
    assert "plain" not in html


def test_job_metric_plots_are_bounded(tmp_path: Path) -> None:
    sampler = a_sampler(Store(tmp_path / "samples.sqlite"))
    metrics = {f"m{i}": float(i) for i in range(8)}
    sampler.latest = Sample(
        T0,
        [HostSample("h1", "ok")],
        [UnitSample("h1", f"j{k}", "job", "job", "running", metrics=metrics) for k in range(3)],
    )
    html = page.document(sampler, "1h", now=T0 + 1)["plots"]["job-metrics"]
    assert html.count("<figure") == page.MAX_JOB_PLOTS
    assert f"and {24 - page.MAX_JOB_PLOTS} more job metrics, not drawn" in html
