"""Several jobs side by side: the parameters that differ, the headline numbers, the curves.

A join of what the API serves per job (its document and its series), done by `GET /v1/compare`
(which `Client.compare`, `lmscope compare` and the dashboard use). Curves are matched by series name
and labels (e.g. `norm.mean` of two models, or `entropy.mean` with `{layer: 2, head: 1}` of two
checkpoints), leaving out the labels that only say which run a curve came from (`RUN_LABELS`, and the
parameters in which the jobs differ: the job itself says that) unless a job needs them to tell its own
curves apart; x values are aligned by
value, in ascending order when they are numbers.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

Scalar = (int, float, str, bool, type(None))
# A summary's lists and objects (mean entropy per layer, the lowest-entropy head, PCA's explained variance) are
# compared too, up to this many characters of JSON: a hundred checkpoint names fit, a per-position curve does not.
SUMMARY_VALUE_CHARS = 4000
# Labels naming the run rather than the quantity: two entropy jobs label their layer means with
# their own model and step, two sweep children with their own seed.
# Which run a curve came from, and what a run counted along the way (how many trajectories a norms
# job's inner-loss curves average: a property of the run, not of the curve; `over`, what they average,
# stays).
RUN_LABELS = ("model", "step", "seed", "seeds", "seed_count", "kept", "total", "trajectories")
# Run labels that name a point within a run (a checkpoint, a seed): when one job needs them to tell its
# curves apart, another job's curve with the same value is that point's too (a single checkpoint
# `run@step600` against the run's step-600 curve).
POINT_LABELS = ("step", "seed")


def _names_a_point(key: str, value: Any, labels: dict[str, Any], values: set[str] | None) -> bool:
    """A step that is a checkpoint's (its model is `run@step<N>`; an entropy job on a plain model says step 0,
    a list of plain models their index), a seed, or a parameter's value that another job's curves are told
    apart by (`values`: their JSON texts; a value no such curve has names no point another job can match)."""
    if key == "step":
        model = labels.get("model")
        return isinstance(model, str) and model.endswith(f"@step{value}")
    if values is not None:
        return json.dumps(value, sort_keys=True) in values
    return value is not None


def _matching_labels(series: list[dict[str, Any]], run_labels: tuple[str, ...] = RUN_LABELS,
                     points: dict[str, set[str] | None] | None = None) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The labels each of one job's series is matched on, and the run labels it needed: without the run
    labels, or with the fewest of them that still tell the job's curves apart (`step` for a run over
    several checkpoints, `target` for a sweep over several targets compared with a sweep over one: the
    points and the parameters in which the jobs differ are tried before the counts). The `points` labels
    are kept where they name a point (`_names_a_point`)."""
    points = points or {}

    def keep(extra: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{k: v for k, v in (s.get("labels") or {}).items()
                 if k not in run_labels or k in extra
                 or (k in points and _names_a_point(k, v, s.get("labels"), points[k]))}
                for s in series]

    present = {k for s in series for k in (s.get("labels") or {})}
    candidates = tuple(k for k in _point_candidates(run_labels) if k in present)
    # the fewest first; past three at once, every run label (a job's own curves rarely need more)
    tries = [extra for size in range(min(len(candidates), 3) + 1) for extra in combinations(candidates, size)]
    for extra in tries + [run_labels]:
        labels = keep(extra)
        keys = Counter((s["name"], json.dumps(m, sort_keys=True)) for s, m in zip(series, labels))
        if all(n == 1 for n in keys.values()):
            return labels, extra
    return labels, extra  # the very same name and labels twice: both are kept, in order


def _point_candidates(run_labels: tuple[str, ...]) -> tuple[str, ...]:
    """The run labels that may name a curve within a job: a checkpoint's step, a seed, and the parameters
    in which the jobs differ (not the model, nor a count of what a run averaged)."""
    return POINT_LABELS + tuple(k for k in run_labels if k not in RUN_LABELS)


