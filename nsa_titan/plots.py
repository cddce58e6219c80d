"""Line charts as PNG files, drawn with Pillow (installed with tensorboard): the recall evaluation's
accuracy by distance and the benchmark reports' curves."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

PALETTE = [(200, 40, 40), (40, 80, 200), (40, 150, 40), (200, 140, 20), (130, 50, 170), (20, 150, 160)]
Series = dict[float, float]


def line_chart(series: dict[str, Series], path: Path | str, title: str, xlabel: str, ylabel: str,
               y_range: tuple[float, float] | None = None, marks: dict[str, float] | None = None,
               bands: dict[str, tuple[Series, Series]] | None = None) -> None:
    """One line per entry of `series` ({x: y}), a legend, optional vertical `marks` ({label: x}) and
    shaded `bands` ({name: (low, high)}) around the line of the same name."""
    w, h, pad = 820, 500, 70
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    xs = sorted({x for s in series.values() for x in s})
    values = [v for s in [*series.values(), *(b for pair in (bands or {}).values() for b in pair)] for v in s.values()]
    lo, hi = y_range or (min(values), max(values))
    fx = lambda x: pad + (x - xs[0]) / max(1e-9, xs[-1] - xs[0]) * (w - 2 * pad)  # noqa: E731
    fy = lambda y: h - pad - (y - lo) / max(1e-9, hi - lo) * (h - 2 * pad)  # noqa: E731
    d.line([(pad, pad), (pad, h - pad), (w - pad, h - pad)], fill="black", width=2)
    for k in range(5):
        y = lo + (hi - lo) * k / 4
        d.text((8, fy(y) - 6), f"{y:.3g}", fill="black")
        d.line([(pad - 4, fy(y)), (w - pad, fy(y))], fill=(225, 225, 225))
    for x in xs[::max(1, len(xs) // 12)]:
        d.text((fx(x) - 10, h - pad + 8), f"{x:g}", fill="black")
    for label, x in (marks or {}).items():
        if xs[0] <= x <= xs[-1]:
            d.line([(fx(x), pad), (fx(x), h - pad)], fill=(160, 160, 160))
            d.text((fx(x) + 3, pad + 2), label, fill=(120, 120, 120))
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        if bands and name in bands:
            low, high = bands[name]
            outline = [(fx(x), fy(high[x])) for x in sorted(high)] + [(fx(x), fy(low[x])) for x in sorted(low)[::-1]]
            d.polygon(outline, outline=tuple(c + (255 - c) * 2 // 3 for c in color))
        points = [(fx(x), fy(s[x])) for x in sorted(s)]
        d.line(points, fill=color, width=3)
        for px, py in points:
            d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)
        d.text((w - pad - 220, pad + 18 * i), name, fill=color)
    d.text((pad, 12), title, fill="black")
    d.text((w // 2 - 40, h - 28), xlabel, fill="black")
    d.text((8, pad - 24), ylabel, fill="black")
    img.save(path)
