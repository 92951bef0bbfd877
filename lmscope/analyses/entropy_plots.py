"""Plots of the entropy job: layer × head heatmap, by layer, by position, over training, dimension-wise.

Each reads the per-model results ``entropy.run`` gathers (``results[i]``: mean [L, H], by_position
[L, H, N], bound [L, N], sliding_windows {layer: W}; ``dim_results[i]``: histograms and near-uniform
shares, or None).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import pyplot, save


def draw(out: Path, params, steps, names, results, dim_results, *, over_training: bool) -> None:
    """Every plot of the job into ``out``; ``over_training``: the models are checkpoints of one run (a step axis)."""
    last, last_name = results[-1], names[-1]
    # what a fully mean-pooling head scores: mean of ln(t + 1), less in layers that all slide
    uniform_mean = float(last["bound"].mean(1).max())
    source = (f"{last_name} on {params.dataset}" if len(names) == 1
              else f"{names[0]} … {last_name} on {params.dataset}")
    heatmap(out / "entropy_heatmap.png", last, f"{last_name} on {params.dataset}", uniform_mean)
    by_layer(out / "entropy_by_layer.png", steps, names, results, source, uniform_mean)
    by_position(out / "entropy_by_position.png", last, f"{last_name} on {params.dataset}")
    if len(results) > 1:
        over_models(out / "entropy_over_training.png", steps, names, results, source, params.dataset, over_training)
    if dim_results[-1] is not None:
        dimension_entropy(out / "dimension_entropy.png", dim_results[-1], params, f"{last_name} on {params.dataset}")


def heatmap(path: Path, last: dict, title_source: str, uniform_mean: float) -> None:
    """Layer × head heatmap of the mean entropy, annotated with the values."""
    plt = pyplot()
    layers, heads = last["mean"].shape
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 0.7 * heads), max(3.5, 1.5 + 0.45 * layers)))
    im = ax.imshow(last["mean"], cmap="viridis", aspect="auto", vmin=0, vmax=uniform_mean)
    if layers * heads <= 400:
        for (layer, head), v in np.ndenumerate(last["mean"]):
            ax.text(head, layer, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.6 * uniform_mean else "white")
    ax.set(xlabel="head", ylabel="layer", xticks=range(heads), yticks=range(layers))
    ax.set_title(f"mean attention entropy (nats), {title_source}\n"
                 f"scale top = uniform {uniform_mean:.2f} "
                 f"(mean of {'ln(visible keys)' if last['sliding_windows'] else 'ln(t+1)'})", fontsize=10)
    fig.colorbar(im, ax=ax, label="nats")
    save(fig, path)


def by_layer(path: Path, steps, names, results, source: str, uniform_mean: float) -> None:
    """Mean entropy per layer (±std over heads), one line per checkpoint."""
    plt = pyplot()
    last = results[-1]
    layers = last["mean"].shape[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    cmap = plt.get_cmap("viridis")
    for i, (step, r) in enumerate(zip(steps, results)):
        per_layer = r["mean"].mean(1)
        color = cmap(i / max(1, len(results) - 1))
        # With many checkpoints label only the first and last: the colour runs from early to late.
        label = names[i] if len(results) == 1 else (f"step {step}" if len(results) <= 8 or i in (0, len(results) - 1) else None)
        ax.plot(range(layers), per_layer, marker="o", color=color, label=label)
        if len(results) == 1:
            ax.fill_between(range(layers), per_layer - r["mean"].std(1), per_layer + r["mean"].std(1),
                            color=color, alpha=0.2, label="± std over heads")
    if last["sliding_windows"]:  # windowed layers have a lower ceiling
        ax.plot(range(layers), last["bound"].mean(1), color="k", ls="--", drawstyle="steps-mid",
                label="uniform (mean of ln(visible keys))")
    else:
        ax.axhline(uniform_mean, color="k", ls="--", label="uniform (mean of ln(t+1))")
    ax.set(xlabel="layer", ylabel="mean entropy (nats)", title=f"attention entropy by layer, {source}", xticks=range(layers))
    ax.legend(fontsize=7)
    save(fig, path)


def by_position(path: Path, last: dict, title_source: str) -> None:
    """Entropy against query position, per layer, with the uniform bound ln(t + 1) (and each window's)."""
    plt = pyplot()
    layers, _, n = last["by_position"].shape
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    positions = np.arange(n)
    for layer in range(layers):
        ax.plot(positions, last["by_position"][layer].mean(0), color=cmap(layer / max(1, layers - 1)),
                label=f"layer {layer}")
    ax.plot(positions, np.log(positions + 1.0), "k--", label="uniform bound ln(t+1)")
    for w in sorted(set(last["sliding_windows"].values())):
        in_window = [layer for layer, lw in last["sliding_windows"].items() if lw == w]
        ax.plot(positions, np.log(np.minimum(positions + 1.0, w)), "k:",
                label=f"ln(min(t+1, {w})): sliding layer(s) {', '.join(map(str, in_window))}")
    ax.set(xlabel="query position t", ylabel="mean entropy (nats)", title=f"attention entropy by position, {title_source}")
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def over_models(path: Path, steps, names, results, source: str, dataset: str, over_training: bool) -> None:
    """Training dynamics: one panel per layer, one line per head, across the checkpoints (or models)."""
    plt = pyplot()
    last = results[-1]
    layers, heads = last["mean"].shape
    cols = min(3, layers)
    rows = math.ceil(layers / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), sharex=True, sharey=True, squeeze=False)
    for layer in range(layers):
        ax = axes[layer // cols][layer % cols]
        for head in range(heads):
            ax.plot(steps, [r["mean"][layer, head] for r in results], marker=".", label=f"head {head}")
        ax.axhline(float(last["bound"][layer].mean()), color="k", ls="--", lw=0.8, label="uniform")
        # checkpoints of one run lie on a step axis; other model lists are only in list order
        ax.set(title=f"layer {layer}", xlabel="training step" if over_training else "model", ylabel="mean entropy (nats)")
        if not over_training:
            ax.set_xticks(steps, names, rotation=30, ha="right", fontsize=7)
        ax.tick_params(axis="x", labelbottom=True)  # every panel says which steps it shows
        if layer == 0:
            ax.legend(fontsize=6)
    for extra in range(layers, rows * cols):
        axes[extra // cols][extra % cols].axis("off")
    fig.suptitle(f"attention entropy over training, {source}" if over_training
                 else f"attention entropy across models, on {dataset}")
    save(fig, path)


def dimension_entropy(path: Path, d: dict, params, title_source: str) -> None:
    """Left: how far each row's entropy lies below its uniform bound, ln(visible keys) − H, per layer, on
    log-spaced bins (equal bins over [0, ln N] are wider than the 0.03-nat margin, and nearly every row
    sits in the last one); left of the margin's line a row is near uniform. Right: the near-uniform share
    per layer × head, its colours spread over the values there are."""
    plt = pyplot()
    n, margin = params.seq_len, params.near_uniform_margin
    share = d["near_uniform_pct"]
    layers, heads = share.shape
    gaps = d["gap_edges"]  # [0, floor], then log-spaced
    floor = float(gaps[1])
    cmap = plt.get_cmap("viridis")
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.3, 1]})
    plot_edges = gaps.copy()
    plot_edges[0] = floor * gaps[1] / gaps[2]  # the [0, floor] bin drawn one bin wide, left of floor
    styles = ["-", "--", "-.", ":"]
    for layer in range(layers):
        ax.stairs(d["gap_pct"][layer], plot_edges, color=cmap(layer / max(1, layers - 1)), lw=1.6,
                  ls=styles[layer % len(styles)],
                  label=f"layer {layer} ({d['near_uniform_pct_layer'][layer]:.1f}% near uniform)")
    ax.set_xscale("log")
    filled = np.flatnonzero(d["gap_pct"].sum(0) > 0)
    if filled.size:  # the occupied bins, the margin in view
        ax.set_xlim(min(plot_edges[filled[0]], margin / 3), max(plot_edges[filled[-1] + 1], margin * 3))
    ax.axvline(margin, color="r", ls=":", label=f"near-uniform margin ({margin} nats): rows left of it")
    bound = "ln(t+1), row t" if params.dimension_causal else f"ln({n}) = {math.log(n):.2f}"
    ax.set(xlabel=f"nats below the uniform bound {bound} (log scale; first bin: < {floor:g})",
           ylabel="% of rows",
           title=f"dimension-wise attention entropy, {title_source}\n"
                 f"{d['near_uniform_pct_all']:.1f}% of rows near uniform "
                 f"({'causal' if params.dimension_causal else 'bidirectional'})")
    ax.legend(fontsize=7)
    lo = float(np.floor(share.min())) if share.size else 0.0
    lo = min(lo, 99.0)  # every cell 100: still a scale
    im = hm.imshow(share, cmap="magma", aspect="auto", vmin=lo, vmax=100)
    if layers * heads <= 400:
        for (layer, head), v in np.ndenumerate(share):
            hm.text(head, layer, f"{v:.1f}", ha="center", va="center", fontsize=7,
                    color="black" if v > lo + 0.6 * (100 - lo) else "white")
    hm.set(xlabel="head", ylabel="layer", xticks=range(heads), yticks=range(layers),
           title=f"% of (dimension, query) rows within {margin} nats of uniform")
    fig.colorbar(im, ax=hm, label=f"% (scale from {lo:g})")
    save(fig, path)
