"""One model and method of an attention study (`attention_approx`, a child of `sweep` with study="attention").

Capture q, k, v of every layer of a real model on token windows, and compare Performer (k random
features) or Linformer (k projected keys) with exact softmax attention computed in float64, for every
k: `rel_error` (x = k) and `time_ratio` (approximation time / exact kernel time, x = k);
`attention_approx.png` (the sweep's parent draws the same figure over all its children).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmscope.analyses.base import (JobContext, JobFailed, JobOutput, Series, context_seq_len, dataset_windows,
                                   require_positions)
from lmscope.analyses.plotting import OrderedColours, pyplot, readable_log_y, save
from lmscope.params.sweep import DEFAULT_ATTENTION_SEQ_LEN, AttentionApproxParams
from lmscope.seeds import derived_seed


def per_segment_rel_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """‖approx − exact‖_F / ‖exact‖_F for every segment (batch row), over heads, positions, dims."""
    diff = (approx.double() - exact).flatten(1).norm(dim=1)
    return diff / exact.flatten(1).norm(dim=1)


TIMING_REPEATS = 3  # each timed call is the fastest of this many: a busy host or GPU slows some calls, never speeds one


def _timed(fn, device: torch.device, repeats: int = TIMING_REPEATS) -> tuple[Any, float]:
    """fn()'s result and the fastest of `repeats` calls' wall times (synchronised on CUDA)."""
    out, best = None, float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        out = result if out is None else out
    return out, best


def pooling_projection(k: int, seq_len: int) -> torch.Tensor:
    """[min(k, N), N]: row j averages the contiguous block of positions [j·N/k, (j+1)·N/k).

    As Linformer's E = F this is attention over block means of keys and values; k ≥ N is the identity.
    """
    k = min(k, seq_len)
    p = torch.zeros(k, seq_len)
    for j in range(k):
        lo, hi = j * seq_len // k, (j + 1) * seq_len // k
        p[j, lo:hi] = 1.0 / (hi - lo)
    return p


PROJECTION_LABELS = {"pooling": "block-mean pooling E = F", "shared": "shared Gaussian E = F = R",
                     "gaussian": "independent Gaussian E, F"}


def linformer_projections(kind: str, k: int, seq_len: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, F) [k', N] for `linformer_projection` = pooling | shared | gaussian (see lmscope.params.sweep)."""
    from lmscope.kernels import draw_linformer_projections

    if kind == "pooling":
        pool = pooling_projection(k, seq_len).to(device)
        return pool, pool
    if kind == "shared":
        # one R [k, N] with i.i.d. N(0, 1/k) entries for keys and values: the Linformer paper's JL
        # argument (which scales them as E = δR, F = e^(−δ)R; not here). R is the first matrix the kernels
        # draw for the seed.
        r = draw_linformer_projections(k, seq_len, seed, device)[0]
        return r, r
    if kind == "gaussian":
        return draw_linformer_projections(k, seq_len, seed, device)
    raise ValueError(f"unknown linformer_projection {kind!r}; use pooling, shared or gaussian")


def sliding_window_note(short_windows: dict[int, int], seq_len: int) -> str:
    """What the summary says when selected layers slide over fewer keys than seq_len."""
    sizes = " / ".join(str(w) for w in sorted(set(short_windows.values())))
    return (f"layer(s) {sorted(short_windows)} attend over a sliding window of {sizes} tokens in the model, shorter "
            f"than seq_len {seq_len}; there the methods are compared with full softmax attention over the "
            "same q, k, v, not with the window the model uses (set seq_len at most the window to compare with "
            "the model's own attention)")


