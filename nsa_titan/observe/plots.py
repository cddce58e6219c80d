"""Line charts as PNG files, drawn with matplotlib (a `Figure` of its own, no pyplot state, no display
needed): the recall evaluation's accuracy by distance and the benchmark reports' curves."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

Series = dict[float, float]
SIZE_INCHES, DPI = (8.2, 5.0), 100
"""820 x 500 pixels."""


def line_chart(series: dict[str, Series], path: Path | str, title: str, xlabel: str, ylabel: str,
               y_range: tuple[float, float] | None = None, marks: dict[str, float] | None = None,
               bands: dict[str, tuple[Series, Series]] | None = None) -> None:
    """One line per entry of `series` ({x: y}), a legend, optional vertical `marks` ({label: x}) and
    shaded `bands` ({name: (low, high)}) around the line of the same name."""
    fig = Figure(figsize=SIZE_INCHES, dpi=DPI)
    ax = fig.subplots()
    xs = sorted({x for s in series.values() for x in s})
    for name, s in series.items():
        points = sorted(s.items())
        line, = ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=4, label=name)
        if bands and name in bands:
            low, high = bands[name]
            ax.fill_between(sorted(low), [low[x] for x in sorted(low)], [high[x] for x in sorted(low)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    for label, x in (marks or {}).items():
        if xs and xs[0] <= x <= xs[-1]:
            ax.axvline(x, color="0.6", linewidth=1)
            ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                        textcoords="offset points", color="0.45")
    if y_range:
        ax.set_ylim(*y_range)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, color="0.9")
    ax.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=DPI)
