"""A job's own metrics, for plotting (the dashboard's): the controller's side of the host's
``job_metrics`` action (agent/remote/job_metrics.py).

``specs(rendered)`` is the request for the jobs that declare ``metrics:``; ``read`` asks the
host (one call, served by a kept session), ``read_ahead`` lets the request ride with the
session's next call (a probe or facts: no round trip of its own), and ``job_metrics(answer,
unit)`` gives one job's newest values as ``{name: float}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import Field

from dflashops.agent.answers import FactsModel
from dflashops.agent.calling import SLACK, AgentError
from dflashops.agent.client import Agent

MAX_NAMES = 8  # metrics kept per job (a JSON-lines file may carry any number of keys)
MAX_NAME_LEN = 64


class UnitMetrics(FactsModel):
    values: dict[str, float] = Field(default_factory=dict)  # metric -> its newest value
    skipped: int = 0  # lines of the file's end that were not JSON objects
    error: str | None = None  # the log or file could not be read


class MetricsAnswer(FactsModel):
    units: dict[str, UnitMetrics] = Field(default_factory=dict)


def specs(rendered: Iterable[Any]) -> list[dict[str, Any]]:
    """``[{name, log | file}]`` for the rendered units (engines.render.Rendered) whose job
    declares ``metrics:``."""
    out = []
    for r in rendered:
        declared = getattr(r.unit.spec, "metrics", None)
        if declared is not None:
            out.append({"name": r.unit.name, "log": declared.log, "file": declared.file})
    return out


def read(agent: Agent, workdir: str, units: list[dict[str, Any]]) -> MetricsAnswer:
    if not units:
        return MetricsAnswer()
    data = agent.call("job_metrics", {"workdir": workdir, "units": units}, timeout=2 * SLACK)
    return agent.validate(MetricsAnswer, data, "job_metrics")


def read_ahead(
    agent: Agent,
    workdir: str,
    units: list[dict[str, Any]],
    then: Callable[[MetricsAnswer], None],
) -> None:
    """``read`` riding with the kept session's next call; an answer that does not validate
    is taken as no metrics (a plot misses a point, the look goes on)."""
    if not units:
        return

    def took(data: dict[str, Any]) -> None:
        try:
            then(agent.validate(MetricsAnswer, data, "job_metrics"))
        except AgentError:
            then(MetricsAnswer())

    agent.kept().send_ahead("job_metrics", {"workdir": workdir, "units": units}, took)


def job_metrics(answer: MetricsAnswer | dict[str, Any] | None, unit: str) -> dict[str, float]:
    """One job's newest values (``{"loss": 0.42}``), from a ``MetricsAnswer`` or its raw JSON;
    empty when the job declared none, reported none yet, or its file could not be read.
    Bounded: finite numbers only, the first ``MAX_NAMES`` names in sorted order, each name at
    most ``MAX_NAME_LEN`` characters (a plot each: a file of 500 keys is not 500 plots)."""
    if answer is None:
        return {}
    if isinstance(answer, dict):
        try:
            answer = MetricsAnswer.model_validate(answer)
        except ValueError:
            return {}
    got = answer.units.get(unit)
    if got is None:
        return {}
    fine = sorted(
        (k, v) for k, v in got.values.items() if len(k) <= MAX_NAME_LEN and math.isfinite(v)
    )
    return dict(fine[:MAX_NAMES])
