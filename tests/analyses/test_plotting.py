"""The shared plot helpers: what every saved figure promises."""

from __future__ import annotations

from lmscope.analyses.plotting import pyplot, save


def test_saved_figures_label_ticks_with_absolute_values(tmp_path):
    """A 0.0003-nat spread around 3.2 must read as 3.2054 … 3.2057, not as 0.0004 … 0.0007 with a
    "+3.205" tucked in a corner (which made near-equal layers look far apart)."""
    fig, ax = pyplot().subplots()
    ax.plot([0, 1, 2], [3.2054, 3.2056, 3.2057])
    save(fig, tmp_path / "tiny_spread.png")
    fig.canvas.draw()
    assert ax.yaxis.get_major_formatter().get_offset() == ""
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(label.startswith("3.205") for label in labels), labels
    assert (tmp_path / "tiny_spread.png").stat().st_size > 5_000
