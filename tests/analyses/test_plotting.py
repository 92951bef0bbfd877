"""The shared plot helpers: what every saved figure promises."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from lmscope.analyses import entropy_plots, norms_plots
from lmscope.analyses.plotting import MANY_LINES, pyplot, save, sparse_ticks


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


# ---------------------------------------------------------------- plots of real-model sizes


def test_sparse_ticks_keep_about_most_labels_and_always_the_last():
    assert sparse_ticks(8) == list(range(8))  # few: every one
    assert sparse_ticks(32) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 31]  # 30 moved, not added
    assert sparse_ticks(33) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 32]
    assert sparse_ticks(1) == [0] and sparse_ticks(0) == []


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot modules would save, by file name."""
    saved = {}
    made = []
    for module in (entropy_plots, norms_plots):
        monkeypatch.setattr(module, "save", lambda fig, path: (made.append(fig), saved.setdefault(path.name, fig)))
    yield saved
    for fig in made:  # save() would have closed them
        pyplot().close(fig)


def entropy_results(layers, heads, n, steps, windows=None):
    bound = np.tile(np.log(np.arange(n) + 1.0), (layers, 1))
    for layer, w in (windows or {}).items():
        bound[layer] = np.log(np.minimum(np.arange(n) + 1.0, w))
    rng = np.random.default_rng(0)
    out = []
    for _ in steps:
        by_position = bound[:, None, :] * rng.uniform(0.3, 1.0, (layers, heads, 1))
        out.append({"mean": by_position.mean(2), "by_position": by_position, "bound": bound,
                    "sliding_windows": dict(windows or {})})
    return out


def test_a_32_layer_model_names_its_layers_by_a_colour_bar_and_a_long_context_reads_on_a_log_axis(drawn, tmp_path):
    """32 layer entries made a legend that covered the curves; ln(t+1) over 2048 positions rose in the first
    few per cent of a linear axis. Windowed layers are marked on the heatmap."""
    layers, heads, n = 32, 4, 2048
    params = types.SimpleNamespace(dataset="wiki", seq_len=n)
    results = entropy_results(layers, heads, n, [0], windows={0: 512, 2: 512})
    entropy_plots.draw(tmp_path, params, [0], ["m"], results, [None], over_training=False)
    fig = drawn["entropy_by_position.png"]
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "t = 0" in ax.get_xlabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert not any(t.startswith("layer ") for t in legend) and len(legend) == 2  # the bounds only
    assert [a.get_ylabel() for a in fig.axes[1:]] == ["layer"]  # the colour bar
    lines = [line for line in ax.get_lines() if line.get_label().startswith("_")]  # the layers' curves
    assert len(lines) == layers and lines[0].get_linestyle() == "--" and lines[1].get_linestyle() == "-"
    # position 0 left off the log axis; 2047 positions are more than the axis has pixels: a log-spaced
    # subset from the first to the last, every one below ~100 among them, each at its own mean
    x = lines[5].get_xdata()
    assert x[0] == 1 and x[-1] == n - 1 and (np.diff(x) > 0).all() and len(x) <= entropy_plots.DRAWN_POSITIONS
    assert set(range(1, 100)) <= set(x.tolist())
    np.testing.assert_allclose(lines[5].get_ydata(), results[0]["by_position"][5].mean(0)[x])
    heat = drawn["entropy_heatmap.png"].axes[0]
    ticks = [t.get_text() for t in heat.get_yticklabels()]
    assert ticks[:3] == ["0 W", "1", "2 W"] and ticks[-1] == "31" and len(ticks) == layers  # every layer

    few = entropy_results(4, heads, 128, [0])
    drawn.clear()
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=128), [0], ["m"], few, [None],
                       over_training=False)
    ax = drawn["entropy_by_position.png"].axes[0]
    assert ax.get_xscale() == "linear" and len(drawn["entropy_by_position.png"].axes) == 1
    assert [t.get_text() for t in ax.get_legend().get_texts()][:4] == [f"layer {i}" for i in range(4)]


