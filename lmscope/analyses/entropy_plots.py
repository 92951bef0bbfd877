"""Plots of the entropy job: layer × head heatmap, by layer, by position, over training, dimension-wise.

Each reads the per-model results ``entropy.run`` gathers (``results[i]``: mean [L, H], by_position
[L, H, N], bound [L, N], sliding_windows {layer: W}; ``dim_results[i]``: histograms and near-uniform
shares, or None).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import OrderedColours, at_least_span, pyplot, save, sparse_ticks


# the least of the uniform value a y axis of entropies spans (near-uniform models differ by 1e-4 nats)
NATS_IN_VIEW = 0.05
DRAWN_POSITIONS = 1024  # points per line in entropy_by_position.png: about as many as the axis has pixels


def draw(out: Path, params, steps, names, results, dim_results, *, over_training: bool) -> None:
    """Every plot of the job into ``out``; ``over_training``: the models are checkpoints of one run (a step axis)."""
    last, last_name = results[-1], names[-1]
    # what a fully mean-pooling head scores: mean of ln(t + 1), less in layers that all slide
    uniform_mean = float(last["bound"].mean(1).max())
    source = (f"{last_name} on {params.dataset}" if len(names) == 1
              else f"{names[0]} … {last_name} on {params.dataset}")
    heatmap(out / "entropy_heatmap.png", last, f"{last_name} on {params.dataset}", uniform_mean)
    checkpoint_names = [f"step {step}" for step in steps] if over_training else names
    by_layer(out / "entropy_by_layer.png", checkpoint_names, results, source, uniform_mean)
    by_position(out / "entropy_by_position.png", last, f"{last_name} on {params.dataset}")
    if len(results) > 1:
        over_models(out / "entropy_over_training.png", steps, names, results, source, params.dataset, over_training)
    if dim_results[-1] is not None:
        dimension_entropy(out / "dimension_entropy.png", dim_results[-1], params, f"{last_name} on {params.dataset}")


def _layer_ticks(layers: int, windows: dict, most: int = 16) -> tuple[list[int], list[str]]:
    """Layer tick positions and labels; a layer that slides over a window is marked "W"."""
    at = sparse_ticks(layers, most)
    return at, [f"{layer} W" if layer in windows else str(layer) for layer in at]


def heatmap_floor(mean: np.ndarray, uniform_mean: float) -> float:
    """The colour scale's bottom: 0, or the lowest head's entropy rounded down to half a nat when every
    head sits in the top part of [0, uniform] — a trained model's heads at 2.6–3.9 of 3.9 nats used a
    third of the colours, and a 32 × 32 map (no numbers in the cells) then reads as one colour."""
    low = math.floor(float(mean.min()) * 2) / 2
    return low if low >= 0.25 * uniform_mean else 0.0


def heatmap(path: Path, last: dict, title_source: str, uniform_mean: float) -> None:
    """Layer × head heatmap of the mean entropy, annotated with the values (up to 400 cells)."""
    plt = pyplot()
    layers, heads = last["mean"].shape
    # cells shrink for big models, so that 32 × 32 stays a figure one reads whole at its own size
    annotated = layers * heads <= 400
    cell_w, cell_h = (0.7, 0.45) if annotated else (0.3, 0.25)
    fig, ax = plt.subplots(figsize=(max(5.5, 2.5 + cell_w * heads), max(3.5, 1.8 + cell_h * layers)))
    low = heatmap_floor(last["mean"], uniform_mean)
    im = ax.imshow(last["mean"], cmap="viridis", aspect="auto", vmin=low, vmax=uniform_mean)
    if annotated:
        for (layer, head), v in np.ndenumerate(last["mean"]):
            ax.text(head, layer, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if v > low + 0.6 * (uniform_mean - low) else "white")
    # every layer named (its row is tall enough), so that every windowed one shows its W
    at, names = _layer_ticks(layers, last["sliding_windows"], most=64)
    ax.set(xlabel="head", ylabel="layer" + (" (W: sliding window, a lower ceiling)" if last["sliding_windows"] else ""),
           xticks=sparse_ticks(heads))
    ax.set_yticks(at, names, fontsize=10 if layers <= 32 else 7)
    ax.set_title(f"mean attention entropy (nats), {title_source}\n"
                 f"colour scale {low:g} – {uniform_mean:.2f} nats (top: uniform attention, the mean of "
                 f"{'ln(visible keys)' if last['sliding_windows'] else 'ln(t+1)'})", fontsize=10)
    fig.colorbar(im, ax=ax, label="nats")
    save(fig, path)


# the uniform bound's dashes: grey, as viridis' first colour (the first model, layer 0) is a near-black purple
# that a curve lying on black dashes (an untrained model's) could not be told from
UNIFORM_COLOUR = "0.55"


def by_layer(path: Path, names, results, source: str, uniform_mean: float) -> None:
    """Mean entropy per layer (±std over heads), one line per model ("step N" for a run's checkpoints),
    coloured early to late."""
    plt = pyplot()
    last = results[-1]
    layers = last["mean"].shape[0]
    fig, ax = plt.subplots(figsize=(max(6.0, 3 + 0.22 * layers), 4))
    colours = OrderedColours(range(len(results)), "model")
    for i, r in enumerate(results):
        per_layer = r["mean"].mean(1)
        label = colours.label(names[i])
        ax.plot(range(layers), per_layer, marker=None if colours.many else "o", ms=4,
                color=colours(i), label=label)
        if len(results) == 1:
            ax.fill_between(range(layers), per_layer - r["mean"].std(1), per_layer + r["mean"].std(1),
                            color=colours(i), alpha=0.2, label="± std over heads")
    colours.colour_bar(fig, ax, names)
    if last["sliding_windows"]:  # windowed layers have a lower ceiling
        ax.plot(range(layers), last["bound"].mean(1), color=UNIFORM_COLOUR, ls="--", lw=3, drawstyle="steps-mid",
                label="uniform (mean of ln(visible keys))", zorder=1)
    else:  # beneath the curves, and wider: an untrained model's lies on it, and hid it (or was hidden by it)
        ax.axhline(uniform_mean, color=UNIFORM_COLOUR, ls="--", lw=3, label="uniform (mean of ln(t+1))", zorder=1)
    ax.set(xlabel="layer", ylabel="mean entropy (nats)", title=f"attention entropy by layer, {source}")
    ax.set_xticks(*_layer_ticks(layers, last["sliding_windows"]))
    at_least_span(ax, NATS_IN_VIEW * uniform_mean)
    ax.legend(fontsize=7)
    save(fig, path)


def by_position(path: Path, last: dict, title_source: str) -> None:
    """Entropy against query position, per layer, with the uniform bound ln(t + 1) (and each window's).

    Past 256 positions x is logarithmic: ln(t+1) rises in the first few per cent of a linear axis.
    Position 0 sees one key (entropy 0) and is left off a log axis; past DRAWN_POSITIONS positions the
    lines go through a log-spaced subset of them (every value is in entropy_by_position.npz)."""
    plt = pyplot()
    layers, _, n = last["by_position"].shape
    windows = last["sliding_windows"]
    colours = OrderedColours(range(layers), "layer")
    fig, ax = plt.subplots(figsize=(7.5 if colours.many else 6.5, 4.5))
    logx = n >= 256
    positions = np.arange(n)[1:] if logx else np.arange(n)
    if len(positions) > DRAWN_POSITIONS:  # more points than the axis has pixels: a log-spaced subset
        positions = np.unique(np.geomspace(1, n - 1, DRAWN_POSITIONS).round().astype(int))
    for layer in range(layers):
        ax.plot(positions, last["by_position"][layer].mean(0)[positions], color=colours(layer),
                ls="--" if layer in windows else "-", label=colours.label(f"layer {layer}"))
    colours.colour_bar(fig, ax)
    ax.plot(positions, np.log(positions + 1.0), color=UNIFORM_COLOUR, ls="--", lw=1.2, label="uniform bound ln(t+1)")
    for w in sorted(set(windows.values())):
        in_window = [layer for layer, lw in windows.items() if lw == w]
        which = (f"sliding layer(s) {', '.join(map(str, in_window))}" if len(in_window) <= 4
                 else f"{len(in_window)} sliding layers (dashed)")
        ax.plot(positions, np.log(np.minimum(positions + 1.0, w)), "k:", label=f"ln(min(t+1, {w})): {which}")
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel="query position t" + (" (log scale; t = 0, one visible key, left off)" if logx else ""),
           ylabel="mean entropy (nats)", title=f"attention entropy by position, {title_source}")
    ax.legend(fontsize=7, ncol=1 if colours.many else 2)
    save(fig, path)


def over_models(path: Path, steps, names, results, source: str, dataset: str, over_training: bool) -> None:
    """Training dynamics: one panel per layer, one line per head, across the checkpoints (or models).

    Steps spread over decades (0, 1, 2, 4, …, 143000) go on a symmetric-log axis, so that the early
    checkpoints do not sit on top of each other. Each panel has its own y range (at least NATS_IN_VIEW of
    the uniform value): on a shared one, a layer whose heads are 0.01 nats apart is a flat line beside one
    spanning 0.7. The uniform value is drawn where it is at most a panel's height above the lines, else
    named in the panel's title."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    plt = pyplot()
    last = results[-1]
    layers, heads = last["mean"].shape
    cols = 2 if layers == 4 else min(3 if layers <= 9 else 4, layers)  # 4 on 3 columns left a third blank
    rows = math.ceil(layers / cols)
    # more heads than tab10 has colours: a colour map, named by a colour bar
    colours = OrderedColours(range(heads), "head", cmap="turbo") if heads > 10 else None
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + (1 if colours else 0), 3.2 * rows),
                             sharex=True, squeeze=False, layout="constrained")
    positive = [s for s in steps if s > 0]
    symlog = over_training and len(positive) > 1 and max(positive) / min(positive) > 100
    for layer in range(layers):
        ax = axes[layer // cols][layer % cols]
        for head in range(heads):
            ax.plot(steps, [r["mean"][layer, head] for r in results], marker=None if colours or len(steps) > 30 else ".",
                    color=colours(head) if colours else None, lw=1 if colours else 1.5,
                    label=None if colours else f"head {head}")
        uniform = float(last["bound"][layer].mean())
        lowest = min(float(r["mean"][layer].min()) for r in results)
        highest = max(float(r["mean"][layer].max()) for r in results)
        title = f"layer {layer}"
        if uniform - highest <= max(highest - lowest, NATS_IN_VIEW * uniform):
            ax.axhline(uniform, color=UNIFORM_COLOUR, ls="--", lw=0.8, label="uniform")
        else:  # drawn, it would squeeze the heads into a strip at the bottom
            title += f" (uniform {uniform:.2f}: above)"
        # checkpoints of one run lie on a step axis; other model lists are only in list order
        ax.set(title=title, xlabel="training step" if over_training else "model", ylabel="mean entropy (nats)")
        if not over_training:
            ax.set_xticks(steps, names, rotation=30, ha="right", fontsize=7)
        elif symlog:
            ax.set_xscale("symlog", linthresh=min(positive))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
        if over_training:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20k, not 20000 running into 40000
        ax.tick_params(axis="x", labelbottom=True)  # every panel says which steps it shows
        if layer == 0:
            ax.legend(fontsize=6)
        at_least_span(ax, NATS_IN_VIEW * uniform)
    for extra in range(layers, rows * cols):
        axes[extra // cols][extra % cols].axis("off")
    if colours:
        colours.colour_bar(fig, axes.ravel().tolist(), shrink=0.5, aspect=40)
    # the panels' heights are not comparable: the title says so
    scales = "each panel its own y scale" + (", symmetric log step axis" if symlog else "")
    fig.suptitle(f"attention entropy over training, {source} ({scales})"
                 if over_training else f"attention entropy across models, on {dataset} ({scales})")
    save(fig, path)


def dimension_entropy(path: Path, d: dict, params, title_source: str) -> None:
    """Left: how far each row's entropy lies below its uniform bound, ln(visible keys) − H, per layer, on
    log-spaced bins (equal bins over [0, ln N] are wider than the 0.03-nat margin, and nearly every row
    sits in the last one); left of the margin's line a row is near uniform. Up to MANY_LINES layers one
    outline each; past that a layer × bin heatmap of the same percentages (32 overlapping outlines read as
    none). Right: the near-uniform share per layer × head, its colours spread over the values there are."""
    plt = pyplot()
    n, margin = params.seq_len, params.near_uniform_margin
    share = d["near_uniform_pct"]
    layers, heads = share.shape
    gaps = d["gap_edges"]  # [0, floor], then log-spaced
    floor = float(gaps[1])
    colours = OrderedColours(range(layers), "layer")
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(12, max(4.8, 1.8 + 0.2 * layers)),
                                 gridspec_kw={"width_ratios": [1.3, 1]})
    plot_edges = gaps.copy()
    plot_edges[0] = floor * gaps[1] / gaps[2]  # the [0, floor] bin drawn one bin wide, left of floor
    if colours.many:
        # empty bins blank, not the colour of "a few rows"; layer 0 on top, as in the map beside it
        mesh = ax.pcolormesh(plot_edges, np.arange(layers + 1) - 0.5, np.ma.masked_equal(d["gap_pct"], 0),
                             cmap="viridis", vmin=0)
        ax.set_ylim(layers - 0.5, -0.5)
        ax.set_yticks(sparse_ticks(layers))
        fig.colorbar(mesh, ax=ax, label="% of the layer's rows (empty bins blank)")
    else:
        styles = ["-", "--", "-.", ":"]
        for layer in range(layers):
            ax.stairs(d["gap_pct"][layer], plot_edges, color=colours(layer), lw=1.6, ls=styles[layer % len(styles)],
                      label=f"layer {layer} ({d['near_uniform_pct_layer'][layer]:.1f}% near uniform)")
    ax.set_xscale("log")
    filled = np.flatnonzero(d["gap_pct"].sum(0) > 0)
    if filled.size:  # the occupied bins, the margin in view
        ax.set_xlim(min(plot_edges[filled[0]], margin / 3), max(plot_edges[filled[-1] + 1], margin * 3))
    margin_label = f"near-uniform margin ({margin} nats): rows left of it"
    ax.axvline(margin, color="r", ls=":", label=margin_label)
    bound = "ln(t+1), row t" if params.dimension_causal else f"ln({n}) = {math.log(n):.2f}"
    xlabel = f"nats below the uniform bound {bound} (log scale; first bin: < {floor:g})"
    if colours.many:  # a legend would cover cells of the heatmap
        xlabel += f"\nred dotted line: {margin_label}"
    else:
        ax.legend(fontsize=7)
    ax.set(xlabel=xlabel, ylabel="layer" if colours.many else "% of rows",
           title=f"dimension-wise attention entropy, {title_source}\n"
                 f"{d['near_uniform_pct_all']:.1f}% of rows near uniform "
                 f"({'causal' if params.dimension_causal else 'bidirectional'})")
    lo, hi = near_uniform_scale(share)
    im = hm.imshow(share, cmap="magma", aspect="auto", vmin=lo, vmax=hi)
    if layers * heads <= 400:
        for (layer, head), v in np.ndenumerate(share):
            hm.text(head, layer, f"{v:.1f}", ha="center", va="center", fontsize=7,
                    color="black" if v > lo + 0.6 * (hi - lo) else "white")
    hm.set(xlabel="head", ylabel="layer", xticks=sparse_ticks(heads), yticks=sparse_ticks(layers),
           title=f"% of (dimension, query) rows within {margin} nats of uniform")
    fig.colorbar(im, ax=hm, label=f"% (scale {lo:g} to {hi:g})")
    save(fig, path)


def near_uniform_scale(share: np.ndarray) -> tuple[float, float]:
    """The near-uniform map's colour range: the values present, widened to whole percent (at least 1 apart,
    within 0–100), so 4.6–5.6 % spans the colours instead of sitting in the darkest twentieth of 4–100."""
    if not share.size:
        return 0.0, 100.0
    lo, hi = float(np.floor(share.min())), float(np.ceil(share.max()))
    if hi - lo < 1:
        lo, hi = (99.0, 100.0) if hi >= 100 else (lo, lo + 1)
    return max(lo, 0.0), min(hi, 100.0)