def _x_key(x: Any) -> Any:
    """Equal numbers are one x (1 and 1.0); anything else by its JSON text."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return json.dumps(x, sort_keys=True)


@dataclass
class Curve:
    """One series name + labels, with each job's (x, y) where that job has it."""

    name: str
    labels: dict[str, Any]
    by_job: dict[int, tuple[list, list]] = field(default_factory=dict)

    def aligned(self, job_ids: list[int]) -> list[tuple[Any, list[Any]]]:
        """[(x, [y of each job or None])] over the union of x values: ascending when they are all
        numbers, else in order of first appearance."""
        xs: dict[Any, Any] = {}
        lookup = {}
        for job_id in job_ids:
            x, y = self.by_job.get(job_id, ([], []))
            lookup[job_id] = {}
            for xi, yi in zip(x, y):
                key = _x_key(xi)
                xs.setdefault(key, xi)
                lookup[job_id].setdefault(key, yi)
        keys = list(xs)
        if all(isinstance(k, float) for k in keys):
            keys.sort()
        return [(xs[k], [lookup[j].get(k) for j in job_ids]) for k in keys]


def _short(value: Any) -> bool:
    """A list or object of at most SUMMARY_VALUE_CHARS characters of JSON (a longer list is not serialised to
    find out: the dashboard asks for a comparison every few seconds while jobs run)."""
    return len(value) <= SUMMARY_VALUE_CHARS and len(json.dumps(value)) <= SUMMARY_VALUE_CHARS


@dataclass
class Comparison:
    jobs: list[dict[str, Any]]  # id, kind, name, status, error (type, message or null) of each job, in the order asked
    params: dict[str, dict[int, Any]]  # parameters whose values differ between the jobs
    summary: dict[str, dict[int, Any]]  # every summary value but long lists and objects, by key then job
    curves: list[Curve]
    missing: list[str] = field(default_factory=list)  # --series names no job has
    shared_series: list[str] = field(default_factory=list)  # series names every job has

    @property
    def ids(self) -> list[int]:
        return [j["id"] for j in self.jobs]

    def to_json(self) -> dict[str, Any]:
        def by_id(values: dict[int, Any]) -> dict[str, Any]:
            return {str(k): v for k, v in values.items()}

        return {"jobs": self.jobs, "params": {k: by_id(v) for k, v in self.params.items()},
                "summary": {k: by_id(v) for k, v in self.summary.items()},
                "series": [{"name": c.name, "labels": c.labels, "x_meaning": x_meaning(c.name),
                            "jobs": {str(j): {"x": x, "y": y} for j, (x, y) in c.by_job.items()}} for c in self.curves],
                "missing": self.missing, "shared_series": self.shared_series}

    def plot(self, path: str | Path, *, logx: bool = False, logy: bool = False) -> Path:
        """Draw the curves into `path` (.png, .pdf, .svg, ...) as `lmscope compare --plot` does."""
        return plot_comparison(self, path, logx=logx, logy=logy)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Comparison":
        def by_int(values: dict[str, Any]) -> dict[int, Any]:
            return {int(k): v for k, v in values.items()}

        curves = [Curve(s["name"], s["labels"], {int(j): (xy["x"], xy["y"]) for j, xy in s["jobs"].items()})
                  for s in doc.get("series") or []]
        return cls(jobs=doc["jobs"], params={k: by_int(v) for k, v in doc["params"].items()},
                   summary={k: by_int(v) for k, v in doc["summary"].items()}, curves=curves,
                   missing=doc.get("missing") or [], shared_series=doc.get("shared_series") or [])


