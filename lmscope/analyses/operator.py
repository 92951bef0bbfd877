"""Job kind `operator`: how far each attention head's linear map W'(x) depends on its input (Wang & Li, UAT).

Once the attention weights are fixed, multi-head attention is linear in the layer's input:

    MHA(x)_t = Σ_h o_{h,t} + b_O,    o_{h,t} = Σ_j A_h(x)[t, j] · v_{h,j} · W_O^h,    v_{h,j} = x_j W_V^h + b_V^h

so MHA(x) = W'(x)·x. UAT's point is the input dependence: the input chooses the map it is multiplied by.
This job measures how much. For each head it replaces the window's own weights A_h(x) by weights the window
did not choose, keeps the values v and W_O, and takes the relative change of the head's term,

    D_{l,h} = sqrt( Σ_{w,t} ‖(Ã_h − A_h(x_w)) v_h W_O^h‖²_t / Σ_{w,t} ‖A_h(x_w) v_h W_O^h‖²_t ),

over every token t of the measured windows w. Replacements Ã:
- other_window: another window's A_h (the one before it in its batch, cyclically): the same positions, the text before it;
- mean: A_h averaged over the measured windows, Ā_h[t, j] = E_w A_h(x_w)[t, j] (a fixed pattern of positions:
  a previous-token head or a sink head is close to its mean, a head that looks up content is not);
- uniform: 1 / (visible keys) over the visible keys (mean pooling; the entropy job's uniform bound).
D = 0: the head applies the same linear map to every input. D ≈ 1 or more: the input decides the map.
The layer's value takes the sum over heads, Σ_h, inside the norms; by position it is the layer's per query
position t. Terms are taken at the output projection (before any post-attention norm), as in `pruning`.

The weights come from the model's own eager attention (its module's `eager_attention_forward`, registered
with transformers' AttentionInterface as "lmscope_operator"): the N × N matrix per layer is materialised, and
the job checks that A·v reproduces the attention output the model computed (`reconstruction_error`).
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from lmscope.analyses.base import (JobContext, JobFailed, JobOutput, Series, context_seq_len, dataset_windows,
                                   overflow_advice, require_positions)
from lmscope.analyses.norms import model_parts
from lmscope.analyses.pruning import head_weights, output_projection
from lmscope.catalog import kv_heads
from lmscope.params.operator import DEFAULT_SEQ_LEN, OperatorParams
from lmscope.wording import STUDY_INTERFACE_MODEL

ATTENTION_NAME = "lmscope_operator"
NAMED_HEADS = 5  # the most and least input-dependent heads the summary names
# ‖A·v − the model's attention output‖ / ‖output‖ above this fails the job: the weights read are not the ones
# the model used. fp32 recomputes the same product; half types round the model's output (2^-8 relative, bf16).
RECONSTRUCTION_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}

# The measurement the attention function feeds, per thread (a worker's threads run different models).
_ACTIVE: contextvars.ContextVar["OperatorMeasurement | None"] = contextvars.ContextVar("lmscope_operator",
                                                                                      default=None)


def operator_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The module's own eager attention; hands (A, v, output) of every call to the active measurement."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise JobFailed(f"{type(module).__name__} has no eager_attention_forward beside it, where the operator job "
                        f"reads the attention weights; {STUDY_INTERFACE_MODEL}")
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)
    measurement = _ACTIVE.get()
    if measurement is not None:
        measurement.observe(module, weights, value, out, attention_mask)
    return out, weights


def register_attention() -> str:
    """Register "lmscope_operator" (and the eager mask builder under its name) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, operator_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, AttentionMaskInterface._global_mapping["eager"])
    return ATTENTION_NAME


def visible_keys(mask: torch.Tensor | None, batch: int, nq: int, nk: int, device) -> torch.Tensor:
    """[B or 1, 1, Nq, Nk] bool: which keys each query sees (the eager mask is additive; None is causal)."""
    if mask is None:
        return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)[None, None]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., :nk]


