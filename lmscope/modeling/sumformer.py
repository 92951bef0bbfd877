"""Sumformers and the one-attention-layer networks of the Sumformer paper (Alberti et al., 2023).

A Sumformer maps a sequence X = (x_1, …, x_n), x_k ∈ R^d, to

    S(X)_i = ψ(x_i, Σ_k φ(x_k)),      φ: R^d → R^d',  ψ: R^(d+d') → R^d,

which is permutation-equivariant by construction and approximates every continuous equivariant
function (the paper's main theorem). We use the *mean* (1/n)·Σ_k φ(x_k) everywhere: n is fixed
within a dataset, so the factor n is absorbed by ψ's first layer, and the mean keeps the inputs of
ψ at the scale of φ.

Architectures (`build_network`):
- `poly_sumformer`: φ(x) = all monomials x^α with multidegree 1 ≤ |α| ≤ n (fixed, no weights):
  the multisymmetric power sums p_α = Σ_k x_k^α determine the set {x_k}, so d' = C(n+d, d) − 1
  suffices. A smaller d' keeps the first d' monomials in graded order (a truncated embedding);
  ψ is an MLP.
- `mlp_sumformer`: φ and ψ are MLPs (depth hidden layers of width hidden, ReLU).
- `transformer`, `linformer`, `performer`: the proofs' construction. A feed-forward layer makes
  h_i = [x_i, φ(x_i)]; one attention head with value v_i = φ(x_i) averages the values; a feed-forward
  ψ reads (x_i, attention output_i). With zero queries/keys the attention is exactly the mean:
    softmax:   scores q_i·k_j = 0 → A = (1/n)·1 (every row uniform).
    Linformer: scores against the k projected keys E·K are 0 → uniform 1/k over them; with
               F = (1/k)·1 every projected value is (1/k)·Σ_j v_j, so the output is (1/k)·Σ_j v_j;
               we rescale by k/n to get the mean. (E = (1/n)·1 is the proof's choice; with zero
               queries it does not change the output.)
    Performer: FAVOR+ features φ⁺(u) = exp(ωᵀu − ‖u‖²/2)/√m are all 1/√m at u = 0, so every kernel
               value φ⁺(q_i)·φ⁺(k_j) = 1 and the normaliser is D_i = n: the output is the mean
               (scale 1; the "rescaling" of the proof is this normaliser D).
  Training starts at this construction, perturbed by `qk_init_std` (query/key weights ~ N(0, qk_init_std²);
  E, F multiplied entrywise by 1 + qk_init_std·N(0, 1)) so that it can leave the symmetric point, and
  trains everything end to end through the kernels' differentiable reference paths. Trained E and F
  weight positions differently, so the Linformer stops being permutation-equivariant as it trains;
  `linformer_projections="fixed"` keeps the proof's E, F exactly (buffers, no perturbation).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch import nn

from lmscope.seeds import derived_seed


def mlp(in_dim: int, hidden: int, depth: int, out_dim: int) -> nn.Sequential:
    """in → (Linear, ReLU) × depth → Linear → out."""
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- polynomial features

def monomial_exponents(token_dim: int, max_degree: int) -> Iterator[tuple[int, ...]]:
    """Exponents α ∈ N^d with 1 ≤ |α| ≤ max_degree, in graded order (degree 1, then 2, …).

    Within a degree the order is lexicographic, smallest first: for d = 2, degree 1 gives (0,1), (1,0)
    and degree 2 gives (0,2), (1,1), (2,0). There are C(max_degree + d, d) − 1 of them.
    """
    for degree in range(1, max_degree + 1):
        # stars and bars: choose where the d − 1 bars go among degree + d − 1 slots
        for bars in itertools.combinations(range(degree + token_dim - 1), token_dim - 1):
            edges = (-1,) + bars + (degree + token_dim - 1,)
            yield tuple(edges[c + 1] - edges[c] - 1 for c in range(token_dim))


class PowerSumFeatures(nn.Module):
    """φ(x) = (x^α)_α for the first `latent_dim` monomials of degree ≤ n (no trainable weights)."""

    def __init__(self, token_dim: int, seq_len: int, latent_dim: int):
        super().__init__()
        exps = list(itertools.islice(monomial_exponents(token_dim, seq_len), latent_dim))
        self.register_buffer("exponents", torch.tensor(exps, dtype=torch.long))  # [d', d]

    @property
    def latent_dim(self) -> int:
        return self.exponents.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., d] → [..., d'] with entry α = Π_c x_c^α_c (0^0 = 1 in torch, as wanted)
        return torch.pow(x.unsqueeze(-2), self.exponents.to(x.dtype)).prod(dim=-1)


# ---------------------------------------------------------------- Sumformer

class Sumformer(nn.Module):
    """S(X)_i = ψ(x_i, (1/n)·Σ_k φ(x_k)) for X of shape [B, n, d]."""

    def __init__(self, phi: nn.Module, psi: nn.Module):
        super().__init__()
        self.phi, self.psi = phi, psi

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(1/n)·Σ_k φ(x_k), broadcast to every token: [B, n, d']."""
        return self.phi(x).mean(dim=-2, keepdim=True).expand(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.psi(torch.cat([x, self.pooled(x)], dim=-1))


# ---------------------------------------------------------------- one attention layer

class OneLayerAttentionNet(nn.Module):
    """Feed-forward φ, one attention head whose output is the mean of φ, feed-forward ψ.

    `attention` is "transformer" (softmax), "linformer" (E, F ∈ R^(k×n)) or "performer"
    (FAVOR+ with k positive orthogonal random features, drawn once from `seed`).
    """

    def __init__(self, attention: str, token_dim: int, seq_len: int, latent_dim: int, hidden: int, depth: int,
                 *, features: int | None = None, seed: int = 0, qk_init_std: float = 0.01,
                 linformer_projections: str = "trained"):
        super().__init__()
        if attention not in ("transformer", "linformer", "performer"):
            raise ValueError(f"unknown attention {attention!r}; use transformer, linformer or performer")
        if attention != "transformer" and not features:
            raise ValueError(f"{attention} needs features (k ≥ 1)")
        self.attention, self.seq_len, self.features = attention, seq_len, features
        d, dp = token_dim, latent_dim
        self.phi = mlp(d, hidden, depth, dp)
        # Queries and keys read the whole token state h_i = [x_i, φ(x_i)]; 0 weights = uniform attention.
        self.w_q = nn.Linear(d + dp, dp, bias=False)
        self.w_k = nn.Linear(d + dp, dp, bias=False)
        self.w_v = nn.Linear(dp, dp, bias=False)  # identity: v_i = φ(x_i)
        self.psi = mlp(d + dp, hidden, depth, d)
        with torch.no_grad():
            g = torch.Generator().manual_seed(derived_seed(seed, "qk_init"))
            for w in (self.w_q.weight, self.w_k.weight):
                w.copy_(torch.randn(w.shape, generator=g) * qk_init_std)
            self.w_v.weight.copy_(torch.eye(dp))
        if attention == "linformer":
            e = torch.full((features, seq_len), 1.0 / seq_len)
            f = torch.full((features, seq_len), 1.0 / features)
            if linformer_projections == "fixed":  # the proof's, exactly: equivariant whatever is learnt
                self.register_buffer("E", e)
                self.register_buffer("F", f)
            elif linformer_projections == "trained":
                # Trainable as in Linformer. Constant rows make all projected keys equal, so the
                # attention is uniform whatever the queries and E gets no gradient: a relative
                # perturbation of qk_init_std lets training leave that symmetric point.
                e = e * (1 + qk_init_std * torch.randn(e.shape, generator=g))
                f = f * (1 + qk_init_std * torch.randn(f.shape, generator=g))
                self.E, self.F = nn.Parameter(e), nn.Parameter(f)
            else:
                raise ValueError(f"unknown linformer_projections {linformer_projections!r}; use trained or fixed")
        if attention == "performer":
            from lmscope.kernels import draw_favor_projection

            projection = draw_favor_projection(features, dp, derived_seed(seed, "favor_projection"), "cpu")
            self.register_buffer("projection", projection)

    @property
    def mean_scale(self) -> float:
        """Factor that turns the attention output at the construction into the mean (1/n)·Σ_j v_j."""
        return self.features / self.seq_len if self.attention == "linformer" else 1.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One head, q, k, v [B, n, d'] → [B, n, d'] through the lmscope kernels (differentiable path)."""
        q, k, v = (t.unsqueeze(1) for t in (q, k, v))  # [B, H=1, n, d']
        if self.attention == "transformer":
            from lmscope.kernels import attention_with_entropy

            out = attention_with_entropy(q, k, v, causal=False, backend="reference").out
        elif self.attention == "linformer":
            from lmscope.kernels import linformer_attention

            out = linformer_attention(q, k, v, self.E, self.F, backend="reference")
        else:
            from lmscope.kernels import favor_attention

            out = favor_attention(q, k, v, num_features=self.features, causal=False,
                                  projection=self.projection, backend="reference")
        return out.squeeze(1) * self.mean_scale

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """The attention layer's output for every token: (1/n)·Σ_k φ(x_k) at the construction."""
        if x.shape[-2] != self.seq_len:
            raise ValueError(f"this network was built for sequences of {self.seq_len} tokens, got {x.shape[-2]}")
        phi = self.phi(x)
        h = torch.cat([x, phi], dim=-1)
        return self.attend(self.w_q(h), self.w_k(h), self.w_v(phi))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.psi(torch.cat([x, self.pooled(x)], dim=-1))


# ---------------------------------------------------------------- factory

def build_network(architecture: str, *, token_dim: int, seq_len: int, latent_dim: int, hidden: int,
                  depth: int, features: int | None = None, seed: int = 0, qk_init_std: float = 0.01,
                  linformer_projections: str = "trained") -> nn.Module:
    """The network of one sweep grid point, initialised from `seed` (same seed → same weights).

    latent_dim: the d′ the network uses (`lmscope.params.sweep.effective_latent_dim` of the grid point).
    """
    with torch.random.fork_rng(devices=[]):  # seed nn.Linear's initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        return _build(architecture, token_dim, seq_len, latent_dim, hidden, depth, features, seed, qk_init_std,
                      linformer_projections)


def _build(architecture, token_dim, seq_len, d_eff, hidden, depth, features, seed, qk_init_std,
           linformer_projections) -> nn.Module:
    if architecture == "poly_sumformer":
        return Sumformer(PowerSumFeatures(token_dim, seq_len, d_eff), mlp(token_dim + d_eff, hidden, depth, token_dim))
    if architecture == "mlp_sumformer":
        return Sumformer(mlp(token_dim, hidden, depth, d_eff), mlp(token_dim + d_eff, hidden, depth, token_dim))
    if architecture in ("transformer", "linformer", "performer"):
        return OneLayerAttentionNet(architecture, token_dim, seq_len, d_eff, hidden, depth, features=features,
                                    seed=seed, qk_init_std=qk_init_std,
                                    linformer_projections=linformer_projections)
    raise ValueError(f"unknown architecture {architecture!r}")


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["OneLayerAttentionNet", "PowerSumFeatures", "Sumformer", "build_network", "mlp",
           "monomial_exponents", "num_parameters"]