def test_the_heatmap_spends_its_colours_on_the_entropies_there_are(drawn, tmp_path):
    """Heads at 2.6–3.9 of a 3.9-nat ceiling used the top third of a 0-based scale: the scale starts at the
    lowest head rounded down to half a nat, up to the uniform value; a focused head keeps it at 0."""
    results = entropy_results(4, 4, 128, [0])
    uniform = float(results[0]["bound"].mean(1).max())
    results[0]["mean"] = np.linspace(2.61, 3.85, 16).reshape(4, 4)
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=128), [0], ["m"], results, [None],
                       over_training=False)
    image = drawn["entropy_heatmap.png"].axes[0].get_images()[0]
    assert image.get_clim() == pytest.approx((2.5, uniform))
    assert f"colour scale 2.5 – {uniform:.2f} nats (top: uniform attention, the mean of ln(t+1))" in \
        drawn["entropy_heatmap.png"].axes[0].get_title()
    results[0]["mean"][2, 1] = 0.3  # one head looks at one token
    drawn.clear()
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=128), [0], ["m"], results, [None],
                       over_training=False)
    assert drawn["entropy_heatmap.png"].axes[0].get_images()[0].get_clim() == pytest.approx((0.0, uniform))


def test_checkpoints_spread_over_decades_sit_on_a_symmetric_log_step_axis(drawn, tmp_path):
    """Pythia-style checkpoints 0, 1, 2, 4, …, 143000: on a linear axis all but the last few sit at x ≈ 0.
    More than 10 heads: tab10's colours would repeat, so a colour map and a colour bar name them."""
    steps = [0, 1, 2, 4, 8, 16, 512, 1000, 33000, 143000]
    results = entropy_results(2, 12, 16, steps)
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=16), steps,
                       [f"run@step{s}" for s in steps], results, [None] * len(steps), over_training=True)
    fig = drawn["entropy_over_training.png"]
    panels = [ax for ax in fig.axes if ax.get_title().startswith("layer")]
    assert [ax.get_xscale() for ax in panels] == ["symlog", "symlog"]
    assert any(ax.get_ylabel() == "head" for ax in fig.axes)  # the colour bar
    assert len({line.get_color() for line in panels[0].get_lines()[:12]}) == 12
    by_layer = drawn["entropy_by_layer.png"]
    assert len(steps) > MANY_LINES and by_layer.axes[-1].get_ylabel() == "model"
    assert [t.get_text() for t in by_layer.axes[-1].get_yticklabels()][-1] == "step 143000"


def test_four_layers_over_training_fill_a_two_by_two_grid_and_the_uniform_line_lies_beneath(drawn, tmp_path):
    """Four layers on three columns left two empty panels, a third of the figure; the uniform line, drawn
    over the curves, hid an untrained model's curve, which lies on it."""
    steps = [0, 100, 200]
    results = entropy_results(4, 2, 16, steps)
    results[0]["mean"] = results[0]["bound"].mean(1, keepdims=True).repeat(2, 1)  # step 0: uniform attention
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=16), steps,
                       [f"run@step{s}" for s in steps], results, [None] * 3, over_training=True)
    panels = [ax for ax in drawn["entropy_over_training.png"].axes if ax.get_title().startswith("layer")]
    assert len(panels) == 4 and len({round(ax.get_position().x0, 3) for ax in panels}) == 2
    assert not [ax for ax in drawn["entropy_over_training.png"].axes if not ax.get_visible() or not ax.axison]
    ax = drawn["entropy_by_layer.png"].axes[0]
    (uniform,) = [line for line in ax.get_lines() if line.get_label().startswith("uniform")]
    step0 = ax.get_lines()[0]
    np.testing.assert_allclose(step0.get_ydata(), uniform.get_ydata()[0])  # the curve on the line ...
    assert step0.get_zorder() > uniform.get_zorder()  # ... drawn over it


