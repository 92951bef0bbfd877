"""Approximation sweeps (DESIGN.md §7 "sweep"; Alberti et al., "Sumformer", 2023).

A `sweep` is a parent job; the API expands its grid into children (`lmscope.params.sweep`):

- `sumformer_fit` (`run_sumformer_fit`): train one network (poly / MLP Sumformer, one-attention-layer
  Transformer / Linformer / Performer, `lmscope.modeling.sumformer`) on one equivariant target
  (`lmscope.analyses.targets`) and report the relative L2 validation error

      err = ‖f(X) − g(X)‖₂ / ‖g(X)‖₂   over every sample, token and coordinate of the validation split

  every `eval_every` epochs (`val_error`, x = epoch) and the training MSE (`train_loss`).
- `attention_approx` (`run_attention_approx`): capture q, k, v of every layer of a real model on
  token windows, and compare Performer (k random features) or Linformer (k projected keys) with exact
  softmax attention computed in float64, for every k: `rel_error` (x = k) and `time_ratio`
  (approximation time / exact kernel time, x = k).
- `aggregate`: runs once when the last child ended; averages over seeds, writes the parent's series
  and the figures (`fig1_training.png`, `fig2_latent_dim.png` or `attention_approx.png`), and lists
  the children that failed in the summary.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmscope.analyses.base import (ChildResult, JobContext, JobFailed, JobOutput, Series, context_seq_len,
                                   require_positions)
from lmscope.analyses.plotting import OrderedColours, pyplot, save
from lmscope.params.sweep import (
    DEFAULT_ATTENTION_SEQ_LEN,
    AttentionApproxParams,
    SumformerFitParams,
    SweepParams,
    clamped_latent_dims,
    effective_latent_dim,
    theory_latent_dim,
)
from lmscope.seeds import derived_seed

# ============================================================================ sumformer_fit


def relative_l2_error(pred: torch.Tensor, target: torch.Tensor) -> float:
    """‖pred − target‖₂ / ‖target‖₂ over all entries, in float64."""
    pred, target = pred.double(), target.double()
    return float((pred - target).norm() / target.norm())


def make_dataset(params: SumformerFitParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_val, y_val): `samples` sequences uniform on [0,1]^(n×d) from the seed.

    The target is evaluated in float64 (fig2_poly reaches ~10²·n³) and stored as float32.
    """
    from lmscope.analyses.targets import evaluate_target, sample_inputs

    t = params.train
    x = sample_inputs(t.samples, params.seq_len, params.token_dim, params.seed, dtype=torch.float64)
    y = evaluate_target(params.target, x)
    n_val = t.val_samples
    n_train = t.samples - n_val
    x, y = x.float(), y.float()
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@torch.no_grad()
def _predict(model, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def random_permutations(count: int, n: int, seed: int) -> torch.Tensor:
    """[count, n]: a uniformly random permutation of 0 … n−1 per row, from `seed`."""
    return torch.rand(count, n, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)


def equivariance_error(model, x: torch.Tensor, perm: torch.Tensor) -> float:
    """‖S(πX) − π S(X)‖₂ / ‖S(X)‖₂ over the sequences x [B, n, d], π = perm [B, n] (πX)_i = x_π(i).
    0 up to rounding for a permutation-equivariant network."""
    perm = perm.to(x.device)

    def permuted(t):
        return t.gather(1, perm[..., None].expand_as(t))

    return relative_l2_error(_predict(model, permuted(x)), permuted(_predict(model, x)))


@contextmanager
def _single_threaded(ctx: JobContext):
    """Train with one intra-op thread on a CPU, when this process runs one job at a time.

    These networks are tiny: on a CPU, intra-op threads only fight each other (measured 10-40x slower
    with 2 threads on a loaded 2-core machine). The thread count is process-wide, so it is left alone
    when other jobs may run in this process (`ctx.shares_process`: it would throttle them), and it is
    changed only when it is > 1; the count found on entry is restored on exit.
    """
    before = torch.get_num_threads()
    apply = torch.device(ctx.device).type == "cpu" and not ctx.shares_process and before > 1
    if apply:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if apply:
            torch.set_num_threads(before)


def run_sumformer_fit(params: SumformerFitParams, ctx: JobContext) -> JobOutput:
    """Train one grid point; report `val_error` and `train_loss` per epoch and write `training.png`."""
    from lmscope.modeling.sumformer import build_network, num_parameters

    t = params.train
    device = torch.device(ctx.device)
    theory = theory_latent_dim(params.token_dim, params.seq_len)
    d_eff = effective_latent_dim(params.architecture, params.latent_dim, params.token_dim, params.seq_len)

    with ctx.stage("data"):
        x_train, y_train, x_val, y_val = (a.to(device) for a in make_dataset(params))
        # Train on standardised targets (Adam's lr then means the same for every target); the
        # error is measured on the original scale.
        mu, sigma = y_train.mean(), y_train.std().clamp_min(1e-12)
        y_train_std = (y_train - mu) / sigma

    model = build_network(params.architecture, token_dim=params.token_dim, seq_len=params.seq_len,
                          latent_dim=d_eff, hidden=t.hidden, depth=t.depth, features=params.features,
                          seed=params.seed, qk_init_std=t.qk_init_std,
                          linformer_projections=t.linformer_projections).to(device)
    if params.architecture in ("transformer", "linformer", "performer"):
        ctx.record("kernel_backend", "reference")  # training needs autograd: the PyTorch reference kernels
    # fused: one kernel per step for all parameters instead of several per tensor; these networks are
    # so small that the optimiser's per-tensor overhead is a third of a step (1.4x faster on a CPU)
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, fused=device.type in ("cpu", "cuda"))
    shuffle = torch.Generator().manual_seed(derived_seed(params.seed, "shuffle"))

    epochs_x: list[int] = []
    losses: list[float] = []
    eval_x: list[int] = []
    val_errors: list[float] = []
    start = time.perf_counter()
    with ctx.stage("train"), _single_threaded(ctx):
        for epoch in range(1, t.epochs + 1):
            model.train()
            perm = torch.randperm(len(x_train), generator=shuffle).to(device)
            # summed on the device and read once per epoch: a read per step would make a GPU wait for
            # every step to finish before queueing the next (these steps are launch-bound)
            total = torch.zeros((), device=device)
            for i in range(0, len(perm), t.batch_size):
                idx = perm[i:i + t.batch_size]
                loss = torch.nn.functional.mse_loss(model(x_train[idx]), y_train_std[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach() * len(idx)
            train_mse = float(total) / len(perm) * float(sigma) ** 2  # back to the target's units
            if not math.isfinite(train_mse):
                raise JobFailed(f"training diverged at epoch {epoch} (loss {train_mse}); lower train.lr "
                                f"(now {t.lr})", error_type="diverged")
            epochs_x.append(epoch)
            losses.append(train_mse)
            if epoch % t.eval_every == 0 or epoch == t.epochs:
                model.eval()
                err = relative_l2_error(_predict(model, x_val) * sigma + mu, y_val)
                eval_x.append(epoch)
                val_errors.append(err)
            stage = f"epoch {epoch}/{t.epochs}" + (f", val error {val_errors[-1]:.3g}" if val_errors else "")
            ctx.progress(epoch, t.epochs, stage)
    seconds = time.perf_counter() - start
    model.eval()
    # The validation data are exchangeable, so the error cannot show a network that is not equivariant
    # (a trained Linformer's E, F weight positions differently): measure it, on the final network.
    perm = random_permutations(len(x_val), params.seq_len, derived_seed(params.seed, "equivariance"))
    equivariance = equivariance_error(model, x_val, perm)

    best = min(range(len(val_errors)), key=val_errors.__getitem__)
    summary: dict[str, Any] = {
        "architecture": params.architecture,
        "target": params.target,
        "token_dim": params.token_dim,
        "seq_len": params.seq_len,
        "features": params.features,
        "seed": params.seed,
        "latent_dim": params.latent_dim,
        "latent_dim_effective": d_eff,
        "theory_latent_dim": theory,
        "best_val_error": val_errors[best],
        "best_epoch": eval_x[best],
        "final_val_error": val_errors[-1],
        "final_train_loss": losses[-1],
        "equivariance_error": equivariance,
        "num_parameters": num_parameters(model),
        "train_samples": len(x_train),
        "val_samples": len(x_val),
        "train_seconds": round(seconds, 3),
    }
    if params.architecture == "poly_sumformer" and d_eff < theory:
        summary["note"] = (f"latent_dim {params.latent_dim} < C(n+d,d)-1 = {theory}: φ keeps the first {d_eff} "
                           "monomials in graded order (a truncated power-sum embedding)")
    asked = list(params.latent_dim_requested or [])
    if params.architecture == "poly_sumformer" and params.latent_dim is not None and params.latent_dim > theory:
        asked.append(params.latent_dim)  # a child submitted with a d′ above the theory (not via a sweep)
    if params.architecture == "poly_sumformer" and asked:
        summary["latent_dim_requested"] = asked
        summary["note"] = (f"latent_dim {', '.join(map(str, asked))} > C(n+d,d)-1 = {theory}: clamped to {theory} "
                           "(φ has only that many monomials; all of them are used)")
    labels = {"architecture": params.architecture, "target": params.target, "token_dim": params.token_dim,
              "seq_len": params.seq_len, "latent_dim": d_eff, "features": params.features, "seed": params.seed}
    series = [Series("val_error", eval_x, val_errors, labels), Series("train_loss", epochs_x, losses, labels)]
    _plot_training(ctx.artifact_dir, params, eval_x, val_errors, epochs_x, losses, d_eff)
    return JobOutput(summary, series)


# ============================================================================ attention_approx


def per_segment_rel_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """‖approx − exact‖_F / ‖exact‖_F for every segment (batch row), over heads, positions, dims."""
    diff = (approx.double() - exact).flatten(1).norm(dim=1)
    return diff / exact.flatten(1).norm(dim=1)


def _timed(fn, device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


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
    from lmscope.kernels.hf import lmscope_attention_unsupported

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
        raise JobFailed(f"the attention study reads each layer's q, k, v through lmscope's attention function, "
                        f"which cannot run {params.model}: {unsupported}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise JobFailed(f"{params.model} soft-caps its attention scores (Gemma 2): its attention is not the softmax "
                        "attention Performer and Linformer approximate")
    return loaded, layers, params


class Approximation:
    """``params.method`` with k features on one layer's q, k, v. The random features / projections are
    drawn once per (layer, k), from the job's seed, and reused for every segment."""

    def __init__(self, params: AttentionApproxParams):
        self.params = params
        self.draws: dict[tuple[int, int], Any] = {}

    def __call__(self, layer: int, k: int, q, kk, v, scale: float):
        from lmscope.kernels import draw_favor_projection, favor_attention, linformer_attention

        p = self.params
        if (layer, k) not in self.draws:
            seed = derived_seed(p.seed, "projection", layer, k)
            # on the layer's own device (a model spread over several GPUs)
            self.draws[layer, k] = (draw_favor_projection(k, q.shape[-1], seed, q.device)
                                    if p.method == "performer" else
                                    linformer_projections(p.linformer_projection, k, q.shape[2], seed, q.device))
        if p.method == "performer":
            return favor_attention(q, kk, v, projection=self.draws[layer, k], causal=True, scale=scale)
        e, f = self.draws[layer, k]
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
                    attention_with_entropy(q, kk, v, causal=causal_ref, scale=scale)
                    for k in ks:
                        approx(layer, k, q, kk, v, scale)
                # on the layer's own GPU (a model spread over several runs its later layers on others)
                res, dt = _timed(lambda: attention_with_entropy(q, kk, v, causal=causal_ref, scale=scale), q.device)
                m.exact_seconds += dt
                m.backends.add(res.backend)
                # the oracle: the reference kernel in float64, with the N × N matrix built explicitly,
                # one window at a time (the float64 matrices of all heads of one window at most)
                exact = torch.cat([attention_with_entropy(q[i:i + 1].double(), kk[i:i + 1].double(),
                                                          v[i:i + 1].double(), causal=causal_ref, scale=scale,
                                                          backend="reference").out
                                   for i in range(q.shape[0])])
                for k in ks:
                    out, dt = _timed(lambda: approx(layer, k, q, kk, v, scale), q.device)
                    m.approx_seconds[k] += dt
                    m.errors[layer, k].extend(per_segment_rel_error(out, exact).tolist())
                del exact
            del col
            ctx.progress(b + 1, len(batches), f"batch {b + 1}/{len(batches)} ({params.method}, seed {params.seed})")
    return m


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
    from lmscope.kernels import kernel_backend
    from lmscope.modeling.windows import token_windows

    loaded, layers, params = _attention_study_model(params, ctx)
    device = next(loaded.model.parameters()).device
    with ctx.stage("load_documents"):
        documents = ctx.load_documents(params.dataset)
    try:
        windows = token_windows(loaded.tokenizer, documents, params.seq_len, params.num_segments)
    except ValueError as e:
        raise JobFailed(f"dataset {params.dataset!r}: {e}") from None

    causal_ref = params.method == "performer"  # every supported model is a causal LM
    m = measure_approximations(loaded.model, windows, layers, params, Approximation(params), causal_ref, ctx)
    backend = "/".join(sorted(m.backends))  # what ran, not what the device would pick
    ctx.record("kernel_backend", backend)
    # FAVOR+ / Linformer pick theirs like the exact kernel (no gradients here): causal FAVOR+'s prefix sums
    # run in Triton on a GPU; Linformer's attention over the projected keys runs in the exact kernel, with
    # its limits (head_dim > 256: the reference), so it ran where the exact side did
    ctx.record("approximation_backend", backend if params.method == "linformer" else kernel_backend(device))

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
    _plot_attention(ctx.artifact_dir / "attention_approx.png",
                    {(params.method, layer): (ks, curve[layer], None, None) for layer in layers},
                    {params.method: (ks, ratios)},
                    title=f"{params.model} on {params.dataset}: {params.method} (seed {params.seed}) vs exact "
                          "softmax attention",
                    notes={"linformer": PROJECTION_LABELS[params.linformer_projection]}, seq_len=params.seq_len,
                    timing=_timing_note(m.backends), windows=m.short_windows)
    return JobOutput(summary, series)


# ============================================================================ aggregation


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
                        f"(first error: {not_ok[0].error if not_ok else 'none'}); see the children's errors")
    ctx.progress(0, 1, "aggregating")
    if params.study == "sumformer":
        out = _aggregate_sumformer(params, ok, ctx)
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


def _aggregate_sumformer(params: SweepParams, ok: list[ChildResult], ctx: JobContext) -> JobOutput:
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
    else:
        plots_note = "no fig2_latent_dim.png: every line has a single d′ (give grid.latent_dim two or more values)"
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
    _plot_attention(ctx.artifact_dir / "attention_approx.png", panels, times,
                    title=f"{params.model} on {params.dataset}: approximations vs exact softmax attention "
                          f"({params.num_segments} windows of {seq_len} tokens; "
                          + ("1 seed: one random draw per k" if seeds == 1 else f"mean over {seeds} seeds, band = min–max")
                          + ")",
                    notes={"linformer": PROJECTION_LABELS[params.linformer_projection]}, seq_len=seq_len,
                    timing=_timing_note({(c.summary or {}).get("kernel_backend", "?") for c in ok}),
                    windows=windowed)
    return JobOutput(summary, series)


# ============================================================================ plots


def _plot_training(folder: Path, p: SumformerFitParams, ex, errs, lx, losses, d_eff) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.semilogy(ex, errs, marker="o", ms=3)
    a1.set(xlabel="epoch", ylabel="relative L2 validation error", title="validation error")
    a2.semilogy(lx, losses, color="tab:orange")
    a2.set(xlabel="epoch", ylabel="training MSE", title="training loss")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
    k = f", k={p.features}" if p.features else ""
    fig.suptitle(f"{p.architecture} on {p.target}: d={p.token_dim}, n={p.seq_len}, d'={d_eff}{k}, seed {p.seed}")
    save(fig, Path(folder) / "training.png")


def _grid(plt, count: int, width: float = 5.0, height: float = 3.8, **subplots):
    cols = min(count, 3)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, **subplots)
    for a in axes.flat[count:]:
        a.set_visible(False)
    return fig, list(axes.flat)


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
        for key in sorted(keys, key=lambda key: (key[0], *(-1 if v is None else v for v in key[2:]))):
            arch, _, d, n, k, d_eff = key
            x, y = _mean_curve(curves[key])
            label = f"{arch} (d={d}, n={n}, d'={d_eff}" + (f", k={k}" if k else "") + ")"
            ax.semilogy(x, y, label=label, color=colors.get(arch) if len(archs) == len(keys) else None,
                        marker="o" if len(x) < 3 else None, ms=4)  # a one-point curve is a dot, not nothing
        ax.set(xlabel="epoch", ylabel="relative L2 validation error",
               title=f"target {target}" + (f"\n({pruned})" if pruned else ""))
        ax.grid(True, which="both", alpha=0.3)
        # below the panel: inside, the legend covers whichever curves run through its corner
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1 if len(keys) < 4 else 2)
        lo, hi = ax.get_xlim()
        if hi - lo < 2:  # one evaluation: show the epochs around it, not fractions of one
            ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
        ax.xaxis.get_major_locator().set_params(integer=True)  # epochs
    fig.suptitle("Fig. 1: validation error during training\n(mean over seeds)")
    save(fig, path)
    return True


