"""Server-side SVG charts: pure functions from numbers to an SVG string.

Why on the server: the console works without JavaScript and loads nothing from
outside the hub, so a chart is markup the page already carries. Every piece of
text that reaches the SVG (titles, series and layer names) is escaped here, and
styling is done through CSS classes and presentation attributes only: the
console's Content-Security-Policy forbids inline ``style`` attributes.

Non-finite values (NaN, inf) and ``None`` are gaps, never drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from ..readmodel.figures import short_number as _fmt

__all__ = [
    "Bar",
    "Series",
    "bar_chart",
    "line_chart",
    "nice_ticks",
    "score_gauge",
]

# Colour-blind-safe palette (Okabe-Ito); also set through classes in console.css.
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9")


@dataclass(frozen=True)
class Series:
    """One line: ``points`` are (x, y); a y of ``None`` or non-finite is a gap."""

    name: str
    points: Sequence[tuple[float, float | None]]


@dataclass(frozen=True)
class Bar:
    """One labelled group of bars; ``values`` align with the chart's ``legend``."""

    label: str
    values: Sequence[float | None]


def _ok(v: float | None) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _num(v: float) -> str:
    """Coordinates with two decimals: short, deterministic output."""
    return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 5, 10):
        step = m * mag
        if step >= raw:
            break
    start = math.floor(lo / step) * step
    ticks: list[float] = []
    t = start
    while t <= hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _empty(width: int, height: int, title: str, message: str) -> str:
    t = escape(title)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart chart-empty" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{t}"><title>{t}</title>'
        f'<text x="{width // 2}" y="{height // 2}" text-anchor="middle" class="chart-note" '
        f'fill="#666">{escape(message)}</text></svg>'
    )


@dataclass(frozen=True)
class _Frame:
    """A plot area (``left``, ``top``, width ``pw``, height ``ph``) and the data ranges it shows."""

    left: int
    top: int
    pw: int
    ph: int
    x_lo: float
    x_hi: float
    y_lo: float = 0.0
    y_hi: float = 1.0

    def sx(self, x: float) -> float:
        return self.left + (x - self.x_lo) / (self.x_hi - self.x_lo) * self.pw

    def sy(self, y: float) -> float:
        return self.top + (1 - (y - self.y_lo) / (self.y_hi - self.y_lo)) * self.ph


def _svg_head(width: int, height: int, title: str, cls: str, title_x: int) -> list[str]:
    t = escape(title)
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{t}">',
        f"<title>{t}</title>",
        f'<text x="{title_x}" y="18" class="chart-title" font-size="13" font-weight="600">{t}</text>',
    ]


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str = "round",
    y_label: str = "",
    width: int = 640,
    height: int = 260,
    y_min: float | None = None,
    y_max: float | None = None,
    integer_x: bool = True,
) -> str:
    """A line chart of one or more series with axes, ticks, legend and point tooltips.

    ``integer_x``: x values are counts (rounds), so only whole-number ticks are drawn.
    """
    pts = [(x, y) for s in series for x, y in s.points if _ok(x) and _ok(y)]
    if not pts:
        return _empty(width, height, title, "no data yet")
    xs = [float(p[0]) for p in pts]
    ys = [float(p[1]) for p in pts if p[1] is not None]
    x_lo, x_hi = min(xs), max(xs)
    y_lo = min(ys) if y_min is None else y_min
    y_hi = max(ys) if y_max is None else y_max
    if x_hi == x_lo:  # one point: centre it, no ticks beyond the data
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    yt = nice_ticks(y_lo, y_hi)
    if yt:
        y_lo, y_hi = min(yt[0], y_lo), max(yt[-1], y_hi)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    xt = [t for t in nice_ticks(x_lo, x_hi, 6) if x_lo <= t <= x_hi]
    if integer_x:
        xt = [t for t in xt if float(t).is_integer()]

    left, right, top, bottom = 56, 16, 30, 44
    frame = _Frame(left, top, width - left - right, height - top - bottom, x_lo, x_hi, y_lo, y_hi)
    out = _svg_head(width, height, title, "chart", left)
    out += _line_axes(frame, xt, yt, height, x_label, y_label)
    for i, s in enumerate(series):
        out += _line_series(frame, i, s)
    out += _line_legend(series, left + frame.pw)
    out.append("</svg>")
    return "".join(out)