@dataclass
class OperatorSums:
    """Sums over the measured tokens, per layer: the heads' terms ‖o‖² and, per replacement, ‖Δo‖²."""

    term: np.ndarray  # [L, H] Σ ‖o_{h,t}‖² (0 for a silent head: W_O^h or its values zero)
    change: np.ndarray  # [R, L, H] Σ ‖Δo_{h,t}‖²
    layer_term: np.ndarray  # [L, N] Σ_w ‖Σ_h o_{h,t}‖² per position
    layer_change: np.ndarray  # [R, L, N]
    reconstruction: np.ndarray  # [L] the largest ‖A·v − output‖ / ‖output‖ of a batch (NaN kept)

    @staticmethod
    def ratio(change: np.ndarray, term: np.ndarray) -> np.ndarray:
        """sqrt(change / term), NaN where the term is 0: a head that adds nothing has no map to compare (and
        would otherwise pass for the least input-dependent)."""
        return np.sqrt(np.divide(change, term, out=np.full_like(change, np.nan), where=term > 0))

    @property
    def head(self) -> np.ndarray:
        """[R, L, H] D_{l,h}."""
        return self.ratio(self.change, self.term[None])

    @property
    def layer(self) -> np.ndarray:
        """[R, L] the layer's D (its heads summed)."""
        return self.ratio(self.layer_change.sum(-1), self.layer_term.sum(-1)[None])

    @property
    def by_position(self) -> np.ndarray:
        """[R, L, N] the layer's D at each query position."""
        return self.ratio(self.layer_change, self.layer_term[None])


class OperatorMeasurement:
    """What the attention function hands over, per layer: the mean pattern Ā (first pass, with `mean`) or the
    sums of the terms and of their changes under each replacement (second pass)."""

    def __init__(self, model, replacements: list[str], heads: int, seq_len: int):
        blocks = model_parts(model).blocks
        self.replacements, self.heads, self.seq_len = replacements, heads, seq_len
        self.layer_of: dict[int, int] = {}
        self.w_o: list[torch.Tensor] = []  # per layer [H, D_out, d] float32
        for layer, block in enumerate(blocks):
            projection = output_projection(block)
            attention = next((m for m in block.modules() if any(c is projection for c in m.children())), None)
            self.layer_of[id(attention)] = layer
            self.w_o.append(head_weights(projection, heads))
        layers = len(blocks)
        self.grams = [torch.einsum("hod,hoe->hde", w, w) for w in self.w_o]  # ‖z_h W_O^hᵀ‖² = z_h G_h z_hᵀ
        self.mean_sum: list[torch.Tensor | None] = [None] * layers  # Σ_w A, first pass
        self.mean: list[torch.Tensor | None] = [None] * layers  # Ā, second pass
        self.windows_seen = [0] * layers
        self.calls = [0] * layers
        self.collecting_mean = False
        self.sums: OperatorSums | None = None

    def start_sums(self) -> None:
        layers, r, n = len(self.w_o), len(self.replacements), self.seq_len
        self.sums = OperatorSums(np.zeros((layers, self.heads)), np.zeros((r, layers, self.heads)),
                                 np.zeros((layers, n)), np.zeros((r, layers, n)), np.zeros(layers))
        self.calls = [0] * layers

    def finish_mean(self) -> None:
        """Ā = Σ_w A / windows, in place, then float32 (what the measuring pass multiplies; half the memory)."""
        for layer, n in enumerate(self.windows_seen):
            self.mean[layer] = self.mean_sum[layer].div_(n).float()
            self.mean_sum[layer] = None
        self.collecting_mean = False

    def missed_layers(self, batches: int) -> JobFailed | None:
        """The failure to raise when a layer's attention did not come through the attention function every batch."""
        missed = [layer for layer, n in enumerate(self.calls) if n < batches]
        if not missed:
            return None
        return JobFailed(f"the attention of layer(s) {', '.join(map(str, missed))} did not go through transformers' "
                         f"AttentionInterface, where the operator job reads the weights; {STUDY_INTERFACE_MODEL}")

    def observe(self, module, weights: torch.Tensor, value: torch.Tensor, out: torch.Tensor, mask) -> None:
        layer = self.layer_of.get(id(module))
        if layer is None:
            raise JobFailed(f"an attention module ({type(module).__name__}) that is not a block's was called; "
                            "the operator job measures the blocks' attention only, so it cannot measure this "
                            "architecture")
        self.calls[layer] += 1
        A = weights.float()  # [B, H, N, N] (no copy in float32)
        batch, heads, nq, nk = A.shape
        if self.collecting_mean:
            total = A.sum(0, dtype=torch.float64)
            self.mean_sum[layer] = total if self.mean_sum[layer] is None else self.mean_sum[layer].add_(total)
            self.windows_seen[layer] += batch
            return
        # query head h reads key/value head h // (H / KV), as transformers' repeat_kv lays them out
        v = value.float().repeat_interleave(heads // value.shape[1], dim=1)  # [B, H, N, d]
        z = A @ v
        own = out.float().transpose(1, 2)  # [B, H, N, d]
        error = float((z - own).norm() / own.norm().clamp_min(1e-30))
        s = self.sums
        s.reconstruction[layer] = np.maximum(s.reconstruction[layer], error)  # NaN stays NaN
        w, gram = self.w_o[layer].to(z.device), self.grams[layer].to(z.device)
        s.term[layer] += torch.einsum("bhnd,hde,bhne->h", z, gram, z).double().cpu().numpy()
        y = torch.einsum("bhnd,hod->bno", z, w)  # the layer's term Σ_h o_h (no bias)
        s.layer_term[layer, :nq] += y.double().pow(2).sum((0, 2)).cpu().numpy()
        for r, name in enumerate(self.replacements):
            if name == "other_window":
                # window b's values under window b−1's weights: rolling v (N × d) copies less than rolling A (N × N)
                dz = (A @ v.roll(-1, dims=0)).roll(1, dims=0) - z
            elif name == "mean":
                dz = self.mean[layer][None] @ v - z
            else:
                visible = visible_keys(mask, batch, nq, nk, A.device).float()
                dz = (visible / visible.sum(-1, keepdim=True).clamp_min(1)) @ v - z
            s.change[r, layer] += torch.einsum("bhnd,hde,bhne->h", dz, gram, dz).double().cpu().numpy()
            dy = torch.einsum("bhnd,hod->bno", dz, w)
            s.layer_change[r, layer, :nq] += dy.double().pow(2).sum((0, 2)).cpu().numpy()


def window_batches(count: int, batch_size: int) -> list[slice]:
    """Batches of at most `batch_size` windows, none of one window alone (other_window pairs within a batch):
    a last single window joins the batch before it."""
    starts = list(range(0, count, batch_size))
    bounds = [(s, min(s + batch_size, count)) for s in starts]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], count)]
    return [slice(a, b) for a, b in bounds]


