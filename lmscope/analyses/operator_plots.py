"""Plots of the operator job: how far each head's map W'(x) moves when its attention weights are replaced."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import OrderedColours, pyplot, save, sparse_ticks

REPLACEMENT_TITLES = {"other_window": "another window's weights",
                      "mean": "the mean weights over windows",
                      "uniform": "uniform weights (mean pooling)"}
REPLACEMENT_COLOURS = {"other_window": "tab:orange", "mean": "tab:blue", "uniform": "tab:gray"}


def heatmaps(path: Path, head: np.ndarray, replacements: list[str], source: str, tokens: int) -> None:
    """One layer × head heatmap of D per replacement, on one colour scale, annotated up to 400 cells."""
    plt = pyplot()
    panels, layers, heads = head.shape
    annotated = layers * heads <= 400
    cell_w, cell_h = (0.62, 0.42) if annotated else (0.28, 0.22)
    width = max(4.2, 1.6 + cell_w * heads)
    fig, axes = plt.subplots(1, panels, figsize=(width * panels + 1.2, max(3.4, 1.9 + cell_h * layers)),
                             squeeze=False)
    top = float(np.nanmax(head, initial=0.0)) or 1.0  # NaN: a silent head, drawn blank
    for ax, values, name in zip(axes[0], head, replacements):
        im = ax.imshow(values, cmap="viridis", aspect="auto", vmin=0.0, vmax=top)
        if annotated:
            for (layer, h), v in np.ndenumerate(values):
                # two significant digits: at 0.0039, "0.00" read as "the same map for every input"
                ax.text(h, layer, "silent" if np.isnan(v) else f"{v:.2g}", ha="center", va="center", fontsize=7,
                        color="black" if np.isnan(v) or v > 0.6 * top else "white")
        ax.set(xlabel="head", ylabel="layer", xticks=sparse_ticks(heads), yticks=sparse_ticks(layers, 64))
        ax.set_title(f"replaced by {REPLACEMENT_TITLES[name]}", fontsize=10)
    fig.colorbar(im, ax=list(axes[0]), label="relative change of the head's term")
    fig.suptitle(f"input dependence of each head's map W'(x), {source}\n"
                 f"‖(Ã − A(x))·v·W_O‖ / ‖A(x)·v·W_O‖ over {tokens:,} tokens (0: the same map for every input)",
                 fontsize=10)
    fig.set_layout_engine("constrained")
    save(fig, path)


def by_layer_and_position(path: Path, layer: np.ndarray, by_position: np.ndarray, replacements: list[str],
                          source: str) -> None:
    """Left: each layer's D (heads summed), one line per replacement. Then, per replacement, D against the query
    position, one line per layer."""
    plt = pyplot()
    panels, layers, positions = by_position.shape
    fig, axes = plt.subplots(1, 1 + panels, figsize=(4.8 * (1 + panels), 4.2), squeeze=False)
    ax = axes[0, 0]
    for values, name in zip(layer, replacements):
        ax.plot(range(layers), values, marker="o", ms=4, color=REPLACEMENT_COLOURS[name],
                label=REPLACEMENT_TITLES[name])
    ax.set(xlabel="layer", ylabel="relative change of the layer's attention term", xticks=sparse_ticks(layers, 32),
           ylim=(0, None))
    ax.set_title("per layer", fontsize=10)
    ax.legend(fontsize=8)
    colours = OrderedColours(range(layers), "layer")
    x = np.arange(positions)
    for ax, values, name in zip(axes[0, 1:], by_position, replacements):
        for l in range(layers):
            ax.plot(x, values[l], color=colours(l), lw=1.0, label=colours.label(f"layer {l}"))
        ax.set(xlabel="query position", ylabel="relative change", ylim=(0, None))
        ax.set_title(f"by position, replaced by {REPLACEMENT_TITLES[name]}", fontsize=10)
        if not colours.many:
            ax.legend(fontsize=7, ncol=2 if layers > 4 else 1)
    colours.colour_bar(fig, axes[0, -1])
    fig.suptitle(f"input dependence of the attention map W'(x), {source}", fontsize=11)
    save(fig, path)


def over_training(path: Path, steps: list[int], layer: np.ndarray, replacements: list[str], source: str,
                  xlabel: str = "training step") -> None:
    """Per replacement, each layer's D across the models (x = training step), one line per layer."""
    plt = pyplot()
    models, panels, layers = layer.shape
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels, 4.2), squeeze=False)
    colours = OrderedColours(range(layers), "layer")
    for ax, i, name in zip(axes[0], range(panels), replacements):
        for l in range(layers):
            ax.plot(steps, layer[:, i, l], color=colours(l), marker="o", ms=3.5, lw=1.3,
                    label=colours.label(f"layer {l}"))
        ax.set(xlabel=xlabel, ylabel="relative change of the layer's attention term", ylim=(0, None))
        ax.set_title(f"replaced by {REPLACEMENT_TITLES[name]}", fontsize=10)
        ax.grid(alpha=0.3)
        if not colours.many:
            ax.legend(fontsize=7, ncol=2 if layers > 4 else 1)
    colours.colour_bar(fig, axes[0, -1])
    fig.suptitle(f"input dependence across {models} models, {source}", fontsize=11)
    save(fig, path)