def test_the_inner_loss_band_stops_at_the_5th_percentile_and_ln_vocab_is_drawn(drawn, tmp_path):
    """Per-token cross-entropy is skewed: mean − std ≤ 0 was drawn at half the smallest loss, six decades
    below every curve."""
    rng = np.random.default_rng(1)
    losses = np.stack([rng.gamma(0.5, m / 0.5, 400) for m in (9.0, 6.0, 3.0)], 1) + 1e-7
    kept = np.ones(400, bool)
    norms_plots.plot_inner_loss(tmp_path / "inner_loss.png", losses, kept, None, "m", vocab_size=1000)
    ax = drawn["inner_loss.png"].axes[0]
    band = ax.collections[0].get_paths()[0].vertices
    lower = band[1:4, 1]  # fill_between's outline: the lower edge first
    np.testing.assert_allclose(lower, np.quantile(losses, 0.05, axis=0), rtol=1e-6)
    assert (losses.mean(0) - losses.std(0) < lower).all()
    reference = [line for line in ax.get_lines() if "uniform guess" in line.get_label()]
    assert len(reference) == 1 and reference[0].get_ydata()[0] == pytest.approx(math.log(1000))
    assert "cut at the 5th percentile" in [t.get_text() for t in ax.get_legend().get_texts()][0]


def test_a_few_far_larger_trajectories_are_left_out_of_the_3d_plot_and_counted(drawn, tmp_path):
    rng = np.random.default_rng(2)
    coords = rng.normal(0, 1, (40, 6, 3))
    coords[[3, 17]] *= 50  # massive activations
    far = norms_plots.far_trajectories(coords)
    assert np.flatnonzero(far).tolist() == [3, 17]
    norms_plots.plot_pca3d(tmp_path / "pca3d.png", coords, np.array([0.5, 0.2, 0.1]), False, "m")
    ax = drawn["pca3d.png"].axes[0]
    assert "m: 38 trajectories" in ax.get_title() and "(2 far larger trajectories not drawn" in ax.get_title()
    from mpl_toolkits.mplot3d.art3d import Line3DCollection

    assert sum(isinstance(c, Line3DCollection) for c in ax.collections) == 1  # the polylines
    (starts,) = [c for c in ax.collections if c.get_label() == "start (h0)"]
    assert len(starts.get_offsets()) == 38  # one per trajectory drawn, the two far ones left out
    (points,) = [c for c in ax.collections if c.get_array() is not None and not isinstance(c, Line3DCollection)]
    assert len(points.get_offsets()) == 38 * 6  # every point of those, coloured by layer
    # equal units along the three axes (the default box squeezed PC3 by a quarter): the box is the drawn spans
    spans = np.ptp(coords[~far].reshape(-1, 3), axis=0)
    aspect = np.asarray(ax.get_box_aspect())
    np.testing.assert_allclose(aspect / aspect[0], spans / spans[0], rtol=1e-6)
    half = rng.normal(0, 1, (40, 6, 3))
    half[:20] *= 50  # half of them that large: no outliers, two kinds of trajectory
    assert not norms_plots.far_trajectories(half).any()


def test_norms_spanning_decades_go_on_a_log_axis(drawn, tmp_path):
    norms = np.outer(np.ones(50), [1.0, 5.0, 20.0, 80.0]) * np.random.default_rng(3).uniform(0.8, 1.2, (50, 4))
    norms_plots.plot_norms(tmp_path / "norms.png", norms, np.arange(5), False, "m", 10.0, 60.0)
    assert drawn["norms.png"].axes[0].get_yscale() == "log"
    drawn.clear()
    norms_plots.plot_norms(tmp_path / "norms.png", norms[:, 1:3], np.arange(5), False, "m", 10.0, 60.0)
    assert drawn["norms.png"].axes[0].get_yscale() == "linear"