def compare(jobs: list[dict[str, Any]], series_of: list[list[dict[str, Any]]]) -> Comparison:
    """Join jobs ({id, kind, name, status, params, summary}) with their series ([{name, labels, x, y}]),
    in the same order."""
    ids = [j["id"] for j in jobs]
    # A job without a key is left out of its values (shown "-"), apart from one whose value is null.
    params: dict[str, dict[int, Any]] = {}
    for key in dict.fromkeys(k for j in jobs for k in (j.get("params") or {})):
        values = {j["id"]: j["params"][key] for j in jobs if key in (j.get("params") or {})}
        if len(values) < len(jobs) or len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            params[key] = values
    summary: dict[str, dict[int, Any]] = {}
    for key in dict.fromkeys(k for j in jobs for k in (j.get("summary") or {})):
        values = {j["id"]: j["summary"][key] for j in jobs if key in (j.get("summary") or {})}
        if all(isinstance(v, Scalar) or _short(v) for v in values.values()):
            summary[key] = values
    # A label that is a parameter in which the jobs differ names the job too: sweep grid points that
    # differ in latent_dim label their curves with it, and are compared on one curve. Not one that only
    # some jobs have: a sweep's curves per latent_dim match the one grid point's of the same latent_dim.
    run_labels = RUN_LABELS + tuple(k for k, values in params.items() if len(values) == len(jobs))
    # the point labels some job needs (not its last resort, every run label, which another job cannot share)
    needed = [_matching_labels(series, run_labels)[1] for series in series_of]
    points: dict[str, set[str] | None] = {}
    for k in _point_candidates(run_labels):
        needing = [series for series, extra in zip(series_of, needed) if extra != run_labels and k in extra]
        if needing:  # a checkpoint's step or a seed as before; a parameter by the values those jobs have
            points[k] = None if k in POINT_LABELS else {
                json.dumps(s["labels"][k], sort_keys=True) for series in needing for s in series if k in (s.get("labels") or {})}
    curves: dict[tuple, Curve] = {}
    for job_id, series in zip(ids, series_of):
        seen: Counter[tuple] = Counter()
        for s, labels in zip(series, _matching_labels(series, run_labels, points)[0]):
            key = (s["name"], json.dumps(labels, sort_keys=True))
            seen[key] += 1
            # a job with the very same name and labels twice keeps both curves
            curve = curves.setdefault((*key, seen[key]), Curve(s["name"], labels))
            curve.by_job[job_id] = (s["x"], s["y"])
    return Comparison(jobs=[{k: j.get(k) for k in ("id", "kind", "name", "status", "error")} for j in jobs],
                      params=params, summary=summary, curves=list(curves.values()))


MAX_PANELS = 12
LEGEND_WIDTH = 40  # characters of a job's "what differs" in a legend entry
TITLE_WIDTH = 70  # characters of a panel's shared labels under its title

# What x is in the series the analyses write (series carry no x name): a series name, or the start of
# one before a ".", with its x; the longest match wins.
X_MEANINGS: dict[str, str] = {
    "norm": "hidden state h_l (l = 0: embedding output, l: output of block l)",
    "inner_loss": "layer l whose hidden state goes through the last block",
    "entropy": "training step",
    "entropy.layer_mean": "layer",
    "entropy.by_position": "query position t",
    "entropy.histogram": "attention entropy (nats)",
    "dimension_entropy": "training step",
    "dimension_entropy.histogram": "dimension-wise entropy (nats)",
    "dimension_entropy.gap_histogram": "nats below the uniform bound ln(visible keys)",
    "uniform_bound": "query position t",
    "parameters.by_layer": "layer",
    "val_error": "epoch",
    "train_loss": "epoch",
    "best_val_error": "latent dimension d′",
    "theory_latent_dim": "token dimension d",
    "rel_error": "k (random features / projected keys)",
    "time_ratio": "k (random features / projected keys)",
    "loss": "training step",
    "lr": "training step",
    "unigram_entropy": "training step",
    # pruning: per unit of a layer (a head, or a key/value group with unit=kv_group), or per model
    "head_contribution": "head (the unit's index in its layer)",
    "head_contribution.over_training": "training step",
    "head_share": "head (the unit's index in its layer)",
    "head_importance": "head (the unit's index in its layer)",
    "first_order_loss_increase": "head (the unit's index in its layer)",
    "single_head_loss_increase": "head (the unit's index in its layer)",
    "pruned_loss": "share of heads removed (k / all units)",
    "baseline_loss": "training step",
    "prunable_fraction": "training step",
    "mean_loss_increase": "training step",
    "rank_correlation": "training step",
    "importance_rank_correlation": "training step",
    # operator
    "input_dependence": "head",
    "input_dependence.layer": "layer",
    "input_dependence.by_position": "query position t",
    "input_dependence.layer.over_training": "training step",
    "input_dependence.over_training": "training step",
}


