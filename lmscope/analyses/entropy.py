"""Attention entropy (DESIGN.md §7 "entropy"; "LLMs and their Fundamental Limitations, Part 2").

Every row of a causal attention matrix is a probability distribution p over the keys the query
at position t may see (keys 0..t, so t + 1 of them). Its entropy

    H(t) = -Σ_j p_j ln p_j   (nats),   0 <= H(t) <= ln(t + 1)

is ln(t + 1) for a head that averages (mean pooling, kernel smoothing with a wide kernel) and near 0
for a head that looks at one token. We measure H for every layer, head, query position and window
with the fused kernel ``attention_with_entropy`` (online softmax: the N x N matrix is never built)
and reduce it on the fly to float64 sums:

    mean     = Σ H / rows                      std = sqrt(Σ H² / rows - mean²)
    normalised mean = mean over rows t >= 1 of H(t) / ln(t + 1)   (row 0 sees one key: 0/0, left out)
    by position     = mean over windows of H(t)  next to the uniform bound ln(t + 1)
    histogram       = counts of H in fixed bins on [0, ln(seq_len)]

Architectures the fused kernel cannot run (attention computed outside transformers' AttentionInterface,
as in Falcon, Bloom and GPT-Neo) fall back to the model's own attention matrices (``output_attentions``),
with the same statistics: slower, and every layer's N x N matrix is held at once.

Across checkpoints of a training run the same numbers become curves against the training step.
Windows are plain stream windows, or BOS + seq_len − 1 stream tokens (``bos_per_window``). In a layer
with a sliding window W (Mistral, Gemma 2, some Qwen layers) query t sees min(t + 1, W) keys: its bound,
and the normalisation, are ln(min(t + 1, W)) instead.

Dimension-wise entropy (optional): for each head dimension i alone, the scores q_i k_iᵀ/√d give a
softmax row per query; the note looks at how many of those rows are near uniform
(H >= ln(visible keys) - margin). Bidirectional by default as in the note (every row sees all
seq_len keys, bound ln(seq_len)); ``dimension_causal`` uses the model's causal rows instead.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from lmscope.analyses.base import (JobContext, JobFailed, JobOutput, Series, context_seq_len, dataset_windows,
                                   overflow_advice, require_positions)
from lmscope.analyses import entropy_plots
from lmscope.modeling.memory import to_device
from lmscope.params.entropy import DEFAULT_SEQ_LEN, EntropyParams

# ---------------------------------------------------------------------------- which models


def checkpoint_list(params: EntropyParams, ctx: JobContext) -> list[tuple[int, str]]:
    """(step, model name) of every model the job measures, in step order.

    ``train_job``: the run's checkpoints. ``models``: the ``@step<N>`` suffixes when every name has one
    (and they differ), else the list index. ``model``: one model at its ``@step<N>``, else at x = 0.
    """
    if params.train_job is not None:
        found = sorted(ctx.checkpoints_of(params.train_job))
        if not found:
            raise JobFailed(f"train job {params.train_job} has no registered checkpoints (none written yet, or "
                            "removed with `lmscope models delete`); give 'model' / 'models' instead",
                            error_type="no-checkpoints")
        return found
    if params.model is not None:  # a checkpoint keeps its step: compared with a run's, it lines up
        return [((training_steps([params.model]) or [0])[0], params.model)]
    names = list(params.models)
    steps = training_steps(names)
    return sorted(zip(steps, names)) if steps is not None else list(enumerate(names))


def training_steps(names: list[str]) -> list[int] | None:
    """The `@step<N>` suffix of every name, or None unless every name has one and they differ."""
    suffixes = [re.search(r"@step(\d+)$", n) for n in names]
    steps = [int(m.group(1)) for m in suffixes if m]
    return steps if len(steps) == len(names) and len(set(steps)) == len(steps) else None


def sliding_windows(config, layers: int) -> dict[int, int]:
    """{layer: window} for the layers whose attention is a sliding window (query t sees the last `window` keys).

    Mistral: every layer when ``sliding_window`` is set. Qwen2/Qwen3 (``use_sliding_window``) and others:
    the layers that ``layer_types`` marks "sliding_attention".
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    if types is not None:
        return {i: int(window) for i, kind in enumerate(types) if kind == "sliding_attention"}
    return {i: int(window) for i in range(layers)}