def test_the_attention_study_plot_of_many_layers_names_them_by_a_colour_bar(monkeypatch, tmp_path):
    from lmscope.analyses import attention_approx

    saved = {}
    monkeypatch.setattr(attention_approx, "save", lambda fig, path: saved.setdefault(path.name, fig))
    ks = [16, 32, 64]
    panels = {("performer", layer): (ks, [0.5, 0.3, 0.2], [0.4, 0.2, 0.1], [0.6, 0.4, 0.3]) for layer in range(12)}
    attention_approx.plot_attention_approx(tmp_path / "attention_approx.png", panels, {"performer": (ks, [0.2, 0.4, 0.8])},
                          title="t", windows={layer: 8 for layer in range(12)})
    fig = saved["attention_approx.png"]
    ax = fig.axes[0]
    assert not any(t.get_text().startswith("layer") for t in ax.get_legend().get_texts())
    assert any(a.get_ylabel() == "layer" for a in fig.axes)  # the colour bar
    assert not ax.collections  # twelve min–max bands would smear the panel
    assert "12 layers slide over 8 keys in the model" in ax.get_title()
    assert [line.get_ydata()[0] for line in ax.get_lines() if "zero output" in line.get_label()] == [1.0]


def test_the_norms_and_inner_loss_titles_carry_the_numbers_a_reader_needs(drawn, tmp_path):
    """norms.png: how many trajectories, the sequence and pair shares and the null 100·2^-(pairs);
    inner_loss.png: kept/total and the rule, or that nothing met it."""
    norms = np.random.default_rng(4).uniform(1, 2, (30, 4))
    norms_plots.plot_norms(tmp_path / "norms.png", norms, np.arange(3), False, "m on d", 10.0, 60.0)
    title = drawn["norms.png"].axes[0].get_title()
    assert title.startswith("m on d: 30 trajectories") and "10.0 % of sequences, 60.0 % of pairs (null 12.5 %)" in title
    mean = [line for line in drawn["norms.png"].axes[0].get_lines() if line.get_label() == "mean"][0]
    np.testing.assert_allclose(mean.get_ydata(), norms.mean(0))
    # below: per step h_{l-1} → h_l the % of trajectories not falling, the sequence % won or lost step by step
    bars = drawn["norms.png"].axes[1].patches
    expected = [100 * sum(norms[s, l] >= norms[s, l - 1] for s in range(30)) / 30 for l in (1, 2, 3)]
    assert [b.get_x() + b.get_width() / 2 for b in bars] == pytest.approx([1, 2, 3])
    assert [b.get_height() for b in bars] == pytest.approx(expected)
    losses = np.random.default_rng(5).uniform(1, 3, (30, 3))
    kept = np.zeros(30, bool)
    kept[:12] = True
    norms_plots.plot_inner_loss(tmp_path / "inner_loss.png", losses, kept, 1.5, "m on d")
    ax = drawn["inner_loss.png"].axes[0]
    assert "kept 12/30 trajectories (final loss ≤ 1.5)" in ax.get_title()
    mean = [line for line in ax.get_lines() if line.get_label() == "mean"][0]
    np.testing.assert_allclose(mean.get_ydata(), losses[:12].mean(0))  # over the kept ones only
    drawn.clear()
    norms_plots.plot_inner_loss(tmp_path / "inner_loss.png", losses, np.zeros(30, bool), 0.5, "m on d")
    assert "no sample meets final loss ≤ 0.5 (0/30); showing all 30" in drawn["inner_loss.png"].axes[0].get_title()