# What y is, the same way: the quantity and its unit, for a plot's y axis.
Y_MEANINGS: dict[str, str] = {
    "norm": "L2 norm of the current token's hidden state",
    "inner_loss": "inner loss: cross-entropy at the current token (nats)",
    "entropy": "attention entropy (nats)",
    "entropy.normalized_mean": "attention entropy / ln(visible keys)",
    "entropy.histogram": "probability density (1/nat)",
    "dimension_entropy": "% of (dimension, query) rows near uniform",
    "dimension_entropy.histogram": "probability density (1/nat)",
    "dimension_entropy.gap_histogram": "% of rows",
    "uniform_bound": "ln(visible keys) (nats)",
    "parameters.by_layer": "parameters",
    "val_error": "relative L2 validation error",
    "train_loss": "training loss (MSE, target units²)",
    "best_val_error": "best relative L2 validation error",
    "theory_latent_dim": "theory d′ = C(n+d,d) − 1",
    "rel_error": "relative L2 error of the attention output",
    "time_ratio": "approximation time / exact kernel time",
    "loss": "next-token loss (nats)",
    "lr": "learning rate",
    "unigram_entropy": "unigram cross-entropy (nats)",
    "head_contribution": "c = E‖head term‖ / E‖residual stream‖",
    "head_share": "the head's share of its layer's terms",
    "head_importance": "I = E over windows |∂loss/∂gate| (nats)",
    "first_order_loss_increase": "first-order loss increase −E ∂loss/∂gate (nats)",
    "single_head_loss_increase": "loss increase with only this head removed (nats)",
    "pruned_loss": "next-token loss (nats)",
    "baseline_loss": "unpruned next-token loss (nats)",
    "prunable_fraction": "share of heads removable within tolerance",
    "mean_loss_increase": "relative loss increase, mean over the grid",
    "rank_correlation": "Spearman ρ(c, Δ)",
    "importance_rank_correlation": "Spearman ρ(c, I)",
    "input_dependence": "relative change of the head's term",
    "input_dependence.layer": "relative change of the layer's attention term",
    "input_dependence.by_position": "relative change of the layer's attention term",
}


def _meaning(table: dict[str, str], name: str) -> str | None:
    for key in sorted(table, key=len, reverse=True):  # the longest match wins
        if name == key or name.startswith(key + "."):
            return table[key]
    return None


def x_meaning(name: str) -> str:
    """What a series' x values are (`X_MEANINGS`), or "x" when lmscope does not know the series."""
    return _meaning(X_MEANINGS, name) or "x"


def y_meaning(name: str, unit: Any = None) -> str:
    """A y axis label: what the series' values are (`Y_MEANINGS`) and its name, e.g. "attention entropy
    (nats) [entropy.mean]"; an unknown series is its name (and its `unit` label, if it has one)."""
    meaning = _meaning(Y_MEANINGS, name)
    if meaning is not None:
        return f"{meaning} [{name}]"
    return name + (f" ({unit})" if unit is not None else "")


def clip(text: str, width: int) -> str:
    """`text`, cut to `width` characters with "…" when longer."""
    return text if len(text) <= width else text[:width - 1] + "…"


def clip_apart(texts: list[str], width: int, most: int = 3 * LEGEND_WIDTH) -> list[str]:
    """`texts`, each cut to `width` characters, or wider (up to `most`) where cutting would make two
    different texts read the same: a legend must still tell its entries apart."""
    for w in range(width, max(width, most) + 1):
        cut = [clip(t, w) for t in texts]
        if len(set(cut)) == len(set(texts)):
            return cut
    return cut


def _value_text(v: Any) -> str:
    """A value as the tables write it: strings as they are, anything else as JSON (None: null)."""
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def labels_text(labels: dict[str, Any], keys) -> str:
    """`k=v, ...` for a curve's labels; a label the curve does not have (None: a Sumformer's features)
    is left out rather than written as `features=-` (the dashboard writes them the same way)."""
    return ", ".join(f"{k}={_value_text(labels[k])}" for k in keys if labels.get(k) is not None)


def _what_differs(c: Comparison, job: dict[str, Any]) -> str:
    # a parameter the job does not have (another kind's) is left out: a norms job beside an entropy job would
    # otherwise list every parameter of both, most of them "-"
    # a null (`model=null` beside `train_job=7`) is said only when the job differs in nothing else: the
    # legend names each job by what it sets
    own = [(k, v[job["id"]]) for k, v in c.params.items() if job["id"] in v]
    shown = [(k, value) for k, value in own if value is not None] or own
    return ", ".join(f"{k}={_value_text(value)}" for k, value in shown) or job.get("name") or ""


