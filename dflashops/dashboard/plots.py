"""Line plots drawn on the server as SVG: no script library, no CDN, nothing to load.

Each plot is a ``<figure>``: the SVG (its ``<title>`` names the plot, each series' path has a
``<title>`` naming the series) and a ``<figcaption>`` legend in text: a colour swatch (class ``cN``: the page's style sheet has the same PALETTE, so
the page needs no inline style under its Content-Security-Policy), the
series' name and its last value. Every piece of text is XML-escaped here (host and unit names
are the user's and the hosts' words). A gap in the samples (a host unreachable, the dashboard
stopped) breaks the line instead of joining across it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from html import escape

PALETTE = (
    "#2563eb",
    "#dc2626",
    "#16a34a",
    "#9333ea",
    "#ea580c",
    "#0891b2",
    "#ca8a04",
    "#db2777",
    "#4b5563",
    "#65a30d",
)
WIDTH, HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 12, 24
MAX_SERIES = 10  # drawn per plot; the legend counts the rest


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (t seconds, value)
    note: str = ""  # the legend's text after the name: its last value, an ETA
    # A dashed continuation (a job's projection to its ETA): (t, value) pairs.
    projection: list[tuple[float, float]] = field(default_factory=list)


def nice_max(value: float) -> float:
    """The axis top: 1, 2, 2.5 or 5 times a power of ten, at or above ``value``."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return step * power
    return 10 * power


def clock(t: float, span: float) -> str:
    when = datetime.fromtimestamp(t, timezone.utc)
    return when.strftime("%m-%d %H:%M" if span > 86400 else "%H:%M" if span > 600 else "%H:%M:%S")


def number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value / 1000:.3g}k"
    return f"{value:.3g}"


def path_of(points: list[tuple[float, float]], x: Scale, y: Scale, gap: float) -> tuple[str, int]:
    """The SVG path of ``points`` (and how many it holds), broken where two are further
    apart than ``gap`` seconds."""
    parts: list[str] = []
    last: float | None = None
    for t, v in points:
        move = "M" if last is None or t - last > gap else "L"
        parts.append(f"{move}{x(t):.1f},{y(v):.1f}")
        last = t
    return " ".join(parts), len(parts)


class Scale:
    def __init__(self, low: float, high: float, start: float, end: float) -> None:
        self.low, self.high, self.start, self.end = low, high, start, end

    def __call__(self, value: float) -> float:
        span = (self.high - self.low) or 1.0
        return self.start + (value - self.low) / span * (self.end - self.start)


def plot(
    name: str,
    title: str,
    series: list[Series],
    since: float,
    until: float,
    *,
    unit: str = "",
    top: float | None = None,
    gap: float = 10.0,
    more: int = 0,
) -> str:
    """A ``<figure>`` with the plot ``title`` of ``series`` from ``since`` to ``until``
    (seconds); the y axis from 0 to ``top`` (default: a round number above the highest).
    ``more``: series left out before (counted in the legend with those past MAX_SERIES)."""
    shown = series[:MAX_SERIES]
    values = [v for s in shown for _, v in (*s.points, *s.projection)]
    high = top if top is not None else nice_max(max(values, default=0.0))
    # A job's own metric may be below 0 (a reward): the axis then reaches a round number below.
    low = min(0.0, -nice_max(-min(values)) if values and min(values) < 0 else 0.0)
    x = Scale(since, until, LEFT, WIDTH - RIGHT)
    y = Scale(low, high, HEIGHT - BOTTOM, TOP)
    body = [f"<title>{escape(title)}</title>", *axes(x, y, since, until, (low, high), unit)]
    drawn = 0
    legend = []
    for i, s in enumerate(shown):
        colour = PALETTE[i % len(PALETTE)]
        d, n = path_of(s.points, x, y, gap)
        drawn += n
        if d:
            body.append(
                f'<path class="series" data-points="{n}" d="{d}" fill="none" '
                f'stroke="{colour}" stroke-width="1.6"><title>{escape(s.name)}</title></path>'
            )
        if s.projection:
            d, _ = path_of(s.projection, x, y, float("inf"))
            body.append(
                f'<path class="projection" d="{d}" fill="none" stroke="{colour}" '
                f'stroke-dasharray="4 3"><title>{escape(s.name)}: to its ETA</title></path>'
            )
        legend.append(
            f'<span class="key"><i class="c{i % len(PALETTE)}"></i>{escape(s.name)}'
            + (f" <b>{escape(s.note)}</b>" if s.note else "")
            + "</span>"
        )
    hidden = len(series) - len(shown) + more
    if hidden > 0:
        legend.append(f'<span class="key">and {hidden} more, not drawn</span>')
    if not drawn:
        body.append(
            f'<text x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" text-anchor="middle" '
            'class="empty">no samples in this window yet</text>'
        )
    svg = (
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
        f'preserveAspectRatio="none">{"".join(body)}</svg>'
    )
    caption = "".join(legend) or "no series"
    return (
        f'<figure class="plot" id="plot-{escape(name)}"><h3>{escape(title)}</h3>{svg}'
        f"<figcaption>{caption}</figcaption></figure>"
    )


def axes(
    x: Scale, y: Scale, since: float, until: float, bounds: tuple[float, float], unit: str
) -> list[str]:
    out = []
    low, high = bounds
    for i in range(5):
        v = low + (high - low) * i / 4
        py = y(v)
        out.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}"/>'
        )
        label = f"{number(v)}{unit}" if v else f"0{unit}"
        out.append(
            f'<text class="axis" x="{LEFT - 4}" y="{py + 4:.1f}" text-anchor="end">'
            f"{escape(label)}</text>"
        )
    span = until - since
    for i in range(5):
        t = since + span * i / 4
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        out.append(
            f'<text class="axis" x="{x(t):.1f}" y="{HEIGHT - 6}" text-anchor="{anchor}">'
            f"{escape(clock(t, span))}</text>"
        )
    return out
