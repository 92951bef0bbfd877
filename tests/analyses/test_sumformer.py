"""Sumformer architectures and targets: exact constructions checked against direct computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lmscope.analyses.targets import TARGETS, evaluate_target, sample_inputs
from lmscope.modeling.sumformer import OneLayerAttentionNet, PowerSumFeatures, build_network, monomial_exponents
from lmscope.params.sweep import TARGET_FORMULAS, effective_latent_dim, theory_latent_dim


# ---------------------------------------------------------------- targets

def _g_loop(name: str, x1: float, others: list[float]) -> float:
    """The documented formulas, written out by hand for one coordinate."""
    if name == "fig2_poly":
        return x1 + 7 * x1**2 + 3 * x1 * sum(others) ** 3
    if name == "poly_moments":
        return x1 * sum(others) + sum(o**2 for o in others)
    if name == "sin_exp":
        return math.sin(2 * math.pi * x1) + math.exp(-sum((o - x1) ** 2 for o in others))
    if name == "max_dist":
        return max(abs(o - x1) for o in others)
    raise KeyError(name)


def test_targets_match_their_formulas_and_are_equivariant():
    assert set(TARGETS) == set(TARGET_FORMULAS)
    x = sample_inputs(3, 4, 2, seed=5, dtype=torch.float64)  # 3 sequences, n = 4, d = 2
    perm = torch.tensor([2, 0, 3, 1])
    for name in TARGETS:
        y = evaluate_target(name, x)
        for b, i, c in itertools.product(range(3), range(4), range(2)):
            others = [float(x[b, k, c]) for k in range(4) if k != i]
            assert float(y[b, i, c]) == pytest.approx(_g_loop(name, float(x[b, i, c]), others), rel=1e-12, abs=1e-12)
        # permuting the tokens permutes the outputs
        torch.testing.assert_close(evaluate_target(name, x[:, perm]), y[:, perm])


def test_targets_at_a_long_sequence_match_their_formulas():
    """Long sequences are where power-sum shortcuts lose digits (sin_exp's Σ(x_k − x_1)² as p2 − 2·x1·p1 +
    n·x1²) and where a table of pairwise differences would not fit: n = 4096, d = 2 would be 537 MB."""
    x = sample_inputs(2, 4096, 2, seed=11, dtype=torch.float64)
    x[1] = 0.5 + 1e-3 * x[1]  # tokens close together: exp(−Σ(x_k − x_1)²) ≈ 0.9993, from p2 ≈ 1024 less 2·x1·p1
    ys = {name: evaluate_target(name, x) for name in ("sin_exp", "max_dist")}
    for b, i, c in [(0, 0, 0), (1, 4095, 1), (0, 1234, 1)]:
        others = [float(x[b, k, c]) for k in range(4096) if k != i]
        for name, y in ys.items():
            assert float(y[b, i, c]) == pytest.approx(_g_loop(name, float(x[b, i, c]), others), rel=1e-12, abs=1e-300)
    # a sequence with one token has no others: the exp term is exp(0) and the farthest distance is 0
    one = sample_inputs(1, 1, 3, seed=2, dtype=torch.float64)
    torch.testing.assert_close(evaluate_target("sin_exp", one), torch.sin(2 * math.pi * one) + 1)
    assert evaluate_target("max_dist", one).abs().max() == 0


def test_fig2_worked_example():
    # x = (0.5, 0.2, 0.1), d = 1: g(0.5; {0.2, 0.1}) = 0.5 + 7·0.25 + 3·0.5·0.3³ = 2.2905
    y = evaluate_target("fig2_poly", torch.tensor([[[0.5], [0.2], [0.1]]], dtype=torch.float64))
    assert float(y[0, 0, 0]) == pytest.approx(2.2905, abs=1e-12)


# ---------------------------------------------------------------- polynomial Sumformer

@pytest.mark.parametrize("d,n", [(1, 3), (2, 3), (3, 2), (4, 5)])
def test_monomials_are_all_multidegrees_up_to_n(d, n):
    exps = list(monomial_exponents(d, n))
    brute = {a for a in itertools.product(range(n + 1), repeat=d) if 1 <= sum(a) <= n}
    assert set(exps) == brute and len(exps) == len(brute)
    assert len(exps) == math.comb(n + d, d) - 1 == theory_latent_dim(d, n)
    assert [sum(a) for a in exps] == sorted(sum(a) for a in exps)  # graded order: truncation keeps low degrees


def test_poly_features_are_power_sums_and_truncate():
    x = sample_inputs(2, 3, 2, seed=0, dtype=torch.float64)
    phi = PowerSumFeatures(2, 3, theory_latent_dim(2, 3))
    feats = phi(x)  # [2, 3, 9]
    for j, (a, b) in enumerate(monomial_exponents(2, 3)):
        torch.testing.assert_close(feats[..., j], x[..., 0] ** a * x[..., 1] ** b)
    assert PowerSumFeatures(2, 3, 4).latent_dim == 4
    assert effective_latent_dim("poly_sumformer", 1000, 2, 3) == 9  # clamped to the theory
    assert effective_latent_dim("mlp_sumformer", 1000, 2, 3) == 1000


def test_poly_sumformer_represents_a_polynomial_target_exactly():
    """ψ linear in (1, x_i, x_i², s, x_i ⊗ s) with s the mean power sums: least squares hits poly_moments exactly.

    poly_moments = x1·p1 + p2 − 2·x1² per coordinate (p_m = Σ_k x_k^m = n·s_m): linear in those features.
    The same least squares with the degree-2 monomials truncated away (d' = d) cannot fit it.
    """
    d, n = 2, 4
    x = sample_inputs(400, n, d, seed=1, dtype=torch.float64)
    y = evaluate_target("poly_moments", x)

    def lstsq_error(latent_dim):
        net = build_network("poly_sumformer", token_dim=d, seq_len=n, latent_dim=latent_dim, hidden=4, depth=1).double()
        s = net.pooled(x)  # (1/n)·Σ_k φ(x_k), every token
        feats = torch.cat([torch.ones_like(x[..., :1]), x, x**2, s, (x.unsqueeze(-1) * s.unsqueeze(-2)).flatten(-2)], -1)
        a = feats.reshape(-1, feats.shape[-1])
        coef = torch.linalg.lstsq(a, y.reshape(-1, d)).solution
        return float((a @ coef - y.reshape(-1, d)).norm() / y.norm())

    assert lstsq_error(theory_latent_dim(d, n)) < 1e-10  # all monomials (d' = C(n+d,d) − 1 = 14)
    assert lstsq_error(d) > 1e-2  # only p1 of each coordinate: p2 is missing


def test_a_target_linear_in_the_power_sums_is_fitted_exactly_by_a_linear_psi():
    """The spec's case: ψ linear in the power sums. y = 3·p_(1,2) − p_(3,0) + 0.5·p_(0,1) + 2 (every
    coordinate; p_α = Σ_k x_k^α, computed here by hand) is an affine function of the Sumformer's pooled
    φ, so least squares on (1, pooled φ) alone fits it to rounding error; without the degree-3 monomials
    (d′ = 5 keeps degrees 1 and 2) it cannot."""
    d, n = 2, 3
    x = sample_inputs(300, n, d, seed=2, dtype=torch.float64)
    p = {a: (x[..., 0] ** a[0] * x[..., 1] ** a[1]).sum(1, keepdim=True) for a in [(1, 2), (3, 0), (0, 1)]}
    y = (3 * p[(1, 2)] - p[(3, 0)] + 0.5 * p[(0, 1)] + 2).unsqueeze(-1).expand(-1, n, d)

    def fitted_error(latent_dim):
        net = build_network("poly_sumformer", token_dim=d, seq_len=n, latent_dim=latent_dim, hidden=4, depth=1).double()
        s = net.pooled(x)  # [B, n, d′]: the same for every token
        a = torch.cat([torch.ones_like(s[..., :1]), s], -1).reshape(-1, latent_dim + 1)
        coef = torch.linalg.lstsq(a, y.reshape(-1, d)).solution  # ψ(s) = [1, s] @ coef
        return float((a @ coef - y.reshape(-1, d)).norm() / y.norm())

    assert fitted_error(theory_latent_dim(d, n)) < 1e-10  # d′ = C(5,2) − 1 = 9
    assert fitted_error(5) > 1e-2


# ---------------------------------------------------------------- one attention layer = the mean

@pytest.mark.parametrize("kind", ["transformer", "linformer", "performer"])
def test_attention_construction_computes_the_mean_of_phi(kind):
    """With the proofs' weights the attention output is exactly (1/n)·Σ_k φ(x_k), for every token."""
    n, d, dp, k = 5, 3, 6, 4
    net = OneLayerAttentionNet(kind, d, n, dp, hidden=8, depth=2, features=k, seed=3, qk_init_std=0.0).double()
    x = sample_inputs(7, n, d, seed=2, dtype=torch.float64)
    direct = net.phi(x).sum(dim=1, keepdim=True).expand(-1, n, -1) / n  # Σ_k φ(x_k) / n, by hand
    # the reference kernels compute in float64 for float64 inputs: exact up to float64 rounding
    torch.testing.assert_close(net.pooled(x), direct, rtol=1e-12, atol=1e-12)
    # …and it is the construction that does it: random query/key weights break it.
    torch.nn.init.normal_(net.w_q.weight, std=1.0)
    torch.nn.init.normal_(net.w_k.weight, std=1.0)
    if kind == "linformer":  # constant rows of E, F make every projected key/value equal: perturb them too
        torch.nn.init.normal_(net.E, std=1.0)
        torch.nn.init.normal_(net.F, std=1.0)
    assert (net.pooled(x) - direct).abs().max() > 1e-3


