"""Job kind `pruning`: what each attention head adds, and what removing the small ones costs (Wang & Li, UAT).

Multi-head attention is a sum over heads of terms that are linear in the layer's input once the
attention weights are fixed:

    MHA(x)_t = Σ_h o_{h,t} + b_O,    o_{h,t} = Σ_j A_h(x)[t, j] · (x_j W_V^h + b_V^h) · W_O^h

so MHA(x) = W'(x)·x, an input-dependent linear map. UAT's reading of pruning: a term that contributes
little can be dropped without changing the function much. This job measures every term and tests that.

1. Measure, on `num_segments` windows: the size of each head's term relative to the residual stream
   it is added to,  c_{l,h} = E_t ‖o_{l,h,t}‖ / E_t ‖h_{l,t}‖  (h_l: the stream entering block l).
   ‖o_{h,t}‖ comes from the output projection's input z_h (the head's A_h V_h): ‖z_h W_O^hᵀ‖² = z_h G_h z_hᵀ
   with G_h = W_O^hᵀ W_O^h, which costs d² per head and token instead of d·D. Where the block transforms
   the attention output y before adding it (an RMS norm: g ⊙ y · s_t with s_t = 1/rms(y_t); Granite's
   residual_multiplier m), the transform is one per-token linear map shared by the heads, so the head's
   share of what reaches the stream is g ⊙ o_{h,t} · s_t exactly: G_h = W_O^hᵀ diag(g²) W_O^h, times s_t².
2. Remove heads, by zeroing their z_h (the term goes, b_O stays: Michel et al.'s head mask), in orders
   over all layers × heads: smallest c first, largest first, random (seeded), and least harm alone first
   (step 3); at each share in `fractions` evaluate the mean next-token loss on `eval_segments` other
   windows. `unit` makes a key/value group's heads, or a layer's, one unit measured and removed together.

If the small terms matter little, the smallest-first curve stays near the unpruned loss far longer than
the random and largest-first ones.

3. Optionally (`single_head_ablation`), remove each head alone on the measured windows: its loss increase
   Δ_{l,h} is the direct measure of what the head does for the model, c the proxy UAT suggests. Their
   Spearman rank correlation says how far the proxy ranks like the direct measure, and the order
   `least_harm_first` (smallest Δ first) is the greedy one-at-a-time ranking to compare smallest-first with.
4. Optionally (`gradient_importance`), Michel et al.'s (2019) importance: scale each head's z_h by a gate
   ξ_{l,h} = 1 per window w and take I_{l,h} = E_w |∂L_w/∂ξ_{l,h}| (L_w: the window's mean next-token loss),
   one backward pass per batch. Removing the head sets ξ from 1 to 0, so −E_w ∂L_w/∂ξ is the first-order
   estimate of Δ_{l,h}; the order `least_important_first` removes the smallest I first, and
   `least_important_iterative` is the paper's procedure: before each point of `fractions` it takes I again on
   the model with the heads so far removed and removes the least important of the rest. With
   `normalize_importance` both rank by I_{l,h} / ‖I_{l,·}‖₂, the paper's layer-wise normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from lmscope.analyses.base import (JobContext, JobFailed, JobOutput, Series, context_seq_len, dataset_windows,
                                   overflow_advice, own_attention, require_positions)
from lmscope.analyses.norms import model_parts
from lmscope.catalog import kv_heads
from lmscope.params.pruning import DEFAULT_SEQ_LEN, PruningParams

# Where each architecture keeps the projection whose input is the concatenation of its heads' A_h V_h
OUTPUT_PROJECTIONS = ("attn.c_proj",            # GPT-2 (Conv1D), GPTBigCode
                      "self_attn.o_proj",       # LLaMA, Mistral, Qwen, Gemma, Phi-3, OLMo, StarCoder2, …
                      "self_attn.dense",        # Phi
                      "self_attention.dense",   # Falcon, BLOOM
                      "attention.dense",        # GPT-NeoX
                      "attn.out_proj")          # GPT-J
NAMED_HEADS = 5  # the smallest and largest heads the summary names
UNIT_KEYS = {"head": "head", "kv_group": "kv_group", "layer": None}  # how the summary names a unit in its layer
# Blocks that normalise the attention output before the residual add: model_type → (the norm's name in the
# block, the gain's offset: Gemma's RMS norms scale by 1 + weight)
POST_ATTENTION_NORMS = {"gemma2": ("post_attention_layernorm", 1.0),
                        "gemma3_text": ("post_attention_layernorm", 1.0),
                        "olmo2": ("post_attention_layernorm", 0.0),
                        "olmo3": ("post_attention_layernorm", 0.0),
                        "glm4": ("post_self_attn_layernorm", 0.0)}  # its post_attention_layernorm is the MLP's


def output_projection(block) -> torch.nn.Module:
    """The block's attention output projection (its input is [.., heads · head_dim])."""
    for path in OUTPUT_PROJECTIONS:
        module = block
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module) and hasattr(module, "weight"):
            return module
    raise JobFailed(f"cannot find the attention output projection of a {type(block).__name__} "
                    f"(looked for {', '.join(OUTPUT_PROJECTIONS)}); the pruning job supports the architectures "
                    "lmscope.catalog.SUPPORTED_ARCHITECTURES lists")


