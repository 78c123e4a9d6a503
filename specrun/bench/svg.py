"""Two small chart kinds drawn as inline SVG text: grouped bars and lines.

No JavaScript and no fonts or styles from elsewhere, so the HTML report that embeds
them opens anywhere with no network. Hovering a bar or point shows its value
(an SVG ``<title>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

# Okabe-Ito's colour-blind-safe eight, then four of Tol's muted palette.
PALETTE = (
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00",
    "#8c6d1f", "#555555", "#882255", "#44aa99", "#999933", "#332288",
)
WIDTH, PLOT_HEIGHT = 900, 260
LEFT, RIGHT, BOTTOM = 64, 16, 64  # margins: y-axis labels, nothing, x labels
TITLE_HEIGHT, LEGEND_ROW = 30, 20
CHAR_WIDTH = 7  # about one character of 12px text, for laying out the legend


@dataclass(frozen=True)
class Series:
    """One named set of values, drawn in one colour."""

    name: str
    values: Sequence[float]  # one per group (bars) or per x (lines)
    color: str


def colors(count: int) -> list[str]:
    """``count`` distinguishable colours, cycling the palette."""
    return [PALETTE[i % len(PALETTE)] for i in range(count)]


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top`` (steps of 1, 2, 2.5 or 5 × 10^n)."""
    top = top if top > 0 else 1.0
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [round(i * step, 10) for i in range(math.ceil(top / step - 1e-9) + 1)]


def bar_chart(
    chart_id: str,
    title: str,
    groups: Sequence[str],
    series: Sequence[Series],
    y_label: str,
    reference: float | None = None,
    value_format: str = "{:.2f}",
) -> str:
    """Bars grouped along x (one bar per series in each group), with an optional reference line."""
    legend, frame = _legend_and_frame(series, [v for s in series for v in s.values], reference)
    parts = [*legend, *_axes(frame, y_label)]
    group_width = frame.plot_width / max(1, len(groups))
    bar_width = group_width * 0.8 / max(1, len(series))
    for g, group in enumerate(groups):
        x0 = LEFT + g * group_width + group_width * 0.1
        for s, line in enumerate(series):
            value = line.values[g]
            y = frame.y(value)
            tip = f"{line.name}, {group}: {value_format.format(value)}"
            parts.append(
                f'<rect class="bar" x="{x0 + s * bar_width:.1f}" y="{y:.1f}" width="{bar_width * 0.92:.1f}" '
                f'height="{frame.y(0) - y:.1f}" fill="{line.color}"><title>{escape(tip)}</title></rect>'
            )
        parts.append(_text(LEFT + (g + 0.5) * group_width, frame.bottom + 18, group, "middle", "group-label"))
    if reference is not None:
        parts.append(_reference_line(frame, reference))
    return _svg(chart_id, title, frame, parts)


def line_chart(
    chart_id: str,
    title: str,
    xs: Sequence[float],
    series: Sequence[Series],
    x_label: str,
    y_label: str,
    reference: float | None = None,
) -> str:
    """One line with points per series over shared x values (a series may hold NaN for a gap)."""
    finite = [v for s in series for v in s.values if not math.isnan(v)]
    legend, frame = _legend_and_frame(series, finite, reference)
    parts = [*legend, *_axes(frame, y_label)]
    low, high = min(xs), max(xs)

    def x_at(x: float) -> float:
        return LEFT + frame.plot_width * (0.5 if high == low else 0.04 + 0.92 * (x - low) / (high - low))

    for x in xs:
        parts.append(_text(x_at(x), frame.bottom + 18, f"{x:g}", "middle", "x-tick"))
    parts.append(_text(LEFT + frame.plot_width / 2, frame.bottom + 48, x_label, "middle", "axis-label"))
    for line in series:
        points = [(x_at(x), frame.y(v), x, v) for x, v in zip(xs, line.values) if not math.isnan(v)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _, _ in points)
        parts.append(f'<polyline class="line" points="{path}" fill="none" stroke="{line.color}" stroke-width="2.5"/>')
        for px, py, x, v in points:
            tip = f"{line.name}, {x_label} {x:g}: {v:.2f}"
            parts.append(
                f'<circle class="point" cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{line.color}">'
                f"<title>{escape(tip)}</title></circle>"
            )
    if reference is not None:
        parts.append(_reference_line(frame, reference))
    return _svg(chart_id, title, frame, parts)


@dataclass(frozen=True)
class _Frame:
    """Where the plot area lies (below the title and legend) and the value at its top."""

    top: float
    y_max: float
    ticks: tuple[float, ...]

    @property
    def plot_width(self) -> float:
        return WIDTH - LEFT - RIGHT

    @property
    def bottom(self) -> float:
        return self.top + PLOT_HEIGHT

    @property
    def height(self) -> float:
        return self.bottom + BOTTOM

    def y(self, value: float) -> float:
        return self.bottom - PLOT_HEIGHT * max(0.0, value) / self.y_max


def _legend_and_frame(
    series: Sequence[Series], values: Sequence[float], reference: float | None
) -> tuple[list[str], _Frame]:
    """The legend, wrapped into rows across the chart's width, and the plot frame below it."""
    parts, x, y = [], float(LEFT), TITLE_HEIGHT
    for line in series:
        width = 30 + CHAR_WIDTH * len(line.name)
        if x + width > WIDTH - RIGHT and x > LEFT:
            x, y = float(LEFT), y + LEGEND_ROW
        parts.append(f'<rect class="legend-key" x="{x:.0f}" y="{y}" width="12" height="12" fill="{line.color}"/>')
        parts.append(_text(x + 17, y + 10, line.name, "start", "legend"))
        x += width
    ticks = nice_ticks(max([*values, reference or 0.0]))
    return parts, _Frame(top=y + LEGEND_ROW + 16, y_max=ticks[-1], ticks=tuple(ticks))


def _axes(frame: _Frame, y_label: str) -> list[str]:
    parts = []
    for tick in frame.ticks:
        y = frame.y(tick)
        parts.append(_horizontal_line("grid", y, 'stroke="#e2e2e2"'))
        parts.append(_text(LEFT - 8, y + 4, f"{tick:g}", "end", "y-tick"))
    parts.append(_horizontal_line("axis", frame.y(0), 'stroke="#333"'))
    middle = (frame.top + frame.bottom) / 2
    parts.append(
        f'<text class="axis-label" x="16" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {middle:.1f})">{escape(y_label)}</text>'
    )
    return parts


def _reference_line(frame: _Frame, value: float) -> str:
    return _horizontal_line("reference", frame.y(value), 'stroke="#b00020" stroke-width="1.5" stroke-dasharray="6 4"')


def _horizontal_line(css_class: str, y: float, stroke: str) -> str:
    return f'<line class="{css_class}" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" {stroke}/>'


def _text(x: float, y: float, text: str, anchor: str, css_class: str) -> str:
    return f'<text class="{css_class}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{escape(text)}</text>'


def _svg(chart_id: str, title: str, frame: _Frame, parts: list[str]) -> str:
    body = "\n".join(parts)
    return (
        f'<svg id="{chart_id}" class="chart" xmlns="http://www.w3.org/2000/svg" role="img" '
        f'viewBox="0 0 {WIDTH} {frame.height:.0f}" width="{WIDTH}" height="{frame.height:.0f}">\n'
        f"<title>{escape(title)}</title>\n"
        f'<text class="chart-title" x="{LEFT}" y="20">{escape(title)}</text>\n{body}\n</svg>'
    )