def _timing_note(backends: set[str]) -> str:
    """What the time ratios were measured on: the exact side is attention_with_entropy (entropy included)."""
    where = "/".join(sorted(backends))
    cpu = "\nthe CPU reference builds the N × N matrix" if "reference" in backends else ""
    return f"{where} kernels, exact incl. entropy{cpu}"


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
        for i, d in enumerate(ds):
            color = cmap(0.85 * i / max(len(ds) - 1, 1))  # viridis' last 15 % is too pale to see on white
            per_x = best[arch, target, d, n, k]
            xs = sorted(per_x)
            stats = [_stats(per_x[x]) for x in xs]
            ax.plot(xs, [m for m, _, _ in stats], marker="o", ms=3, color=color, label=f"d={d}")
            if any(len(per_x[x]) > 1 for x in xs):
                ax.fill_between(xs, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], color=color, alpha=0.15)
            # theory d′ as a triangle of the line's colour on the top edge (ten dotted verticals in
            # neighbouring greens could not be told apart), and a dotted vertical for a few d
            ax.plot([theory[i]], [1.0], marker="v", ms=8, color=color, mec="k", mew=0.4,
                    transform=ax.get_xaxis_transform(), clip_on=False)
            if len(ds) <= 3:
                ax.axvline(theory[i], color=color, ls=":", lw=1.6, alpha=0.9)
        xs_all = [x for key in best if (key[0], key[1], key[3], key[4]) == (arch, target, n, k) for x in best[key]]
        ax.set_xlim(min(xs_all + theory) / 1.5, max(xs_all + theory) * 1.5)  # every theory d′ inside the frame
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        title = f"{arch} on {target}, n={n}" + (f", k={k}" if k else "")
        ax.set(xlabel="latent dimension d′", ylabel="best relative L2 validation error")
        ax.set_title(title, pad=12)  # above the theory triangles
        ax.grid(True, which="both", alpha=0.3)
        # below the panel, as in Fig. 1: inside, it covers whichever curves run through its corner
        ax.legend(fontsize=7, ncol=min(5, len(ds)), loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  title="▼ on the top edge" + (" and dotted" if len(ds) <= 3 else "") + ": theory d′ = C(n+d,d)−1",
                  title_fontsize=7)
    fig.suptitle("Fig. 2: best validation error vs latent dimension\n(mean over seeds, band = min–max over seeds)")
    save(fig, path)


