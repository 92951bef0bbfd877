"""norms — the current token's norm across layers (Wu & Varshney, "A Meta-Learning Perspective on
Transformers for Causal Language Modeling"; DESIGN.md §7, docs/analyses/norms.md).

For every sample (one document, first max_tokens + 1 tokens; the model reads all but the last):

    trajectory      ‖h_0[t]‖, ‖h_1[t]‖, …, ‖h_{L-1}[t]‖   (+ ‖h_L[t]‖ before the final norm, optional)
                    h_0 = embedding output, h_l = output of block l, t = the current token
    sequence %      share of trajectories with every step non-decreasing; pair % = share of steps
    inner loss      loss_l = CE(lm_head(final_norm(block_L(h_l)))[t], label)   l = 0 … L-1   (eq. 14)
    PCA             principal axes of all trajectory points; 3-D polylines for a few trajectories
    Gram condition  W = (I + W2·W1)(I + Σ_h W_O^h (Σ_{i≤t} v_i^h k_i^hᵀ) W_Q^h),  v_i = W_V z_i, k_i = W_K z_i
                    (linear attention over the sample's own layer-l context z_i = h_l[i]; eq. 10;
                    I + W_MHSA + W_FFN for parallel-residual blocks; lmscope.analyses.linearised_layer)
                    holds when Σ λ_j a_j b_j ≥ Σ a_j b_j,  WᵀW = U Λ U⁻¹, a = Uᵀx, b = U⁻¹x, x = h_l[t]

Everything is batched: one forward pass per batch of right-padded samples gives all hidden states;
the last block is re-applied to the hidden states of several layers at once (stacked on the batch
axis), computing only what its output at the current tokens needs for GPT-2 and LLaMA-family blocks
(keys and values everywhere, or for GPT-2 not even those, the rest at the current tokens); the Gram condition runs on (sample,
layer) pairs at once in float64.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lmscope.analyses import norms_plots
from lmscope.analyses.base import JobContext, JobFailed, JobOutput, Series, overflow_advice, own_attention
from lmscope.analyses.linearised_layer import (apply as apply_linearised, block_matrices, linearisable,
                                               parallel_residual, rotate, stretch_ratio)
from lmscope.modeling.loading import max_positions
from lmscope.modeling.memory import to_device
from lmscope.modeling.windows import document_samples
from lmscope.params.norms import NormsParams

# Memory budgets that bound the size of one chunk of work, whatever the model size.
LAST_BLOCK_ELEMENTS = 64_000_000  # hidden-state elements fed to one call of the last block
LOGIT_ELEMENTS = 64_000_000  # logits materialised at once for the inner loss
GRAM_CONTEXT_BYTES = 256 * 2**20  # the Gram condition's [pairs, T, D] contexts (gathered + float64 copy), per chunk
GRAM_WEIGHT_BYTES = 2**30  # float64 copies of every linearised block's weights kept for the job, when they fit
TRAJECTORY_LINES = 30  # thin lines drawn in norms.png


# ---------------------------------------------------------------- the model's parts

@dataclass
class ModelParts:
    base: torch.nn.Module  # the transformer without the LM head (GPT2Model, LlamaModel, …)
    blocks: torch.nn.ModuleList
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    # what the model does to the LM head's logits: Granite divides them by logits_scaling, Cohere
    # multiplies them by logit_scale, Gemma 2/3 soft-cap them (cap · tanh(logits / cap))
    logit_scale: float = 1.0
    logit_softcap: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def float32_head(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]:
        """(final norm, LM-head weight, bias) in float32: the inner loss makes its logits in float32
        whatever the model's dtype (in bf16/fp16 the cross-entropy would be off by ~1e-2 nats). Made
        once per job: a half-precision model's head is copied (1 GB for a 128k × 2048 vocabulary)."""
        bias = getattr(self.lm_head, "bias", None)
        return (copy.deepcopy(self.final_norm).float(),  # D parameters: cheap to copy
                self.lm_head.weight.float(), None if bias is None else bias.float())

    def logits(self, h: torch.Tensor, head: tuple) -> torch.Tensor:
        """The model's own logits from the last block's output h: lm_head(final_norm(h)), then what the
        model does to them; ``head`` is :meth:`float32_head`."""
        norm, weight, bias = head
        logits = F.linear(norm(h), weight, bias)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def model_parts(model) -> ModelParts:
    """Blocks, final norm and LM head of a HF causal LM, whatever the architecture calls them."""
    base = model.base_model
    blocks = next((getattr(base, n) for n in ("h", "layers", "blocks") if hasattr(base, n)), None)
    final_norm = next((getattr(base, n) for n in ("ln_f", "norm", "final_layer_norm", "final_layernorm")
                       if hasattr(base, n)), None)
    lm_head = model.get_output_embeddings()
    if blocks is None or final_norm is None or lm_head is None:
        raise JobFailed(f"cannot find the blocks / final norm / LM head of a {type(model).__name__}; "
                        "the norms analysis supports the architectures lmscope.catalog.SUPPORTED_ARCHITECTURES lists")
    # Read only where the architecture uses them: a stray key in another model's config.json changes nothing.
    cfg, family = model.config, str(getattr(model.config, "model_type", ""))
    scale = 1.0
    if family.startswith("granite"):
        scale /= float(getattr(cfg, "logits_scaling", None) or 1.0)
    own_scale = getattr(model, "logit_scale", None)  # Cohere keeps config.logit_scale on the model
    if family.startswith("cohere") and isinstance(own_scale, (int, float)) and not isinstance(own_scale, bool):
        scale *= float(own_scale)
    cap = getattr(cfg, "final_logit_softcapping", None) if family.startswith("gemma") else None  # Gemma 2, 3
    return ModelParts(base, blocks, final_norm, lm_head, scale, float(cap) if cap else None)