def _attention_study_model(params: AttentionApproxParams, ctx: JobContext):
    """(the loaded model, the layers to study, params with seq_len set): refused when a layer does not exist
    or lmscope's attention function cannot read the model's q, k, v, or its attention is not plain softmax
    attention."""
    from lmscope.kernels.hf import lmscope_attention_unsupported, uses_attention_interface

    with ctx.stage("load_model"):
        loaded = ctx.load_model(params.model)
    cfg = loaded.model.config
    num_layers = int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))
    if params.seq_len is None:  # not given: 512, or the model's context when shorter
        params = params.model_copy(update={"seq_len": context_seq_len(cfg, DEFAULT_ATTENTION_SEQ_LEN)})
    require_positions(cfg, params.seq_len, params.model)
    layers = list(range(num_layers)) if params.layers is None else list(params.layers)
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise JobFailed(f"layers {bad} do not exist: {params.model} has layers 0..{num_layers - 1}")
    # q, k, v come from lmscope's attention function, and "exact" must be the model's own softmax
    unsupported = lmscope_attention_unsupported(loaded.model)
    if unsupported is not None:
        # only where the model computes attention in its own modules does entropy take another route
        advice = ("" if uses_attention_interface(loaded.model) else
                  ". Study a model whose attention goes through transformers' AttentionInterface "
                  "(docs/models-and-datasets.md lists them); the `entropy` job still runs this one")
        raise JobFailed(f"the attention study reads each layer's q, k, v through lmscope's attention function, "
                        f"which cannot run {params.model}: {unsupported}{advice}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise JobFailed(f"{params.model} soft-caps its attention scores (Gemma 2): its attention is not the softmax "
                        "attention Performer and Linformer approximate. Study a model without soft-capping "
                        "(Gemma 3, LLaMA, Qwen, …); the `entropy` job runs this one, caps included")
    return loaded, layers, params


class Approximation:
    """``params.method`` with k features on one layer's q, k, v. The random features / projections are
    drawn once per (layer, k), from the job's seed, and reused for every segment."""

    def __init__(self, params: AttentionApproxParams):
        self.params = params
        self.draws: dict[tuple[int, int], Any] = {}
        self.backends: set[str] = set()  # what ran the approximation (the kernels' own choice per call)

    def __call__(self, layer: int, k: int, q, kk, v, scale: float):
        from lmscope.kernels import (draw_favor_projection, favor_attention, favor_backend, linformer_attention,
                                     linformer_backend)

        p = self.params
        if (layer, k) not in self.draws:
            seed = derived_seed(p.seed, "projection", layer, k)
            # on the layer's own device (a model spread over several GPUs)
            self.draws[layer, k] = (draw_favor_projection(k, q.shape[-1], seed, q.device)
                                    if p.method == "performer" else
                                    linformer_projections(p.linformer_projection, k, q.shape[2], seed, q.device))
        if p.method == "performer":
            self.backends.add(favor_backend(q, kk, v, causal=True))
            return favor_attention(q, kk, v, projection=self.draws[layer, k], causal=True, scale=scale)
        e, f = self.draws[layer, k]
        self.backends.add(linformer_backend(q, kk, v))
        return linformer_attention(q, kk, v, e, f, scale=scale)


@dataclass
class ApproxMeasurements:
    errors: dict[tuple[int, int], list[float]]  # (layer, k) → relative error per segment
    exact_seconds: float  # the exact kernel, all layers and segments
    approx_seconds: dict[int, float]  # k → the approximation, all layers and segments
    scales: dict[int, float] = field(default_factory=dict)  # layer → the softmax scale the model applies
    short_windows: dict[int, int] = field(default_factory=dict)  # layer → its sliding window, when < seq_len
    head_info: dict[str, int] = field(default_factory=dict)
    backends: set[str] = field(default_factory=set)  # what ran the exact side (head_dim > 256: the reference)


