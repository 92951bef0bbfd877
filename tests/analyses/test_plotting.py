"""The shared plot helpers: what every saved figure promises."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg

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


def test_titles_wider_than_the_figure_wrap_and_keep_every_word(tmp_path):
    """A checkpoint list with long model names made entropy_by_layer.png's title run off both edges."""
    title = ("attention entropy by layer, a-rather-long-run-name@step300 … "
             "a-rather-long-run-name@step6000 on wikitext-2-with-a-long-name")
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ax.plot([0, 1], [0, 1])
    ax.set_title(title)
    fig.suptitle("short")
    save(fig, tmp_path / "long_title.png")
    renderer = FigureCanvasAgg(fig).get_renderer()  # pyplot.close left the figure without a canvas
    extent = ax.title.get_window_extent(renderer)
    assert 0 <= extent.x0 and extent.x1 <= fig.bbox.width, (extent, fig.bbox.width)
    assert ax.title.get_text().count("\n") >= 1
    assert ax.title.get_text().split() == title.split()  # wrapped at spaces, nothing cut
    assert fig._suptitle.get_text() == "short"  # titles that fit are left alone