def head_weights(projection, heads: int) -> torch.Tensor:
    """W_O split per head: [H, D_out, d] float32, so that head h's term is z_h @ W[h]ᵀ."""
    w = projection.weight.detach().float()
    if type(projection).__name__ == "Conv1D":  # GPT-2: y = x @ weight, weight [in, out]
        w = w.T
    out, inner = w.shape
    if inner % heads:
        raise JobFailed(f"the attention output projection reads {inner} features, not a multiple of the "
                        f"{heads} heads the config gives")
    return w.view(out, heads, inner // heads).permute(1, 0, 2).contiguous()


@dataclass
class StreamMap:
    """How a block's attention output y (the output projection's) reaches the residual stream, per token t:
    y_t ↦ gain ⊙ y_t · multiplier / rms(y_t) with an RMS norm (eps set), else y_t · multiplier."""

    kind: str  # "identity", "post_attention_norm" or "residual_multiplier"
    gain: torch.Tensor | None = None  # [D] float32
    eps: float | None = None
    multiplier: float = 1.0

    def scale(self, y: torch.Tensor) -> torch.Tensor | float:
        """[..., 1] float32: the per-token factor s_t (the gain aside); a number when it is the same for all."""
        if self.eps is None:
            return self.multiplier
        y = y.float()  # in float32, as the models' RMS norms compute it
        return self.multiplier * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)


def stream_map(block, config) -> StreamMap:
    """The block's map from attention output to residual stream (identity for pre-norm blocks)."""
    family = str(getattr(config, "model_type", ""))
    if family in POST_ATTENTION_NORMS:
        name, offset = POST_ATTENTION_NORMS[family]
        norm = getattr(block, name, None)
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        if norm is None or getattr(norm, "weight", None) is None or eps is None:
            raise JobFailed(f"a {family} block has no RMS norm {name!r} on its attention output, which the pruning "
                            "job expects there; this transformers version builds the block differently")
        return StreamMap("post_attention_norm", gain=norm.weight.detach().float() + offset, eps=float(eps))
    if family.startswith("granite"):
        return StreamMap("residual_multiplier", multiplier=float(getattr(config, "residual_multiplier", None) or 1.0))
    return StreamMap("identity")


@dataclass
class HeadTerms:
    """Sums over the measured tokens: ‖o_{l,h,t}‖ per head, ‖h_{l,t}‖ per layer, the token count, and the
    unpruned model's mean next-token loss on those windows."""

    term_norm: np.ndarray  # [L, H] float64
    residual_norm: np.ndarray  # [L] float64
    tokens: int
    loss: float

    @property
    def contribution(self) -> np.ndarray:
        """c_{l,h} = E‖o_{l,h}‖ / E‖h_l‖: comparable across layers, which the pruning orders need."""
        return self.term_norm / self.residual_norm[:, None]

    @property
    def share(self) -> np.ndarray:
        """E‖o_{l,h}‖ as a share of the layer's heads' sum (0 in a layer whose heads add nothing)."""
        sums = self.term_norm.sum(1, keepdims=True)
        return np.divide(self.term_norm, sums, out=np.zeros_like(self.term_norm), where=sums > 0)


