"""Shared plot setup of the analyses: matplotlib on the Agg backend, imported only when a plot is drawn."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot``; the first import picks the Agg backend (workers have no display).

    Where pyplot is already imported (a notebook) its backend is left alone: switching would close
    the user's open figures.
    """
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> None:
    """Lay out, write at 120 dpi and close the figure (so a long-lived worker does not keep it).

    Tick labels show absolute values: matplotlib's offset notation ("+3.205" in a corner, ticks
    0.0004 … 0.0007) makes a 0.0002-nat spread read like a large one. Titles wider than the figure
    (long model or dataset names) are wrapped onto more lines instead of being cut at its edges.
    """
    from matplotlib.ticker import ScalarFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if isinstance(axis.get_major_formatter(), ScalarFormatter):
                axis.get_major_formatter().set_useOffset(False)
    _wrap_wide_titles(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def _wrap_wide_titles(fig) -> None:
    """Re-wrap every title and suptitle whose rendered width exceeds 95 % of the figure's."""
    if not hasattr(fig.canvas, "get_renderer"):  # a backend that cannot measure text: leave titles be
        return
    renderer = fig.canvas.get_renderer()
    titles = [ax.title for ax in fig.axes] + ([fig._suptitle] if fig._suptitle is not None else [])
    room = 0.95 * fig.bbox.width
    for title in titles:
        for _ in range(4):  # characters differ in width: shrink the line length until it fits
            text = title.get_text()
            width = title.get_window_extent(renderer).width
            if not text or width <= room:
                break
            longest = max(len(line) for line in text.split("\n"))
            chars = max(10, int(longest * room / width) - 1)
            title.set_text("\n".join(textwrap.fill(line, chars, break_on_hyphens=False)
                                     for line in text.split("\n")))
