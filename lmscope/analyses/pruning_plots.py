"""Plots of the pruning job: the heads' terms (layer × head) and the loss as heads are removed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmscope.analyses.plotting import OrderedColours, pyplot, save, sparse_ticks

ORDER_STYLE = {"smallest_first": ("smallest term first", "tab:green"),
               "largest_first": ("largest term first", "tab:red"),
               "random": ("random order", "tab:gray"),
               "least_harm_first": ("least harm when removed alone first", "tab:blue"),
               "least_important_first": ("least gradient importance first", "tab:purple"),
               "least_important_iterative": ("least importance, re-taken at each step", "tab:pink")}
ORDER_MARKERS = "osD^vP"  # one per order (all six can be asked for)
# the unit's name in a label: singular, plural
UNIT_NAMES = {"head": ("head", "heads"), "kv_group": ("key/value group", "key/value groups"),
              "layer": ("layer's attention", "layers' attention")}


def contributions(path: Path, contribution: np.ndarray, source: str, tokens: int, unit: str = "head") -> None:
    """Layer × head heatmap of E‖head term‖ / E‖residual stream‖, annotated up to 400 cells."""
    plt = pyplot()
    layers, heads = contribution.shape
    annotated = layers * heads <= 400
    cell_w, cell_h = (0.7, 0.45) if annotated else (0.3, 0.25)
    fig, ax = plt.subplots(figsize=(max(5.5, 2.5 + cell_w * heads), max(3.5, 1.8 + cell_h * layers)))
    top = float(contribution.max()) or 1.0
    im = ax.imshow(contribution, cmap="magma", aspect="auto", vmin=0.0, vmax=top)
    if annotated:
        for (layer, head), v in np.ndenumerate(contribution):
            ax.text(head, layer, f"{v:#.2g}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.6 * top else "white")
    one = UNIT_NAMES[unit][0]
    ax.set(xlabel="" if unit == "layer" else one, ylabel="layer", xticks=sparse_ticks(heads),
           yticks=sparse_ticks(layers, 64))
    ax.set_title(f"size of each {one}'s term, {source}\nE‖{one} term‖ / E‖residual stream‖ over {tokens:,} tokens",
                 fontsize=10)
    fig.colorbar(im, ax=ax, label="relative size")
    save(fig, path)


def pruning_curves(path: Path, counts: list[int], total: int, curves: dict[str, np.ndarray], baseline: float,
                   tolerance: float, source: str, tokens: int, unit: str = "head") -> None:
    """Mean next-token loss against the share of heads removed, one line per order (random: each draw thin,
    their mean thick), the unpruned loss and the tolerance dashed."""
    plt = pyplot()
    shares = np.array(counts) / total
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for order, losses in curves.items():
        label, colour = ORDER_STYLE[order]
        if len(losses) > 1:
            for row in losses:
                ax.plot(shares, row, color=colour, lw=0.7, alpha=0.45)
            label += f" (mean of {len(losses)})"
        ax.plot(shares, losses.mean(0), color=colour, marker="o", ms=3.5, lw=1.8, label=label)
    ax.axhline(baseline, color="k", ls="--", lw=1, label=f"all heads: {baseline:.3f} nats")
    ax.axhline(baseline * (1 + tolerance), color="k", ls=":", lw=1, label=f"+{tolerance:.0%}")
    many = UNIT_NAMES[unit][1]
    ax.set(xlabel=f"share of the {total} {many} removed", ylabel="next-token loss (nats)", xlim=(-0.02, 1.02))
    ax.set_title(f"removing attention {many}, {source}\nloss on {tokens:,} predicted tokens not used to rank them",
                 fontsize=10)
    # the loss rises to the right and the baseline lines lie low: the upper left is where the curves are not
    ax.legend(fontsize=8, loc="upper left")
    save(fig, path)


def contribution_against_ablation(path: Path, contribution: np.ndarray, harm: np.ndarray, rho: float | None,
                                  source: str, tokens: int, unit: str = "head") -> None:
    """Each head's measured term c against the loss its removal alone costs, coloured by layer."""
    plt = pyplot()
    layers, heads = contribution.shape
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    colours = _by_layer(plt, ax, contribution, harm, unit)
    ax.axhline(0.0, color="k", lw=0.8)
    one, many = UNIT_NAMES[unit]
    ax.set(xlabel=f"c = E‖{one} term‖ / E‖residual stream‖",
           ylabel=f"loss increase with only this {one} removed (nats)")
    said = "n/a" if rho is None else f"{rho:.2f}"
    ax.set_title(f"measured term against removing each {one} alone, {source}\n"
                 f"Spearman ρ = {said} over {layers * heads} {many}, {tokens:,} predicted tokens", fontsize=10)
    colours.colour_bar(fig, ax)
    _name_points(fig, [(ax, contribution, harm)], unit)
    save(fig, path)