def job_labels(c: Comparison, width: int = LEGEND_WIDTH) -> dict[int, str]:
    """{job id: `job 3 (model=tiny-gpt2)`}: each job and the parameters in which it differs from the others
    (its name when none differs), cut to `width` characters, or wider where that would make two read the same."""
    whats = clip_apart([_what_differs(c, job) for job in c.jobs], width)
    return {job["id"]: f"job {job['id']}" + (f" ({what})" if what else "") for job, what in zip(c.jobs, whats)}


def plot_formats() -> dict[str, str]:
    """The file formats --plot can write: {extension: description}, as matplotlib's canvas has them."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("plotting needs matplotlib (pip install matplotlib, or lmscope[worker]); "
                           "--format csv gives the numbers") from None
    return dict(Figure().canvas.get_supported_filetypes())


def _is_integer(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()


# Line looks a reader tells apart in a legend: four dash patterns, then the same with markers.
LOOKS = [(dash, marker) for marker in (None, "o", "s") for dash in ("-", "--", ":", "-.")]


def line_look(i: int, dot: str | None) -> dict[str, Any]:
    """matplotlib line keywords of look `i`; `dot` marks the points of looks without a marker of their own."""
    dash, marker = LOOKS[i % len(LOOKS)]
    return {"linestyle": dash, "marker": marker or dot, "markersize": 4 if marker else None}


def comparison_figure(c: Comparison, *, logx: bool = False, logy: bool = False):
    """The comparison as a matplotlib Figure: one panel per series name.

    Each panel: x labelled with what x is (`x_meaning`), y with what y is and the series name (`y_meaning`);
    the labels its curves share under the title. Jobs and the label sets that vary between its curves
    (e.g. layers) are told apart by colour and by line look: colour for whichever is more numerous, a
    look (dash pattern, then markers; twelve) for the other, both named in the legend — a job by what
    differs between the jobs (`job_labels`). Past twelve looks (or twenty colours) they repeat, and the
    title says how many curves there are by which labels.
    """
    plot_formats()  # matplotlib is there
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

    names = list(dict.fromkeys(curve.name for curve in c.curves))
    if not names:
        raise ValueError("no curves to plot: no job has a series of the names asked for; name some that they have "
                         "(--series 'norm.*' in the CLI, compare(ids, series='norm.*') in Python; shared_series "
                         "lists those all the jobs have)")
    if len(names) > MAX_PANELS:
        raise ValueError(f"{len(names)} series names match; plot at most {MAX_PANELS} (narrow --series)")
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(5.2 * cols, 4.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    labels_of_jobs = job_labels(c)
    beside = []  # the legends beside their panels
    for ax, name in zip(axes.flat, names):
        curves = [curve for curve in c.curves if curve.name == name]
        jobs = [job for job in c.jobs if any(job["id"] in cv.by_job for cv in curves)]
        keys = list(dict.fromkeys(k for curve in curves for k in curve.labels))
        first = curves[0].labels
        shared = {k: first[k] for k in keys
                  if all(k in cv.labels and _value_text(cv.labels[k]) == _value_text(first[k]) for cv in curves)}
        varying = [k for k in keys if k not in shared]
        unit = shared.pop("unit", None)
        # colour for the more numerous of jobs and label sets: 2 jobs × 8 layers is 8 colours, 2 looks
        colour_curves = bool(varying) and len(curves) > len(jobs)
        n_colours, n_looks = (len(curves), len(jobs)) if colour_curves else (len(jobs), len(curves))
        palette = matplotlib.colormaps["tab10" if n_colours <= 10 else "tab20"]
        named = n_colours <= palette.N and n_looks <= len(LOOKS)
        dot = "." if max(len(x) for cv in curves for x, _ in cv.by_job.values()) < 30 else None  # few points: marked
        for li, curve in enumerate(curves):
            for ji, job in enumerate(jobs):
                if job["id"] not in curve.by_job:
                    continue
                x, y = curve.by_job[job["id"]]
                colour, look = (li, ji) if colour_curves else (ji, li)
                ax.plot(x, y, color=palette(colour % palette.N), **line_look(look, dot), markevery=max(1, len(x) // 15),
                        alpha=0.9 if len(curves) * len(jobs) < 16 else 0.6)
        # the legend: each job, then each label set that varies, by its colour or its look
        def entry(i: int, text: str, by_colour: bool) -> Line2D:
            return (Line2D([], [], color=palette(i % palette.N), marker=".", label=text) if by_colour
                    else Line2D([], [], color="dimgrey", label=text, **line_look(i, dot)))

        handles = [entry(ji, labels_of_jobs[job["id"]], not colour_curves) for ji, job in enumerate(jobs)]
        if varying and named:
            # a curve without the labels the others vary by (a single model's, beside a run's steps) says so
            texts = clip_apart([labels_text(cv.labels, varying) or f"no {', '.join(varying)}" for cv in curves],
                               LEGEND_WIDTH)
            handles += [entry(li, text, colour_curves) for li, text in enumerate(texts)]
        common = labels_text(shared, shared)
        if varying and not named:
            common = ", ".join(filter(None, [f"{len(curves)} curves by {', '.join(varying)}", common]))
        ax.set_title(name + (f"\n{clip(common, TITLE_WIDTH)}" if common else ""), fontsize=9)
        ax.set_xlabel(x_meaning(name), fontsize=8)
        ax.set_ylabel(y_meaning(name, unit), fontsize=8)
        xs = [v for cv in curves for x, _ in cv.by_job.values() for v in x]
        if not logx:  # few enough ticks that 750, 1000, 1250 do not run together beside a legend
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=bool(xs) and all(_is_integer(v) for v in xs)))
        numeric = [float(v) for v in xs if isinstance(v, (int, float)) and not isinstance(v, bool)]
        unlogged = sum(v <= 0 for v in numeric)
        if logx and numeric and unlogged == len(numeric):  # e.g. layer 0 alone: a linear axis, and why
            ax.set_xlabel(f"{x_meaning(name)} (linear: no x > 0 for a log axis)", fontsize=8)
        elif logx:
            if unlogged:
                ax.set_xlabel(f"{x_meaning(name)} (log; {unlogged} point(s) at x ≤ 0 not drawn)", fontsize=8)
            ax.set_xscale("log")
            distinct = sorted({v for v in numeric if v > 0})
            if 1 < len(distinct) <= 12:  # a sweep's k = 16, 32, ...: those values as plain ticks
                ax.set_xticks(distinct, [f"{v:g}" for v in distinct])
                ax.xaxis.set_minor_formatter(NullFormatter())
        if logy:
            ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # absolute values: "+3.877" in a corner makes 1e-4 nats read large
            if isinstance(axis.get_major_formatter(), ScalarFormatter):
                axis.get_major_formatter().set_useOffset(False)
        ax.grid(alpha=0.3)
        if len(handles) > 6:  # beside the panel, not over its lines (savefig's tight box takes it in)
            ncol = 2 if len(handles) > 16 else 1
            beside.append(ax.legend(handles=handles, fontsize=7, handlelength=3, loc="upper left",
                                    bbox_to_anchor=(1.01, 1), ncol=ncol))
        else:
            ax.legend(handles=handles, fontsize=7, handlelength=3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.suptitle("compared: " + ", ".join(f"job {j['id']} ({j['kind']})" for j in c.jobs))
    if beside:  # the figure widens by the widest legend beside a panel, rather than squeezing the panels
        fig.draw_without_rendering()
        inches = max(legend.get_window_extent().width for legend in beside) / fig.dpi
        fig.set_size_inches((5.2 + inches) * cols, fig.get_figheight())
    fig.tight_layout()
    return fig


def plot_comparison(c: Comparison, path: str | Path, *, logx: bool = False, logy: bool = False) -> Path:
    """Draw `comparison_figure` into `path`, in the format its extension names (.png without one).
    Returns the path written."""
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = plot_formats()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"cannot draw a {path.suffix} file; the formats are: {', '.join(sorted(formats))}")
    fig = comparison_figure(c, logx=logx, logy=logy)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
