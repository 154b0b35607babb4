"""The report's line charts as inline SVG: the geometry (ranges, round ticks, the lines, their
markers and a legend that never hides a line) computed here, the markup in
templates/chart.svg.j2.
"""

from __future__ import annotations

import math

from finetune.pages import Markup, render
from finetune.report.run_files import finite

CHART_WIDTH, CHART_HEIGHT = 560, 300
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 64, 16, 30, 44
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
_MAX_MARKED_POINTS = 40
_LEGEND_CHAR_WIDTH = 6.5  # rough glyph width at font-size 11; SVG text cannot be measured


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round numbers (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [i * step for i in range(first, last + 1)]


def _fmt_tick(value: float) -> str:
    size = abs(value)
    if size < 1e-12:
        return "0"
    if size >= 1e6:
        return f"{value / 1e6:.3g}M"
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 1e-3:
        return f"{value:.4g}"
    return f"{value:.1e}"


def _padded_range(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi > lo:
        return lo, hi
    # a single point or a flat line still needs a non-empty axis to place it on
    pad = abs(lo) * 0.1 or 1.0
    return lo - pad, hi + pad


def svg_line_chart(
    series: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str
) -> Markup:
    """Inline SVG line chart of named (x, y) series; None/NaN points are skipped. The geometry
    is computed here, the markup is templates/chart.svg.j2."""
    w, h = CHART_WIDTH, CHART_HEIGHT
    left, right = _MARGIN_LEFT, w - _MARGIN_RIGHT
    top, bottom = _MARGIN_TOP, h - _MARGIN_BOTTOM
    clean = {
        name: [
            (float(x), float(y))
            for x, y in points
            if finite(x) is not None and finite(y) is not None
        ]
        for name, points in series.items()
    }
    box = {"w": w, "h": h, "left": left, "right": right, "top": top, "bottom": bottom,
           "x_mid": (left + right) / 2, "y_mid": (top + bottom) / 2}
    all_points = [p for points in clean.values() for p in points]
    if not all_points:
        return _chart(box, title, x_label, y_label, None)

    x_lo, x_hi = _padded_range([x for x, _ in all_points])
    y_lo, y_hi = _padded_range([y for _, y in all_points])

    def sx(x: float) -> float:
        return round(left + (x - x_lo) / (x_hi - x_lo) * (right - left), 2)

    def sy(y: float) -> float:
        return round(bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top), 2)

    lines = [{
        "color": _COLORS[i % len(_COLORS)],
        "coords": " ".join(f"{sx(x)},{sy(y)}" for x, y in points) if len(points) > 1 else "",
        # sparse series (eval loss, a single point) would be invisible as a bare line
        "markers": [(sx(x), sy(y)) for x, y in points] if len(points) <= _MAX_MARKED_POINTS
        else [],
    } for i, points in enumerate(clean.values())]
    # the legend sits in the top margin, laid out right to left, so it never hides a line
    legend, legend_x = [], right
    for i, name in reversed(list(enumerate(clean))):
        text_x = legend_x - _LEGEND_CHAR_WIDTH * len(name)
        if text_x - 22 < left:  # many series (GPUs): the legend shows those that fit
            break
        legend.append({"name": name, "x": text_x, "color": _COLORS[i % len(_COLORS)]})
        legend_x = text_x - 34
    return _chart(box, title, x_label, y_label, {
        "x_ticks": [(sx(t), _fmt_tick(t)) for t in _nice_ticks(x_lo, x_hi)],
        "y_ticks": [(sy(t), _fmt_tick(t)) for t in _nice_ticks(y_lo, y_hi)],
        "lines": lines, "legend": legend})


def _chart(box: dict, title: str, x_label: str, y_label: str, plot: dict | None) -> Markup:
    return Markup(render("chart.svg.j2", box=box, title=title, x_label=x_label,
                         y_label=y_label, plot=plot).strip())