def _by_layer(plt, ax, x: np.ndarray, y: np.ndarray, unit: str) -> OrderedColours:
    """Scatter y against x per unit, coloured by layer (a legend up to MANY_LINES layers, else a colour bar)."""
    layers = x.shape[0]
    colours = OrderedColours(range(layers), "layer")
    for layer in range(layers):
        ax.scatter(x[layer], y[layer], s=22, color=colours(layer), edgecolors="none",
                   label=colours.label(f"layer {layer}"))
    if not colours.many:
        ax.legend(fontsize=7, ncol=2 if layers > 4 else 1)
    return colours


NAMED_POINTS = 64  # more units than this are told apart by colour only
LABEL_OFFSETS = ((2, 2), (2, -8), (-14, 2), (-14, -8), (2, 9), (-14, -15), (9, -3), (-21, -3))  # points


def _name_points(fig, panels: list, unit: str) -> None:
    """Name each point of the scatters (``panels``: (ax, x, y) with x, y [L, U]) "layer.unit", at the first
    offset where the name overlaps no name already placed (heads at nearly the same spot wrote over each
    other); a point with no free place stays unnamed, and the panel says how many. Run last: the names are
    placed on the figure as laid out."""
    if not panels or panels[0][1].size > NAMED_POINTS or not hasattr(fig.canvas, "get_renderer"):
        return
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax, x, y in panels:
        placed, unnamed = [], 0
        for (layer, u), v in np.ndenumerate(x):
            name = f"{layer}" if unit == "layer" else f"{layer}.{u}"
            for offset in LABEL_OFFSETS:
                label = ax.annotate(name, (v, y[layer, u]), fontsize=6, xytext=offset, textcoords="offset points")
                box = label.get_window_extent(renderer).expanded(1.05, 1.1)
                if not any(box.overlaps(other) for other in placed):
                    placed.append(box)
                    break
                label.remove()
            else:
                unnamed += 1
        if unnamed:
            ax.text(0.99, 0.01, f"{unnamed} too crowded to name", transform=ax.transAxes, ha="right", va="bottom",
                    fontsize=6, color="0.35")