def _line_axes(
    f: _Frame, xt: list[float], yt: list[float], height: int, x_label: str, y_label: str
) -> list[str]:
    """The grid with its y ticks, the x ticks, the frame and the axis labels."""
    left, top, pw, ph = f.left, f.top, f.pw, f.ph
    out = []
    for v in yt:
        if not (f.y_lo <= v <= f.y_hi):
            continue
        yc = _num(f.sy(v))
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{yc}" y2="{yc}" class="grid" '
            f'stroke="#ddd" stroke-width="1"/>'
            f'<text x="{left - 6}" y="{yc}" dy="4" text-anchor="end" class="tick" '
            f'font-size="11">{escape(_fmt(v))}</text>'
        )
    for v in xt:
        xc = _num(f.sx(v))
        out.append(
            f'<line x1="{xc}" x2="{xc}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#888"/>'
            f'<text x="{xc}" y="{top + ph + 16}" text-anchor="middle" class="tick" '
            f'font-size="11">{escape(_fmt(v))}</text>'
        )
    out.append(
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888" '
        f'class="frame"/>'
    )
    out.append(
        f'<text x="{left + pw / 2:.1f}" y="{height - 6}" text-anchor="middle" '
        f'class="axis-label" font-size="11">{escape(x_label)}</text>'
    )
    if y_label:
        out.append(
            f'<text x="12" y="{top + ph / 2:.1f}" text-anchor="middle" class="axis-label" '
            f'font-size="11" transform="rotate(-90 12 {top + ph / 2:.1f})">{escape(y_label)}</text>'
        )
    return out


def _line_series(f: _Frame, i: int, s: Series) -> list[str]:
    """Series ``i``: its lines (split into runs at gaps, so a missing round is not bridged) and
    its points with their tooltips."""
    colour = PALETTE[i % len(PALETTE)]
    cls = f"series s{i % len(PALETTE)}"
    name = escape(s.name)
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in s.points:
        if _ok(x) and _ok(y) and y is not None:
            runs[-1].append((float(x), float(y)))
        elif runs[-1]:
            runs.append([])
    out = [f'<g class="{cls}"><title>{name}</title>']
    for run in runs:
        if len(run) > 1:
            d = " ".join(f"{_num(f.sx(x))},{_num(f.sy(y))}" for x, y in run)
            out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in run:
            out.append(
                f'<circle cx="{_num(f.sx(x))}" cy="{_num(f.sy(y))}" r="3" fill="{colour}">'
                f"<title>{name} @ {escape(_fmt(x))}: {escape(_fmt(y))}</title></circle>"
            )
    out.append("</g>")
    return out


def _line_legend(series: Sequence[Series], right_x: float) -> list[str]:
    """The legend, right-aligned in the title row at ``right_x``, last series right-most."""
    out = []
    legend_x = right_x
    for i in reversed(range(len(series))):
        name = series[i].name
        legend_x -= 18 + 7 * len(name)
        colour = PALETTE[i % len(PALETTE)]
        out.append(
            f'<g class="legend"><rect x="{legend_x}" y="9" width="10" height="10" '
            f'fill="{colour}"/><text x="{legend_x + 14}" y="18" font-size="11">'
            f"{escape(name)}</text></g>"
        )
    return out