def test_linformer_weights_of_the_proof_give_the_sum_over_k():
    """E = (1/n)·1, F = (1/k)·1, zero queries: the raw Linformer output is (1/k)·Σ_j v_j; rescaled by k/n, the mean."""
    from lmscope.kernels import linformer_attention

    n, k, dim = 6, 3, 4
    v = torch.randn(2, 1, n, dim, dtype=torch.float64)
    zeros = torch.zeros(2, 1, n, dim, dtype=torch.float64)
    E = torch.full((k, n), 1.0 / n, dtype=torch.float64)
    F = torch.full((k, n), 1.0 / k, dtype=torch.float64)
    out = linformer_attention(zeros, zeros, v, E, F, backend="reference")
    torch.testing.assert_close(out, v.sum(dim=2, keepdim=True).expand_as(v) / k)


def test_performer_features_at_zero_are_constant():
    """FAVOR+ at q = k = 0: every feature is 1/√m (+ε), every kernel value equal, normaliser D = n."""
    from lmscope.kernels import draw_favor_projection, favor_attention

    n, dim, m = 5, 4, 16
    v = torch.randn(1, 2, n, dim, dtype=torch.float64)
    zeros = torch.zeros(1, 2, n, dim, dtype=torch.float64)
    proj = draw_favor_projection(m, dim, seed=0, dtype=torch.float64)
    out = favor_attention(zeros, zeros, v, projection=proj, causal=False, backend="reference")
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(v))