@torch.no_grad()
def measure_operator(model, windows: torch.Tensor, params: OperatorParams, heads: int, ctx: JobContext,
                     report) -> OperatorSums:
    """The two passes over the windows (the first only with `mean`), through "lmscope_operator"."""
    from lmscope.kernels.hf import UnsupportedAttention, attention_implementation

    device = next(model.parameters()).device
    measurement = OperatorMeasurement(model, params.replacements, heads, windows.shape[1])
    batches = window_batches(len(windows), params.batch_size)
    register_attention()
    token = _ACTIVE.set(measurement)
    try:
        with attention_implementation(model, ATTENTION_NAME):
            if "mean" in params.replacements:
                measurement.collecting_mean = True
                with ctx.stage("mean_attention"):
                    for batch in batches:
                        model(input_ids=windows[batch].to(device), use_cache=False)
                        report("averaging the attention weights")
                if (missed := measurement.missed_layers(len(batches))) is not None:
                    raise missed
                measurement.finish_mean()
            measurement.start_sums()
            with ctx.stage("measure"):
                for batch in batches:
                    model(input_ids=windows[batch].to(device), use_cache=False)
                    report("replacing the attention weights")
    except UnsupportedAttention as e:
        raise JobFailed(f"{e}: the operator job reads the attention weights there; {STUDY_INTERFACE_MODEL}") from None
    finally:
        _ACTIVE.reset(token)
    if (missed := measurement.missed_layers(len(batches))) is not None:
        raise missed
    sums = measurement.sums
    if not (np.isfinite(sums.term).all() and np.isfinite(sums.change).all()):
        raise JobFailed(f"the attention terms reach inf or NaN in {params.dtype}: {overflow_advice(params.dtype)}")
    tolerance = RECONSTRUCTION_TOLERANCE[params.dtype]
    off = [layer for layer, e in enumerate(sums.reconstruction) if not e <= tolerance]  # NaN is off too
    if off:
        errors = ", ".join(f"{sums.reconstruction[layer]:.3g}" for layer in off)
        raise JobFailed(f"layer(s) {', '.join(map(str, off))}: the attention weights read, times the values, differ "
                        f"from the attention output the model computed by {errors} of its norm (at most "
                        f"{tolerance:g} in {params.dtype}), so they are not the weights the "
                        "model used and D would not measure its map; this architecture cannot be measured so "
                        "(please report it with the model's config)")
    return sums


