"""Approximation sweeps (DESIGN.md §7 "sweep"; Alberti et al., "Sumformer", 2023).

A `sweep` is a parent job; the API expands its grid into children (`lmscope.params.sweep`):

- `sumformer_fit` (`lmscope.analyses.sumformer_fit`): train one network (poly / MLP Sumformer, one-attention-layer
  Transformer / Linformer / Performer, `lmscope.modeling.sumformer`) on one equivariant target
  (`lmscope.analyses.targets`) and report the relative L2 validation error

      err = ‖f(X) − g(X)‖₂ / ‖g(X)‖₂   over every sample, token and coordinate of the validation split

  every `eval_every` epochs (`val_error`, x = epoch) and the training MSE (`train_loss`).
- `attention_approx` (`lmscope.analyses.attention_approx`): capture q, k, v of every layer of a real model on
  token windows, and compare Performer (k random features) or Linformer (k projected keys) with exact
  softmax attention computed in float64, for every k: `rel_error` (x = k) and `time_ratio`
  (approximation time / exact kernel time, x = k).
- `aggregate` (here): runs once when the last child ended; averages over seeds, writes the parent's series
  and the figures (`fig1_training.png`, `fig2_latent_dim.png` or `attention_approx.png`), and lists
  the children that failed in the summary.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from lmscope.analyses.attention_approx import PROJECTION_LABELS, plot_attention_approx, sliding_window_note, timing_note
from lmscope.analyses.base import ChildResult, JobContext, JobFailed, JobOutput, Series
from lmscope.analyses.plotting import pyplot, readable_log_y, save
from lmscope.params.sweep import SweepParams, clamped_latent_dims, theory_latent_dim


MAX_LISTED_CHILDREN = 100  # children without results named in the summary; summary["children"] counts them all


def aggregate(params: SweepParams, children: list[ChildResult], ctx: JobContext) -> JobOutput:
    """Combine the children's results into the parent's series, summary and plots (runs once).

    The children's counts per status (summary["children"]) are the worker's (lmscope.worker.runner).
    """
    ok = [c for c in children if c.status == "succeeded"]
    not_ok = sorted((c for c in children if c.status != "succeeded"), key=lambda c: c.status != "failed")
    def listed(status: str) -> list[dict[str, Any]]:
        ended = [c for c in not_ok if c.status == status][:MAX_LISTED_CHILDREN]
        return [{"job_id": c.job_id, "status": c.status, **({"error": c.error[:500]} if c.error else {}),
                 "params": _short_params(c)} for c in ended]

    # named by how they ended (a cancelled sweep can have hundreds of cancelled points, which say little)
    summary: dict[str, Any] = {"study": params.study, "failed_children": listed("failed")}
    if cancelled := listed("cancelled"):
        summary["cancelled_children"] = cancelled
    if not ok:
        raise JobFailed(f"all {len(children)} children of this sweep ended without results "
                        f"(first error: {not_ok[0].error if not_ok else 'none'}); see the children's errors",
                        error_type="children-failed")
    ctx.progress(0, 1, "aggregating")
    if params.study == "sumformer":
        out = _aggregate_sumformer(params, ok, ctx, incomplete=len(ok) < len(children))
    else:
        out = _aggregate_attention(params, ok, ctx)
    out.summary = {**summary, **out.summary}
    ctx.progress(1, 1, "aggregated")
    return out


def _short_params(c: ChildResult) -> dict[str, Any]:
    return {k: v for k, v in (c.params or {}).items() if k != "train"}


def _stats(values: list[float]) -> tuple[float, float, float]:
    return sum(values) / len(values), min(values), max(values)


def _series_y(child: ChildResult, name: str) -> tuple[list, list] | None:
    for s in child.series:
        if s.name == name:
            return list(s.x), list(s.y)
    return None


def _aggregate_sumformer(params: SweepParams, ok: list[ChildResult], ctx: JobContext, *,
                         incomplete: bool = False) -> JobOutput:
    """`incomplete`: some grid points failed or were cancelled (`ok` holds the others)."""
    # best_val_error[(arch, target, d, n, k)][d'] = [error per seed]
    best: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    curves: dict[tuple, list[tuple[list, list]]] = defaultdict(list)  # (key, d') → val_error per seed
    equivariance: dict[str, float] = {}  # architecture → the largest of its children's
    for c in ok:
        p, s = c.params, c.summary or {}
        key = (p["architecture"], p["target"], p["token_dim"], p["seq_len"], p.get("features"))
        d_eff = s["latent_dim_effective"]  # every sumformer_fit summary has it
        best[key][d_eff].append(float(s["best_val_error"]))
        if s.get("equivariance_error") is not None:  # children stored before it was measured have none
            equivariance[key[0]] = max(equivariance.get(key[0], 0.0), float(s["equivariance_error"]))
        curve = _series_y(c, "val_error")
        if curve:
            curves[key + (d_eff,)].append(curve)

    series: list[Series] = []
    headline = []
    for key in sorted(best, key=str):
        arch, target, d, n, k = key
        labels = {"architecture": arch, "target": target, "token_dim": d, "seq_len": n, "features": k}
        xs = sorted(best[key])
        stats = [_stats(best[key][x]) for x in xs]
        series += [
            Series("best_val_error", xs, [m for m, _, _ in stats], {**labels, "seed_count": [len(best[key][x]) for x in xs]}),
            Series("best_val_error.min", xs, [lo for _, lo, _ in stats], labels),
            Series("best_val_error.max", xs, [hi for _, _, hi in stats], labels),
        ]
        i = min(range(len(xs)), key=lambda j: stats[j][0])
        headline.append({**labels, "best_latent_dim": xs[i], "best_val_error": stats[i][0]})
    for n in sorted({key[3] for key in best}):
        ds = sorted({key[2] for key in best if key[3] == n})
        series.append(Series("theory_latent_dim", ds, [theory_latent_dim(d, n) for d in ds], {"seq_len": n}))
    for key in sorted(curves, key=str):
        arch, target, d, n, k, d_eff = key
        x, y = _mean_curve(curves[key])
        series.append(Series("val_error", x, y, {"architecture": arch, "target": target, "token_dim": d,
                                                 "seq_len": n, "features": k, "latent_dim": d_eff,
                                                 "seed_count": len(curves[key])}))

    plots, plots_note = [], None
    if _plot_fig1(ctx.artifact_dir / "fig1_training.png", curves):
        plots.append("fig1_training.png")
    # Fig. 2 needs more than one d′ on a line (a Fig. 1 sweep has one each: nothing to draw)
    if any(len(per_x) > 1 for per_x in best.values()):
        _plot_fig2(ctx.artifact_dir / "fig2_latent_dim.png", best)
        plots.append("fig2_latent_dim.png")
    elif len(set(params.grid.latent_dim)) < 2:
        plots_note = "no fig2_latent_dim.png: every line has a single d′ (give grid.latent_dim two or more values)"
    else:  # the grid asked for several: say what left one per line (both, where both did)
        why = ([] if not incomplete else
               ["the other grid points failed or were cancelled (failed_children, cancelled_children)"])
        if clamped_latent_dims(params):
            why.append("d′ values were clamped to C(n+d,d)−1 (latent_dim_clamped)")
        plots_note = ("no fig2_latent_dim.png: every line has a single d′ with results: "
                      + ("; ".join(why) or "the grid's d′ values are one d′ here (null is the theory d′ C(n+d,d)−1)"))
    summary: dict[str, Any] = {"best": headline[:100], "best_lines": len(headline), "plots": plots}
    if equivariance:
        summary["equivariance_error_max"] = dict(sorted(equivariance.items()))
    if plots_note:
        summary["plots_note"] = plots_note
    clamped = clamped_latent_dims(params)
    if clamped:  # the grid asked for more monomials than exist: those points ran with C(n+d,d)−1
        summary["latent_dim_clamped"] = clamped
    return JobOutput(summary, series)


def _mean_curve(curves: list[tuple[list, list]]) -> tuple[list, list]:
    """Mean over seeds at the x values every seed has (they share the training settings)."""
    common = set(curves[0][0]).intersection(*(set(x) for x, _ in curves[1:]))
    xs = sorted(common)
    ys = [sum(dict(zip(x, y))[e] for x, y in curves) / len(curves) for e in xs]
    return xs, ys


def _aggregate_attention(params: SweepParams, ok: list[ChildResult], ctx: JobContext) -> JobOutput:
    err: dict[tuple[str, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    ratio: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    references: dict[str, str] = {}
    points: set[tuple[str, int, int]] = set()  # every (method, layer, k) a child measured, null or not
    for c in ok:
        method = c.params["method"]
        references[method] = (c.summary or {}).get("reference", "")
        for s in c.series:
            if s.name == "rel_error":
                for x, y in zip(s.x, s.y):
                    points.add((method, int(s.labels["layer"]), int(x)))
                    if y is not None:  # a NaN error is stored as null: that seed has no value at this k
                        err[method, int(s.labels["layer"])][int(x)].append(float(y))
            elif s.name == "time_ratio":
                for x, y in zip(s.x, s.y):
                    if y is not None:
                        ratio[method][int(x)].append(float(y))
    series: list[Series] = []
    panels: dict[tuple[str, int], tuple] = {}
    for (method, layer) in sorted(err):
        xs = sorted(err[method, layer])
        stats = [_stats(err[method, layer][x]) for x in xs]
        labels = {"method": method, "layer": layer}
        means, los, his = [m for m, _, _ in stats], [lo for _, lo, _ in stats], [hi for _, _, hi in stats]
        series += [Series("rel_error", xs, means, {**labels, "seed_count": [len(err[method, layer][x]) for x in xs]}),
                   Series("rel_error.min", xs, los, labels), Series("rel_error.max", xs, his, labels)]
        panels[method, layer] = (xs, means, los, his)
    times = {}
    for method in sorted(ratio):
        xs = sorted(ratio[method])
        ys = [_stats(ratio[method][x])[0] for x in xs]
        series.append(Series("time_ratio", xs, ys, {"method": method}))
        times[method] = (xs, ys)
    summary = {
        "reference": references,
        "rel_error_at_max_features": {
            m: sum(panels[m, layer][1][-1] for (mm, layer) in panels if mm == m) / sum(1 for mm, _ in panels if mm == m)
            for m in sorted({m for m, _ in panels})
        },
        "time_ratio_at_max_features": {m: ys[-1] for m, (_, ys) in times.items()},
        **({"linformer_projection": params.linformer_projection} if "linformer" in references else {}),
        "plots": ["attention_approx.png"],
    }
    # a seed whose error was not a number (stored null) is left out of that point's mean: say where
    ran = Counter(c.params["method"] for c in ok)
    short = [{"method": m, "layer": layer, "features": x, "seeds": len(err[m, layer].get(x, [])), "of": ran[m]}
             for m, layer, x in sorted(points) if len(err[m, layer].get(x, [])) < ran[m]]
    if short:
        summary["points_missing_seeds"] = short
    # the children read the same windows of the same model (seq_len set by them when the sweep left it to the model)
    seq_len = params.seq_len or next((c.summary["seq_len"] for c in ok if (c.summary or {}).get("seq_len")), None)
    if seq_len is not None:
        summary["seq_len"] = seq_len
    # their union, should they ever disagree
    windowed = {int(k): w for c in ok for k, w in ((c.summary or {}).get("sliding_windows") or {}).items()}
    if windowed:
        summary["sliding_windows"] = {str(layer): w for layer, w in sorted(windowed.items())}
        summary["sliding_window_note"] = sliding_window_note(windowed, seq_len)
    seeds = len(params.seed_list)
    plot_attention_approx(ctx.artifact_dir / "attention_approx.png", panels, times,
                    title=f"{params.model} on {params.dataset}: approximations vs exact softmax attention "
                          f"({params.num_segments} windows of {seq_len} tokens; "
                          + ("1 seed: one random draw per k" if seeds == 1 else f"mean over {seeds} seeds, band = min–max")
                          + ")",
                    notes={"linformer": PROJECTION_LABELS[params.linformer_projection]}, seq_len=seq_len,
                    timing=timing_note({(c.summary or {}).get("kernel_backend", "?") for c in ok}),
                    windows=windowed)
    return JobOutput(summary, series)


# ============================================================================ plots


def _grid(plt, count: int, width: float = 5.0, height: float = 3.8, **subplots):
    cols = min(count, 3)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, **subplots)
    for a in axes.flat[count:]:
        a.set_visible(False)
    return fig, list(axes.flat)


def _shade(colour: str, i: int, n: int) -> tuple[float, float, float]:
    """The `i`-th of `n` shades of `colour`: itself for the first, then towards white (at most 45 % of the way)
    for the others, so that n lines of one hue stay apart and none fades into the background."""
    from matplotlib.colors import to_rgb

    t = 0.0 if n < 2 else 0.45 * i / (n - 1)
    return tuple(c + (1.0 - c) * t for c in to_rgb(colour))


def _plot_fig1(path: Path, curves: dict[tuple, list]) -> bool:
    """Val error vs epoch, one panel per target, Polynomial vs MLP Sumformer (and other architectures)."""
    plt = pyplot()
    targets = sorted({key[1] for key in curves})
    if not targets:
        return False
    # constrained layout leaves room for the legends under the panels
    fig, axes = _grid(plt, len(targets), height=5.0, layout="constrained")
    colors = {"poly_sumformer": "tab:blue", "mlp_sumformer": "tab:orange", "transformer": "tab:green",
              "linformer": "tab:red", "performer": "tab:purple"}
    # The attention networks start from the same φ and ψ weights with near-uniform attention, so for a
    # while their curves coincide: staggered dashes (each a third of one period) keep all three visible
    # where they do, and the MLP Sumformer's gaps show the polynomial one beneath it.
    styles = {"mlp_sumformer": (0, (5, 2)), "transformer": (0, (4, 8)), "linformer": (4, (4, 8)),
              "performer": (8, (4, 8))}
    for ax, target in zip(axes, targets):
        keys = [key for key in curves if key[1] == target]
        pruned = ""
        # Too many curves for one panel (a Fig. 2 grid): keep the best d' of each (architecture, target,
        # d, n, k), and if that is still too many, the best configuration of each architecture.
        for group, what in ((lambda key: key[:5], "best d′ per architecture and d"),
                            (lambda key: key[0], "best configuration per architecture")):
            if len(keys) <= 8:
                break
            keep: dict[Any, tuple[float, tuple]] = {}
            for key in keys:
                err = min(_mean_curve(curves[key])[1])
                if group(key) not in keep or err < keep[group(key)][0]:
                    keep[group(key)] = (err, key)
            keys, pruned = [key for _, key in keep.values()], what
        archs = {key[0] for key in keys}
        # by architecture, then by number: d'=4 before d'=16 (as text, 16 came first)
        ordered = sorted(keys, key=lambda key: (key[0], *(-1 if v is None else v for v in key[2:])))
        per_arch = Counter(key[0] for key in ordered)
        nth: Counter = Counter()
        for key in ordered:
            arch, _, d, n, k, d_eff = key
            x, y = _mean_curve(curves[key])
            label = f"{arch} (d={d}, n={n}, d'={d_eff}" + (f", k={k}" if k else "") + ")"
            dashed = arch in styles and len(archs) > 1  # dashes tell architectures apart; alone, a plain line
            # an architecture's hue, darker to lighter over its configurations: the architectures group at a
            # glance (one colour per configuration mixed them), and a lone architecture's lines still differ
            colour = _shade(colors.get(arch, "tab:gray"), nth[arch], per_arch[arch])
            nth[arch] += 1
            ax.semilogy(x, y, label=label, color=colour,
                        ls=styles[arch] if dashed else "-", lw=1.4 if dashed else 1.8,
                        zorder=2.2 if dashed else 2,  # dashes over the solid line they may hide
                        marker="o" if len(x) < 3 else None, ms=4)  # a one-point curve is a dot, not nothing
        ax.set(xlabel="epoch", ylabel="relative L2 validation error",
               title=f"target {target}" + (f"\n({pruned})" if pruned else ""))
        ax.grid(True, which="both", alpha=0.3)
        readable_log_y(ax)
        # below the panel: inside, the legend covers whichever curves run through its corner
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1 if len(keys) < 4 else 2)
        lo, hi = ax.get_xlim()
        if hi - lo < 2:  # one evaluation: show the epochs around it, not fractions of one
            ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
        ax.xaxis.get_major_locator().set_params(integer=True)  # epochs
    # the paper's Fig. 1 sets the polynomial Sumformer against the MLP one; a sweep without both is not that figure
    both = {"poly_sumformer", "mlp_sumformer"} <= {key[0] for key in curves}
    fig.suptitle(f"{'Fig. 1: ' if both else ''}validation error during training\n"
                 f"({seeds_wording(len(c) for c in curves.values())})")
    save(fig, path)
    return True


def _plot_fig2(path: Path, best: dict[tuple, dict]) -> None:
    """Best val error vs d′ (log–log), one line per token dim d, theory d′ = C(n+d,d)−1 marked."""
    plt = pyplot()
    panels = sorted({(key[0], key[1], key[3], key[4]) for key in best}, key=str)
    if not panels:
        return
    fig, axes = _grid(plt, len(panels), width=5.5, height=4.6, layout="constrained")
    cmap = plt.get_cmap("viridis")
    for ax, (arch, target, n, k) in zip(axes, panels):
        ds = sorted({key[2] for key in best if (key[0], key[1], key[3], key[4]) == (arch, target, n, k)})
        theory = [theory_latent_dim(d, n) for d in ds]
        xs_all = [x for key in best if (key[0], key[1], key[3], key[4]) == (arch, target, n, k) for x in best[key]]
        # A theory d′ far beyond the grid (C(n+d,d)−1 is 2.7e16 at n = 64, d = 16) would squeeze every
        # line into a sliver of the panel: within 64× of the grid it is drawn, beyond it is named in
        # the legend and marked by an arrow on the right edge.
        near = [min(xs_all) / 64 <= t <= max(xs_all) * 64 for t in theory]
        for i, d in enumerate(ds):
            color = cmap(0.85 * i / max(len(ds) - 1, 1))  # viridis' last 15 % is too pale to see on white
            per_x = best[arch, target, d, n, k]
            xs = sorted(per_x)
            stats = [_stats(per_x[x]) for x in xs]
            label = f"d={d}" if near[i] else f"d={d} (theory d′ {theory[i]:.2g} →)"
            ax.plot(xs, [m for m, _, _ in stats], marker="o", ms=3, color=color, label=label)
            if any(len(per_x[x]) > 1 for x in xs):
                ax.fill_between(xs, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=color, alpha=0.15)
            # theory d′ as a triangle of the line's colour on the top edge (ten dotted verticals in
            # neighbouring greens could not be told apart), and a dotted vertical for a few d
            if not near[i]:
                ax.plot([1.0], [1.0], marker=">", ms=8, color=color, mec="k", mew=0.4,
                        transform=ax.transAxes, clip_on=False)
                continue
            ax.plot([theory[i]], [1.0], marker="v", ms=8, color=color, mec="k", mew=0.4,
                    transform=ax.get_xaxis_transform(), clip_on=False)
            if len(ds) <= 3:
                ax.axvline(theory[i], color=color, ls=":", lw=1.6, alpha=0.9)
        shown = xs_all + [t for t, inside in zip(theory, near) if inside]
        ax.set_xlim(min(shown) / 1.5, max(shown) * 1.5)  # the near theory d′ inside the frame
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        title = f"{arch} on {target}, n={n}" + (f", k={k}" if k else "")
        ax.set(xlabel="latent dimension d′", ylabel="best relative L2 validation error")
        ax.set_title(title, pad=12)  # above the theory triangles
        ax.grid(True, which="both", alpha=0.3)
        readable_log_y(ax)
        # below the panel, as in Fig. 1: inside, it covers whichever curves run through its corner
        ax.legend(fontsize=7, ncol=min(5, len(ds)), loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  title=", ".join(filter(None, [
                      "▼ on the top edge" + (" and dotted" if len(ds) <= 3 else "") if any(near) else "",
                      "▶: beyond the axis" if not all(near) else ""])) + ": theory d′ = C(n+d,d)−1",
                  title_fontsize=7)
    seeds = seeds_wording(len(errors) for per_x in best.values() for errors in per_x.values())
    fig.suptitle("Fig. 2: best validation error vs latent dimension\n"
                 f"({seeds}{'' if seeds == 'one seed' else ', band = min–max over seeds'})")
    save(fig, path)


def seeds_wording(counts) -> str:
    """What a point of the figure is, from the number of seeds behind each: "one seed", "mean over 3
    seeds", "mean over 1–3 seeds" (children that failed leave fewer)."""
    counts = set(counts)
    if not counts or counts == {1}:
        return "one seed"
    lo, hi = min(counts), max(counts)
    return f"mean over {hi} seeds" if lo == hi else f"mean over {lo}–{hi} seeds"


__all__ = ["aggregate"]