def measure_approximations(model, windows: torch.Tensor, layers: list[int], params: AttentionApproxParams,
                           approx: Approximation, causal_ref: bool, ctx: JobContext) -> ApproxMeasurements:
    """Every layer's q, k, v from a forward pass per batch of windows; the approximation's error against
    exact attention in float64 for every k, and both timed."""
    from lmscope.kernels import attention_with_entropy
    from lmscope.kernels.hf import EntropyCollector

    device = next(model.parameters()).device
    ks = list(params.features)
    m = ApproxMeasurements({(layer, k): [] for layer in layers for k in ks}, 0.0, {k: 0.0 for k in ks})
    batches = list(range(0, len(windows), params.batch_size))
    with torch.no_grad(), ctx.stage("measure"):
        for b, start in enumerate(batches):
            input_ids = windows[start:start + params.batch_size].to(device)
            with EntropyCollector(model, capture_qkv=True) as col:
                model(input_ids=input_ids, use_cache=False)
            # the windows the attention calls received (some configs carry a sliding_window their model ignores)
            m.short_windows.update({layer: col.sliding_window[layer] for layer in layers
                                    if col.sliding_window.get(layer, params.seq_len) < params.seq_len})
            for layer in layers:
                q, kk, v = col.qkv[layer]
                scale = m.scales[layer] = col.scaling[layer]  # the layer's own (GPT-2 may use 1/(√D·(l+1)))
                m.head_info = {"num_heads": q.shape[1], "num_kv_heads": kk.shape[1], "head_dim": q.shape[-1]}
                if b == 0:  # warm-up (Triton compilation, cuBLAS handles) outside the timings
                    refuse_what_cannot_fit(params, q, kk, v)
                    attention_with_entropy(q, kk, v, causal=causal_ref, scale=scale)
                    for k in ks:
                        approx(layer, k, q, kk, v, scale)
                # on the layer's own GPU (a model spread over several runs its later layers on others)
                res, dt = _timed(lambda: attention_with_entropy(q, kk, v, causal=causal_ref, scale=scale), q.device)
                m.exact_seconds += dt
                m.backends.add(res.backend)
                exact = exact_attention_float64(q, kk, v, causal=causal_ref, scale=scale)
                for k in ks:
                    out, dt = _timed(lambda: approx(layer, k, q, kk, v, scale), q.device)
                    m.approx_seconds[k] += dt
                    m.errors[layer, k].extend(per_segment_rel_error(out, exact).tolist())
                del exact
            del col
            ctx.progress(b + 1, len(batches), f"batch {b + 1}/{len(batches)} ({params.method}, seed {params.seed})")
    return m


def approximation_bytes(method: str, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor, k: int) -> int:
    """About the most memory one call of the approximation with k features holds on one layer's q, k, v.

    Performer: the query and key features [B, H, N, k] in float32 and the log-features they come from.
    Linformer: E and F [k, N], and on the reference path the scores and weights [B, H, N, k] (the Triton
    path attends over the k projected keys without forming them)."""
    from lmscope.kernels import linformer_backend

    B, H, N, _ = q.shape
    features = B * H * N * k * 4
    if method == "performer":
        return 3 * features
    projections = 2 * k * N * 4
    return projections if linformer_backend(q, kk, v) == "triton" else projections + 2 * features


def refuse_what_cannot_fit(params: AttentionApproxParams, q, kk, v) -> None:
    """A clear failure up front, not an out-of-memory kill hours in (or a host swapping), when the
    largest k cannot fit beside what the job already holds."""
    from lmscope.modeling.memory import available_bytes

    k = max(params.features)
    need, free = approximation_bytes(params.method, q, kk, v, k), available_bytes(q.device)
    if free is not None and need > 0.9 * free:
        raise JobFailed(f"{params.method} with {k} features on {q.shape[0]} windows of {q.shape[2]} tokens × "
                        f"{q.shape[1]} heads needs about {need / 2**30:.3g} GiB for one layer, and {q.device} has "
                        f"{free / 2**30:.3g} GiB free: lower the largest features, seq_len or batch_size",
                        error_type="out-of-memory")


ORACLE_ELEMENTS = 2**26  # float64 scores per block of query rows: 512 MB, plus the softmax's temporaries


