"""Plots of the norms job: per-layer norms (Table 1), inner loss (Fig. 2), 3-D PCA trajectories (Fig. 3)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import pyplot, readable_log_y, save, sparse_ticks


def layer_names(points: int, include_last_layer: bool) -> list[str]:
    names = [f"h{l}" for l in range(points)]
    if include_last_layer:
        names[-1] += "\n(pre-norm)"
    return names


def _layer_axis(ax, points: int, include_last_layer: bool) -> None:
    names = layer_names(points, include_last_layer)
    at = sparse_ticks(points, 20)
    ax.set_xticks(at, [names[i] for i in at], fontsize=8)


def plot_norms(path: Path, norms: np.ndarray, lines: np.ndarray, include_last_layer: bool, title: str,
               sequence_pct: float, pair_pct: float) -> None:
    """Mean and median norm per layer, the 10–90 % band, and a few single trajectories; below, the share of
    trajectories whose norm does not fall at each step h_{l-1} → h_l, against the null of 50 %.

    The y axis is logarithmic when the norms span more than a factor of 20 (an embedding output far
    smaller than the last blocks', or tokens with massive activations): on a linear axis the band of
    the other trajectories would be a flat line at the bottom. On that axis the later steps, often a few
    per cent, are invisible: the lower panel shows them, and it is where the sequence % is won or lost."""
    S, points = norms.shape
    x = np.arange(points)
    plt = pyplot()
    fig, (ax, steps_ax) = plt.subplots(2, 1, figsize=(min(12.0, max(6.0, 0.45 * points + 3)), 6.6), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1.3]})
    for i, s in enumerate(lines):
        ax.plot(x, norms[s], color="tab:gray", lw=0.7, alpha=0.5, label="single trajectories" if i == 0 else None)
    q10, q90 = np.quantile(norms, [0.1, 0.9], axis=0)
    ax.fill_between(x, q10, q90, color="tab:blue", alpha=0.2, label="10–90 % of trajectories")
    ax.plot(x, norms.mean(0), color="tab:blue", lw=2.2, marker="o" if points <= 40 else None, label="mean")
    ax.plot(x, np.median(norms, 0), color="tab:orange", lw=1.5, ls="--", label="median")
    drawn = np.concatenate([q10, q90, norms[lines].ravel()]) if len(lines) else np.concatenate([q10, q90])
    positive = drawn[np.isfinite(drawn) & (drawn > 0)]
    log = positive.size > 0 and positive.max() / positive.min() > 20
    if log:
        ax.set_yscale("log")
        readable_log_y(ax)
    ax.set_ylabel("L2 norm of the current token's\nhidden state" + (" (log scale)" if log else ""))
    ax.set_title(f"{title}: {S} trajectories\nnon-decreasing: {sequence_pct:.1f} % of sequences, "
                 f"{pair_pct:.1f} % of pairs (null {100 * 2.0 ** -(points - 1):.3g} %)", fontsize=10)
    ax.grid(alpha=0.3, which="both" if log else "major")
    ax.legend(fontsize=8, loc="lower right")  # the norms rise to the right: the lower right is free
    _plot_rising_share(steps_ax, norms)
    _layer_axis(steps_ax, points, include_last_layer)
    steps_ax.set_xlabel("hidden state (h0 = embedding output, hl = output of block l)")
    save(fig, path)


def rising_share(norms: np.ndarray) -> np.ndarray:
    """Per step h_{l-1} → h_l (l = 1 … L'-1): % of trajectories whose norm does not fall, the pair rule of
    ``norms.monotone_percentages`` taken one step at a time."""
    return 100.0 * (np.diff(norms, axis=1) >= 0).mean(0)


def _plot_rising_share(ax, norms: np.ndarray) -> None:
    share = rising_share(norms)
    at = np.arange(1, norms.shape[1])
    ax.bar(at, share, width=0.6, color="tab:blue", alpha=0.6)
    ax.axhline(50, color="k", ls=":", lw=1, label="50 %: a coin flip")
    if len(at) <= 24:  # the numbers a reader compares; past that the bars say it
        for l, v in zip(at, share):
            ax.annotate(f"{v:.0f}", (l, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    ax.set_ylim(0, 112)
    ax.set_yticks([0, 50, 100])
    ax.set_ylabel("% not falling\nfrom the previous", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="lower left")


def plot_inner_loss(path: Path, losses: np.ndarray, kept: np.ndarray, loss_filter: float | None, title: str,
                    vocab_size: int | None = None) -> None:
    """Mean ± std of the inner loss per layer on a log scale, and the median, over the kept trajectories
    (all finite ones if none is kept); ln(vocabulary), the loss of a uniform guess, for reference.

    Per-token cross-entropy is skewed (std often above the mean): where mean − std falls below the 5th
    percentile the band stops there, rather than at a floor decades below every value."""
    S, L = losses.shape
    x = np.arange(L)
    use = kept if kept.any() else np.isfinite(losses).all(1)
    if not use.any():
        use = np.ones(S, bool)  # nothing finite to draw: the plot shows that, rather than nothing
    mean, std = losses[use].mean(0), losses[use].std(0)
    q05 = np.quantile(losses[use], 0.05, axis=0)
    lower = np.maximum(mean - std, np.maximum(q05, 1e-6))  # a log axis cannot show mean - std ≤ 0
    cut = bool((mean - std < lower).any())
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 0.45 * L + 3)), 4.5))
    ax.fill_between(x, lower, mean + std, color="tab:green", alpha=0.25,
                    label="mean ± std" + (" (cut at the 5th percentile)" if cut else ""))
    ax.plot(x, mean, color="tab:green", lw=2, marker="o" if L <= 40 else None, label="mean")
    ax.plot(x, np.median(losses[use], 0), color="tab:olive", lw=1.3, ls="--", label="median")
    if vocab_size:
        ax.axhline(math.log(vocab_size), color="k", ls=":", lw=1,
                   label=f"ln(vocabulary) = {math.log(vocab_size):.2f}: a uniform guess")
    ax.set_yscale("log")
    readable_log_y(ax)
    ax.set_xticks(sparse_ticks(L, 20))
    ax.set_xlabel("layer l whose hidden state h_l goes through the last block")
    ax.set_ylabel("cross-entropy at the current token (nats, log scale)")
    rule = "all with a finite loss" if loss_filter is None else f"final loss ≤ {loss_filter:g}"
    if kept.any():
        sub = f"kept {int(kept.sum())}/{S} trajectories ({rule})"
    else:
        sub = f"no sample meets {rule} (0/{S}); showing all {S}"
    ax.set_title(f"{title}: approximate inner loss (eq. 14)\n{sub}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    # under the axes: inside, it sat on the ln(vocabulary) line it names (a full-width line has no free corner)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    save(fig, path)


def plot_pca3d(path: Path, coords: np.ndarray, explained: np.ndarray, include_last_layer: bool, title: str) -> None:
    """Each trajectory as a 3-D polyline in the top principal components, its points coloured by layer (the
    colour bar names them); circle = h0, triangle = last point. A few trajectories far larger than the
    rest (``far_trajectories``) are left out, and the title says how many."""
    plt = pyplot()
    from mpl_toolkits.mplot3d.art3d import Line3DCollection

    far = far_trajectories(coords)
    fig = plt.figure(figsize=(7.6, 6))
    ax = fig.add_subplot(projection="3d")
    points = coords.shape[1] if coords.ndim == 3 else 0
    depth = np.arange(points)
    norm = plt.Normalize(0, max(1, points - 1))
    drawn = coords[~far] if points else np.zeros((0, 0, 3))
    drawn = np.pad(drawn, ((0, 0), (0, 0), (0, max(0, 3 - drawn.shape[-1]))))[..., :3]  # a model narrower than 3 dims
    if len(drawn):
        # one unit the same length along every axis: segment lengths are what a reader compares
        spans = np.ptp(drawn.reshape(-1, 3), axis=0)
        ax.set_box_aspect(np.maximum(spans, 0.05 * spans.max()) if spans.max() > 0 else None)
        # One artist per kind, not per trajectory: mplot3d projects and sorts every artist on every draw,
        # and 4 artists × 50 trajectories took most of the job's plotting time.
        ax.add_collection3d(Line3DCollection(drawn, colors="0.55", linewidths=0.8, alpha=0.6))
        dots = ax.scatter(*drawn.reshape(-1, 3).T, c=np.tile(depth, len(drawn)), cmap="viridis", norm=norm, s=8,
                          depthshade=False)
        ax.scatter(*drawn[:, 0].T, color=plt.cm.viridis(norm(0)), marker="o", s=22, edgecolor="k", linewidth=0.4,
                   depthshade=False, label="start (h0)")
        ax.scatter(*drawn[:, -1].T, color=plt.cm.viridis(norm(points - 1)), marker="^", s=30, edgecolor="k",
                   linewidth=0.4, depthshade=False,
                   label="end (last block, pre-norm)" if include_last_layer else "end (last point)")
        bar = fig.colorbar(dots, ax=ax, shrink=0.6, pad=0.1, label="hidden state")
        names = layer_names(points, include_last_layer)
        at = sparse_ticks(points, 12)  # about a dozen tick labels, the last point's among them
        bar.set_ticks(at, labels=[names[i] for i in at])
    pcs = [f"PC{k + 1} ({100 * v:.1f} %)" for k, v in enumerate(list(explained) + [0.0] * (3 - len(explained)))]
    ax.set_xlabel(pcs[0], fontsize=9)
    ax.set_ylabel(pcs[1], fontsize=9)
    ax.set_zlabel(pcs[2], fontsize=9)
    ax.set_title(f"{title}: {len(coords) - int(far.sum())} trajectories in the top 3 principal components"
                 + (f"\n({int(far.sum())} far larger trajectories not drawn; all are in pca.npz)" if far.any() else ""),
                 fontsize=10)
    if len(coords):
        ax.legend(fontsize=8, loc="upper left")
    save(fig, path)


def far_trajectories(coords: np.ndarray, factor: float = 4.0) -> np.ndarray:
    """Which trajectories reach more than ``factor`` times as far from the centre of all points as the
    median trajectory does (massive activations): drawn, they would shrink all the others into one blob.
    None are marked when they are more than a fifth of all (then they are no outliers)."""
    if coords.ndim != 3 or len(coords) < 5:
        return np.zeros(len(coords), bool)
    centre = np.median(coords.reshape(-1, coords.shape[-1]), axis=0)
    reach = np.linalg.norm(coords - centre, axis=-1).max(axis=1)  # per trajectory
    far = reach > factor * np.median(reach)
    return far if far.sum() <= len(coords) / 5 else np.zeros(len(coords), bool)