@dataclass
class Measured:
    name: str
    step: int
    sums: OperatorSums
    windows: int


@torch.no_grad()
def run(params: OperatorParams, ctx: JobContext) -> JobOutput:
    from lmscope.analyses.entropy import checkpoint_list

    checkpoints = checkpoint_list(params, ctx)
    with ctx.stage("load_documents"):
        documents = ctx.load_documents(params.dataset)
    passes = 1 + ("mean" in params.replacements)
    results: list[Measured] = []
    shape: tuple[int, int, int] | None = None
    done = 0

    for index, (step, name) in enumerate(checkpoints):
        with ctx.stage("load_model"):
            loaded = ctx.load_model(name, dtype=params.dtype)
        model, config = loaded.model, loaded.model.config
        if params.seq_len is None:
            params = params.model_copy(update={"seq_len": context_seq_len(config, DEFAULT_SEQ_LEN)})
        require_positions(config, params.seq_len, name)
        layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
        kv = kv_heads(config.to_dict(), heads) or heads
        if shape is not None and (layers, heads, kv) != shape:
            raise JobFailed(f"model {name!r} has {layers} layers × {heads} heads ({kv} key/value) but "
                            f"{results[0].name!r} has {shape[0]} × {shape[1]} ({shape[2]}); one operator job "
                            "follows the same heads across its models (checkpoints of one run): submit one job per "
                            "architecture")
        shape = (layers, heads, kv)
        if (too_large := params.mean_attention_refusal(layers, heads, params.seq_len)) is not None:
            raise JobFailed(f"{name}: {too_large}")
        with ctx.stage("tokenize"):
            windows = dataset_windows(loaded.tokenizer, documents, params, name)
        if len(windows) < 2 and "other_window" in params.replacements:
            raise JobFailed(f"dataset {params.dataset!r} holds one window of {params.seq_len} tokens; other_window "
                            "needs two: lower seq_len, use a larger dataset, or drop 'other_window'")
        batches = len(window_batches(len(windows), params.batch_size))
        total = passes * batches * len(checkpoints)

        def report(stage: str) -> None:
            nonlocal done
            done += 1
            ctx.progress(done, max(total, done), stage)

        sums = measure_operator(model, windows, params, heads, ctx, report)
        results.append(Measured(name, step, sums, len(windows)))
        del loaded, model
    ctx.record("kernel_backend", "transformers-eager (lmscope_operator)")

    with ctx.stage("write"):
        output = _output(params, results[-1], shape)
        if len(results) > 1:
            _over_training(output, params, results)
        _write_files(ctx, params, results, output)
    return output