@torch.no_grad()
def check_logits_reproduced(model, parts: ModelParts, input_ids: torch.Tensor) -> None:
    """The inner loss rebuilds the model's logits from a block output: check on one short input that
    this gives the model's own (an architecture that transforms its logits in a way ModelParts does
    not know would otherwise get a silently wrong inner loss)."""
    ids = input_ids[None, :16]
    mask = torch.ones_like(ids)
    dtype = next(model.parameters()).dtype
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0].float()
    _, call = hidden_states(parts, ids, mask)
    got = parts.logits(call.output[0].float(), parts.float32_head)
    want = torch.log_softmax(logits, -1)
    got = torch.log_softmax(got.to(want.device), -1)
    # the tokens that carry the loss (the model's 16 likeliest per position): far in the tail, half
    # precision rounding of large logits moves log-probabilities by more than a wrong transform would
    # move these; positions that overflowed (fp16) are the inner loss's own business (inner_loss_nonfinite)
    top = want.topk(min(16, want.shape[-1]), dim=-1).indices
    diff = (got.gather(-1, top) - want.gather(-1, top)).abs()
    # Half precision rounds the model's own logits by up to eps·|logit| (bfloat16: 0.8 at a logit of 100),
    # and its final norm's output as much again, relative: allowed per position, on top of a fixed 0.5.
    allowed = (torch.full_like(diff, 1e-3) if dtype == torch.float32 else
               0.5 + 4 * torch.finfo(dtype).eps * logits.nan_to_num(0.0, 0.0, 0.0).abs().amax(-1, keepdim=True))
    allowed = allowed.expand_as(diff)
    finite = torch.isfinite(diff)
    if not finite.any():
        return
    excess = (diff - allowed)[finite]
    worst = int(excess.argmax())
    if not excess[worst] <= 0:  # (a NaN refuses too)
        error, tolerance = diff[finite][worst].item(), allowed[finite][worst].item()
        raise JobFailed(f"the inner loss rebuilds {type(model).__name__}'s logits from its last block's output, but "
                        f"they differ from the model's own by {error:.3g} nats (more than "
                        f"{str(dtype).removeprefix('torch.')} rounding explains: {tolerance:.3g}); it changes its "
                        "logits in a way lmscope does not know; set inner_loss=false to measure the norms alone")


# ---------------------------------------------------------------- samples

@dataclass
class Samples:
    tokens: list[list[int]]  # first max_tokens + 1 tokens of each sample
    doc_ids: np.ndarray  # [N] index of each sample's document in the dataset
    traj_sample: np.ndarray  # [S] which sample each trajectory belongs to (trajectories grouped by sample)
    traj_pos: np.ndarray  # [S] position of its current token (its label is the token at pos + 1)
    offsets: np.ndarray  # [N + 1] sample s owns trajectories offsets[s] … offsets[s+1]-1
    too_short: int = 0  # documents with enough words but too few tokens, skipped before max_samples was reached


def select_samples(tokenizer, documents: list[str], params: NormsParams, max_tokens: int | None = None) -> Samples:
    """Documents → samples → trajectories (one per current token), as the definitions say.
    `max_tokens` overrides params.max_tokens (a model that reads fewer positions)."""
    max_tokens = params.max_tokens if max_tokens is None else max_tokens
    min_tokens = 2 if params.position == "last" else params.min_position + 2  # current token + its label
    eligible = [i for i, d in enumerate(documents) if len(d.split()) >= params.min_words]
    tokens, doc_ids, too_short = [], [], 0
    chunk = max(256, params.max_samples)
    for start in range(0, len(eligible), chunk):
        ids = eligible[start:start + chunk]
        # min_words=0: `eligible` already applied the filter, so `encoded` lines up with `ids`
        encoded = document_samples(tokenizer, [documents[i] for i in ids], min_words=0,
                                   max_tokens=max_tokens, max_samples=None)
        for doc_id, toks in zip(ids, encoded):
            if len(tokens) >= params.max_samples:
                break
            if len(toks) >= min_tokens:
                tokens.append(toks)
                doc_ids.append(doc_id)
            else:
                too_short += 1
        if len(tokens) >= params.max_samples:
            break
    tokens, doc_ids = tokens[: params.max_samples], doc_ids[: params.max_samples]
    if not tokens:
        raise JobFailed(f"no document of the dataset has at least min_words={params.min_words} words / "
                        f"{min_tokens} tokens (of {len(documents)} documents, {len(eligible)} have enough words); "
                        "lower min_words" + (" or min_position" if params.position == "all" else "")
                        + " or pick a larger dataset")
    last = np.array([len(t) - 2 for t in tokens])  # the model reads toks[:-1]; its last token is the current one
    first = last if params.position == "last" else np.full_like(last, params.min_position)
    counts = last - first + 1
    traj_sample = np.repeat(np.arange(len(tokens)), counts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    traj_pos = np.arange(offsets[-1]) - offsets[traj_sample] + first[traj_sample]
    return Samples(tokens, np.asarray(doc_ids), traj_sample, traj_pos, offsets, too_short)


def batches(samples: Samples, batch_size: int, subset: np.ndarray | None = None):
    """Yield (sample ids, trajectory ids) per batch; longest samples first so padding stays small.
    With `subset` (sorted trajectory ids) only those trajectories and their samples."""
    ids = np.arange(len(samples.tokens)) if subset is None else np.unique(samples.traj_sample[subset])
    ids = sorted(ids, key=lambda s: -len(samples.tokens[s]))
    for start in range(0, len(ids), batch_size):
        batch = np.asarray(ids[start:start + batch_size])
        trajs = np.concatenate([np.arange(samples.offsets[s], samples.offsets[s + 1]) for s in batch])
        if subset is not None:
            trajs = trajs[np.isin(trajs, subset)]
        yield batch, np.sort(trajs)


def current_tokens(samples: Samples, batch: np.ndarray, trajs: np.ndarray, device):
    """(row in the batch, position) of each trajectory's current token, as index tensors."""
    by_id = np.argsort(batch)  # the batch's rows in sample-id order
    rows = by_id[np.searchsorted(batch, samples.traj_sample[trajs], sorter=by_id)]
    return to_device(torch.from_numpy(rows), device), to_device(torch.from_numpy(samples.traj_pos[trajs]), device)


def pad_batch(samples: Samples, batch: np.ndarray, pad_id: int, device):
    """Right-padded inputs (every token but each sample's last) and the attention mask."""
    inputs = [samples.tokens[s][:-1] for s in batch]
    width = max(len(x) for x in inputs)
    input_ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for row, x in enumerate(inputs):
        input_ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(x)] = 1
    return to_device(input_ids, device), to_device(mask, device)


# ---------------------------------------------------------------- forward pass