class HeadHooks:
    """Hooks on every block's output projection: measure the heads' terms as they reach the residual stream
    (forward hook: input and output), or remove heads (pre-hook); and on every block, to sum the norms of the
    residual stream entering it while measuring."""

    def __init__(self, blocks, heads: int, config):
        self.projections = [output_projection(b) for b in blocks]
        self.heads = heads
        self.maps = [stream_map(b, config) for b in blocks]
        self.grams = []  # per layer [H, d, d]: W_O^hᵀ diag(g²) W_O^h
        for projection, m in zip(self.projections, self.maps):
            w = head_weights(projection, heads)
            g2 = torch.ones(w.shape[1], device=w.device) if m.gain is None else m.gain.to(w.device) ** 2
            self.grams.append(torch.einsum("hod,o,hoe->hde", w, g2, w))
        self.sums: list[torch.Tensor] | None = None  # per layer [H] float64 while measuring
        self.residual: list[torch.Tensor] | None = None  # per layer [] float64 while measuring
        self.calls = [0] * len(blocks)  # forward calls seen per layer while measuring
        self.masks: list[torch.Tensor | None] = [None] * len(blocks)  # per layer [H] 0/1 while pruning
        self.gates: list[torch.Tensor] | None = None  # per layer [B, H] at 1, requiring grad, while taking gradients
        self.handles = [p.register_forward_pre_hook(self._hook(i)) for i, p in enumerate(self.projections)]
        self.handles += [p.register_forward_hook(self._measure_hook(i)) for i, p in enumerate(self.projections)]
        # the block's input, not output_hidden_states: no L + 1 [batch, seq_len, D] tensors kept per pass
        self.handles += [b.register_forward_pre_hook(self._residual_hook(i), with_kwargs=True)
                         for i, b in enumerate(blocks)]

    def _residual_hook(self, layer: int):
        def hook(module, args, kwargs):
            if self.residual is None:
                return None
            h = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(h, torch.Tensor):
                raise JobFailed(f"block {layer} ({type(module).__name__}) was called without its hidden states as "
                                "the first argument or `hidden_states`; the pruning job cannot measure the residual "
                                "stream of this model")
            self.residual[layer] += h.float().norm(dim=-1).sum().double().to(self.residual[layer].device)
            return None
        return hook

    def _measure_hook(self, layer: int):
        # a forward hook sees the input as the pre-hook left it: no mask is set while measuring
        def hook(module, args, output):
            if self.sums is None:
                return None
            z = args[0].float()
            zf = z.reshape(*z.shape[:-1], self.heads, z.shape[-1] // self.heads)  # [B, N, H, d]
            sq = torch.einsum("bnhd,hde,bnhe->bnh", zf, self.grams[layer].to(zf.device), zf)
            scale = self.maps[layer].scale(output)  # s_t ≥ 0 per token
            norms = sq.clamp_min(0).sqrt() * (scale.to(sq.device) if isinstance(scale, torch.Tensor) else scale)
            self.sums[layer] += norms.sum((0, 1)).double().to(self.sums[layer].device)
            self.calls[layer] += 1
            return None
        return hook

    def _hook(self, layer: int):
        def hook(module, args):
            z = args[0]
            per_head = z.reshape(*z.shape[:-1], self.heads, z.shape[-1] // self.heads)  # [B, N, H, d]
            mask = self.masks[layer]
            if mask is not None:  # removed heads stay removed under the gates (the iterative importance)
                per_head = per_head * mask.to(z.dtype)[:, None]
            if self.gates is not None:
                gate = self.gates[layer]  # [B, H]: one gate per window, so ∂ of the summed losses is per window
                if z.dim() != 3 or z.shape[0] != gate.shape[0]:
                    raise JobFailed(f"the attention output projection of layer {layer} reads a {list(z.shape)} "
                                    f"tensor, not [windows, tokens, features]; the gradient importance cannot tell "
                                    "the windows apart there: set gradient_importance to false")
                per_head = per_head * gate.to(z.dtype)[:, None, :, None]
            if mask is None and self.gates is None:
                return None
            return (per_head.reshape(z.shape),) + tuple(args[1:])
        return hook

    def remove_heads(self, removed: list[tuple[int, int]]) -> None:
        """Zero the terms of these (layer, head)s in the next forward passes ([] restores the model)."""
        masks: list[torch.Tensor | None] = [None] * len(self.projections)
        for layer, head in removed:
            if masks[layer] is None:
                weight = self.projections[layer].weight
                masks[layer] = torch.ones(self.heads, dtype=weight.dtype, device=weight.device)
            masks[layer][head] = 0.0
        self.masks = masks

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def next_token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ over every predicted position of the next-token cross-entropy, from float32 logits (float64 sum)."""
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").double()


@torch.no_grad()
def measure_terms(model, hooks: HeadHooks, windows: torch.Tensor, batch_size: int, report) -> HeadTerms:
    """Sum ‖o_{l,h,t}‖ and ‖h_{l,t}‖ over every token of the windows, and the unpruned model's loss there."""
    layers, device = len(hooks.projections), next(model.parameters()).device
    # a model split over devices keeps each layer's sums on its own
    hooks.sums = [torch.zeros(hooks.heads, dtype=torch.float64, device=p.weight.device) for p in hooks.projections]
    hooks.residual = [torch.zeros((), dtype=torch.float64, device=p.weight.device) for p in hooks.projections]
    hooks.calls = [0] * layers
    loss = torch.zeros((), dtype=torch.float64, device=device)
    passes = 0
    try:
        for start in range(0, len(windows), batch_size):
            ids = windows[start:start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            loss += next_token_loss_sum(logits, ids.to(logits.device)).to(device)
            passes += 1
            report("measuring the heads' terms")
        term = torch.stack([s.cpu() for s in hooks.sums]).numpy()
        residual = torch.stack([r.cpu() for r in hooks.residual]).numpy()
    finally:
        hooks.sums = hooks.residual = None
    missed = [layer for layer, n in enumerate(hooks.calls) if n < passes]
    if missed:  # e.g. BLOOM with pretraining_tp > 1 and slow_but_exact calls F.linear on slices of the weight
        raise JobFailed(f"the attention output projection of layer(s) {', '.join(map(str, missed))} was not called as a "
                        f"module ({type(hooks.projections[missed[0]]).__name__}); the pruning job reads and removes "
                        "heads there and cannot measure this model")
    return HeadTerms(term, residual, int(windows.numel()), float(loss) / (windows.shape[0] * (windows.shape[1] - 1)))


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch_size: int, report, stage: str = "evaluating pruned models") -> float:
    """Mean next-token cross-entropy (nats) over every position of the windows, logits in float32."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(windows), batch_size):
        ids = windows[start:start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        total += next_token_loss_sum(logits, ids.to(logits.device)).to(device)
        report(stage)
    return float(total) / (windows.shape[0] * (windows.shape[1] - 1))


@torch.no_grad()
def single_head_losses(model, hooks: HeadHooks, windows: torch.Tensor, batch_size: int, report) -> np.ndarray:
    """[L, H]: the mean loss on the windows with only that head removed."""
    layers = len(hooks.projections)
    losses = np.empty((layers, hooks.heads))
    try:
        for layer in range(layers):
            for head in range(hooks.heads):
                hooks.remove_heads([(layer, head)])
                losses[layer, head] = mean_loss(model, windows, batch_size, report, "removing each head alone")
    finally:
        hooks.remove_heads([])
    return losses


def gradient_importance(model, hooks: HeadHooks, windows: torch.Tensor, batch_size: int, report,
                        stage: str = "taking the gradient importance") -> tuple[np.ndarray, np.ndarray]:
    """[L, H] twice: I = E_w |∂L_w/∂ξ| and the first-order loss increase −E_w ∂L_w/∂ξ, the gates ξ at 1
    (L_w: window w's mean next-token loss, from float32 logits). Only the gates' gradients are formed."""
    layers, units = len(hooks.projections), hooks.heads
    absolute = np.zeros((layers, units))
    signed = np.zeros((layers, units))
    device = next(model.parameters()).device
    # the weights need no gradient: without this autograd would also keep every layer's input for them
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        with torch.enable_grad():
            for start in range(0, len(windows), batch_size):
                ids = windows[start:start + batch_size].to(device)
                hooks.gates = [torch.ones(len(ids), units, device=p.weight.device, requires_grad=True)
                               for p in hooks.projections]
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
                targets = ids[:, 1:].to(logits.device)
                per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none")
                per_window = per_token.view(targets.shape).mean(1)
                grads = torch.autograd.grad(per_window.sum(), hooks.gates)
                g = torch.stack([x.detach().double().cpu() for x in grads], 1).numpy()  # [B, L, H]
                absolute += np.abs(g).sum(0)
                signed += g.sum(0)
                del logits, per_token, per_window, grads
                report(stage)
    finally:
        hooks.gates = None
        for p in trainable:
            p.requires_grad_(True)
    return absolute / len(windows), -signed / len(windows)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1 … n, tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    _, groups = np.unique(values, return_inverse=True)
    sums, counts = np.bincount(groups, ranks), np.bincount(groups)
    return (sums / counts)[groups]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's ρ: the Pearson correlation of the average ranks; None when either side is constant."""
    ra, rb = average_ranks(np.ravel(a)), average_ranks(np.ravel(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else None


def normalized_by_layer(importance: np.ndarray) -> np.ndarray:
    """I_{l,h} / ‖I_{l,·}‖₂ (Michel et al.'s layer-wise normalisation); a layer whose importances are all 0 stays 0."""
    norms = np.sqrt((importance ** 2).sum(1, keepdims=True))
    return np.divide(importance, norms, out=np.zeros_like(importance), where=norms > 0)


def ranking_importance(importance: np.ndarray, params: PruningParams) -> np.ndarray:
    return normalized_by_layer(importance) if params.normalize_importance else importance


def iterative_importance_order(model, hooks: HeadHooks, windows: torch.Tensor, params: PruningParams,
                               counts: list[int], importance: np.ndarray, report) -> np.ndarray:
    """Michel et al.'s iterative pruning as one removal order: up to each count, the least important remaining
    units go, their importance taken on the model with the units before them removed (`importance`: the
    unpruned model's, for the first step). The rest follow by the last importance taken."""
    units = importance.shape[1]
    removed: list[int] = []
    current = importance

    def remaining_by_importance() -> list[int]:
        gone = set(removed)
        return [int(i) for i in np.argsort(ranking_importance(current, params).ravel(), kind="stable") if i not in gone]

    for k in counts:
        if k <= len(removed):
            continue
        # the first step ranks by the unpruned importance, already taken; removing every unit needs no ranking
        if removed and k < importance.size:
            hooks.remove_heads([divmod(i, units) for i in removed])
            try:
                current, _ = gradient_importance(
                    model, hooks, windows, params.batch_size, report,
                    f"taking the gradient importance again, {len(removed)} of {importance.size} {params.unit}s removed")
            finally:
                hooks.remove_heads([])
            if not np.isfinite(current).all():
                raise JobFailed(f"the loss's gradient reaches inf or NaN in {params.dtype} once heads are removed: "
                                f"{overflow_advice(params.dtype)}")
        removed += remaining_by_importance()[:k - len(removed)]
    return np.array(removed + remaining_by_importance())


def iterative_passes(counts: list[int], total: int) -> int:
    """Gradient passes the iterative order takes beyond the unpruned one: one before each count after the first
    nonzero, except the count removing every unit (nothing left to rank)."""
    steps = [k for k in counts if k > 0]
    return len([k for k in steps[1:] if k < total])


def removal_orders(contribution: np.ndarray, params: PruningParams, harm: np.ndarray | None = None,
                   importance: np.ndarray | None = None) -> dict[str, list[np.ndarray]]:
    """Per order, the flat head indices (layer · H + head) in the order they are removed; ties by index.
    `harm`: each head's single-head loss increase, for least_harm_first; `importance`: each head's gradient
    importance, for least_important_first (least_important_iterative is measured apart)."""
    flat = contribution.ravel()
    orders: dict[str, list[np.ndarray]] = {}
    if "smallest_first" in params.orders:
        orders["smallest_first"] = [np.argsort(flat, kind="stable")]
    if "largest_first" in params.orders:
        orders["largest_first"] = [np.argsort(-flat, kind="stable")]
    if "least_harm_first" in params.orders:
        orders["least_harm_first"] = [np.argsort(harm.ravel(), kind="stable")]
    if "least_important_first" in params.orders:
        orders["least_important_first"] = [np.argsort(ranking_importance(importance, params).ravel(), kind="stable")]
    if "random" in params.orders:
        rng = np.random.default_rng(params.seed)
        orders["random"] = [rng.permutation(flat.size) for _ in range(params.random_orders)]
    return orders


def head_counts(fractions: list[float], total: int) -> list[int]:
    """Whole heads removed at each share (half up, on the decimal as written: 0.7 × 45 is 31.5 → 32, where
    float arithmetic gives 31.4999…), each count once."""
    return sorted({math.floor(Fraction(str(f)) * total + Fraction(1, 2)) for f in fractions})


def prunable_fraction(counts: list[int], losses: list[float], baseline: float, tolerance: float, total: int) -> float:
    """The largest share on the grid up to which every point's loss is within (1 + tolerance) · baseline."""
    best = 0.0
    for k, loss in zip(counts, losses):
        if loss > baseline * (1 + tolerance):
            break
        best = k / total
    return best


@dataclass
class Pruned:
    """One model's measured terms, single-unit losses, removal orders and loss curves."""

    name: str
    step: int
    terms: HeadTerms
    harm: np.ndarray | None  # [L, U] single-unit loss increase, with the ablation
    importance: np.ndarray | None  # [L, U] E|∂L_w/∂ξ|, with gradient_importance
    first_order: np.ndarray | None  # [L, U] −E ∂L_w/∂ξ: the first-order estimate of harm
    orders: dict[str, list[np.ndarray]]
    curves: dict[str, np.ndarray]  # per order [draws, K]
    baseline: float
    stream: str
    windows_measured: int
    windows_evaluated: int


class PruningProgress:
    """One count over every model's batches. A model's number of evaluated sets is known once its terms are
    measured, its windows once it is tokenized: until then the total counts the first model's, and the most
    sets there can be."""

    def __init__(self, ctx: JobContext, models: int):
        self.ctx, self.models, self.done = ctx, models, 0
        self.fixed: list[int] = []  # per model known so far: measuring (and ablation) batches
        self.planned: list[int] = []  # evaluated sets (at most, until measured)
        self.eval_batches: list[int] = []

    def start_model(self, fixed: int, planned_at_most: int, eval_batches: int) -> int:
        self.fixed.append(fixed)
        self.planned.append(planned_at_most)
        self.eval_batches.append(eval_batches)
        return len(self.fixed) - 1

    def __call__(self, stage: str) -> None:
        self.done += 1
        known = sum(f + p * e for f, p, e in zip(self.fixed, self.planned, self.eval_batches))
        rest = (self.models - len(self.fixed)) * (self.fixed[0] + self.planned[0] * self.eval_batches[0])
        self.ctx.progress(self.done, known + rest, stage)


def split_windows(windows: torch.Tensor, params: PruningParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The measured windows, then the evaluated ones; a short dataset is split in the asked proportion."""
    if len(windows) < 2:
        raise JobFailed(f"dataset {params.dataset!r} holds one window of {params.seq_len} tokens; the job measures "
                        "on some windows and evaluates on others: lower seq_len or use a larger dataset")
    measured = min(params.num_segments, max(1, round(len(windows) * params.num_segments /
                                                     (params.num_segments + params.eval_segments))))
    measured = min(measured, len(windows) - 1)
    return windows[:measured], windows[measured:measured + params.eval_segments]


def prune_model(model, units: int, params: PruningParams, measure_windows: torch.Tensor, eval_windows: torch.Tensor,
                counts: list[int], report: PruningProgress, index: int, ctx: JobContext) -> tuple:
    """Measure, optionally ablate, then evaluate every distinct set of removed units of every order."""
    hooks = HeadHooks(model_parts(model).blocks, units, model.config)
    try:
        with ctx.stage("measure"):
            terms = measure_terms(model, hooks, measure_windows, params.batch_size, report)
        if not np.isfinite(terms.term_norm).all() or not np.isfinite(terms.residual_norm).all():
            raise JobFailed(f"the states reach inf or NaN in {params.dtype}: {overflow_advice(params.dtype)}")
        harm = None
        if params.single_head_ablation:
            with ctx.stage("ablate"):  # on the measured windows: the evaluation windows stay unseen by every ranking
                harm = single_head_losses(model, hooks, measure_windows, params.batch_size, report) - terms.loss
            if not np.isfinite(harm).all():
                raise JobFailed(f"the loss reaches inf or NaN in {params.dtype} once a head is removed: "
                                f"{overflow_advice(params.dtype)}")
        importance = first_order = None
        if params.gradient_importance:
            with ctx.stage("importance"):
                importance, first_order = gradient_importance(model, hooks, measure_windows, params.batch_size,
                                                              report)
            if not np.isfinite(importance).all():
                raise JobFailed(f"the loss's gradient reaches inf or NaN in {params.dtype}: "
                                f"{overflow_advice(params.dtype)}")
        orders = removal_orders(terms.contribution, params, harm, importance)
        if "least_important_iterative" in params.orders:
            with ctx.stage("importance_iterative"):
                orders["least_important_iterative"] = [iterative_importance_order(
                    model, hooks, measure_windows, params, counts, importance, report)]
        # each distinct set of removed units is evaluated once (k = 0 and k = all are every order's)
        plan: dict[frozenset, None] = {frozenset(): None}
        for perms in orders.values():
            for perm in perms:
                for k in counts:
                    plan.setdefault(frozenset(perm[:k].tolist()), None)
        report.planned[index] = len(plan)
        losses: dict[frozenset, float] = {}
        with ctx.stage("evaluate"):
            for removed in plan:
                hooks.remove_heads([divmod(i, units) for i in sorted(removed)])
                losses[removed] = mean_loss(model, eval_windows, params.batch_size, report)
    finally:
        hooks.close()
    if not all(math.isfinite(v) for v in losses.values()):
        raise JobFailed(f"the loss reaches inf or NaN in {params.dtype} once heads are removed: "
                        f"{overflow_advice(params.dtype)}")
    curves = {order: np.array([[losses[frozenset(p[:k].tolist())] for k in counts] for p in perms])
              for order, perms in orders.items()}  # [draws, K]
    return terms, harm, importance, first_order, orders, curves, losses[frozenset()], hooks.maps[0].kind


@torch.no_grad()
def run(params: PruningParams, ctx: JobContext) -> JobOutput:
    from lmscope.analyses.entropy import checkpoint_list

    checkpoints = checkpoint_list(params, ctx)
    with ctx.stage("load_documents"):
        documents = ctx.load_documents(params.dataset)
    results: list[Pruned] = []
    shapes: list[tuple[int, int, int]] = []  # layers, heads, key/value heads: every model's must be the first's
    backends: set[str] = set()
    report = PruningProgress(ctx, len(checkpoints))
    for index, (step, name) in enumerate(checkpoints):
        with ctx.stage("load_model"):
            loaded = ctx.load_model(name, dtype=params.dtype)
        model, config = loaded.model, loaded.model.config
        if params.seq_len is None:  # not given: 256, or the (first) model's context when shorter
            params = params.model_copy(update={"seq_len": context_seq_len(config, DEFAULT_SEQ_LEN)})
        require_positions(config, params.seq_len, name)
        layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
        # a unit is a run of adjacent query heads: a key/value group's heads are adjacent in every supported layout
        kv = kv_heads(config.to_dict(), heads) or heads
        if not 1 <= kv <= heads or heads % kv:
            raise JobFailed(f"model {name!r} has {heads} query heads and {kv} key/value heads, which do not form "
                            "groups of equal size; the pruning job cannot tell its heads' groups apart")
        units = heads // {"head": 1, "kv_group": heads // kv, "layer": heads}[params.unit]
        shape = (layers, heads, kv)
        if results and shape != shapes[0]:
            raise JobFailed(f"model {name!r} has {layers} layers × {heads} heads ({kv} key/value) but "
                            f"{results[0].name!r} has {shapes[0][0]} × {shapes[0][1]} ({shapes[0][2]}); one pruning "
                            "job follows the same heads across its models (checkpoints of one run): submit one job "
                            "per architecture")
        shapes.append(shape)
        with ctx.stage("tokenize"):
            wanted = SimpleNamespace(seq_len=params.seq_len, num_segments=params.num_segments + params.eval_segments,
                                     bos_per_window=params.bos_per_window, dataset=params.dataset)
            measure_windows, eval_windows = split_windows(dataset_windows(loaded.tokenizer, documents, wanted, name),
                                                          params)
        total = layers * units
        counts = head_counts(params.fractions, total)
        measure_batches = math.ceil(len(measure_windows) / params.batch_size)
        inner = [k for k in counts if 0 < k < total]
        planned = 1 + len(inner) * sum(params.random_orders if o == "random" else 1 for o in params.orders) + (total in counts)
        passes = (1 + (total if params.single_head_ablation else 0) + params.gradient_importance
                  + ("least_important_iterative" in params.orders) * iterative_passes(counts, total))
        report.start_model(measure_batches * passes, planned,
                           math.ceil(len(eval_windows) / params.batch_size))
        backends.add(own_attention(model))
        found = prune_model(model, units, params, measure_windows, eval_windows, counts, report, index, ctx)
        results.append(Pruned(name, step, *found, len(measure_windows), len(eval_windows)))
        del loaded, model  # the worker's model cache decides what stays resident
    ctx.record("kernel_backend", "+".join(sorted(backends)))

    last = results[-1]
    with ctx.stage("write"):
        output = _output(params, heads, kv, last, counts)
        if len(results) > 1:
            _over_training(output, params, results, counts)
        _write_files(ctx, params, results, counts, output)
    return output


def _write_files(ctx: JobContext, params: PruningParams, results: list[Pruned], counts: list[int],
                 output: JobOutput) -> None:
    from lmscope.analyses import pruning_plots

    last = results[-1]
    terms, contribution, total = last.terms, last.terms.contribution, last.terms.term_norm.size
    optional = {} if last.harm is None else {"single_head_loss_increase": last.harm, "measured_loss": terms.loss}
    if last.importance is not None:
        optional.update(importance=last.importance, first_order_loss_increase=last.first_order)
    np.savez_compressed(ctx.artifact_dir / "pruning.npz", contribution=contribution, share=terms.share,
                        term_norm_mean=terms.term_norm / terms.tokens,
                        residual_norm_mean=terms.residual_norm / terms.tokens,
                        heads_removed=np.array(counts), baseline_loss=last.baseline,
                        **{f"loss_{o}": c for o, c in last.curves.items()},
                        **{f"order_{o}": np.stack(last.orders[o]) for o in last.orders}, **optional)
    source = f"{last.name} on {params.dataset}"
    pruning_plots.contributions(ctx.artifact_dir / "head_contributions.png", contribution, source,
                                last.windows_measured * params.seq_len, params.unit)
    pruning_plots.pruning_curves(ctx.artifact_dir / "pruning.png", counts, total, last.curves, last.baseline,
                                 params.tolerance, source, output.summary["tokens_evaluated"], params.unit)
    if last.harm is not None:
        pruning_plots.contribution_against_ablation(ctx.artifact_dir / "contribution_vs_ablation.png", contribution,
                                                    last.harm, output.summary["single_head"]["rank_correlation"],
                                                    source, last.windows_measured * (params.seq_len - 1), params.unit)
    if last.importance is not None:
        pruning_plots.contribution_against_importance(
            ctx.artifact_dir / "contribution_vs_importance.png", contribution, last.importance,
            output.summary["gradient_importance"], source, last.windows_measured, params.unit,
            first_order=last.first_order, harm=last.harm)
    if len(results) > 1:
        over = output.summary["over_training"]
        np.savez_compressed(ctx.artifact_dir / "pruning_over_training.npz", steps=np.array(over["steps"]),
                            models=np.array(over["models"]),
                            contribution=np.stack([r.terms.contribution for r in results]),
                            baseline_loss=np.array(over["baseline_loss"]), heads_removed=np.array(counts),
                            **{f"loss_{o}": np.stack([r.curves[o] for r in results]) for o in last.curves},
                            **({"single_head_loss_increase": np.stack([r.harm for r in results])}
                               if last.harm is not None else {}),
                            **({"importance": np.stack([r.importance for r in results])}
                               if last.importance is not None else {}))
        from lmscope.analyses.entropy import training_steps

        steps_known = params.train_job is not None or training_steps(over["models"]) is not None
        pruning_plots.over_training(ctx.artifact_dir / "pruning_over_training.png", over,
                                    np.stack([r.terms.contribution for r in results]),
                                    f"{results[0].name} … {results[-1].name} on {params.dataset}", params.unit,
                                    "training step" if steps_known else "model (list index)")


def _over_training(output: JobOutput, params: PruningParams, results: list[Pruned], counts: list[int]) -> None:
    """Per model (x = training step): the unpruned loss, each order's prunable fraction and mean loss increase,
    ρ(c, Δ) with the ablation, and every unit's c."""
    steps = [r.step for r in results]
    total = results[-1].terms.term_norm.size
    per_order = {o: [r.curves[o].mean(0) for r in results] for o in results[-1].curves}
    over = {
        "steps": steps,
        "models": [r.name for r in results],
        "baseline_loss": [r.baseline for r in results],
        "prunable_fraction": {o: [prunable_fraction(counts, c.tolist(), r.baseline, params.tolerance, total)
                                  for c, r in zip(curves, results)] for o, curves in per_order.items()},
        "mean_loss_increase": {o: [float((c / r.baseline - 1).mean()) for c, r in zip(curves, results)]
                               for o, curves in per_order.items()},
    }
    if results[-1].harm is not None:
        over["rank_correlation"] = [rank_correlation(r.terms.contribution, r.harm) for r in results]
    if results[-1].importance is not None:
        over["importance_rank_correlation"] = [rank_correlation(r.terms.contribution, r.importance) for r in results]
    output.summary["over_training"] = over
    output.summary["summary_of"] = results[-1].name
    series = output.series
    series += [Series("baseline_loss", steps, over["baseline_loss"], {})]
    series += [Series("prunable_fraction", steps, v, {"order": o}) for o, v in over["prunable_fraction"].items()]
    series += [Series("mean_loss_increase", steps, v, {"order": o}) for o, v in over["mean_loss_increase"].items()]
    for name in ("rank_correlation", "importance_rank_correlation"):
        if name in over:  # a model whose c, Δ or I is constant has none
            known = [(x, v) for x, v in zip(steps, over[name]) if v is not None]
            series += [Series(name, [x for x, _ in known], [v for _, v in known], {})]
    stacked = np.stack([r.terms.contribution for r in results])  # [M, L, U]
    key = UNIT_KEYS[params.unit]  # as the summary names a unit: head, kv_group, or the layer alone
    series += [Series("head_contribution.over_training", steps, stacked[:, layer, unit].tolist(),
                      {"layer": layer, **({} if key is None else {key: unit})})
               for layer in range(stacked.shape[1]) for unit in range(stacked.shape[2])]


def _output(params: PruningParams, heads: int, kv: int, result: Pruned, counts: list[int]) -> JobOutput:
    terms, curves, baseline, harm = result.terms, result.curves, result.baseline, result.harm
    importance, first_order = result.importance, result.first_order
    measured, evaluated, stream_maps = result.windows_measured, result.windows_evaluated, result.stream
    contribution = terms.contribution
    layers, units = contribution.shape
    total = layers * units
    key = UNIT_KEYS[params.unit]
    shares = [k / total for k in counts]
    by_size = np.argsort(contribution.ravel(), kind="stable")

    def named(indices) -> list[dict]:
        return [{"layer": int(i // units), **({} if key is None else {key: int(i % units)}),
                 "contribution": float(contribution.ravel()[i])} for i in indices]

    mean_curve = {order: c.mean(0) for order, c in curves.items()}
    summary = {
        "model": result.name,
        "dataset": params.dataset,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "unit": params.unit,  # what is measured and removed: a head, a key/value group's heads, a layer's heads
        "heads_per_unit": heads * layers // total,
        "units": total,
        # identity, or how the attention output is transformed before the add (c is measured after it)
        "stream_map": stream_maps,
        "seq_len": params.seq_len,
        "windows_measured": measured,
        "windows_evaluated": evaluated,
        "tokens_measured": terms.tokens,
        "tokens_evaluated": evaluated * (params.seq_len - 1),  # predicted tokens: each window's all but the first
        "baseline_loss": baseline,
        "baseline_perplexity": math.exp(min(baseline, 700.0)),
        "smallest_heads": named(by_size[:NAMED_HEADS]),
        "largest_heads": named(np.argsort(-contribution.ravel(), kind="stable")[:NAMED_HEADS]),  # as largest_first
        "contribution_by_layer": contribution.mean(1).tolist(),
        "heads_removed": counts,  # units removed at each point (heads, groups or layers)
        "query_heads_removed": [k * heads * layers // total for k in counts],
        # the mean over the grid of loss / baseline − 1: one number per order to compare them by
        "mean_loss_increase": {o: float((c / baseline - 1).mean()) for o, c in mean_curve.items()},
        "prunable_fraction": {o: prunable_fraction(counts, c.tolist(), baseline, params.tolerance, total)
                              for o, c in mean_curve.items()},
        "tolerance": params.tolerance,
    }
    if harm is not None:
        worst = np.argsort(-harm.ravel(), kind="stable")[:NAMED_HEADS]
        summary["single_head"] = {
            "measured_loss": terms.loss,  # the unpruned loss on the measured windows, which Δ is taken against
            "rank_correlation": rank_correlation(contribution, harm),  # Spearman's ρ between c and Δ
            "most_harmful_heads": [dict(h, loss_increase=float(harm.ravel()[i])) for h, i in zip(named(worst), worst)],
            "heads_within_tolerance": int((harm <= params.tolerance * terms.loss).sum()),
            "max_loss_increase": float(harm.max()),
        }
    if importance is not None:
        flat = importance.ravel()
        least = np.argsort(flat, kind="stable")[:NAMED_HEADS]  # by the unnormalised I, as reported
        most = np.argsort(-flat, kind="stable")[:NAMED_HEADS]
        summary["gradient_importance"] = {
            "rank_correlation": rank_correlation(contribution, importance),  # Spearman's ρ between c and I
            "least_important_heads": [dict(h, importance=float(flat[i])) for h, i in zip(named(least), least)],
            "most_important_heads": [dict(h, importance=float(flat[i])) for h, i in zip(named(most), most)],
            "max_importance": float(flat.max()),
            "normalized_by_layer": params.normalize_importance,  # whether the importance orders ranked I / ‖I_l‖₂
        }
        if harm is not None:  # how far the gradient predicts what removing each head alone costs
            summary["gradient_importance"]["rank_correlation_with_ablation"] = rank_correlation(importance, harm)
            summary["gradient_importance"]["first_order_rank_correlation"] = rank_correlation(first_order, harm)
    if total in counts:
        summary["loss_all_heads_removed"] = float(next(iter(curves.values()))[0, counts.index(total)])
    series = [Series("head_contribution", list(range(units)), contribution[layer].tolist(), {"layer": layer})
              for layer in range(layers)]
    series += [Series("head_share", list(range(units)), terms.share[layer].tolist(), {"layer": layer})
               for layer in range(layers)]
    series += [Series("pruned_loss", shares, c.tolist(), {"order": o}) for o, c in mean_curve.items()]
    if harm is not None:
        series += [Series("single_head_loss_increase", list(range(units)), harm[layer].tolist(), {"layer": layer})
                   for layer in range(layers)]
    if importance is not None:
        series += [Series("head_importance", list(range(units)), importance[layer].tolist(), {"layer": layer})
                   for layer in range(layers)]
        series += [Series("first_order_loss_increase", list(range(units)), first_order[layer].tolist(),
                          {"layer": layer}) for layer in range(layers)]
    if "random" in curves:
        series += [Series("pruned_loss.random_draw", shares, row.tolist(), {"draw": i})
                   for i, row in enumerate(curves["random"])]
    return JobOutput(summary=summary, series=series)