ERROR_FLOOR = 1e-4  # relative errors below it are exact up to rounding: drawn at the floor, as ▼


def _plot_attention(path: Path, panels: dict[tuple[str, int], tuple], times: dict[str, tuple], *, title: str,
                    notes: dict[str, str] | None = None, seq_len: int | None = None,
                    timing: str | None = None, windows: dict[int, int] | None = None) -> None:
    """Relative error vs k (log–log, one line per layer), a panel per method, and the time ratio.
    ``seq_len`` marks k = N on the Linformer panel; ``timing`` says what the times were measured on;
    ``windows`` {layer: w}: layers that slide over w < seq_len keys in the model (compared on all keys)."""
    plt = pyplot()
    methods = sorted({m for m, _ in panels})
    fig, axes = plt.subplots(1, len(methods) + 1, figsize=(5.2 * (len(methods) + 1), 4.2), squeeze=False)
    axes = list(axes.flat)
    for ax, method in zip(axes, methods):
        layers = sorted(layer for m, layer in panels if m == method)
        colours = OrderedColours(layers, "layer", cmap="plasma")
        for i, layer in enumerate(layers):
            xs, ys, los, his = panels[method, layer]
            color = colours(i)
            # float rounding (~1e-7) would stretch the log axis over decades that mean nothing
            ax.plot(xs, [max(y, ERROR_FLOOR) for y in ys], marker="o", ms=3, color=color, lw=1 if colours.many else 1.5,
                    label=colours.label(f"layer {layer}" + (" (W)" if windows and layer in windows else "")))
            exact = [(x, ERROR_FLOOR) for x, y in zip(xs, ys) if y < ERROR_FLOOR]
            if exact:
                ax.plot(*zip(*exact), "v", ms=7, color=color)
            if los is not None and not colours.many:  # many layers' bands would only smear the panel
                ax.fill_between(xs, [max(v, ERROR_FLOOR) for v in los], [max(v, ERROR_FLOOR) for v in his],
                                color=color, alpha=0.15)
        if any(y < ERROR_FLOOR for layer in layers for y in panels[method, layer][1]):
            ax.plot([], [], "v", color="gray", label=f"< {ERROR_FLOOR:g}: exact up to rounding")
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
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=1 if colours.many else 2)
    ax = axes[-1]
    for method, (xs, ys) in sorted(times.items()):
        ax.plot(xs, ys, marker="o", ms=3, label=method)
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="k", ylabel="approximation time / exact kernel time",
           title="time ratio" + (f"\n({timing})" if timing else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    save(fig, path)


__all__ = ["aggregate", "linformer_projections", "make_dataset", "per_segment_rel_error", "pooling_projection",
           "relative_l2_error", "run_attention_approx", "run_sumformer_fit"]