@dataclass
class BlockCall:
    """How the model called its last block: re-used to apply that block to other layers' states."""

    args: tuple
    kwargs: dict
    output: torch.Tensor  # h_L before the final norm [B, T, D]


@torch.no_grad()
def hidden_states(parts: ModelParts, input_ids, attention_mask) -> tuple[list[torch.Tensor], BlockCall]:
    """h_0 … h_{L-1} (transformers' hidden_states[:L]) and the last block's call (its output is h_L)."""
    call = {}

    def grab(module, args, kwargs, output):
        call["call"] = BlockCall(args, kwargs, output[0] if isinstance(output, tuple) else output)

    handle = parts.blocks[-1].register_forward_hook(grab, with_kwargs=True)
    try:
        out = parts.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                         use_cache=False)
    finally:
        handle.remove()
    L = parts.num_layers
    # hidden_states[L] is after the final norm in transformers (GPT-2 ln_f, LLaMA norm): never used.
    assert len(out.hidden_states) == L + 1, "expected embeddings + one hidden state per block"
    return list(out.hidden_states[:L]), call["call"]


def _tile(obj, batch: int, times: int, name: str | None = None):
    """Repeat every per-sample tensor (first dim = batch) `times` along the batch axis (layer-major).

    A 1-D tensor is per position, not per sample (``cache_position`` is [T], and T may equal the batch).
    BLOOM's ``alibi`` is per sample and head, flattened batch-major to [batch·heads, 1, T]: it is
    repeated as [batch, heads, …] so that row (l·batch + b)·heads + h stays sample b's head h.
    """
    if isinstance(obj, torch.Tensor) and obj.dim() > 1:
        if name == "alibi" and obj.shape[0] % batch == 0:
            per_sample = obj.reshape(batch, -1, *obj.shape[1:])
            return per_sample.repeat(times, *[1] * (per_sample.dim() - 1)).flatten(0, 1)
        if obj.shape[0] == batch:
            return obj.repeat(times, *[1] * (obj.dim() - 1))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tile(o, batch, times) for o in obj)
    if isinstance(obj, dict):
        return {k: _tile(v, batch, times, k) for k, v in obj.items()}
    return obj


