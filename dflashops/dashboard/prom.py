"""The fleet's own Prometheus series, from the dashboard's last look (``/metrics``).

A registry of its own (never prometheus_client's global one: nothing of this process's own
runtime leaks in), collected at each scrape from the last sample:

- ``dflashops_host_reachable{host}``: 1 when the host answered the last look;
- ``dflashops_unit_up{host,unit}``: 1 for a unit that is ready (a service answering its health
  check, or running where it has none; a job running), services and jobs alike;
- ``dflashops_unit_restarts_total{host,unit}``: restarts its supervisor began;
- ``dflashops_job_progress_ratio{host,unit}``: a job's done/total (jobs that say a total).

The engines' own /metrics stay theirs: `dflashops prometheus-targets` lists them for
Prometheus' file_sd_configs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dflashops.dashboard.sample import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FleetCollector(Collector):
    def __init__(self, latest: Callable[[], Sample | None]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        sample = self.latest()
        reachable = GaugeMetricFamily(
            "dflashops_host_reachable", "1 when the host answered the last look", labels=["host"]
        )
        up = GaugeMetricFamily(
            "dflashops_unit_up",
            "1 when the unit is ready (a service answering its health check, or running where "
            "it has none; a job running)",
            labels=["host", "unit"],
        )
        restarts = CounterMetricFamily(
            "dflashops_unit_restarts",
            "restarts the unit's supervisor began since a deploy started it",
            labels=["host", "unit"],
        )
        progress = GaugeMetricFamily(
            "dflashops_job_progress_ratio",
            "a job's done/total, from its progress file",
            labels=["host", "unit"],
        )
        for h in sample.hosts if sample is not None else []:
            reachable.add_metric([h.host], 1.0 if h.reachable else 0.0)
        for u in sample.units if sample is not None else []:
            up.add_metric([u.host, u.unit], 1.0 if u.up else 0.0)
            restarts.add_metric([u.host, u.unit], float(u.restarts))
            if u.kind == "job" and u.ratio is not None:
                progress.add_metric([u.host, u.unit], u.ratio)
        yield from (reachable, up, restarts, progress)


def exposition(latest: Callable[[], Sample | None]) -> bytes:
    """The text format of the fleet's series now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(latest))
    return generate_latest(registry)