def bar_chart(
    bars: Sequence[Bar],
    *,
    title: str,
    legend: Sequence[str],
    width: int = 640,
    bar_height: int = 9,
    threshold: float | None = None,
    threshold_label: str = "threshold",
    max_bars: int = 64,
) -> str:
    """Horizontal grouped bars, one group per label (e.g. one per layer).

    Typical use: a flagged update's per-layer value next to the round's centre.
    ``threshold`` draws a dashed vertical reference line.
    """
    bars = list(bars)[:max_bars]
    vals = [float(v) for b in bars for v in b.values if _ok(v) and v is not None]
    if threshold is not None and _ok(threshold):
        vals.append(float(threshold))
    if not bars or not vals:
        return _empty(width, 80, title, "no per-layer data")
    n = max(1, len(legend))
    group_h = n * bar_height + 8
    label_w = min(240, 12 + 7 * max(len(b.label) for b in bars))
    left, right = label_w, 60
    top = 62 if threshold is not None else 46
    height = top + group_h * len(bars) + 28
    pw = max(40, width - left - right)
    lo, hi = min(0.0, *vals), max(0.0, *vals)
    ticks = nice_ticks(lo, hi)
    if ticks:
        lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    if hi == lo:
        hi = lo + 1
    frame = _Frame(left, top, pw, group_h * len(bars), lo, hi)
    out = _svg_head(width, height, title, "chart bars", 8)
    out += _bar_legend(legend)
    out += _bar_grid(frame, ticks)
    for gi, b in enumerate(bars):
        out += _bar_group(frame, gi, b, legend, group_h, bar_height)
    if threshold is not None and _ok(threshold):
        x = _num(frame.sx(float(threshold)))
        out.append(
            f'<line x1="{x}" x2="{x}" y1="{top - 4}" y2="{top + frame.ph}" stroke="#c00" '
            f'stroke-dasharray="4 3" stroke-width="1.5" class="threshold"/>'
            f'<text x="{x}" y="{top - 6}" text-anchor="middle" font-size="10" fill="#c00">'
            f"{escape(threshold_label)} {escape(_fmt(float(threshold)))}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def _bar_legend(legend: Sequence[str]) -> list[str]:
    out = []
    lx = 8
    for i, name in enumerate(legend):
        colour = PALETTE[i % len(PALETTE)]
        out.append(
            f'<rect x="{lx}" y="27" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="36" font-size="11">{escape(name)}</text>'
        )
        lx += 24 + 7 * len(name)
    return out


def _bar_grid(f: _Frame, ticks: list[float]) -> list[str]:
    """The value ticks under the groups, and the zero line."""
    top, base = f.top, f.top + f.ph
    out = []
    for v in ticks:
        x = _num(f.sx(v))
        out.append(
            f'<line x1="{x}" x2="{x}" y1="{top}" y2="{base}" stroke="#eee"/>'
            f'<text x="{x}" y="{base + 14}" text-anchor="middle" font-size="10" class="tick">'
            f"{escape(_fmt(v))}</text>"
        )
    zero = _num(f.sx(0.0))
    out.append(f'<line x1="{zero}" x2="{zero}" y1="{top}" y2="{base}" stroke="#888"/>')
    return out


def _bar_group(
    f: _Frame, gi: int, b: Bar, legend: Sequence[str], group_h: int, bar_height: int
) -> list[str]:
    """Group ``gi``: its label and one bar per value (a gap for a missing one)."""
    gy = f.top + gi * group_h
    out = [
        f'<text x="{f.left - 6}" y="{gy + group_h / 2 + 3:.1f}" text-anchor="end" '
        f'font-size="11" class="bar-label">{escape(b.label[:40])}</text>'
    ]
    for si, bv in enumerate(list(b.values)[: max(1, len(legend))]):
        if not _ok(bv) or bv is None:
            continue
        v = float(bv)
        x0, x1 = f.sx(min(0.0, v)), f.sx(max(0.0, v))
        colour = PALETTE[si % len(PALETTE)]
        name = legend[si] if si < len(legend) else ""
        out.append(
            f'<rect x="{_num(x0)}" y="{gy + 4 + si * bar_height}" '
            f'width="{_num(max(1.0, x1 - x0))}" height="{bar_height - 1}" fill="{colour}" '
            f'class="bar s{si % len(PALETTE)}"><title>{escape(b.label)} {escape(name)}: '
            f"{escape(_fmt(float(v)))}</title></rect>"
        )
    return out


def score_gauge(
    value: float | None,
    threshold: float | None,
    *,
    bad_when: str = "above",
    title: str = "",
    width: int = 220,
    height: int = 26,
) -> str:
    """A small bar: where ``value`` sits against ``threshold`` (red past it).

    ``bad_when`` is "above" (e.g. norm ratio > max) or "below" (e.g. cosine < min).
    """
    if not _ok(value) or value is None:
        return _empty(width, height, title or "score", "n/a")
    v = float(value)
    th = float(threshold) if threshold is not None and _ok(threshold) else None
    cands = [v, 0.0] + ([th] if th is not None else [])
    lo, hi = min(cands), max(cands)
    span = (hi - lo) or 1.0
    lo, hi = lo - 0.1 * span, hi + 0.1 * span

    def sx(x: float) -> float:
        return 4 + (x - lo) / (hi - lo) * (width - 8)

    bad = th is not None and (v > th if bad_when == "above" else v < th)
    colour = "#c0392b" if bad else "#2e7d32"
    t = escape(title or "score")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="gauge" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{t}">',
        f"<title>{t}: {escape(_fmt(v))}"
        + (f" (threshold {escape(_fmt(th))})" if th is not None else "")
        + "</title>",
        f'<rect x="4" y="8" width="{width - 8}" height="10" fill="#eee"/>',
    ]
    x0, x1 = sx(min(0.0, v)), sx(max(0.0, v))
    out.append(
        f'<rect x="{_num(x0)}" y="8" width="{_num(max(1.0, x1 - x0))}" height="10" '
        f'fill="{colour}" class="{"bad" if bad else "ok"}"/>'
    )
    if th is not None:
        x = _num(sx(th))
        out.append(f'<line x1="{x}" x2="{x}" y1="2" y2="24" stroke="#000" stroke-width="2"/>')
    out.append("</svg>")
    return "".join(out)
