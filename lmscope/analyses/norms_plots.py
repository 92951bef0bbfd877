"""Plots of the norms job: per-layer norms (Table 1), inner loss (Fig. 2), 3-D PCA trajectories (Fig. 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import pyplot, save


def layer_names(points: int, include_last_layer: bool) -> list[str]:
    names = [f"h{l}" for l in range(points)]
    if include_last_layer:
        names[-1] += "\n(pre-norm)"
    return names


def plot_norms(path: Path, norms: np.ndarray, lines: np.ndarray, include_last_layer: bool, title: str,
               sequence_pct: float, pair_pct: float) -> None:
    """Mean and median norm per layer, the 10–90 % band, and a few single trajectories."""
    S, points = norms.shape
    x = np.arange(points)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * points + 3), 4.5))
    for i, s in enumerate(lines):
        ax.plot(x, norms[s], color="tab:gray", lw=0.7, alpha=0.5, label="single trajectories" if i == 0 else None)
    q10, q90 = np.quantile(norms, [0.1, 0.9], axis=0)
    ax.fill_between(x, q10, q90, color="tab:blue", alpha=0.2, label="10–90 % of trajectories")
    ax.plot(x, norms.mean(0), color="tab:blue", lw=2.2, marker="o", label="mean")
    ax.plot(x, np.median(norms, 0), color="tab:orange", lw=1.5, ls="--", label="median")
    ax.set_xticks(x, layer_names(points, include_last_layer), fontsize=8)
    ax.set_xlabel("hidden state (h0 = embedding output, hl = output of block l)")
    ax.set_ylabel("L2 norm of the current token's hidden state")
    ax.set_title(f"{title}: {S} trajectories\nnon-decreasing: {sequence_pct:.1f} % of sequences, "
                 f"{pair_pct:.1f} % of pairs (null {100 * 2.0 ** -(points - 1):.3g} %)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    save(fig, path)


def plot_inner_loss(path: Path, losses: np.ndarray, kept: np.ndarray, loss_filter: float | None, title: str) -> None:
    """Mean ± std of the inner loss per layer on a log scale, over the kept trajectories (all finite ones
    if none is kept)."""
    from matplotlib.ticker import LogFormatter

    S, L = losses.shape
    x = np.arange(L)
    use = kept if kept.any() else np.isfinite(losses).all(1)
    if not use.any():
        use = np.ones(S, bool)  # nothing finite to draw: the plot shows that, rather than nothing
    mean, std = losses[use].mean(0), losses[use].std(0)
    floor = max(float(losses[use].min()), 1e-6) * 0.5  # a log axis cannot show mean - std ≤ 0
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * L + 3), 4.5))
    ax.fill_between(x, np.maximum(mean - std, floor), mean + std, color="tab:green", alpha=0.25, label="mean ± std")
    ax.plot(x, mean, color="tab:green", lw=2, marker="o", label="mean")
    ax.set_yscale("log")
    # decimal tick labels ("5.6", not "5.6×10⁰"); minor ticks labelled only when the range is narrow
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    ax.set_xticks(x)
    ax.set_xlabel("layer l whose hidden state h_l goes through the last block")
    ax.set_ylabel("cross-entropy at the current token (nats, log scale)")
    rule = "all with a finite loss" if loss_filter is None else f"final loss ≤ {loss_filter:g}"
    if kept.any():
        sub = f"kept {int(kept.sum())}/{S} trajectories ({rule})"
    else:
        sub = f"no sample meets {rule} (0/{S}); showing all {S}"
    ax.set_title(f"{title}: approximate inner loss (eq. 14)\n{sub}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, path)


def plot_pca3d(path: Path, coords: np.ndarray, explained: np.ndarray, include_last_layer: bool, title: str) -> None:
    """Each trajectory as a 3-D polyline in the top principal components, its points coloured by layer (the
    colour bar names them); circle = h0, triangle = last point."""
    plt = pyplot()
    fig = plt.figure(figsize=(7.6, 6))
    ax = fig.add_subplot(projection="3d")
    points = coords.shape[1] if coords.ndim == 3 else 0
    depth = np.arange(points)
    norm = plt.Normalize(0, max(1, points - 1))
    dots = None
    for i, c in enumerate(coords):
        c = np.pad(c, ((0, 0), (0, max(0, 3 - c.shape[1]))))  # a model narrower than 3 dims
        ax.plot(c[:, 0], c[:, 1], c[:, 2], color="0.55", lw=0.8, alpha=0.6)
        dots = ax.scatter(c[:, 0], c[:, 1], c[:, 2], c=depth, cmap="viridis", norm=norm, s=8, depthshade=False)
        ax.scatter(*c[0, :3], color=plt.cm.viridis(norm(0)), marker="o", s=22, edgecolor="k", linewidth=0.4,
                   label="start (h0)" if i == 0 else None)
        ax.scatter(*c[-1, :3], color=plt.cm.viridis(norm(points - 1)), marker="^", s=30, edgecolor="k", linewidth=0.4,
                   label=("end (last block, pre-norm)" if include_last_layer else "end (last point)") if i == 0 else None)
    if dots is not None:
        bar = fig.colorbar(dots, ax=ax, shrink=0.6, pad=0.1, label="hidden state")
        names = layer_names(points, include_last_layer)
        step = max(1, -(-points // 12))  # at most a dozen tick labels
        bar.set_ticks(list(depth[::step]), labels=names[::step])
    pcs = [f"PC{k + 1} ({100 * v:.1f} %)" for k, v in enumerate(list(explained) + [0.0] * (3 - len(explained)))]
    ax.set_xlabel(pcs[0], fontsize=8)
    ax.set_ylabel(pcs[1], fontsize=8)
    ax.set_zlabel(pcs[2], fontsize=8)
    ax.set_title(f"{title}: {len(coords)} trajectories in the top 3 principal components", fontsize=10)
    if len(coords):
        ax.legend(fontsize=8, loc="upper left")
    save(fig, path)