def exact_attention_float64(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    """The oracle: the reference kernel in float64, score matrices built explicitly, one window and one
    block of query rows at a time. All heads of one 8192-token window at once would be 17 GB; rows
    a..b−1 of a causal window see keys 0..b−1 only, so a block needs no more keys than that."""
    from lmscope.kernels import attention_with_entropy

    B, H, N, _ = q.shape
    rows = max(1, ORACLE_ELEMENTS // (H * N))
    out = torch.empty(B, H, N, v.shape[-1], dtype=torch.float64, device=q.device)
    for i in range(B):
        k_i, v_i = k[i:i + 1].double(), v[i:i + 1].double()
        for a in range(0, N, rows):
            b = min(N, a + rows)
            keys = b if causal else N  # causal: bottom-right aligned, query a + j sees keys ≤ a + j
            out[i:i + 1, :, a:b] = attention_with_entropy(q[i:i + 1, :, a:b].double(), k_i[:, :, :keys],
                                                          v_i[:, :, :keys], causal=causal, scale=scale,
                                                          backend="reference").out
    return out


def run_attention_approx(params: AttentionApproxParams, ctx: JobContext) -> JobOutput:
    """Performer or Linformer vs exact softmax attention on a real model's q, k, v, for every k.

    Performer is causal (prefix sums) and is compared with the model's causal attention. Linformer
    projects the keys along the sequence (E K mixes every position), so it cannot be causal: it is
    compared with exact *bidirectional* softmax attention on the same q, k, v. Its E, F are block-mean
    pooling, one shared Gaussian R (E = F = R) or independent Gaussians (`linformer_projection`).
    Every method uses each layer's own softmax scale (the attention module's `scaling`, recorded by
    the collector), so "exact" is the model's own attention — over all earlier keys: on layers whose
    sliding window is shorter than seq_len it is not the model's windowed attention, which the summary
    says (`sliding_windows`, `sliding_window_note`).
    """
    loaded, layers, params = _attention_study_model(params, ctx)
    with ctx.stage("load_documents"):
        documents = ctx.load_documents(params.dataset)
    windows = dataset_windows(loaded.tokenizer, documents, params, params.model)

    causal_ref = params.method == "performer"  # every supported model is a causal LM
    approx = Approximation(params)
    m = measure_approximations(loaded.model, windows, layers, params, approx, causal_ref, ctx)
    backend = "/".join(sorted(m.backends))  # what ran, not what the device would pick
    ctx.record("kernel_backend", backend)
    # causal FAVOR+'s prefix sums run in Triton on a GPU; Linformer's attention over the projected keys in
    # the exact kernel, with its limits (head_dim > 256: the reference)
    ctx.record("approximation_backend", "/".join(sorted(approx.backends)))

    ks = list(params.features)
    # mean over segments for each layer and k
    curve = {layer: [sum(m.errors[layer, k]) / len(m.errors[layer, k]) for k in ks] for layer in layers}
    ratios = [m.approx_seconds[k] / m.exact_seconds for k in ks]
    series = [Series("rel_error", ks, curve[layer], {"method": params.method, "layer": layer, "seed": params.seed})
              for layer in layers]
    series.append(Series("time_ratio", ks, ratios, {"method": params.method, "seed": params.seed}))
    summary = {
        "method": params.method,
        "seed": params.seed,
        "model": params.model,
        "reference": "causal softmax" if causal_ref else "bidirectional softmax",
        **({"linformer_projection": params.linformer_projection} if params.method == "linformer" else {}),
        "layers": layers,
        "segments": len(windows),
        "seq_len": params.seq_len,
        **m.head_info,
        "softmax_scale": [m.scales[layer] for layer in layers],  # per layer, as the model applies it
        "features": ks,
        "kernel_backend": backend,
        "exact_seconds": round(m.exact_seconds, 4),
        "rel_error_at_max_features": sum(curve[layer][-1] for layer in layers) / len(layers),
        "time_ratio_at_max_features": ratios[-1],
    }
    if m.short_windows:
        summary["sliding_windows"] = {str(layer): w for layer, w in sorted(m.short_windows.items())}
        summary["sliding_window_note"] = sliding_window_note(m.short_windows, params.seq_len)
    if len(windows) < params.num_segments:
        summary["note"] = f"the dataset holds only {len(windows)} windows of {params.seq_len} tokens"
    plot_attention_approx(ctx.artifact_dir / "attention_approx.png",
                    {(params.method, layer): (ks, curve[layer], None, None) for layer in layers},
                    {params.method: (ks, ratios)},
                    title=f"{params.model} on {params.dataset}: {params.method} (seed {params.seed}) vs exact "
                          "softmax attention",
                    notes={"linformer": PROJECTION_LABELS[params.linformer_projection]}, seq_len=params.seq_len,
                    timing=timing_note(m.backends), windows=m.short_windows)
    return JobOutput(summary, series)


def timing_note(backends: set[str]) -> str:
    """What the time ratios were measured on: the exact side is attention_with_entropy (entropy included)."""
    where = "/".join(sorted(backends))
    cpu = ";\nthe CPU reference computes all N × N scores" if "reference" in backends else ""
    return f"{where} kernels, exact incl. entropy{cpu}"


ERROR_FLOOR = 1e-4  # relative errors below it are exact up to rounding: drawn as ▼ on the panel's bottom edge


def plot_attention_approx(path: Path, panels: dict[tuple[str, int], tuple], times: dict[str, tuple], *, title: str,
                    notes: dict[str, str] | None = None, seq_len: int | None = None,
                    timing: str | None = None, windows: dict[int, int] | None = None) -> None:
    """Relative error vs k (log–log, one line per layer), a panel per method, and the time ratio.
    ``seq_len`` marks k = N on the Linformer panel; ``timing`` says what the times were measured on;
    ``windows`` {layer: w}: layers that slide over w < seq_len keys in the model (compared on all keys)."""
    plt = pyplot()
    methods = sorted({m for m, _ in panels})
    # constrained layout leaves room for the legends under the panels
    fig, axes = plt.subplots(1, len(methods) + 1, figsize=(5.2 * (len(methods) + 1), 5.0), squeeze=False,
                             layout="constrained")
    axes = list(axes.flat)
    for ax, method in zip(axes, methods):
        layers = sorted(layer for m, layer in panels if m == method)
        colours = OrderedColours(layers, "layer", cmap="plasma")
        for i, layer in enumerate(layers):
            xs, ys, los, his = panels[method, layer]
            color = colours(i)
            # An error below the floor is float rounding (~1e-7, Linformer at k ≥ N): a ▼ on the panel's bottom edge,
            # not a point that stretches the log axis over decades that mean nothing and squeezes the rest
            kept = [j for j, y in enumerate(ys) if y >= ERROR_FLOOR]
            ax.plot([xs[j] for j in kept], [ys[j] for j in kept], marker="o", ms=3, color=color,
                    lw=1 if colours.many else 1.5,
                    label=colours.label(f"layer {layer}" + (" (W)" if windows and layer in windows else "")))
            exact = [x for x, y in zip(xs, ys) if y < ERROR_FLOOR]
            if exact:
                ax.plot(exact, [0.03] * len(exact), "v", ms=7, color=color, transform=ax.get_xaxis_transform(),
                        clip_on=False)
            if los is not None and not colours.many and kept:  # many layers' bands would only smear the panel
                ax.fill_between([xs[j] for j in kept], [max(los[j], ERROR_FLOOR) for j in kept],
                                [his[j] for j in kept], color=color, alpha=0.15)
        if any(y < ERROR_FLOOR for layer in layers for y in panels[method, layer][1]):
            ax.plot([], [], "v", color="gray", label=f"▼ on the bottom edge: < {ERROR_FLOOR:g}, exact up to rounding")
        if method == "linformer" and seq_len and max(panels[method, layers[0]][0]) >= seq_len:
            ax.axvline(seq_len, color="gray", ls="--", lw=1, label=f"k = N = {seq_len}")
        ax.axhline(1.0, color="gray", ls=":", lw=1, label="1: the error of a zero output")
        colours.colour_bar(fig, ax)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ref = "causal" if method == "performer" else "bidirectional"
        extra = f" ({notes[method]})" if notes and method in notes else ""
        slid = ""
        if windows:  # once for the panel, not on every layer's entry
            sizes = ", ".join(str(w) for w in sorted(set(windows.values())))
            mark = "" if colours.many else " (W)"  # the legend marks them only when it names the layers
            slid = f"\n{len(windows)} layer{'s' if len(windows) > 1 else ''}{mark} slide over {sizes} keys in the model"
        ax.set(xlabel="k (random features / projected keys)", ylabel="relative L2 error of the attention output",
               title=f"{method}{extra}\nvs exact {ref} softmax" + (" over all keys" if windows else "") + slid)
        readable_log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        # below the panel: inside, it covered the layers' curves where they run through its corner
        ax.legend(fontsize=7, ncol=1 if colours.many else 2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax = axes[-1]
    for method, (xs, ys) in sorted(times.items()):
        ax.plot(xs, ys, marker="o", ms=3, label=method)
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="k", ylabel="approximation time / exact kernel time",
           title="time ratio" + (f"\n({timing})" if timing else ""))
    readable_log_y(ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle(title)
    save(fig, path)


__all__ = ["linformer_projections", "per_segment_rel_error", "plot_attention_approx", "pooling_projection",
           "run_attention_approx", "sliding_window_note", "timing_note"]