def test_near_uniform_entropies_are_not_zoomed_to_a_ten_thousandth_of_a_nat(drawn, tmp_path):
    layers, heads, n = 3, 2, 64
    bound = np.tile(np.log(np.arange(n) + 1.0), (layers, 1))
    by_position = bound[:, None, :] * (1 - 1e-5 * np.arange(heads)[None, :, None])  # all but uniform
    results = [{"mean": by_position.mean(2), "by_position": by_position, "bound": bound, "sliding_windows": {}}]
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=n), [0], ["m"], results, [None],
                       over_training=False)
    lo, hi = drawn["entropy_by_layer.png"].axes[0].get_ylim()
    assert hi - lo >= 0.1  # nats: the heads differ by 3e-5 of ln(t+1) (mean 3.2 nats); the axis spans more
    assert lo <= by_position.mean((1, 2)).min() and hi >= bound.mean(1).max()  # the data and the bound in view


@pytest.mark.parametrize("values, scale", [
    ([4.6, 5.1, 5.6], (4, 6)),  # a trial's job: every cell was black on a 4–100 scale
    ([97.2, 100.0], (97, 100)),
    ([100.0, 100.0], (99, 100)),  # all at the top: still a range
    ([0.0, 0.0], (0, 1)),
    ([50.0], (50, 51)),
])
def test_the_near_uniform_map_spans_the_shares_there_are(values, scale):
    assert entropy_plots.near_uniform_scale(np.array(values)) == scale


@pytest.mark.parametrize("lo, hi", [(7.6, 21.0), (3.3, 42.0), (0.02, 1.2), (0.2, 11.0), (1e-4, 1.0), (1e-7, 1e-3)])
def test_a_log_y_axis_is_labelled_in_plain_numbers_a_reader_can_use(lo, hi):
    """An inner loss between 7.6 and 21 nats had labels at 8, 9, 10 only; a relative error from 0.02 to 1.2 had
    10⁻¹ and 10⁰; a span of two decades read 6e-01. Now: at least three labels inside the axis, written as
    numbers."""
    from lmscope.analyses.plotting import readable_log_y

    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [lo, hi])
    ax.set_yscale("log")
    readable_log_y(ax)
    fig.canvas.draw()
    bottom, top = ax.get_ylim()
    inside = [t for t in ax.get_yticklabels() if t.get_text() and bottom <= t.get_position()[1] <= top]
    texts = [t.get_text() for t in inside]
    assert len(texts) >= 3, texts
    assert all(float(t) == pytest.approx(label.get_position()[1]) for t, label in zip(texts, inside)), texts
    assert not any("e" in t for t in texts), texts  # 0.00001, not 1e-05 beside 0.0001
    pyplot().close(fig)


def test_the_training_curve_ends_on_its_trend_and_its_ticks_are_the_checkpoints(monkeypatch, tmp_path):
    """loss.png's running median shrank symmetrically at the end, so its last point was the last batch's loss
    alone: one high batch read as the loss turning up at the end. The x ticks are the checkpoint steps."""
    from lmscope.analyses import train
    from lmscope.params.train import TrainParams

    saved = []
    monkeypatch.setattr(train, "save", lambda fig, path: saved.append(fig))
    losses = [5.0] * 599 + [9.0]  # flat, then one bad batch
    history = {"train": list(zip(range(1, 601), losses)), "val": [(0, 6.0), (600, 5.0)],
               "lr": [(s, 1e-3) for s in range(1, 601)]}
    train._plot(tmp_path / "loss.png", "r", TrainParams(dataset="d", steps=600), history, 6.5, [0, 150, 300, 450, 600])
    ax = saved[0].axes[0]
    (trend,) = [line for line in ax.get_lines() if line.get_label().startswith("train (running median")]
    assert trend.get_ydata()[0] == 5.0 and trend.get_ydata()[-1] == 5.0
    assert list(ax.get_xticks()) == [0, 150, 300, 450, 600]
    pyplot().close(saved[0])


