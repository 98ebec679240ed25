"""A job's own metrics for plotting (DESIGN fleet-page 2): numbers from its log lines (a regex
with named groups) or from a JSON-lines file it writes. Checked here, at the line of the fault:
a regex that does not compile, or has no named group, is a pre-flight error."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from dflashops.config.inventory import StrictModel


class JobMetrics(StrictModel):
    """``{log: REGEX}`` or ``{file: PATH}``: the newest values are read on the host, cheaply
    (the end of the log or of the file, bounded)."""

    log: Annotated[
        str | None,
        Field(
            description="A Python regex with named groups, matched against each log line: each "
            "group that matched a number is a metric, e.g. 'loss[=: ]+(?P<loss>[0-9.eE+-]+)'."
        ),
    ] = None
    file: Annotated[
        str | None,
        Field(
            min_length=1,
            description="A JSON-lines file the job writes (relative to its unit folder, its "
            "working directory, or absolute): each object's numbers are metrics; lines that "
            "are not JSON objects are skipped and counted.",
        ),
    ] = None

    @field_validator("log")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"the regex does not compile: {exc}") from None
        if not compiled.groupindex:
            raise ValueError(
                "the regex has no named group: name each number, e.g. (?P<loss>[0-9.]+)"
            )
        return value

    @model_validator(mode="after")
    def _one(self) -> JobMetrics:
        if (self.log is None) == (self.file is None):
            raise ValueError("metrics takes exactly one of `log` (a regex) or `file` (a path)")
        return self