def short_windows(name: str, seq_len: int, windows: dict[int, int]) -> dict[int, int]:
    """The sliding windows that matter for windows of seq_len tokens: those shorter than seq_len."""
    short = {layer: w for layer, w in windows.items() if w < seq_len}
    single = sorted(layer for layer, w in short.items() if w < 2)
    if single:  # every row then holds one key: H = 0 = ln 1, nothing to measure
        raise JobFailed(f"{name}: layer(s) {single} attend over a sliding window of 1 token; "
                        "their attention rows have no entropy to measure")
    return short


def visible_keys_bound(seq_len: int, window: int | None = None, device="cpu") -> torch.Tensor:
    """ln(visible keys) of every query row t of a causal window: ln(t + 1), or ln(min(t + 1, window))."""
    visible = torch.arange(1, seq_len + 1, dtype=torch.float64, device=device)
    if window is not None:
        visible = visible.clamp(max=window)
    return torch.log(visible)


def _refuse_causal_dimensions_over_windows(name: str, params: EntropyParams, windows: dict[int, int]) -> None:
    if windows and params.dimension_wise and params.dimension_causal:
        raise JobFailed(f"{name}: dimension_causal=true follows the model's causal rows, but layer(s) "
                        f"{sorted(windows)} slide over {min(windows.values())} keys, which the dimension-wise "
                        "pass does not model; set dimension_causal=false (every row sees all seq_len keys) "
                        f"or seq_len to at most {min(windows.values())}")


# ---------------------------------------------------------------------------- statistics


def count_into(counts: torch.Tensor, index: torch.Tensor) -> None:
    """counts.flatten()[i] += how often i occurs in ``index``, in place.

    Not torch.bincount: on a GPU it reads the index's min and max back to the host to size its output,
    and two host syncs per layer and batch keep the next forward pass from being queued."""
    flat = index.flatten()
    counts.view(-1).index_add_(0, flat, torch.ones(1, dtype=counts.dtype, device=flat.device).expand(len(flat)))