def test_a_silent_head_reads_silent_on_the_operator_heatmap_and_leaves_the_colour_scale_alone(monkeypatch, tmp_path):
    """A head with a zero output projection has no D (NaN): its cell says "silent" in black (white text on a
    blank cell could not be read) and the scale still runs from 0 to the largest D there is. A small D keeps two
    significant digits: 0.0039 read "0.00", which the subtitle says means the same map for every input."""
    from lmscope.analyses import operator_plots

    saved = []
    monkeypatch.setattr(operator_plots, "save", lambda fig, path: saved.append(fig))
    head = np.linspace(0.1, 0.9, 2 * 3 * 4).reshape(2, 3, 4)
    head[:, 1, 2] = np.nan
    head[:, 2, 0] = 0.0039
    operator_plots.heatmaps(tmp_path / "operator_heatmap.png", head, ["uniform", "mean"], "m on wiki", 1024)
    fig = saved[0]
    for ax, values in zip(fig.axes[:2], head):
        cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in ax.texts}
        assert len(cells) == 12
        assert cells[1, 2].get_text() == "silent" and cells[1, 2].get_color() == "black"
        assert [cells[0, h].get_text() for h in range(4)] == [f"{v:.2g}" for v in values[0]]
        assert cells[2, 0].get_text() == "0.0039"
        assert ax.get_images()[0].get_clim() == pytest.approx((0.0, 0.9))
    assert "replaced by uniform weights" in fig.axes[0].get_title()
    pyplot().close(fig)


def test_scatter_names_of_heads_at_nearly_the_same_spot_do_not_write_over_each_other(monkeypatch, tmp_path):
    """Heads 2.2 and 3.2 at almost the same (c, Δ) printed "2.2" over "3.2". Each name now takes the first free
    place around its point; one with none stays unnamed and is counted. Checked on the figure as saved."""
    from lmscope.analyses import pruning_plots

    saved = []
    monkeypatch.setattr(pruning_plots, "save", lambda fig, path: saved.append(fig))
    rng = np.random.default_rng(0)
    contribution = rng.uniform(0.0, 1.0, (4, 4))
    harm = rng.uniform(0.0, 1.0, (4, 4))
    contribution[3, 2], harm[3, 2] = contribution[2, 2] + 1e-4, harm[2, 2] + 1e-4  # on top of each other
    contribution[:2, :], harm[:2, :] = 0.5 + 1e-4 * np.arange(8).reshape(2, 4), 0.5  # eight in one spot
    pruning_plots.contribution_against_ablation(tmp_path / "c.png", contribution, harm, 0.3, "m on wiki", 100)
    fig = saved[0]
    save(fig, tmp_path / "c.png")  # laid out and written as the job writes it
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    names = [t for t in ax.texts if t.get_text()[0].isdigit() and "crowded" not in t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in names]
    assert not [(a.get_text(), b.get_text()) for i, (a, p) in enumerate(zip(names, boxes))
                for b, q in zip(names[i + 1:], boxes[i + 1:]) if p.overlaps(q)]
    named = {t.get_text() for t in names}
    assert {"2.2", "3.2"} <= named and len(named) == len(names)
    crowded = [t.get_text() for t in ax.texts if "crowded" in t.get_text()]
    assert len(named) + sum(int(c.split()[0]) for c in crowded) == 16


