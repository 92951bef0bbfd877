"""Shared plot setup of the analyses: matplotlib on the Agg backend, imported only when a plot is drawn."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np


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
    if fig.get_layout_engine() is None:  # a constrained-layout figure (legends below panels) lays itself out
        fig.tight_layout()
        if _wrap_wide_titles(fig):  # the layout moved the axes, and with them their titles' centres
            fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def _wrap_wide_titles(fig) -> bool:
    """Re-wrap every title and suptitle that does not fit inside the figure; True when one changed.

    A title is centred on its axes (a suptitle on the figure), so the room is twice the distance from
    that centre to the nearer edge of the figure.
    """
    if not hasattr(fig.canvas, "get_renderer"):  # a backend that cannot measure text: leave titles be
        return False
    renderer = fig.canvas.get_renderer()
    width_px = fig.bbox.width
    titles = [(ax.title, ax.get_position().x0 + ax.get_position().width / 2) for ax in fig.axes]
    if fig._suptitle is not None:
        titles.append((fig._suptitle, 0.5))
    changed = False
    for title, centre in titles:
        room = 0.96 * 2 * min(centre, 1 - centre) * width_px
        # always wrap the text as written (its own line breaks kept), so a second call re-flows, not re-splits
        original = getattr(title, "_lmscope_unwrapped", None) or title.get_text()
        lines = original.split("\n")
        chars = max(len(line) for line in lines)
        for _ in range(8):  # characters differ in width: shrink the line length until it fits
            width = title.get_window_extent(renderer).width
            if not original or width <= room:
                break
            chars = max(10, min(chars - 1, int(chars * room / width)))
            title.set_text("\n".join(textwrap.fill(line, chars, break_on_hyphens=False) for line in lines))
            title._lmscope_unwrapped = original
            changed = True
    return changed


MANY_LINES = 8  # past this many ordered lines (layers, checkpoints), a colour bar names them, not a legend


class OrderedColours:
    """Colours for lines in an order (layers, heads, checkpoints): a sequential colour map over `values`.

    Up to MANY_LINES lines each gets a legend entry (`label`); past that a legend would cover the data,
    so `label` gives None and `colour_bar` names the colours instead.
    """

    def __init__(self, values, name: str, cmap: str = "viridis"):
        plt = pyplot()
        self.values, self.name = list(values), name
        lo, hi = min(self.values), max(self.values)
        self.norm = plt.Normalize(lo, hi if hi > lo else lo + 1)
        self.cmap = plt.get_cmap(cmap)
        # viridis' and plasma's tops are a pale yellow a thin line vanishes in: stop short of it
        self.top = 0.9 if cmap in ("viridis", "plasma") else 1.0
        self.many = len(self.values) > MANY_LINES

    def __call__(self, i: int):
        return self.cmap(self.top * self.norm(self.values[i]))

    def label(self, text: str) -> str | None:
        return None if self.many else text

    def colour_bar(self, fig, ax, names: list[str] | None = None, **kwargs) -> None:
        """A colour bar naming the lines, when there are too many for a legend; `names` (one per value)
        label its ticks (checkpoints coloured in order, named by their steps)."""
        if not self.many:
            return
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import ListedColormap

        shown = ListedColormap(self.cmap(np.linspace(0, self.top, 256)))
        bar = fig.colorbar(ScalarMappable(norm=self.norm, cmap=shown), ax=ax, label=self.name, **kwargs)
        if names is not None:
            at = sparse_ticks(len(self.values), 10)
            bar.set_ticks([self.values[i] for i in at], labels=[names[i] for i in at])


def sparse_ticks(n: int, most: int = 16) -> list[int]:
    """0 … n−1, every k-th so that about `most` tick labels are written, the last always among them
    (32 layers: 0, 2, 4, …, 28, 31: 30 gives way to 31 rather than crowd it)."""
    step = max(1, -(-n // most))
    at = list(range(0, n, step))
    if at and at[-1] != n - 1:
        if len(at) > 1 and n - 1 - at[-1] <= step / 2:
            at[-1] = n - 1  # moved, not added: two labels one apart would overlap
        else:
            at.append(n - 1)
    return at


def at_least_span(ax, span: float) -> None:
    """Widen the y axis to at least ``span`` around its middle: near-uniform heads a ten-thousandth of a nat
    apart must not fill the panel as if they differed much (ticks 5.24585 … 5.24620)."""
    lo, hi = ax.get_ylim()
    if hi - lo < span:
        middle = (lo + hi) / 2
        ax.set_ylim(middle - span / 2, middle + span / 2)


def readable_log_y(ax) -> None:
    """Label a log y axis in plain numbers (0.2, 0.5, 1, 2, 5, not 6e-01 or 10⁻¹ alone) with enough ticks to
    read values off: evenly spaced round numbers within a decade (8, 10, 12, … 20), 1-2-5 within two and a
    half (1-2-3-5 up to one and a half), powers of ten beyond. Call once the data are drawn (the limits decide)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lo, hi = ax.get_ylim()
    if not (lo > 0 and hi > lo):
        return
    decades = np.log10(hi / lo)
    subs = (1, 2, 3, 5) if decades < 1.5 else (1, 2, 5) if decades < 2.5 else (1,)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]) if decades < 1 else
                               LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: np.format_float_positional(float(f"{v:.6g}"), trim="-")))
    ax.yaxis.set_minor_formatter(NullFormatter())