def _mean_over_layers(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def _named(values: np.ndarray, indices) -> list[dict]:
    heads = values.shape[1]
    return [{"layer": int(i // heads), "head": int(i % heads), "input_dependence": float(values.ravel()[i])}
            for i in indices]


def _output(params: OperatorParams, result: Measured, shape: tuple[int, int, int]) -> JobOutput:
    sums, replacements = result.sums, params.replacements
    head, layer, by_position = sums.head, sums.layer, sums.by_position
    layers, heads, kv = shape
    ranked = replacements.index("mean") if "mean" in replacements else 0  # the heads are ranked by this one
    flat = head[ranked].ravel()
    speaking = np.flatnonzero(np.isfinite(flat))  # a silent head (its term 0) has no D and no rank
    silent = np.flatnonzero(~(sums.term.ravel() > 0))
    summary = {
        "model": result.name,
        "dataset": params.dataset,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "seq_len": params.seq_len,
        "windows": result.windows,
        "tokens": result.windows * params.seq_len,
        "replacements": list(replacements),
        # per replacement: the layer's D (its heads summed), per layer, and their mean over layers
        "input_dependence_by_layer": {r: layer[i].tolist() for i, r in enumerate(replacements)},
        # (a layer whose every head is silent has no D and is left out)
        "mean_input_dependence": {r: _mean_over_layers(layer[i]) for i, r in enumerate(replacements)},
        "ranked_by": replacements[ranked],
        "most_input_dependent_heads": _named(head[ranked],
                                             speaking[np.argsort(-flat[speaking], kind="stable")][:NAMED_HEADS]),
        "least_input_dependent_heads": _named(head[ranked],
                                              speaking[np.argsort(flat[speaking], kind="stable")][:NAMED_HEADS]),
        # heads whose term is 0 on every token (W_O^h or their values zero): D is null for them
        "silent_heads": [{"layer": int(i // heads), "head": int(i % heads)} for i in silent],
        # the largest ‖A·v − the model's attention output‖ / ‖output‖ of a batch: the decomposition's check
        "reconstruction_error": float(sums.reconstruction.max()),
        "attention": "eager",  # the model's own eager attention: N × N weights per layer
    }
    series = []
    for i, r in enumerate(replacements):
        series += [Series("input_dependence", list(range(heads)), head[i, l].tolist(), {"layer": l, "replacement": r})
                   for l in range(layers)]
        series.append(Series("input_dependence.layer", list(range(layers)), layer[i].tolist(), {"replacement": r}))
        # position 0 sees one key: every replacement gives it the same weights (D = 0 there)
        series += [Series("input_dependence.by_position", list(range(params.seq_len)), by_position[i, l].tolist(),
                          {"layer": l, "replacement": r}) for l in range(layers)]
    return JobOutput(summary=summary, series=series)


def _over_training(output: JobOutput, params: OperatorParams, results: list[Measured]) -> None:
    steps = [r.step for r in results]
    layer = np.stack([r.sums.layer for r in results])  # [M, R, L]
    head = np.stack([r.sums.head for r in results])  # [M, R, L, H]
    output.summary["over_training"] = {
        "steps": steps,
        "models": [r.name for r in results],
        "mean_input_dependence": {rep: [_mean_over_layers(row) for row in layer[:, i]]
                                  for i, rep in enumerate(params.replacements)},
    }
    output.summary["summary_of"] = results[-1].name
    for i, rep in enumerate(params.replacements):
        output.series += [Series("input_dependence.layer.over_training", steps, layer[:, i, l].tolist(),
                                 {"layer": l, "replacement": rep}) for l in range(layer.shape[2])]
        output.series += [Series("input_dependence.over_training", steps, head[:, i, l, h].tolist(),
                                 {"layer": l, "head": h, "replacement": rep})
                          for l in range(head.shape[2]) for h in range(head.shape[3])]


def _write_files(ctx: JobContext, params: OperatorParams, results: list[Measured], output: JobOutput) -> None:
    from lmscope.analyses import operator_plots
    from lmscope.analyses.entropy import training_steps

    last = results[-1]
    sums = last.sums
    np.savez_compressed(ctx.artifact_dir / "operator.npz", replacements=np.array(params.replacements),
                        input_dependence=sums.head, layer_input_dependence=sums.layer,
                        by_position=sums.by_position, term_rms=np.sqrt(sums.term / (last.windows * params.seq_len)),
                        reconstruction_error=sums.reconstruction)
    source = f"{last.name} on {params.dataset}"
    tokens = last.windows * params.seq_len
    operator_plots.heatmaps(ctx.artifact_dir / "input_dependence.png", sums.head, params.replacements, source, tokens)
    operator_plots.by_layer_and_position(ctx.artifact_dir / "input_dependence_by_position.png", sums.layer,
                                         sums.by_position, params.replacements, source)
    if len(results) > 1:
        steps = [r.step for r in results]
        layer = np.stack([r.sums.layer for r in results])
        np.savez_compressed(ctx.artifact_dir / "operator_over_training.npz", steps=np.array(steps),
                            models=np.array([r.name for r in results]), replacements=np.array(params.replacements),
                            layer_input_dependence=layer, input_dependence=np.stack([r.sums.head for r in results]))
        steps_known = params.train_job is not None or training_steps([r.name for r in results]) is not None
        operator_plots.over_training(ctx.artifact_dir / "input_dependence_over_training.png", steps, layer,
                                     params.replacements, f"{results[0].name} … {last.name} on {params.dataset}",
                                     "training step" if steps_known else "model (list index)")