class EntropyStats:
    """Running float64 sums over the query rows of one model, per layer × head (× position, × bin)."""

    def __init__(self, layers: int, heads: int, seq_len: int, bins: int, device="cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.seq_len, self.bins = seq_len, bins
        self.segments = 0  # token windows (segments) added, the same for every layer
        self.sum = torch.zeros(layers, heads, **f64)
        self.sum_sq = torch.zeros(layers, heads, **f64)
        self.sum_normalized = torch.zeros(layers, heads, **f64)
        self.by_position_sum = torch.zeros(layers, heads, seq_len, **f64)
        self.hist = torch.zeros(layers, heads, bins, dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros(layers, dtype=torch.int64, device=device)  # rows, per layer
        self.bin_width = math.log(seq_len) / bins
        self.set_sliding_windows({})

    def set_sliding_windows(self, windows: dict[int, int]) -> None:
        """The layers whose rows see min(t + 1, W) keys (before the first ``add``)."""
        self.sliding_windows = dict(sorted(windows.items()))
        # ln(visible keys) per layer and query row; row 0 (one key, 0/0) is left out of the normalised mean
        self.bound = torch.stack([visible_keys_bound(self.seq_len, windows.get(layer), self.sum.device)
                                  for layer in range(self.sum.shape[0])])

    def add(self, layer: int, entropy: torch.Tensor) -> None:
        """entropy: [B, H, N] nats of one layer for B full windows (N = seq_len, no padding)."""
        e = entropy.to(self.sum.device, torch.float64)  # a sharded model's layers may sit on other GPUs
        b, h, n = e.shape
        assert n == self.seq_len, (n, self.seq_len)
        self.nonfinite[layer] += (~torch.isfinite(e)).sum()
        self.sum[layer] += e.sum(dim=(0, 2))
        self.sum_sq[layer] += (e * e).sum(dim=(0, 2))
        self.sum_normalized[layer] += (e[:, :, 1:] / self.bound[layer, 1:]).sum(dim=(0, 2))
        self.by_position_sum[layer] += e.sum(dim=0)
        # Fixed bins on [0, ln N]; float error may put a value a hair outside, so clamp to the ends.
        idx = (e / self.bin_width).floor().long().clamp_(0, self.bins - 1)
        count_into(self.hist[layer], torch.arange(h, device=e.device)[None, :, None] * self.bins + idx)
        if layer == 0:
            self.segments += b

    def result(self) -> dict[str, np.ndarray]:
        rows = self.segments * self.seq_len
        mean = self.sum / rows
        var = (self.sum_sq / rows - mean**2).clamp_min(0)
        hist = self.hist.double()
        return {
            "mean": mean.cpu().numpy(),  # [L, H]
            "std": var.sqrt().cpu().numpy(),  # [L, H]
            "normalized_mean": (self.sum_normalized / (self.segments * (self.seq_len - 1))).cpu().numpy(),
            "by_position": (self.by_position_sum / self.segments).cpu().numpy(),  # [L, H, N]
            "hist_counts": self.hist.cpu().numpy(),  # [L, H, bins]
            # density per layer: integrates to 1 over [0, ln N]
            "hist_density": (hist.sum(1) / (hist.sum((1, 2))[:, None] * self.bin_width)).cpu().numpy(),
            "bound": self.bound.cpu().numpy(),  # [L, N] ln(visible keys)
            "sliding_windows": self.sliding_windows,  # {layer: W} for windows shorter than seq_len
        }


GAP_BINS_PER_DECADE = 8
GAP_FLOOR = 1e-4  # nats: closer to the bound than this is uniform up to float32 rounding (the first bin)


def gap_edges(seq_len: int) -> np.ndarray:
    """Bin edges of the distance below the uniform bound, ln(visible keys) − H: [0, 1e-4], then log-spaced
    bins up to ln(seq_len) — the near-uniform margin (0.03) falls inside them, where equal bins over
    [0, ln N] are wider than it."""
    top = math.log(max(seq_len, 2))
    bins = max(1, math.ceil(math.log10(top / GAP_FLOOR) * GAP_BINS_PER_DECADE))
    return np.concatenate([[0.0], np.geomspace(GAP_FLOOR, top, bins + 1)])


def gap_centres(edges: np.ndarray) -> list[float]:
    """Where each gap bin sits on a log axis: the first, [0, 1e-4], at its top; the others at their
    geometric centre."""
    return [float(edges[1])] + np.sqrt(edges[1:-1] * edges[2:]).tolist()


class DimensionStats:
    """Entropies of the per-dimension softmax rows: histograms (of the entropy, and of its distance below
    the uniform bound) and the near-uniform share per layer × head."""

    def __init__(self, layers: int, heads: int, seq_len: int, bins: int, margin: float, causal: bool, device="cpu"):
        self.seq_len, self.bins, self.causal = seq_len, bins, causal
        self.bin_width = math.log(seq_len) / bins
        # Bidirectional rows see all N keys; causal rows t + 1. Causal row 0 (one key) is trivially
        # "uniform" and is left out so it does not inflate the share.
        self.bound = (visible_keys_bound(seq_len, device=device) if causal
                      else torch.full((seq_len,), math.log(seq_len), dtype=torch.float64, device=device))
        self.threshold = self.bound - margin
        self.first = 1 if causal else 0
        self.near = torch.zeros(layers, heads, dtype=torch.int64, device=device)
        self.rows = torch.zeros(layers, heads, dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros(layers, dtype=torch.int64, device=device)
        self.hist = torch.zeros(layers, heads, bins, dtype=torch.int64, device=device)
        self.gap_edges = torch.tensor(gap_edges(seq_len), dtype=torch.float64, device=device)
        self.gap_hist = torch.zeros(layers, len(self.gap_edges) - 1, dtype=torch.int64, device=device)
        self.own_scales: dict[int, float] = {}  # layers whose own softmax scale is not 1/sqrt(d)
        self.backends: set[str] = set()  # what ran dimension_entropy (float64 q, k: the reference)

    def note_scale(self, layer: int, own: float, head_dim: int) -> None:
        """The rows use 1/sqrt(d), as the definition says; remember a layer whose attention scales otherwise."""
        if not math.isclose(own, head_dim**-0.5, rel_tol=1e-6):
            self.own_scales[layer] = own

    def add(self, layer: int, entropy: torch.Tensor) -> None:
        """entropy: [B, H, D, N] nats, one row per (window, head, dimension, query)."""
        e = entropy[..., self.first:].to(self.near.device, torch.float64)
        b, h, d, n = e.shape
        self.nonfinite[layer] += (~torch.isfinite(e)).sum()
        self.near[layer] += (e >= self.threshold[self.first:]).sum(dim=(0, 2, 3))
        self.rows[layer] += b * d * n
        idx = (e / self.bin_width).floor().long().clamp_(0, self.bins - 1)
        count_into(self.hist[layer], torch.arange(h, device=e.device)[None, :, None, None] * self.bins + idx)
        gap = (self.bound[self.first:] - e).clamp_(min=0.0)  # rounding can put H a hair above its bound
        gap_bins = len(self.gap_edges) - 1
        gap_idx = (torch.bucketize(gap.flatten(), self.gap_edges[1:-1], right=True)).clamp_(0, gap_bins - 1)
        count_into(self.gap_hist[layer], gap_idx)

    def result(self) -> dict[str, np.ndarray]:
        hist = self.hist.double()
        return {
            "near_uniform_pct": (100.0 * self.near.double() / self.rows.double()).cpu().numpy(),  # [L, H]
            "near_uniform_pct_layer": (100.0 * self.near.sum(1).double() / self.rows.sum(1).double()).cpu().numpy(),
            "near_uniform_pct_all": float(100.0 * self.near.sum().double() / self.rows.sum().double()),
            "hist_counts": self.hist.cpu().numpy(),
            "hist_density": (hist.sum(1) / (hist.sum((1, 2))[:, None] * self.bin_width)).cpu().numpy(),
            "gap_edges": self.gap_edges.cpu().numpy(),
            "gap_counts": self.gap_hist.cpu().numpy(),  # [L, gap bins], heads pooled
            "gap_pct": (100.0 * self.gap_hist.double() / self.gap_hist.sum(1, keepdim=True).double()).cpu().numpy(),
            "own_scales": dict(sorted(self.own_scales.items())),
            "backends": set(self.backends),
        }


# ---------------------------------------------------------------------------- measuring one model


MATRIX_ROUTE = "attention-matrix"  # the backend name a job records for the output_attentions route


def refuse_nonfinite(name: str, what: str, nonfinite: torch.Tensor, dtype: str) -> None:
    """Every query row sees at least one key, so an inf or NaN entropy means the model's own activations
    overflowed (float16 stops at 65504) or its weights are not finite: fail saying so, rather than put
    NaN in the curves and histograms."""
    bad = torch.nonzero(nonfinite).flatten().tolist()
    if bad:
        raise JobFailed(f"{name}: {what} of layer(s) {', '.join(map(str, bad))} are inf or NaN in {dtype} (the "
                        f"model's activations overflow); {overflow_advice(dtype)}")


def attention_matrix_entropies(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Row entropies [B, H, N] per layer from the model's materialised attention matrices.

    The route for models lmscope's attention function cannot run; they are switched to eager attention
    (which returns the matrices) for the call and switched back. The matrices are checked to be what
    a causal LM's are (rows summing to 1, nothing above the diagonal) before any entropy is taken.
    """
    from lmscope.kernels.hf import eager_attention

    with eager_attention(model):
        attentions = model(input_ids=input_ids, use_cache=False, output_attentions=True).attentions
    if not attentions or any(a is None for a in attentions):
        raise JobFailed(f"{type(model).__name__} returns no attention matrices (output_attentions), and lmscope's "
                        "kernel cannot run it either; `entropy` does not support this architecture")
    entropies = []
    for a in attentions:
        p = a.float()
        # attention sinks or other off-row mass would make the rows sub-distributions: H is then undefined
        tolerance = 1e-4 if a.dtype == torch.float32 else 2e-2
        sums = p.sum(-1)
        # a row the model overflowed: its entropy is inf or NaN, refused as such (not a boolean index: no sync)
        sums = torch.where(torch.isfinite(sums), sums, torch.ones_like(sums))
        if not torch.allclose(sums, torch.ones((), device=p.device), atol=tolerance):
            raise JobFailed(f"{type(model).__name__}'s attention rows do not sum to 1 (attention sinks?); "
                            "their entropy is not defined, so `entropy` does not support this architecture")
        # a mask the model did not apply (built for another implementation) shows as weight on future keys
        future = float(p.triu(1).sum(-1).nan_to_num(0.0, 0.0, 0.0).max()) if p.shape[-1] == p.shape[-2] else 0.0
        if future > tolerance:
            raise JobFailed(f"{type(model).__name__}'s attention matrices put weight {future:.3g} on future keys: "
                            "the returned matrices are not the causal attention the model runs, so `entropy` "
                            "cannot read them; this architecture is not supported")
        entropies.append(-torch.special.xlogy(p, p).sum(-1))
    return entropies


def measure_model(params: EntropyParams, name: str, loaded, windows: torch.Tensor, report,
                  backends: set[str]) -> tuple[dict, dict | None]:
    """Entropy statistics of one model over `windows` [W, seq_len].

    `report(name)` after every batch; the kernel backends that ran are added to `backends`.
    """
    from lmscope.kernels import dimension_entropy, dimension_entropy_backend
    from lmscope.kernels.hf import EntropyCollector, lmscope_attention_unsupported

    model = loaded.model
    device = next(model.parameters()).device
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    require_positions(model.config, params.seq_len, name)
    declared = short_windows(name, params.seq_len, sliding_windows(model.config, layers))
    stats = EntropyStats(layers, heads, params.seq_len, params.histogram_bins, device=device)
    stats.set_sliding_windows(declared)

    def check(col) -> None:
        if len(col.entropy) != layers:
            raise JobFailed(f"{name}: only {len(col.entropy)} of {layers} attention layers ran through "
                            "transformers' attention interface; this architecture is not supported by `entropy`")
        # the bounds follow the windows the attention calls really received
        received = short_windows(name, params.seq_len, col.sliding_window)
        if received != stats.sliding_windows:
            if stats.segments:
                raise JobFailed(f"{name}: the layers' sliding windows changed between batches "
                                f"({stats.sliding_windows} then {received})")
            stats.set_sliding_windows(received)
        # after the first batch, not from the config: some configs carry a sliding_window their model ignores
        _refuse_causal_dimensions_over_windows(name, params, stats.sliding_windows)
        backends.update(col.backends)

    dim_stats = None
    unsupported = lmscope_attention_unsupported(model)
    if unsupported is not None:
        if params.dimension_wise:
            raise JobFailed(f"{name}: dimension_wise needs each layer's q and k from lmscope's attention function, "
                            f"which cannot run this model ({unsupported}); set dimension_wise=false")
        backends.add(MATRIX_ROUTE)
        with torch.no_grad():
            for start in range(0, len(windows), params.batch_size):
                ents = attention_matrix_entropies(model, to_device(windows[start:start + params.batch_size], device))
                if len(ents) != layers:
                    raise JobFailed(f"{name}: {len(ents)} attention matrices for {layers} layers; "
                                    "this architecture is not supported by `entropy`")
                for layer, ent in enumerate(ents):
                    stats.add(layer, ent)
                report(name)
        refuse_nonfinite(name, "the attention entropies", stats.nonfinite, params.dtype)
        return stats.result(), None
    # Windows are full length: no attention mask, so every row is causal over keys 0..t.
    with torch.no_grad(), EntropyCollector(model) as col:
        for start in range(0, len(windows), params.batch_size):
            model(input_ids=to_device(windows[start:start + params.batch_size], device), use_cache=False)
            check(col)
            for layer, ent in enumerate(col.entropy):  # [B, H, N] per layer, no N x N matrix
                stats.add(layer, ent)
            report(name)
    refuse_nonfinite(name, "the attention entropies", stats.nonfinite, params.dtype)

    if params.dimension_wise:  # check() already refused dimension_causal over sliding windows
        dim_stats = DimensionStats(layers, heads, params.seq_len, params.histogram_bins,
                                   params.near_uniform_margin, params.dimension_causal, device=device)
        dim_windows = windows[:params.dimension_segments]
        with torch.no_grad(), EntropyCollector(model, capture_qkv=True) as col:
            for start in range(0, len(dim_windows), params.batch_size):
                model(input_ids=to_device(dim_windows[start:start + params.batch_size], device), use_cache=False)
                check(col)
                for layer in col.layers:
                    q, k, _ = col.qkv[layer]  # after RoPE; k keeps the model's H_kv heads (GQA)
                    # scale None = 1/sqrt(head dim): the note's softmax(q_i k_iᵀ/√d), whatever the model's own
                    dim_stats.backends.add(dimension_entropy_backend(q, k))
                    dim_stats.add(layer, dimension_entropy(q, k, causal=params.dimension_causal))
                    dim_stats.note_scale(layer, col.scaling[layer], q.shape[-1])
                col.clear()  # drop this batch's q, k, v before the next forward
                report(name)
        refuse_nonfinite(name, "the dimension-wise entropies", dim_stats.nonfinite, params.dtype)
    return stats.result(), (dim_stats.result() if dim_stats else None)


# ---------------------------------------------------------------------------- the job


def run(params: EntropyParams, ctx: JobContext) -> JobOutput:
    checkpoints = checkpoint_list(params, ctx)
    steps = [s for s, _ in checkpoints]
    names = [n for _, n in checkpoints]
    with ctx.stage("load_documents"):
        documents = ctx.load_documents(params.dataset)

    # Progress counts forward batches over all models; the total is an estimate until every model's
    # windows are known (checkpoints of one run share a tokenizer, so it rarely changes).
    done = 0
    batches_per_model: list[int | None] = [None] * len(checkpoints)

    def batch_count(n_windows: int) -> int:
        main = math.ceil(n_windows / params.batch_size)
        dim = math.ceil(min(n_windows, params.dimension_segments) / params.batch_size) if params.dimension_wise else 0
        return main + dim

    def report(stage: str) -> None:
        nonlocal done
        done += 1
        known = [b for b in batches_per_model if b is not None]
        total = sum(known) + (len(batches_per_model) - len(known)) * known[-1]
        ctx.progress(done, total, stage)

    results, dim_results, windows_used = [], [], []
    backends: set[str] = set()
    first_shape = None
    for i, name in enumerate(names):
        with ctx.stage("load_model"):
            loaded = ctx.load_model(name, dtype=params.dtype)
        # the series follow each (layer, head) across the models: they must have the same ones
        config = loaded.model.config
        shape = (getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None))
        first_shape = first_shape or (names[0], shape)
        if shape != first_shape[1]:
            raise JobFailed(f"model {name!r} has {shape[0]} layers × {shape[1]} heads but {first_shape[0]!r} has "
                            f"{first_shape[1][0]} × {first_shape[1][1]}; one entropy job follows the same heads "
                            "across its models (checkpoints of one run): submit one job per architecture")
        if params.seq_len is None:  # not given: 512, or the (first) model's context when shorter
            params = params.model_copy(update={"seq_len": context_seq_len(loaded.model.config, DEFAULT_SEQ_LEN)})
        with ctx.stage("tokenize"):
            windows = dataset_windows(loaded.tokenizer, documents, params, name)
        batches_per_model[i] = batch_count(len(windows))
        with ctx.stage("measure"):
            res, dim = measure_model(params, name, loaded, windows, report, backends)
        del loaded  # the worker's model cache decides what stays resident
        results.append(res)
        dim_results.append(dim)
        windows_used.append(len(windows))
    backend = "+".join(sorted(backends))  # each route a model took: triton, reference, attention-matrix, ...
    ctx.record("kernel_backend", backend)

    with ctx.stage("write"):
        output = _output(params, steps, names, results, dim_results, windows_used, backend)
        _save_arrays(ctx, params, steps, names, results, dim_results)
        _plots(ctx, params, steps, names, results, dim_results)
    return output


def bin_edges(params: EntropyParams) -> np.ndarray:
    """The histograms' bin edges: ``histogram_bins`` equal bins over [0, ln seq_len]."""
    return np.linspace(0.0, math.log(params.seq_len), params.histogram_bins + 1)


HEAD_TIE_NATS = 1e-3  # heads' mean entropies closer than this are not told apart in the summary


def _output(params, steps, names, results, dim_results, windows_used, backend) -> JobOutput:
    last = results[-1]
    layers, heads = last["mean"].shape
    n = params.seq_len
    series: list[Series] = []
    for layer in range(layers):
        for head in range(heads):
            labels = {"layer": layer, "head": head}
            for key in ("mean", "std", "normalized_mean"):
                series.append(Series(f"entropy.{key}", steps, [float(r[key][layer, head]) for r in results], labels))
            if dim_results[0] is not None:
                series.append(Series("dimension_entropy.near_uniform_pct", steps,
                                     [float(d["near_uniform_pct"][layer, head]) for d in dim_results], labels))
    positions = list(range(n))
    edges = bin_edges(params)
    centres = ((edges[:-1] + edges[1:]) / 2).tolist()
    for step, name, r, d in zip(steps, names, results, dim_results):
        model_labels = {"step": step, "model": name}
        series.append(Series("entropy.layer_mean", list(range(layers)), r["mean"].mean(1).tolist(), model_labels))
        for layer in range(layers):
            labels = {"layer": layer, **model_labels}
            series.append(Series("entropy.by_position", positions, r["by_position"][layer].mean(0).tolist(), labels))
            series.append(Series("entropy.histogram", centres, r["hist_density"][layer].tolist(), labels))
            if d is not None:
                series.append(Series("dimension_entropy.histogram", centres, d["hist_density"][layer].tolist(), labels))
                series.append(Series("dimension_entropy.gap_histogram", gap_centres(d["gap_edges"]),
                                     d["gap_pct"][layer].tolist(), labels))
    series.append(Series("uniform_bound", positions, [math.log(t + 1) for t in positions], {}))
    for layer, w in last["sliding_windows"].items():  # these rows see min(t + 1, W) keys
        series.append(Series("uniform_bound", positions, last["bound"][layer].tolist(), {"layer": layer, "window": w}))

    mean = last["mean"]
    lo = np.unravel_index(np.argmin(mean), mean.shape)
    hi = np.unravel_index(np.argmax(mean), mean.shape)
    summary = {
        "models": names,
        "steps": steps,
        "layers": int(layers),
        "heads": int(heads),
        "seq_len": n,
        "num_segments_used": windows_used[-1] if len(set(windows_used)) == 1 else windows_used,
        "tokens": int(windows_used[-1] * n),  # query rows per model
        "uniform_bound_max": float(last["bound"].max()),  # ln(seq_len), or ln W when every layer slides
        "sliding_windows": {str(layer): w for layer, w in last["sliding_windows"].items()},
        "mean_entropy": float(mean.mean()),
        "mean_entropy_per_layer": [round(float(v), 6) for v in mean.mean(1)],
        "normalized_mean_entropy": float(last["normalized_mean"].mean()),
        "lowest_entropy_head": {"layer": int(lo[0]), "head": int(lo[1]), "value": float(mean[lo])},
        "highest_entropy_head": {"layer": int(hi[0]), "head": int(hi[1]), "value": float(mean[hi])},
        "kernel_backend": backend,
    }
    spread = float(mean[hi] - mean[lo])
    if spread < HEAD_TIE_NATS:  # e.g. a random-init model: "lowest" and "highest" are then rounding noise
        summary["heads_note"] = (f"every head's mean entropy is within {spread:.2g} nats of the others': the lowest "
                                 "and highest heads are ties")
    if len(names) > 1:
        summary["summary_of"] = names[-1]  # per-layer numbers above are the last checkpoint's
    if min(windows_used) < params.num_segments:  # a short dataset: fewer windows than asked for, said
        held = (str(windows_used[-1]) if len(set(windows_used)) == 1
                else " / ".join(map(str, windows_used)) + " (per model's tokenizer)")
        summary["note"] = (f"dataset {params.dataset} holds {held} windows of {n} tokens: "
                           f"num_segments={params.num_segments} was cut to that")
    if dim_results[-1] is not None:
        d = dim_results[-1]
        summary["near_uniform_pct"] = d["near_uniform_pct_all"]
        summary["near_uniform_pct_per_layer"] = [round(float(v), 4) for v in d["near_uniform_pct_layer"]]
        summary["near_uniform_margin"] = params.near_uniform_margin
        summary["near_uniform_rule"] = (
            f"H >= ln(position+1) - {params.near_uniform_margin} (causal rows, position 0 left out)"
            if params.dimension_causal else
            f"H >= ln({n}) - {params.near_uniform_margin} = {math.log(n) - params.near_uniform_margin:.4f} nats "
            "(bidirectional rows)")
        summary["dimension_segments_used"] = min(windows_used[-1], params.dimension_segments)
        summary["dimension_backend"] = "+".join(sorted(set().union(*(r["backends"] for r in dim_results))))
        if d["own_scales"]:
            summary["dimension_scale_note"] = (
                "the dimension-wise rows use 1/sqrt(head size), as defined; these layers scale their own scores "
                "otherwise (GPT-2's scale_attn_by_inverse_layer_idx, Gemma's query_pre_attn_scalar, ...): "
                + ", ".join(f"layer {layer}: {scale:.4g}" for layer, scale in d["own_scales"].items()))
    return JobOutput(summary=summary, series=series)


def _save_arrays(ctx, params, steps, names, results, dim_results) -> None:
    """entropy_by_position.npz: [M, L, H, N] means per checkpoint (and the [M, L, H] reductions)."""
    arrays = {key: np.stack([r[key] for r in results]) for key in results[0] if key not in ("bound", "sliding_windows")}
    arrays.update(steps=np.array(steps), models=np.array(names),
                  uniform_bound_per_layer=np.stack([r["bound"] for r in results]),  # [M, L, N]
                  bin_edges=bin_edges(params),
                  uniform_bound=np.log(np.arange(params.seq_len) + 1.0))
    # not compressed: per-position float means shrink by ~7 % under zlib, which took 0.5 s per 16 MB
    np.savez(ctx.artifact_dir / "entropy_by_position.npz", **arrays)
    if dim_results[0] is not None:
        np.savez_compressed(
            ctx.artifact_dir / "dimension_entropy.npz",
            near_uniform_pct=np.stack([d["near_uniform_pct"] for d in dim_results]),
            hist_counts=np.stack([d["hist_counts"] for d in dim_results]),
            gap_counts=np.stack([d["gap_counts"] for d in dim_results]), gap_edges=dim_results[0]["gap_edges"],
            steps=np.array(steps), bin_edges=arrays["bin_edges"])


def _plots(ctx, params, steps, names, results, dim_results) -> None:
    # checkpoints of one run lie on a step axis; other model lists are only in list order
    over_training = params.train_job is not None or training_steps(names) is not None
    entropy_plots.draw(ctx.artifact_dir, params, steps, names, results, dim_results, over_training=over_training)