def test_build_network_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_network("mlp_sumformer", token_dim=2, seq_len=3, latent_dim=4, hidden=8, depth=2, seed=9)
    assert torch.rand(1) == before  # the caller's RNG stream is untouched
    b = build_network("mlp_sumformer", token_dim=2, seq_len=3, latent_dim=4, hidden=8, depth=2, seed=9)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


# ---------------------------------------------------------------- permutation equivariance of a trained network

def test_equivariance_error_worked_example():
    """S(X)_i = x_1 for every i is not equivariant: with π = reversal, S(πX)_i = x_n and (πS(X))_i = x_1,
    so the error is ‖x_n − x_1‖ / ‖x_1‖ over the batch."""
    from lmscope.analyses.sumformer_fit import equivariance_error

    class FirstToken(torch.nn.Module):
        def forward(self, x):
            return x[:, :1].expand_as(x)

    x = sample_inputs(5, 3, 2, seed=0, dtype=torch.float64)
    reverse = torch.tensor([2, 1, 0]).repeat(5, 1)
    expected = float((x[:, 2] - x[:, 0]).norm() / x[:, 0].norm())
    assert equivariance_error(FirstToken(), x, reverse) == pytest.approx(expected, rel=1e-12)
    assert equivariance_error(FirstToken(), x, torch.arange(3).repeat(5, 1)) == 0.0  # π = identity


def test_random_permutations_are_permutations_and_seeded():
    from lmscope.analyses.sumformer_fit import random_permutations

    p = random_permutations(2000, 5, seed=4)
    assert torch.equal(p.sort(dim=1).values, torch.arange(5).repeat(2000, 1))
    assert torch.equal(p, random_permutations(2000, 5, seed=4))
    assert len({tuple(r.tolist()) for r in p}) == math.factorial(5)  # 2000 draws hit all 120 orders


@pytest.mark.parametrize("projections", ["trained", "fixed"])
def test_a_trained_linformer_is_equivariant_only_with_the_proofs_projections(tmp_path, projections):
    """A Linformer's E, F weight positions: trained, they break equivariance (which the exchangeable
    validation data cannot show); fixed at the proof's E = 1/n·1, F = 1/k·1 it stays equivariant."""
    from lmscope.analyses.local import LocalContext
    from lmscope.analyses.sumformer_fit import run_sumformer_fit
    from lmscope.params.sweep import SumformerFitParams

    train = {"samples": 300, "epochs": 8, "eval_every": 4, "hidden": 16, "depth": 2, "batch_size": 32,
             "lr": 3e-3, "linformer_projections": projections}
    params = SumformerFitParams(architecture="linformer", target="fig2_poly", token_dim=2, seq_len=3, latent_dim=4,
                                features=4, seed=0, train=train)
    out = run_sumformer_fit(params, LocalContext(tmp_path))
    if projections == "fixed":
        assert out.summary["equivariance_error"] < 1e-6  # float32 rounding
    else:
        assert out.summary["equivariance_error"] > 1e-4
    if projections == "fixed":  # and a network equivariant by construction (once: it has no projections)
        equivariant = SumformerFitParams(**{**params.model_dump(), "architecture": "mlp_sumformer", "features": None})
        assert run_sumformer_fit(equivariant, LocalContext(tmp_path / "mlp")).summary["equivariance_error"] < 1e-6