@torch.no_grad()
def token_losses(parts: ModelParts, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE(lm_head(final_norm(h)), label) per row of h [N, D]; logits made in chunks to bound memory.

    The LM head runs in float32 whatever the model's dtype: in bf16/fp16 the cross-entropy would be off
    by ~1e-2 nats, enough to move trajectories across `loss_filter`.
    """
    head = parts.float32_head
    rows = max(1, LOGIT_ELEMENTS // head[1].shape[0])  # the vocabulary
    out = []
    for start in range(0, h.shape[0], rows):
        logits = parts.logits(h[start:start + rows].float(), head)
        out.append(F.cross_entropy(logits, labels[start:start + rows], reduction="none"))
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


# ---------------------------------------------------------------- the last block at the current tokens only
#
# Eq. 14 reads the last block's output at the current token t only. In a causal block every part but
# attention acts on each position on its own (norms, projections, MLP), and attention mixes positions
# only through the keys and values of the positions it may see (i ≤ t, not padding). So
#
#     block(h)[t] = u + MLP(norm_2(u)),   u = h[t] + W_O softmax(q_t Kᵀ·scale + mask_t) V
#     q_t = W_Q norm_1(h[t]),   K = W_K norm_1(h),   V = W_V norm_1(h)     (+ RoPE on q_t and K for LLaMA)
#
# is exactly the block applied to all positions of h, read at t. It costs K and V at every position
# (2·D² multiply-adds per token for GPT-2, less with grouped-query attention) and the rest of the
# block at the current tokens only, instead of the whole block (~12·D² per token) at every position.
# GPT-2 with few current tokens per row skips even K and V (attend_without_keys); RoPE rotates each
# key by its own position, so the LLaMA family forms them.

LLAMA_LIKE_BLOCKS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                     "GemmaDecoderLayer"}  # pre-norm, q/k/v/o_proj with RoPE (+ GQA), gated MLP: same maths


def at(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [N, T, …] read at positions [N, Q] → [N, Q, …]."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], positions]


def attend(q, k, v, visible, scale) -> torch.Tensor:
    """Softmax attention of queries q [N, Q, H, d] over keys/values k, v [N, T, H_kv, d] (H_kv divides H:
    grouped-query attention) where visible [N, 1, Q, T] allows it → [N, Q, H·d]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return a.transpose(1, 2).flatten(2)


def attend_without_keys(q, z, w_k, w_v, b_v, visible, scale) -> torch.Tensor:
    """attend(q, z w_k + b_k, z w_v + b_v, visible, scale) without forming the keys and values [N, T, H, d]
    of every position: q [N, Q, H, d], z [N, T, D], w_k and w_v [D, H·d] (y = z @ w), b_v [H·d]. Per head,

        q·k_j = (w_k q)·z_j + q·b_k       the last term is the same for every key j: softmax drops it
        Σ_j p_j v_j = (Σ_j p_j z_j) w_v + b_v       the weights p_j sum to 1

    so each query costs 2·H·T·D multiply-adds instead of the 2·T·D² that K and V cost: far less while
    Q·H < D (one current token per row, the usual case). Half-precision inputs are computed in float32,
    as SDPA does: w_k q and the scores of a model that runs fine in float16 may pass 65504."""
    H, d, orig_dtype = q.shape[2], q.shape[3], z.dtype
    wide = torch.promote_types(z.dtype, torch.float32)
    q, z, w_k, w_v, b_v = (t.to(wide) for t in (q, z, w_k, w_v, b_v))
    r = torch.einsum("nqhe,dhe->nqhd", q, w_k.unflatten(1, (H, d)))  # w_k q per head, in z's space [N, Q, H, D]
    scores = (torch.einsum("nqhd,ntd->nhqt", r, z) * scale).masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [N, H, Q, T]
    mixed = torch.einsum("nhqt,ntd->nqhd", p, z)  # Σ_j p_j z_j per head
    out = torch.einsum("nqhd,dhe->nqhe", mixed, w_v.unflatten(1, (H, d))) + b_v.view(H, d)
    return out.flatten(2).to(orig_dtype)


def gpt2_block_at(block, x, positions, visible, rope=None) -> torch.Tensor:
    """GPT2Block(x) at positions [N, Q] of x [N, T, D], computing queries and the MLP there only (and,
    with few queries per row, no keys or values either: attend_without_keys)."""
    attn, D = block.attn, x.shape[-1]
    H, d = attn.num_heads, attn.head_dim
    W, b = attn.c_attn.weight, attn.c_attn.bias  # Conv1D: y = z @ W + b, output columns q | k | v
    z = block.ln_1(x)
    q = (at(z, positions) @ W[:, :D] + b[:D]).unflatten(-1, (H, d))  # current tokens
    if positions.shape[1] * H < D:
        a = attend_without_keys(q, z, W[:, D:2 * D], W[:, 2 * D:], b[2 * D:], visible, attn.scaling)
    else:
        k, v = (z @ W[:, D:] + b[D:]).unflatten(-1, (2, H, d)).unbind(2)  # all positions
        a = attend(q, k, v, visible, attn.scaling)
    u = at(x, positions) + attn.c_proj(a)
    return u + block.mlp(block.ln_2(u))


def llama_block_at(block, x, positions, visible, rope) -> torch.Tensor:
    """LlamaDecoderLayer(x) (and Mistral, Qwen2/3, Gemma) at positions [N, Q] of x [N, T, D];
    rope = the model's (cos, sin) [N, T, d] for every position."""
    attn, d = block.self_attn, block.self_attn.head_dim
    cos, sin = rope
    z = block.input_layernorm(x)
    q = attn.q_proj(at(z, positions)).unflatten(-1, (-1, d))  # current tokens  [N, Q, H, d]
    k = attn.k_proj(z).unflatten(-1, (-1, d))  # all positions  [N, T, H_kv, d]
    v = attn.v_proj(z).unflatten(-1, (-1, d))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of each head's query and key before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q, at(cos, positions), at(sin, positions)), rotate(k, cos, sin)
    u = at(x, positions) + attn.o_proj(attend(q, k, v, visible, attn.scaling))
    return u + block.mlp(block.post_attention_layernorm(u))


def current_token_block(block, call: BlockCall):
    """(block_at, rope, sliding window) for the blocks written out above, or None: then the generic path
    re-runs the whole block on all positions."""
    name = type(block).__name__
    if name == "GPT2Block":
        return gpt2_block_at, None, None
    rope = call.kwargs.get("position_embeddings")
    if name in LLAMA_LIKE_BLOCKS and rope is not None and getattr(block.self_attn, "is_causal", True):
        attn = block.self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/3: per layer (None on full-attention layers)
            window = attn.sliding_window
        else:  # Mistral: one window for every layer (None: none); LLaMA, Gemma: none
            window = getattr(attn.config, "sliding_window", None)
        return llama_block_at, rope, window
    return None


def query_grid(rows: torch.Tensor, cols: torch.Tensor, attention_mask: torch.Tensor):
    """The current tokens (rows, cols) laid out per batch row: positions [B, Q], Q = most current tokens
    in one row, and each current token's slot in its row (both on the mask's device). Free slots point
    at the row's first real token: any visible position will do, their outputs are never read.

    The layout is worked out on the host, in numpy (Q sizes a tensor: reading it from a GPU would wait
    for all queued work), so rows and cols are best given there."""
    B, T = attention_mask.shape
    r, c = rows.cpu().numpy(), cols.cpu().numpy()
    counts = np.bincount(r, minlength=B)
    order = np.argsort(r * T + c, kind="stable")
    slot = np.empty_like(r)
    slot[order] = np.arange(len(r)) - (np.cumsum(counts) - counts)[r[order]]
    r, c, slot = (to_device(torch.from_numpy(a), attention_mask.device) for a in (r, c, slot))
    positions = attention_mask.long().argmax(1)[:, None].repeat(1, int(counts.max()))
    positions[r, slot] = c
    return positions, slot


def keys_visible_from(positions: torch.Tensor, attention_mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Q, T] bool: from query position t, key i is visible when i ≤ t (causal), i is a real token
    (not padding) and, with a sliding window, t − i < window (transformers' sliding_window_overlay)."""
    keys = torch.arange(attention_mask.shape[1], device=positions.device)
    t = positions[..., None]  # [B, Q, 1]
    visible = (keys <= t) & attention_mask.bool()[:, None, :]
    if window is not None:
        visible &= t - keys < window
    return visible[:, None]


@torch.no_grad()
def last_block_outputs(parts: ModelParts, hidden: list[torch.Tensor], call: BlockCall, attention_mask: torch.Tensor,
                       rows: torch.Tensor, cols: torch.Tensor, route: str = "auto") -> torch.Tensor:
    """block_L(h_l) at the current tokens (rows, cols: best on the host, see query_grid), for l = 0 …
    L-1 → [L, n, D]: the last block applied to ALL positions of h_l with the same masks and position
    embeddings as in the model's own pass. Several layers go through the block at once (stacked on the
    batch axis); l = L-1 is the model's own pass (block_L(h_{L-1}) = h_L), so it is not run again.

    route "auto": computed at the current tokens only (see above) for GPT-2 and LLaMA-family blocks,
    else by re-running the whole block; "full": always re-run the whole block."""
    B, T, D = hidden[0].shape
    L = len(hidden)
    block = parts.blocks[-1]
    cheap = current_token_block(block, call) if route == "auto" else None
    if cheap is not None:
        block_at, rope, window = cheap
        positions, slot = query_grid(rows, cols, attention_mask)
        visible = keys_visible_from(positions, attention_mask, window)
    rows, cols = (to_device(t, call.output.device) for t in (rows, cols))
    per_call = max(1, min(L, LAST_BLOCK_ELEMENTS // (B * T * D)))
    outputs = []  # [c, n, D] per chunk of c layers
    for first in range(0, L - 1, per_call):
        c = min(L - 1, first + per_call) - first
        x = torch.cat(hidden[first:first + c])  # [c·B, T, D], layer-major
        if cheap is not None:
            rope_c = None if rope is None else tuple(r.expand(B, T, -1).repeat(c, 1, 1) for r in rope)
            y = block_at(block, x, positions.repeat(c, 1), visible.repeat(c, 1, 1, 1), rope_c)  # [c·B, Q, D]
            outputs.append(y.view(c, B, -1, D)[:, rows.to(y.device), slot.to(y.device)])
        else:
            y = block(x, *_tile(call.args[1:], B, c), **_tile(call.kwargs, B, c))
            y = (y[0] if isinstance(y, tuple) else y).view(c, B, T, D)
            outputs.append(y[:, rows, cols])  # only the current tokens need the LM head
    outputs.append(call.output[rows, cols][None])
    return torch.cat(outputs)


@torch.no_grad()
def inner_losses(parts: ModelParts, hidden: list[torch.Tensor], call: BlockCall, attention_mask: torch.Tensor,
                 rows: torch.Tensor, cols: torch.Tensor, labels: torch.Tensor, route: str = "auto") -> torch.Tensor:
    """Eq. 14 for l = 0 … L-1 → [n, L]: CE(lm_head(final_norm(block_L(h_l)))[t], label) at the
    current tokens t = (rows, cols)."""
    current = last_block_outputs(parts, hidden, call, attention_mask, rows, cols, route)  # [L, n, D]
    L, _, D = current.shape
    return token_losses(parts, current.reshape(-1, D), labels.repeat(L)).view(L, -1).T  # [n, L]


# ---------------------------------------------------------------- PCA

class RunningPCA:
    """Mean and covariance of all trajectory points, accumulated batch by batch in float64."""

    def __init__(self, dim: int, device):
        self.n = torch.zeros((), dtype=torch.float64, device=device)  # a tensor: counting needs no host sync
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def add(self, points: torch.Tensor, keep: torch.Tensor | None = None) -> None:  # [N, D], [N] bool
        """Only the points `keep` marks (all by default), less any with an inf or NaN coordinate."""
        p = points.to(torch.float64, copy=True)  # (zeroed in place below: never the caller's tensor)
        finite = torch.isfinite(p).all(-1, keepdim=True)
        if keep is not None:
            finite &= keep[:, None]
        p.masked_fill_(~finite, 0.0)
        self.n += finite.sum()
        self.sum += p.sum(0)
        self.outer += p.T @ p

    def fit(self, k: int = 3):
        """(mean [D], components [k, D], explained variance ratio [k])."""
        mean = self.sum / self.n
        cov = (self.outer - self.n * torch.outer(mean, mean)) / (self.n - 1).clamp_min(1)
        var, vecs = torch.linalg.eigh(cov)  # ascending
        k = min(k, var.numel())
        top = torch.flip(torch.arange(var.numel(), device=var.device), [0])[:k]
        ratio = var[top] / var.sum().clamp_min(1e-300)
        return mean, vecs[:, top].T, ratio


# ---------------------------------------------------------------- statistics

def monotone_percentages(norms: np.ndarray) -> tuple[float, float]:
    """(sequence %, pair %) of non-decreasing steps in trajectories [S, L']."""
    steps = np.diff(norms, axis=1) >= 0
    if steps.size == 0:
        return float("nan"), float("nan")
    # 100 * count / total, dividing last: 46.4, not 100 * 0.464 = 46.400000000000006
    return 100.0 * int(steps.all(axis=1).sum()) / len(steps), 100.0 * int(steps.sum()) / steps.size


def _choose(n: int, k: int, seed: int, salt: int) -> np.ndarray:
    """k of n indices at random (sorted), reproducible from the job's seed."""
    rng = np.random.default_rng([seed, salt])
    return np.sort(rng.choice(n, size=min(k, n), replace=False)) if k > 0 and n > 0 else np.zeros(0, int)


@contextlib.contextmanager
def kernel_attention(model, ctx: JobContext):
    """Run the model's attention through lmscope's Triton kernel where it runs (CUDA), or wherever
    LMSCOPE_KERNEL_BACKEND asks for it; the model's own attention implementation is restored
    afterwards (models are cached and shared between jobs). On CPU PyTorch's SDPA is kept: the
    kernel's reference path is ~4× slower there and gives the same numbers. Norms need no entropies,
    so a model the kernel cannot run (Falcon, Bloom, GPT-Neo, attention sinks) keeps its own attention."""
    from lmscope.kernels.attention_entropy import head_dim_refusal
    from lmscope.kernels.dispatch import forced_backend, kernel_backend
    from lmscope.kernels.hf import lmscope_attention, lmscope_attention_unsupported
    from lmscope.modeling.loading import config_head_dim

    backend = kernel_backend(next(model.parameters()).device)
    own = own_attention(model)
    if backend != "triton" and forced_backend() is None:
        ctx.record("kernel_backend", own)
        yield
        return
    reason = ((head_dim_refusal(config_head_dim(model.config) or 0) if backend == "triton" else None)
              or lmscope_attention_unsupported(model))
    if reason is not None:
        ctx.record("kernel_backend", f"{own} (the lmscope kernel cannot run this model: {reason})")
        yield
        return
    with lmscope_attention(model):
        ctx.record("kernel_backend", backend)
        yield


# ---------------------------------------------------------------- the job

@dataclass
class Measurements:
    norms: np.ndarray  # [S, L'] ‖h_l[t]‖ per trajectory, float64 (inf or NaN where the model overflowed)
    losses: np.ndarray  # [S, L] inner loss per layer (NaN when not computed)
    pca_points: np.ndarray  # [pca_samples, L', D] the drawn trajectories' hidden states
    pca: RunningPCA  # moments of all trajectory points


class Progress:
    """One count over the whole job (forward batches, PCA, Gram batches, plots), so it never goes back."""

    def __init__(self, ctx: JobContext, total: int):
        self.ctx, self.done, self.total = ctx, 0, total

    def step(self, stage: str, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self.ctx.progress(self.done, self.total, stage)


def measure(params: NormsParams, ctx: JobContext, parts: ModelParts, samples: Samples, pad_id: int, device,
            points: int, pca_trajs: np.ndarray, progress: Progress, inner_loss_route: str = "auto") -> Measurements:
    """One batched forward pass per batch: norms, PCA moments and (optionally) the inner loss.

    Nothing in the loop waits for a GPU: indices are made on the host and copied over asynchronously,
    results stay on the device until the end. (Each wait would leave the GPU idle while the host
    queues the next batch's kernels.) So on a GPU the stages' times are the host's, and the wait for
    all queued work is timed as "forward", where the results are read back."""
    S, D, L = len(samples.traj_sample), parts.lm_head.weight.shape[1], parts.num_layers
    norms = torch.zeros(S, points, dtype=torch.float64, device=device)
    losses = torch.full((S, L), float("nan"), device=device) if params.inner_loss else None
    pca_points = torch.zeros(len(pca_trajs), points, D, device=device)
    pca = RunningPCA(D, device)
    for batch, trajs in batches(samples, params.batch_size):
        rows, cols = current_tokens(samples, batch, trajs, "cpu")  # the inner loss lays them out on the host
        rows_d, cols_d, at_trajs = (to_device(t, device) for t in (rows, cols, torch.from_numpy(trajs)))
        with ctx.stage("forward"):
            input_ids, mask = pad_batch(samples, batch, pad_id, device)
            hidden, call = hidden_states(parts, input_ids, mask)
            states = hidden + [call.output] if params.include_last_layer else hidden
            # a model spread over several GPUs keeps each layer's states on its own one
            current = torch.stack([h[rows_d.to(h.device), cols_d.to(h.device)].to(device) for h in states], 1).float()
            # in float64: one large coordinate's square leaves float32 no digits for the others, and the
            # layers' norms would tie where they differ
            batch_norms = torch.linalg.vector_norm(current, dim=-1, dtype=torch.float64)  # [n, L']
            norms[at_trajs] = batch_norms
            # a trajectory that overflowed somewhere is left out whole, its finite points too (no host sync)
            pca.add(current.reshape(-1, D), torch.isfinite(batch_norms).all(1).repeat_interleave(points))
            drawn = np.flatnonzero(np.isin(trajs, pca_trajs))
            if len(drawn):
                slots = np.searchsorted(pca_trajs, trajs[drawn])
                pca_points[to_device(torch.from_numpy(slots), device)] = current[to_device(torch.from_numpy(drawn), device)]
        if params.inner_loss:
            with ctx.stage("inner loss"):
                targets = torch.tensor([samples.tokens[s][p + 1] for s, p in
                                        zip(samples.traj_sample[trajs], samples.traj_pos[trajs])])
                losses[at_trajs] = inner_losses(parts, hidden, call, mask, rows, cols, to_device(targets, device),
                                                inner_loss_route).to(losses.device)
            progress.step("forward + inner loss")
        else:
            progress.step("forward")
    with ctx.stage("forward"):
        return Measurements(norms.cpu().numpy(),
                            losses.cpu().numpy() if losses is not None else np.full((S, L), np.nan, np.float32),
                            pca_points.cpu().numpy(), pca)


def finite_trajectories(params: NormsParams, norms: np.ndarray) -> np.ndarray:
    """[S] bool: the trajectories whose every norm is finite. Those that are not (the model's activations
    overflowed the dtype: float16 stops at 65504) are left out of every statistic, and counted; none at
    all is a failure that says what to change."""
    finite = np.isfinite(norms).all(1)
    if len(finite) and not finite.any():
        raise JobFailed(f"every trajectory's hidden states reach inf or NaN in {params.dtype} ({params.model}'s "
                        f"activations overflow); {overflow_advice(params.dtype)}")
    return finite


def summarise(params: NormsParams, m: Measurements, samples: Samples, layers: int) -> tuple[dict, list[Series], np.ndarray]:
    """Headline numbers, per-layer curves and which trajectories the loss filter keeps."""
    S, points = m.norms.shape
    usable = finite_trajectories(params, m.norms)
    norms = m.norms[usable]
    sequence_pct, pair_pct = monotone_percentages(norms)
    summary = {
        "samples": len(samples.tokens), "documents_too_short": samples.too_short, "trajectories": S, "layers": layers, "trajectory_points": points,
        "position": params.position, "sequence_pct": sequence_pct, "pair_pct": pair_pct,
        "null_sequence_pct": 100.0 * 2.0 ** -(points - 1), "nonfinite_trajectories": int((~usable).sum()),
    }
    if not usable.all():
        summary["nonfinite_note"] = (f"{summary['nonfinite_trajectories']} of {S} trajectories reach inf or NaN "
                                     f"norms in {params.dtype} ({params.model}'s activations overflow): they are "
                                     "left out of every statistic and plot; " + overflow_advice(params.dtype))
    x = list(range(points))
    series = [Series(f"norm.{name}", x, fn(norms, axis=0).tolist(), {"unit": "L2 norm"})
              for name, fn in (("mean", np.mean), ("std", np.std), ("median", np.median))]
    series += [Series(f"norm.q{q}", x, np.quantile(norms, q / 100, axis=0).tolist(), {"unit": "L2 norm"})
               for q in (10, 90)]
    kept = np.zeros(S, bool)
    if not params.inner_loss:
        summary["inner_loss_kept"] = None
        return summary, series, kept
    final = m.losses[:, -1]
    # One overflowed fp16 loss must not make the headline or the series NaN: a trajectory with a
    # non-finite loss at any layer is never kept (counted in inner_loss_nonfinite), even when
    # loss_filter is null.
    finite = np.isfinite(m.losses).all(1) & usable  # (an overflowed trajectory's loss is no measurement either)
    kept = finite & (final <= params.loss_filter if params.loss_filter is not None else True)
    summary.update(inner_loss_kept=int(kept.sum()), inner_loss_total=S, loss_filter=params.loss_filter,
                   inner_loss_final_mean=float(final[finite].mean()) if finite.any() else None,
                   inner_loss_nonfinite=int((~finite).sum()))
    # No trajectory passes the filter (e.g. an untrained model, whose loss is about ln(vocab)): the
    # curves are still drawn, over every finite trajectory, and say so (as inner_loss.png does).
    use, over = (kept, "kept") if kept.any() else (finite, "all finite: none passed loss_filter")
    if use.any():
        about = {"kept": int(kept.sum()), "total": S, "loss_filter": params.loss_filter, "over": over,
                 "trajectories": int(use.sum())}
        series += [Series("inner_loss.mean", list(range(layers)), m.losses[use].mean(0).tolist(), about),
                   Series("inner_loss.std", list(range(layers)), m.losses[use].std(0).tolist(), about)]
        if not kept.any():
            summary["inner_loss_note"] = (f"no trajectory has a final inner loss ≤ loss_filter={params.loss_filter}; "
                                          "inner_loss.mean/std are over all finite trajectories")
    elif S:  # the last block attends over positions that overflowed: every row is NaN
        summary["inner_loss_note"] = (f"every trajectory's inner loss is inf or NaN in {params.dtype} (the model's "
                                      f"activations overflow): no inner_loss series or plot; {overflow_advice(params.dtype)}")
    return summary, series, kept


def run(params: NormsParams, ctx: JobContext, *, inner_loss_route: str = "auto") -> JobOutput:
    """The norms job. ``inner_loss_route="full"`` re-runs the whole last block for the inner loss instead of
    only its current rows (the benchmark's comparison; the results are the same)."""
    lm = ctx.load_model(params.model, dtype=params.dtype)
    model, tokenizer = lm.model, lm.tokenizer
    parts = model_parts(model)
    device = next(model.parameters()).device
    L = parts.num_layers
    points = L + 1 if params.include_last_layer else L  # h_0 … h_{L-1} (+ h_L before the final norm)
    if points < 2:
        raise JobFailed(f"{params.model} has {L} block(s): a trajectory needs two points; set include_last_layer=true")
    # A model that reads fewer positions than max_tokens reads as many as it can (said in the summary).
    max_pos = max_positions(model.config)
    max_tokens = min(params.max_tokens, max_pos) if max_pos else params.max_tokens
    if params.position == "all" and params.min_position >= max_tokens:
        raise JobFailed(f"min_position={params.min_position} is beyond the {max_tokens} positions {params.model} "
                        f"reads; set min_position < {max_tokens}")
    # Padded positions are masked out; id 0 is in every embedding table, while a tokenizer's own pad id
    # may be one added to it without growing the model's embeddings (an IndexError at the first padding).
    pad_id = 0

    samples = select_samples(tokenizer, ctx.load_documents(params.dataset), params, max_tokens)
    if params.inner_loss:
        check_logits_reproduced(model, parts, torch.tensor(samples.tokens[0], device=device))
    pca_trajs = _choose(len(samples.traj_sample), params.pca_samples, params.seed, 1)
    gram_chosen = gram_trajectories(params, parts, samples, lm.info)
    progress = Progress(ctx, math.ceil(len(samples.tokens) / params.batch_size) + 1
                        + math.ceil(len(np.unique(samples.traj_sample[gram_chosen])) / params.batch_size)
                        + PLOTS)
    with kernel_attention(model, ctx):
        m = measure(params, ctx, parts, samples, pad_id, device, points, pca_trajs, progress, inner_loss_route)
        usable = finite_trajectories(params, m.norms)  # nothing finite: fail now, not after the Gram condition
        with ctx.stage("pca"):
            mean, components, explained = m.pca.fit(3)
            coords = ((torch.from_numpy(m.pca_points).to(device, torch.float64) - mean) @ components.T).cpu().numpy()
            progress.step("pca")
        gram = gram_condition(params, ctx, parts, samples, pad_id, device, points, lm.info, gram_chosen, progress,
                              usable)

    summary, series, kept = summarise(params, m, samples, L)
    summary["max_tokens"] = max_tokens
    if max_tokens < params.max_tokens:
        summary["note"] = f"{params.model} reads at most {max_tokens} positions: max_tokens={params.max_tokens} was cut to that"
    summary.update(gram)
    summary["pca_explained_variance"] = explained.cpu().tolist()
    if not len(pca_trajs):  # an empty 3-D box would say nothing
        summary["plots_note"] = "no pca3d.png: pca_samples=0 draws no trajectory (pca.npz still holds the principal axes)"

    out = ctx.artifact_dir
    # not compressed: float norms barely shrink under zlib, which is slow on position="all" (millions of rows)
    np.savez(out / "trajectories.npz", norms=m.norms, sample_ids=samples.traj_sample,
             doc_ids=samples.doc_ids[samples.traj_sample], positions=samples.traj_pos,
             layers=np.arange(points), inner_loss=m.losses, inner_loss_kept=kept)
    np.savez_compressed(out / "pca.npz", mean=mean.cpu().numpy(), components=components.cpu().numpy(),
                        explained_variance_ratio=explained.cpu().numpy(), coords=coords,
                        trajectory_ids=pca_trajs, sample_ids=samples.traj_sample[pca_trajs])
    with ctx.stage("plots"):
        title = f"{params.model} on {params.dataset}"
        norms_plots.plot_norms(out / "norms.png", m.norms[usable],
                               _choose(int(usable.sum()), TRAJECTORY_LINES, params.seed, 2),
                               params.include_last_layer, title, summary["sequence_pct"], summary["pair_pct"])
        progress.step("plots")
        if params.inner_loss and summary["inner_loss_final_mean"] is not None:  # (else inner_loss_note says why)
            # an overflowed trajectory's finite losses are left out of the plot too, as out of the series
            losses = np.where(usable[:, None], m.losses, np.nan)
            norms_plots.plot_inner_loss(out / "inner_loss.png", losses, kept, params.loss_filter, title,
                                        vocab_size=parts.lm_head.weight.shape[0])
        progress.step("plots")
        if len(pca_trajs):
            norms_plots.plot_pca3d(out / "pca3d.png", coords[np.isfinite(coords).all((1, 2))],
                                   explained.cpu().numpy(), params.include_last_layer, title)
        progress.step("plots")
    return JobOutput(summary, series)


PLOTS = 3  # norms.png, inner_loss.png, pca3d.png (a step each, drawn or not)


def gram_not_applicable(params: NormsParams, parts: ModelParts, info: dict) -> str | None:
    """Why the Gram condition is not computed, or None when it is."""
    if not params.gram_condition:
        return "not requested (gram_condition=false)"
    gated = info.get("gated_ffn")
    if gated or not all(linearisable(b) for b in parts.blocks):
        why = ("a gated FFN (LLaMA family)" if gated else
               f"{type(parts.blocks[0]).__name__} blocks (linearised here: the blocks of GPT-2, GPTBigCode, BLOOM, "
               "StarCoder2, GPT-NeoX and Phi; GPT-J's rotates keys in interleaved pairs, Falcon's computes its own "
               "attention)")
        return (f"not applicable: Proposition 1's linearised layer needs blocks with a plain two-matrix FFN "
                f"(W2·W1) whose weights lmscope reads; {params.model} has {why}")
    if params.gram_samples == 0:
        return "gram_samples=0"
    if any(p.is_meta for b in parts.blocks for p in b.parameters()):
        return ("not computed: the model's weights are offloaded (device_map=auto put blocks on the CPU or disk "
                "for lack of GPU memory), which the float64 linearisation cannot read; set gram_condition=false "
                "or run it on a worker with more GPU memory")
    return None


def gram_trajectories(params: NormsParams, parts: ModelParts, samples: Samples, info: dict) -> np.ndarray:
    """The trajectories the Gram condition is checked on (none when it does not apply)."""
    if gram_not_applicable(params, parts, info):
        return np.zeros(0, np.int64)
    return _choose(len(samples.traj_sample), params.gram_samples, params.seed, 3)


class LinearisedBlocks:
    """``block_matrices`` of each block, read once and kept when all of them fit in GRAM_WEIGHT_BYTES
    (GPT-2 small: 0.7 GB), else read again for each batch, one block at a time: float64 copies of a large
    model's blocks (8 bytes per parameter: 120 GB for a 15B model) would not fit next to the model."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.keep = sum(8 * p.numel() for b in blocks for p in b.parameters()) <= GRAM_WEIGHT_BYTES
        self.kept: dict[int, object] = {}

    def get(self, layer: int, device):
        """Block ``layer``'s matrices on ``device`` (where its hidden states are: a model spread over GPUs
        keeps each block on its own)."""
        if layer in self.kept:
            return self.kept[layer]
        matrices = block_matrices(self.blocks[layer], device)
        if self.keep:
            self.kept[layer] = matrices
        return matrices


def gram_condition(params: NormsParams, ctx: JobContext, parts: ModelParts, samples: Samples, pad_id: int,
                   device, points: int, info: dict, chosen: np.ndarray, progress: Progress,
                   usable: np.ndarray | None = None) -> dict:
    """% of (trajectory, layer) pairs meeting Proposition 1's condition (lmscope.analyses.linearised_layer).

    Layer l pairs x = h_l[t] with block l + 1 (blocks numbered 1 … L: the map h_l → h_{l+1}), for
    the steps of the trajectory. The pairs of trajectories `usable` [S] leaves out (their norms overflowed
    somewhere) are not counted, as the pairs whose ratio is inf or NaN are not.
    """
    reason = gram_not_applicable(params, parts, info)
    if reason:
        return {"gram_condition_pct": None, "gram_condition_reason": reason}
    steps = points - 1  # blocks 1 … steps (parts.blocks[:steps])
    linear = LinearisedBlocks(list(parts.blocks)[:steps])
    first = linear.get(0, device)
    D, H, rotary = first.W_O.shape[0], first.heads, first.rotary
    del first  # not kept: one block's float64 copy at a time
    longest = max(len(tokens) for tokens in samples.tokens)
    # per pair: the gathered context and its float64 copy [T, D] (and the rotated keys and their rotation's
    # temporaries, at most three more of that size), and [H, D] float64 temporaries
    copies = 5 if rotary else 2
    per_chunk = max(1, GRAM_CONTEXT_BYTES // (copies * 8 * max(longest, H) * D))
    holds, ratio, pair_traj, pair_layer = [], [], [], []
    with ctx.stage("gram condition"):
        for batch, trajs in batches(samples, params.batch_size, subset=chosen):
            input_ids, mask = pad_batch(samples, batch, pad_id, device)
            hidden, call = hidden_states(parts, input_ids, mask)
            rope = call.kwargs.get("position_embeddings") if rotary else None
            if rotary and rope is None:
                raise JobFailed(f"{params.model}: its blocks were not given rotary position embeddings, which the "
                                "Gram condition's keys need; set gram_condition=false")
            rows, cols = current_tokens(samples, batch, trajs, device)
            B, T = input_ids.shape
            traj_ids = torch.as_tensor(trajs)
            # every (trajectory, layer) pair of this batch, layer by layer, in chunks of trajectories
            for layer in range(steps):
                h = hidden[layer]
                matrices = linear.get(layer, h.device)
                for start in range(0, len(trajs), per_chunk):
                    r, c = (t[start:start + per_chunk].to(h.device) for t in (rows, cols))
                    context = h[r]  # [P, T, D]: h_l of the pair's sample
                    visible = keys_visible_from(c[:, None], mask.to(h.device)[r], matrices.window)[:, 0, 0]  # [P, T]
                    x = h[r, c]  # the current token's h_l
                    pair_rope = None if rope is None else tuple(e.to(h.device).expand(B, T, -1)[r] for e in rope)
                    ok, ratio_ = stretch_ratio(apply_linearised(matrices, context, visible, x, pair_rope, c), x)
                    holds.append(ok.cpu())
                    ratio.append(ratio_.cpu())
                    pair_traj.append(traj_ids[start:start + per_chunk])
                    pair_layer.append(torch.full((len(ok),), layer))
                del matrices  # before the next block's are read
            progress.step("gram condition")
    # by (trajectory, layer): the batches' order depends on batch_size, and two jobs' files should line up
    traj_np, layer_np = torch.cat(pair_traj).numpy(), torch.cat(pair_layer).numpy()
    order = np.lexsort((layer_np, traj_np))
    holds_np, ratio_np = torch.cat(holds).numpy()[order], torch.cat(ratio).numpy()[order]
    np.savez_compressed(ctx.artifact_dir / "gram_condition.npz", trajectory_ids=traj_np[order],
                        layers=layer_np[order], holds=holds_np, ratio=ratio_np)
    # a pair whose states overflowed the dtype (inf or NaN) neither meets the condition nor fails it
    finite = np.isfinite(ratio_np) & (usable[traj_np[order]] if usable is not None else True)
    result = {"gram_condition_pct": 100.0 * float(holds_np[finite].mean()) if finite.any() else None,
              "gram_condition_pairs": int(finite.sum()), "gram_condition_nonfinite": int((~finite).sum()),
              "gram_condition_form": GRAM_FORMS[parallel_residual(parts.blocks[0])]}  # one form per model (config)
    if len(finite) and not finite.any():
        result["gram_condition_reason"] = (f"every pair's hidden states reach inf or NaN in {params.dtype} "
                                           f"(an overflow); {overflow_advice(params.dtype)}")
    return result


GRAM_FORMS = {False: "(I + W_FFN)(I + W_MHSA)", True: "I + W_MHSA + W_FFN (parallel residual)"}