def contribution_against_importance(path: Path, contribution: np.ndarray, importance: np.ndarray, said: dict,
                                    source: str, windows: int, unit: str = "head", *,
                                    first_order: np.ndarray | None = None, harm: np.ndarray | None = None) -> None:
    """Each unit's measured term c against its gradient importance I; with the single-head ablation, a second
    panel: the first-order estimate −E ∂L/∂ξ against the loss increase removing the unit alone costs."""
    plt = pyplot()
    panels = 2 if harm is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.6), squeeze=False)
    one, many = UNIT_NAMES[unit]

    def rho(value) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    ax = axes[0, 0]
    colours = _by_layer(plt, ax, contribution, importance, unit)
    ax.set(xlabel=f"c = E‖{one} term‖ / E‖residual stream‖", ylabel="I = E over windows |∂loss/∂gate| (nats)")
    ax.set_title(f"measured term against gradient importance\nSpearman ρ = {rho(said['rank_correlation'])} over "
                 f"{contribution.size} {many}, {windows:,} windows", fontsize=10)
    if harm is not None:
        ax = axes[0, 1]
        # an unbounded line: drawn from the points' extent, it stretched the axis to the other quantity's range
        ax.axline((0.0, 0.0), slope=1.0, color="k", ls="--", lw=0.8, label="equal")
        _by_layer(plt, ax, first_order, harm, unit)
        ax.set(xlabel="first-order estimate −E ∂loss/∂gate (nats)",
               ylabel=f"loss increase with only this {one} removed (nats)")
        ax.set_title(f"first order against removing each {one} alone\nSpearman ρ = "
                     f"{rho(said.get('first_order_rank_correlation'))}", fontsize=10)
    colours.colour_bar(fig, axes[0, -1])
    fig.suptitle(f"gradient importance (Michel et al. 2019), {source}", fontsize=11)
    _name_points(fig, [(axes[0, 0], contribution, importance)]
                 + ([(axes[0, 1], first_order, harm)] if harm is not None else []), unit)
    save(fig, path)


def over_training(path: Path, over: dict, contribution: np.ndarray, source: str, unit: str = "head",
                  xlabel: str = "training step") -> None:
    """Across the models (x = training step): each order's prunable fraction; each order's loss increase
    averaged over the grid (the unpruned loss in the title's place: it falls far more than the orders differ);
    every unit's term c, one line per unit coloured by layer."""
    plt = pyplot()
    steps = np.array(over["steps"])
    models, layers, units = contribution.shape
    one, many = UNIT_NAMES[unit]
    fig, (ax, loss_ax, c_ax) = plt.subplots(1, 3, figsize=(15.5, 4.4))
    seen: dict[tuple, str] = {}  # an order's prunable fractions → the first order with them
    for order, marker in zip(over["prunable_fraction"], ORDER_MARKERS):  # orders that agree overlap: the markers
        label, colour = ORDER_STYLE[order]                               # tell them apart, and the legend says so
        fractions = tuple(over["prunable_fraction"][order])
        same = seen.setdefault(fractions, ORDER_STYLE[order][0])
        ax.plot(steps, fractions, color=colour, marker=marker, ms=5, mfc="none", lw=1.4,
                label=label if same == label else f"{label} (= {same})")
        loss_ax.plot(steps, 100 * np.array(over["mean_loss_increase"][order]), color=colour, marker=marker, ms=5,
                     mfc="none", lw=1.4, label=label)
    ax.set(xlabel=xlabel, ylabel=f"share of {many} removable within tolerance", ylim=(-0.03, 1.03))
    ax.set_title("prunable fraction", fontsize=10)
    ax.legend(fontsize=8)
    loss_ax.set(xlabel=xlabel, ylabel="loss increase, mean over the grid (%)")
    first, last = over["baseline_loss"][0], over["baseline_loss"][-1]
    loss_ax.set_title(f"what removing costs (unpruned loss {first:.2f} → {last:.2f} nats)", fontsize=10)
    loss_ax.grid(alpha=0.3)
    colours = OrderedColours(range(layers), "layer")
    for layer in range(layers):
        for u in range(units):
            c_ax.plot(steps, contribution[:, layer, u], color=colours(layer), lw=0.9, alpha=0.8,
                      label=colours.label(f"layer {layer}") if u == 0 else None)
    c_ax.set(xlabel=xlabel, ylabel=f"c = E‖{one} term‖ / E‖residual stream‖")
    c_ax.set_title(f"each {one}'s term", fontsize=10)
    if not colours.many:
        c_ax.legend(fontsize=7, ncol=2 if layers > 4 else 1)
    colours.colour_bar(fig, c_ax)
    fig.suptitle(f"pruning across {models} models, {source}", fontsize=11)
    save(fig, path)
