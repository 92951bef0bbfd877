"""The linearised transformer layer of Wu & Varshney's Proposition 1 (eq. 10), for the `norms` job's
Gram condition.

A block with a plain two-matrix FFN maps h_l to h_{l+1}. Dropping the softmax, the layer norms, the
biases, the activation and the 1/√d scale leaves a linear map of the current token x = h_l[t]:

    W_MHSA x = Σ_h W_O^h Σ_{i≤t} v_i^h (k_i^h · q^h),   q = W_Q x,  k_i = W_K z_i,  v_i = W_V z_i
    W x      = (I + W_FFN)(I + W_MHSA) x,                W_FFN = W2·W1 (applied as W2 (W1 y): no D × D product)

over the sample's own layer-l context z_i = h_l[i] (the keys query t sees: i ≤ t, and t − i < window
where the layer slides). That is Proposition 1's sequential block, x + MHSA then + FFN. A parallel-residual
block (GPT-NeoX/Pythia, Phi: x + MHSA(x) + FFN(x)) linearises the same way to

    W x      = (I + W_MHSA + W_FFN) x

which is not the paper's product; the job says which form it used. With grouped- or multi-query attention
head h reads key/value head h // (H / H_kv). With rotary positions (StarCoder2, GPT-NeoX, Phi) the query
and each key are rotated as the model rotates them, q = R_t W_Q x and k_i = R_i W_K z_i: still linear in
x (partial rotary, as GPT-NeoX's and Phi's, rotates the first dimensions of each head only). Additive
position terms (BLOOM's ALiBi) are left out like the biases: they do not depend on x.

Each architecture stores W_Q, W_K, W_V, W_O, W1, W2 its own way; ``block_matrices`` reads them into one
layout (column-vector matrices, y = W x, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockMatrices:
    """One block's matrices, y = W x, float64. Rows of W_Q for head h: h·d … (h+1)·d − 1; W_K, W_V
    hold H_kv heads alike; W_O's columns follow W_Q's rows."""

    W_Q: torch.Tensor  # [H·d, D]
    W_K: torch.Tensor  # [H_kv·d, D]
    W_V: torch.Tensor  # [H_kv·d, D]
    W_O: torch.Tensor  # [D, H·d]
    W1: torch.Tensor  # [I, D]: the FFN's first matrix
    W2: torch.Tensor  # [D, I]: its second; W_FFN = W2·W1
    heads: int
    kv_heads: int
    rotary: bool = False  # q and k rotated by the model's RoPE before their dot product
    window: int | None = None  # the layer's sliding window (query t sees keys t − window < i ≤ t)
    parallel: bool = False  # x + MHSA(x) + FFN(x): W = I + W_MHSA + W_FFN instead of the product

    def __post_init__(self):  # slices of transposed weights: contiguous, so that heads are views
        for name in ("W_Q", "W_K", "W_V", "W_O", "W1", "W2"):
            setattr(self, name, getattr(self, name).contiguous())


def linearisable(block) -> bool:
    """Whether ``block_matrices`` reads this block: the blocks with a plain two-matrix FFN of GPT-2 (Conv1D
    q/k/v), GPTBigCode (multi-query or not), BLOOM and StarCoder2 (sequential), GPT-NeoX (either) and Phi
    (parallel)."""
    name = type(block).__name__
    if name == "GPT2Block":
        return type(block.attn.c_attn).__name__ == "Conv1D"
    if name == "GPTBigCodeBlock":
        return not getattr(block.attn, "is_cross_attention", False)
    return name in ("BloomBlock", "Starcoder2DecoderLayer", "GPTNeoXLayer", "PhiDecoderLayer")


def parallel_residual(block) -> bool:
    """Whether the block adds attention and FFN to the same input (x + MHSA(x) + FFN(x))."""
    name = type(block).__name__
    return name == "PhiDecoderLayer" or (name == "GPTNeoXLayer" and bool(block.use_parallel_residual))


def _per_head_thirds(w: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused q/k/v weight [3·H·d, D] laid out per head as [H, 3, d] (BLOOM, GPTBigCode without
    multi-query) into W_Q, W_K, W_V [H·d, D]."""
    per = w.view(heads, 3, w.shape[0] // (3 * heads), w.shape[1])
    return tuple(per[:, j].reshape(-1, w.shape[1]) for j in range(3))


def block_matrices(block, device) -> BlockMatrices | None:
    """The block's matrices, or None for a block this module does not linearise."""

    def f64(weight):
        return weight.detach().to(device, torch.float64)

    if not linearisable(block):
        return None
    name = type(block).__name__
    if name == "GPT2Block":
        attn, mlp = block.attn, block.mlp
        D = attn.c_proj.weight.shape[0]
        qkv = f64(attn.c_attn.weight).T  # Conv1D: y = x @ weight, weight [in, out]; rows q | k | v
        return BlockMatrices(qkv[:D], qkv[D:2 * D], qkv[2 * D:], f64(attn.c_proj.weight).T,
                             f64(mlp.c_fc.weight).T, f64(mlp.c_proj.weight).T, attn.num_heads, attn.num_heads)
    if name == "GPTBigCodeBlock":
        attn, mlp = block.attn, block.mlp
        w, D, d = f64(attn.c_attn.weight), attn.embed_dim, attn.head_dim
        if attn.multi_query:  # outputs q [D] | k [d] | v [d]: one key/value head for all
            W_Q, W_K, W_V = w[:D], w[D:D + d], w[D + d:]
        else:
            W_Q, W_K, W_V = _per_head_thirds(w, attn.num_heads)
        return BlockMatrices(W_Q, W_K, W_V, f64(attn.c_proj.weight), f64(mlp.c_fc.weight), f64(mlp.c_proj.weight),
                             attn.num_heads, 1 if attn.multi_query else attn.num_heads)
    if name == "BloomBlock":
        attn, mlp = block.self_attention, block.mlp
        W_Q, W_K, W_V = _per_head_thirds(f64(attn.query_key_value.weight), attn.num_heads)
        return BlockMatrices(W_Q, W_K, W_V, f64(attn.dense.weight), f64(mlp.dense_h_to_4h.weight),
                             f64(mlp.dense_4h_to_h.weight), attn.num_heads, attn.num_heads)
    if name == "Starcoder2DecoderLayer":  # q/k/v/o_proj with grouped-query heads and RoPE, c_fc/c_proj
        attn, mlp = block.self_attn, block.mlp
        heads = attn.q_proj.weight.shape[0] // attn.head_dim
        kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        window = getattr(attn.config, "sliding_window", None)
        return BlockMatrices(f64(attn.q_proj.weight), f64(attn.k_proj.weight), f64(attn.v_proj.weight),
                             f64(attn.o_proj.weight), f64(mlp.c_fc.weight), f64(mlp.c_proj.weight),
                             heads, kv_heads, rotary=True, window=window)
    if name == "GPTNeoXLayer":  # fused q/k/v laid out per head as [H, 3, d], dense; partial RoPE
        attn, mlp = block.attention, block.mlp
        heads = attn.query_key_value.weight.shape[1] // attn.head_size
        W_Q, W_K, W_V = _per_head_thirds(f64(attn.query_key_value.weight), heads)
        return BlockMatrices(W_Q, W_K, W_V, f64(attn.dense.weight), f64(mlp.dense_h_to_4h.weight),
                             f64(mlp.dense_4h_to_h.weight), heads, heads, rotary=True,
                             parallel=parallel_residual(block))
    if name == "PhiDecoderLayer":  # q/k/v_proj (grouped-query), dense, fc1/fc2; partial RoPE; parallel
        attn, mlp = block.self_attn, block.mlp
        return BlockMatrices(f64(attn.q_proj.weight), f64(attn.k_proj.weight), f64(attn.v_proj.weight),
                             f64(attn.dense.weight), f64(mlp.fc1.weight), f64(mlp.fc2.weight),
                             attn.q_proj.weight.shape[0] // attn.head_dim,
                             attn.k_proj.weight.shape[0] // attn.head_dim, rotary=True, parallel=True)
    raise AssertionError(name)  # linearisable() said yes


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as LLaMA-family models apply it: x [N, T, H, d], cos/sin [N, T, r]; x·cos + (−x₂, x₁)·sin on
    the first r dimensions of each head (r < d: partial rotary, GPT-NeoX and Phi), the rest as they are.
    (The inner loss's LLaMA-family blocks use it too: lmscope.analyses.norms.)"""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, :, None] + torch.cat((-x2, x1), dim=-1) * sin[:, :, None]


def apply(m: BlockMatrices, context: torch.Tensor, visible: torch.Tensor, x: torch.Tensor,
          rope: tuple[torch.Tensor, torch.Tensor] | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """W x [P, D] for P pairs, without forming W: context [P, T, D] (z_i), visible [P, T] (which z_i
    query t sees: lmscope.analyses.norms.keys_visible_from), x [P, D]; with ``m.rotary``, rope = the model's (cos, sin) [P, T, d] and the query
    positions [P].

    Without rotation no key is formed: k_i^h · q^h = z_i · r^h with r^h = W_K^hᵀ q^h, and
    Σ_i v_i^h s_i^h = W_V^h (Σ_i s_i^h z_i): O(T·D·H + D·I) per pair (I: the FFN width). Rotated keys depend on their
    position, so they are formed ([P, T, H_kv·d])."""
    z = context.to(torch.float64)
    x = x.to(torch.float64)
    P, T, D = z.shape
    H, G = m.heads, m.kv_heads
    d = m.W_Q.shape[0] // H
    kv_of = torch.arange(H, device=z.device) // (H // G)  # key/value head of each query head
    q = (x @ m.W_Q.T).view(P, H, d)
    if m.rotary:
        cos, sin = (r.to(torch.float64) for r in rope)
        at_t = torch.arange(P, device=z.device), positions
        q = rotate(q[:, None], cos[at_t][:, None], sin[at_t][:, None])[:, 0]  # the query at its position t
        k = rotate((z @ m.W_K.T).view(P, T, G, d), cos, sin)
        # query heads grouped by the key head they read (h = g·H/G + j): no copy of k per query head
        scores = torch.einsum("ptgd,pgjd->ptgj", k, q.view(P, G, H // G, d)).reshape(P, T, H)
    else:
        r = torch.einsum("phd,hdD->phD", q, m.W_K.view(G, d, D)[kv_of])
        scores = torch.einsum("ptD,phD->pth", z, r)
    scores = scores * visible[..., None]
    pooled = torch.einsum("ptD,pth->phD", z, scores)  # Σ_i s_i^h z_i
    u = torch.einsum("hdD,phD->phd", m.W_V.view(G, d, D)[kv_of], pooled).reshape(P, H * d)
    if m.parallel:
        return x + u @ m.W_O.T + (x @ m.W1.T) @ m.W2.T
    y = x + u @ m.W_O.T
    return y + (y @ m.W1.T) @ m.W2.T


def stretch_ratio(Wx: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖Wx‖ ≥ ‖x‖ [P] bool, ‖Wx‖² / ‖x‖² [P]): Proposition 1's condition and its Σλab / Σab.

    WᵀW is symmetric, so its eigenvectors U are orthogonal and U⁻¹ = Uᵀ: a = b = Uᵀx, and
    Σ λ_i a_i b_i ≥ Σ a_i b_i reads xᵀWᵀWx ≥ xᵀx (the tests check it against the eigen form)."""
    ratio = Wx.to(torch.float64).square().sum(-1) / x.to(torch.float64).square().sum(-1)
    return ratio >= 1, ratio