def test_operator_and_pruning_lines_by_layer_stop_short_of_viridis_pale_top(monkeypatch, tmp_path):
    """The last layer's line was drawn in viridis' top colour, a yellow that vanished on white; past MANY_LINES
    layers a colour bar names them instead of a legend, with the colours the lines have."""
    from matplotlib.colors import to_rgba

    from lmscope.analyses import operator_plots, pruning_plots

    saved = []
    for module in (operator_plots, pruning_plots):
        monkeypatch.setattr(module, "save", lambda fig, path: saved.append(fig))
    pale = np.array(pyplot().get_cmap("viridis")(1.0))
    for layers in (4, 24):
        saved.clear()
        operator_plots.by_layer_and_position(tmp_path / "p.png", np.ones((1, layers)), np.ones((1, layers, 16)),
                                             ["mean"], "m")
        over = {"steps": [0, 10], "prunable_fraction": {"smallest_first": [0.1, 0.2]},
                "mean_loss_increase": {"smallest_first": [0.01, 0.02]}, "baseline_loss": [5.0, 4.0]}
        pruning_plots.over_training(tmp_path / "o.png", over, np.ones((2, layers, 2)), "m")
        for fig, ax in ((saved[0], saved[0].axes[1]), (saved[1], saved[1].axes[2])):
            colours = np.array([to_rgba(line.get_color()) for line in ax.get_lines()])
            assert len(colours) >= layers and not np.isclose(colours, pale, atol=0.05).all(1).any()
            bars = [a for a in fig.axes if a.get_ylabel() == "layer"]
            assert (ax.get_legend() is None) == (layers > MANY_LINES) == (len(bars) == 1)
            pyplot().close(fig)


def test_an_untrained_models_curve_on_the_uniform_line_is_told_from_it(drawn, tmp_path):
    """Step 0's curve (viridis' first colour, a near-black purple) lay on black dashes and read as the uniform
    line itself: the bound is grey in the by-layer and by-position plots (and beneath the curves by layer)."""
    from matplotlib.colors import to_rgb

    results = entropy_results(4, 4, 128, [0, 300])
    results[0]["mean"] = results[0]["bound"].mean(1, keepdims=True).repeat(4, 1)  # step 0: uniform attention
    entropy_plots.draw(tmp_path, types.SimpleNamespace(dataset="wiki", seq_len=128), [0, 300], ["r@step0", "r@step300"],
                       results, [None, None], over_training=True)
    for name in ("entropy_by_layer.png", "entropy_by_position.png"):
        ax = drawn[name].axes[0]
        (bound,) = [line for line in ax.get_lines() if line.get_label().startswith("uniform")]
        curves = [line for line in ax.get_lines() if line is not bound]
        if name == "entropy_by_layer.png":
            assert curves and all(line.get_zorder() > bound.get_zorder() for line in curves)
        grey = np.array(to_rgb(bound.get_color()))
        assert np.allclose(grey, grey[0]) and 0.4 < grey[0] < 0.7, name
        assert min(np.abs(np.array(to_rgb(line.get_color())) - grey).max() for line in curves) > 0.15, name


def test_the_attention_study_legends_sit_below_their_panels(monkeypatch, tmp_path):
    """Linformer's legend covered layer 3's curve where it ran through the panel's upper right."""
    from lmscope.analyses import attention_approx

    saved = {}
    monkeypatch.setattr(attention_approx, "save", lambda fig, path: saved.setdefault(path.name, fig))
    ks = [8, 16, 32, 64]
    panels = {(m, layer): (ks, [0.05 / (layer + 1), 0.03, 0.02, 0.01], None, None)
              for m in ("linformer", "performer") for layer in range(4)}
    attention_approx.plot_attention_approx(tmp_path / "attention_approx.png", panels,
                                           {"linformer": (ks, [0.45, 0.5, 0.6, 0.7]), "performer": (ks, [1, 2, 3, 4])},
                                           title="t")
    fig = saved["attention_approx.png"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels_drawn = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels_drawn) == 3
    for ax in panels_drawn:
        legend, box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.y1 <= box.y0 and fig.bbox.contains(legend.x0, legend.y0)  # below the panel, in the figure
    pyplot().close(fig)


