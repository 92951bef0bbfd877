"""Shared plot setup of the analyses: matplotlib on the Agg backend, imported only when a plot is drawn."""

from __future__ import annotations

import sys
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
    0.0004 … 0.0007) makes a 0.0002-nat spread read like a large one.
    """
    from matplotlib.ticker import ScalarFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if isinstance(axis.get_major_formatter(), ScalarFormatter):
                axis.get_major_formatter().set_useOffset(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