def test_exact_linformer_errors_sit_on_the_bottom_edge_and_leave_the_axis_to_the_data(monkeypatch, tmp_path):
    """Linformer at k ≥ N is exact up to rounding (~1e-7): drawn at 1e-4, those points stretched the log axis down
    three decades and squeezed the errors at k = 8 … 64 (0.25 … 1) into its top quarter."""
    from lmscope.analyses import attention_approx

    saved = {}
    monkeypatch.setattr(attention_approx, "save", lambda fig, path: saved.setdefault(path.name, fig))
    ks = [8, 16, 32, 64, 128, 256]
    panels = {("linformer", layer): (ks, [1.0, 0.7, 0.5, 0.25, 2e-7, 1e-7], None, None) for layer in range(2)}
    attention_approx.plot_attention_approx(tmp_path / "attention_approx.png", panels, {"linformer": (ks, [0.5] * 6)},
                                           title="t", seq_len=128)
    fig = saved["attention_approx.png"]
    ax = fig.axes[0]
    assert ax.get_ylim()[0] > 0.05  # the data's decade, not the floor's
    marks = [line for line in ax.get_lines() if line.get_marker() == "v" and len(line.get_xdata())]
    assert len(marks) == 2 and all(list(m.get_xdata()) == [128, 256] for m in marks)
    assert all(m.get_transform() == ax.get_xaxis_transform() and m.get_ydata()[0] < 0.1 for m in marks)  # bottom edge
    curves = [line for line in ax.get_lines() if line.get_label().startswith("layer")]
    assert [list(c.get_xdata()) for c in curves] == [ks[:4]] * 2
    assert any("exact up to rounding" in t.get_text() for t in ax.get_legend().get_texts())
    pyplot().close(fig)


def test_the_first_order_panel_keeps_its_axes_to_the_points(monkeypatch, tmp_path):
    """The equality line was drawn from min to max of both quantities: a largest single-head loss increase of
    0.033 stretched the first-order axis (points within −0.002 … 0.005) to 0.033, the points in 15 % of it."""
    from lmscope.analyses import pruning_plots

    saved = []
    monkeypatch.setattr(pruning_plots, "save", lambda fig, path: saved.append(fig))
    rng = np.random.default_rng(1)
    contribution, importance = rng.uniform(0, 1, (4, 4)), rng.uniform(0, 1, (4, 4))
    first_order = rng.uniform(-0.002, 0.005, (4, 4))
    harm = rng.uniform(0.0, 0.033, (4, 4))
    pruning_plots.contribution_against_importance(tmp_path / "i.png", contribution, importance,
                                                  {"rank_correlation": 0.5, "first_order_rank_correlation": 0.4},
                                                  "m on wiki", 8, first_order=first_order, harm=harm)
    ax = saved[0].axes[1]
    lo, hi = ax.get_xlim()
    assert hi - lo < 2 * (first_order.max() - first_order.min())
    assert any(line.get_label() == "equal" for line in ax.get_lines())
    pyplot().close(saved[0])


def test_all_six_pruning_orders_over_training_are_drawn_and_coinciding_ones_are_said(monkeypatch, tmp_path):
    """Five markers for six orders: a job with every order over checkpoints failed at its last plot. Orders with
    the same prunable fractions lie on one another; the legend says which equals which."""
    from lmscope.analyses import pruning_plots

    saved = []
    monkeypatch.setattr(pruning_plots, "save", lambda fig, path: saved.append(fig))
    orders = list(pruning_plots.ORDER_STYLE)
    assert len(orders) == 6
    fractions = {o: [1.0, 0.875] for o in orders}
    fractions["largest_first"], fractions["random"] = [0.125, 0.125], [0.5, 0.625]
    over = {"steps": [0, 600], "prunable_fraction": fractions, "mean_loss_increase": {o: [0.01, 0.02] for o in orders},
            "baseline_loss": [7.6, 4.7]}
    pruning_plots.over_training(tmp_path / "o.png", over, np.ones((2, 2, 2)), "m")
    ax = saved[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    first = pruning_plots.ORDER_STYLE["smallest_first"][0]
    assert labels[0] == first and labels[1] == pruning_plots.ORDER_STYLE["largest_first"][0]
    assert sum(f"(= {first})" in label for label in labels) == 3  # least harm, least important, iterative
    assert len({line.get_marker() for line in ax.get_lines()}) == 6
    pyplot().close(saved[0])
