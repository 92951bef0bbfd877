"""The `entropy` job kind against independent computations.

The oracle is the eager attention matrix of the same model (``output_attentions=True``), turned into
-Σ p ln p in float64; the job itself runs through the fused kernel route (``EntropyCollector``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, GPT2Config, GptOssConfig, GPTNeoConfig, LlamaConfig, MistralConfig, Qwen2Config

from lmscope.analyses import entropy, entropy_plots
from lmscope.analyses.base import JobCancelled, JobFailed, LoadedModel
from lmscope.analyses.host_reads import HostReads
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, read_documents
from lmscope.config import Settings
from lmscope.kernels import kernel_backend
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.modeling.windows import token_windows
from lmscope.params import validate_params
from lmscope.params.entropy import EntropyParams
from tests.analyses.conftest import eager_entropies
from tests.conftest import computes_attention_itself, need_module

WIKITEXT = Settings.from_env().wikitext2_path  # the shared copy beside the checkout, else data/ (config.py)
SEQ_LEN = 24


@pytest.fixture(scope="module")
def documents():
    return read_documents(WIKITEXT, "lines")[:40]


def tiny_model(arch: str, seed: int = 0):
    """A random-init tiny model whose attention is far from uniform (large init: peaky scores)."""
    if arch == "gpt2":
        config = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=BYTE_VOCAB_SIZE,
                            bos_token_id=256, eos_token_id=257, initializer_range=0.25)
    elif arch == "gpt_neo":  # computes its attention itself, not through transformers' AttentionInterface
        config = GPTNeoConfig(num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=4, hidden_size=32,
                              max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE, bos_token_id=256, eos_token_id=257,
                              initializer_range=0.25)
    else:  # LLaMA with grouped-query attention: 4 query heads read 2 key/value heads
        config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             intermediate_size=64, max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258, initializer_range=0.25)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()  # sdpa where the architecture has it
    return LoadedModel(name=f"tiny-{arch}", model=model, tokenizer=byte_tokenizer())


def run_job(tmp_path, loaded_models: dict, documents, checkpoints=None, device="cpu", **params):
    """Run the job in-process on `loaded_models` (name -> LoadedModel); `model="m"` unless told otherwise."""
    ctx = LocalContext(tmp_path, models=loaded_models, datasets={"wiki": documents}, checkpoints=checkpoints,
                       device=device)
    if not {"model", "models", "train_job"} & params.keys():
        params["model"] = "m"
    params = EntropyParams(dataset="wiki", **{"seq_len": SEQ_LEN, "num_segments": 5, "batch_size": 2, **params})
    return entropy.run(params, ctx), ctx


def series(output, name, **labels):
    found = [s for s in output.series if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"no series {name} {labels}"
    return found


@pytest.mark.parametrize("arch, bins", [("gpt2", 7), ("llama", 50)])
def test_entropies_match_eager_attention(tmp_path, documents, arch, bins):
    loaded = tiny_model(arch)
    out, ctx = run_job(tmp_path, {"m": loaded}, documents, histogram_bins=bins)

    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 5)
    ref = eager_entropies(loaded, windows)  # [L, W, H, N]
    layers, _, heads, n = ref.shape
    bound = np.log(np.arange(n) + 1.0)
    # The test means something only if heads are far from uniform and differ from each other.
    assert (ref[..., 1:] / bound[1:]).mean() < 0.9 and ref.mean((1, 3)).std() > 0.05

    arrays = np.load(tmp_path / "entropy_by_position.npz")
    np.testing.assert_allclose(arrays["by_position"][0], ref.mean(1), atol=2e-5)  # per layer, head, position
    np.testing.assert_allclose(arrays["mean"][0], ref.mean((1, 3)), atol=2e-5)
    np.testing.assert_allclose(arrays["std"][0], ref.std((1, 3)), atol=2e-5)
    normalized = (ref[..., 1:] / bound[1:]).mean((1, 3))  # position 0 (one visible key) left out
    np.testing.assert_allclose(arrays["normalized_mean"][0], normalized, atol=2e-5)

    for layer in range(layers):
        for head in range(heads):
            (s,) = series(out, "entropy.mean", layer=layer, head=head)
            assert list(s.x) == [0] and s.y[0] == pytest.approx(ref[layer, :, head].mean(), abs=2e-5)
            (s,) = series(out, "entropy.std", layer=layer, head=head)
            assert s.y[0] == pytest.approx(ref[layer, :, head].std(), abs=2e-5)
        (s,) = series(out, "entropy.by_position", layer=layer)
        np.testing.assert_allclose(s.y, ref[layer].mean((0, 1)), atol=2e-5)
        # Histogram on fixed bins [0, ln N]: the same counts as numpy's (a value on a bin edge may flip).
        counts, edges = np.histogram(ref[layer], bins=bins, range=(0, math.log(n)))
        assert np.abs(arrays["hist_counts"][0, layer].sum(0) - counts).sum() <= 2
        (s,) = series(out, "entropy.histogram", layer=layer)
        assert np.sum(np.array(s.y) * np.diff(edges)) == pytest.approx(1.0)
        np.testing.assert_allclose(s.x, (edges[:-1] + edges[1:]) / 2)  # bin centres
        # density × width × rows = numpy's counts (again up to a value on a bin edge)
        assert np.abs(np.array(s.y) * np.diff(edges) * ref[layer].size - counts).sum() <= 2 + 1e-6
    (s,) = series(out, "entropy.layer_mean")
    np.testing.assert_allclose(s.y, ref.mean((1, 2, 3)), atol=2e-5)
    (s,) = series(out, "uniform_bound")
    np.testing.assert_allclose(s.y, bound)

    mean = ref.mean((1, 3))
    lo = np.unravel_index(mean.argmin(), mean.shape)
    assert out.summary["lowest_entropy_head"]["layer"] == lo[0] and out.summary["lowest_entropy_head"]["head"] == lo[1]
    # The headline numbers, each against the eager reference [L, W, H, N]: all rows, per layer, normalised
    # by ln(visible keys) with position 0 left out, and the head of highest mean entropy.
    summary = out.summary
    assert summary["mean_entropy"] == pytest.approx(ref.mean(), abs=2e-5)
    assert summary["mean_entropy_per_layer"] == pytest.approx(ref.mean((1, 2, 3)).tolist(), abs=2e-5)
    assert summary["normalized_mean_entropy"] == pytest.approx(normalized.mean(), abs=2e-5)
    hi = np.unravel_index(mean.argmax(), mean.shape)
    assert np.sort(mean, axis=None)[-2] < mean[hi] - 1e-3  # a clear maximum: argmax cannot flip on rounding
    assert (summary["highest_entropy_head"]["layer"], summary["highest_entropy_head"]["head"]) == hi
    assert summary["highest_entropy_head"]["value"] == pytest.approx(mean[hi], abs=2e-5)
    assert summary["lowest_entropy_head"]["value"] == pytest.approx(mean[lo], abs=2e-5)
    assert summary["uniform_bound_max"] == pytest.approx(math.log(n))
    assert "heads_note" not in summary  # heads 1e-3 nats apart or more are told apart
    assert out.summary["layers"] == layers and out.summary["heads"] == heads
    assert out.summary["tokens"] == 5 * SEQ_LEN and out.summary["num_segments_used"] == 5
    assert out.summary["kernel_backend"] == ctx.environment["kernel_backend"] in ("triton", "reference")
    for plot in ("entropy_heatmap.png", "entropy_by_layer.png", "entropy_by_position.png"):
        assert (tmp_path / plot).stat().st_size > 5000
    assert not (tmp_path / "entropy_over_training.png").exists()
    # Progress once per batch of 2 windows: 3 batches, stage = the model.
    assert ctx.progress_log == [(1, 3, "m"), (2, 3, "m"), (3, 3, "m")]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_fused_triton_kernel_route_matches_eager(tmp_path, documents, monkeypatch, device, arch):
    """The GPU route: the job through the Triton kernel (compiled on a GPU, the interpreter on CPU), GQA LLaMA
    and Mistral with a sliding window of 8 < seq_len."""
    need_module("triton")
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "triton")
    loaded = tiny_model("llama") if arch == "llama" else _sliding("mistral", window=8)
    loaded.model.to(device)
    out, ctx = run_job(tmp_path, {"m": loaded}, documents, num_segments=2, dimension_wise=True, dimension_segments=1,
                       device=device)
    assert ctx.environment["kernel_backend"] == out.summary["kernel_backend"] == "triton"
    ref = eager_entropies(loaded, token_windows(loaded.tokenizer, documents, SEQ_LEN, 2))
    np.testing.assert_allclose(np.load(tmp_path / "entropy_by_position.npz")["by_position"][0], ref.mean(1), atol=2e-5)


def _zero_queries(loaded: LoadedModel) -> LoadedModel:
    """q = 0 in every layer: all scores equal, so every row is uniform over its visible keys."""
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if name.endswith("q_proj"):
                module.weight.zero_()
            if name.endswith("c_attn"):  # GPT-2 packs [q | k | v] in one Conv1D
                d = module.weight.shape[0]
                module.weight[:, :d].zero_()
                module.bias[:d].zero_()
    return loaded


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_uniform_attention_gives_the_causal_bound(tmp_path, documents, arch):
    loaded = _zero_queries(tiny_model(arch))
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=3, dimension_wise=True, dimension_segments=2)
    bound = np.log(np.arange(SEQ_LEN) + 1.0)  # ln(visible keys) = ln(position + 1)
    arrays = np.load(tmp_path / "entropy_by_position.npz")
    np.testing.assert_allclose(arrays["by_position"][0], np.broadcast_to(bound, arrays["by_position"][0].shape),
                               atol=1e-5)
    np.testing.assert_allclose(arrays["normalized_mean"][0], 1.0, atol=1e-5)
    np.testing.assert_allclose(arrays["mean"][0], bound.mean(), atol=1e-5)
    np.testing.assert_allclose(arrays["std"][0], bound.std(), atol=1e-5)
    # q = 0 also makes every per-dimension row uniform over all seq_len keys.
    assert out.summary["near_uniform_pct"] == pytest.approx(100.0)
    # every head alike: the lowest and highest heads are ties, which the summary says
    assert "are ties" in out.summary["heads_note"]
    assert (tmp_path / "dimension_entropy.png").stat().st_size > 5000


def test_models_the_kernel_cannot_run_use_their_attention_matrices(tmp_path, documents):
    """GPT-Neo: the job falls back to output_attentions; q = 0 must still give ln(visible keys) everywhere."""
    loaded = _zero_queries(tiny_model("gpt_neo"))
    assert computes_attention_itself(loaded.model)
    out, ctx = run_job(tmp_path, {"m": loaded}, documents, num_segments=3)
    assert out.summary["kernel_backend"] == ctx.environment["kernel_backend"] == entropy.MATRIX_ROUTE
    bound = np.log(np.arange(SEQ_LEN) + 1.0)
    by_position = np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]
    np.testing.assert_allclose(by_position, np.broadcast_to(bound, by_position.shape), atol=1e-5)
    assert loaded.model.config._attn_implementation == "eager"  # left as it was

    with pytest.raises(JobFailed, match="dimension_wise needs .* set dimension_wise=false"):
        run_job(tmp_path, {"m": loaded}, documents, num_segments=1, dimension_wise=True)


def test_attention_matrix_route_agrees_with_the_kernel_route(tmp_path, documents, monkeypatch):
    """The fallback's statistics equal the fused route's on a model both can run (LLaMA, GQA)."""
    loaded = tiny_model("llama")
    fused, _ = run_job(tmp_path / "fused", {"m": loaded}, documents, num_segments=3)
    monkeypatch.setattr("lmscope.kernels.hf.lmscope_attention_unsupported", lambda model: "forced by the test")
    matrix, _ = run_job(tmp_path / "matrix", {"m": loaded}, documents, num_segments=3)
    assert matrix.summary["kernel_backend"] == entropy.MATRIX_ROUTE != fused.summary["kernel_backend"]
    for name in ("mean", "std", "normalized_mean", "by_position"):
        np.testing.assert_allclose(np.load(tmp_path / "matrix" / "entropy_by_position.npz")[name],
                                   np.load(tmp_path / "fused" / "entropy_by_position.npz")[name], atol=2e-5)
    assert loaded.model.config._attn_implementation == "sdpa"  # switched to eager for the route, and back


def test_attention_sinks_are_refused(tmp_path, documents):
    """gpt-oss rows put mass on a learnt sink: they are not distributions over the keys."""
    config = GptOssConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                          num_experts_per_tok=1, max_position_embeddings=64, layer_types=["full_attention"],
                          bos_token_id=256, eos_token_id=257, pad_token_id=258)
    loaded = LoadedModel("oss", AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer())
    with pytest.raises(JobFailed, match="do not sum to 1"):
        run_job(tmp_path, {"m": loaded}, documents, num_segments=1)


@torch.no_grad()
def _qk_per_layer(loaded: LoadedModel, windows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q [W,H,N,D], k [W,H_kv,N,D]) of every layer as the attention sees them, from the model's own parts."""
    model, cfg = loaded.model, loaded.model.config
    hidden = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states
    qk = []
    if cfg.model_type == "gpt2":
        for layer, block in enumerate(model.transformer.h):
            q, k, _ = block.attn.c_attn(block.ln_1(hidden[layer])).split(cfg.n_embd, dim=2)
            split = lambda t: t.view(*t.shape[:2], cfg.n_head, -1).transpose(1, 2)  # noqa: E731
            qk.append((split(q), split(k)))
    else:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        positions = torch.arange(windows.shape[1])[None]
        cos, sin = model.model.rotary_emb(hidden[0], positions)
        for layer, block in enumerate(model.model.layers):
            x = block.input_layernorm(hidden[layer])
            q = block.self_attn.q_proj(x).view(*x.shape[:2], -1, cfg.head_dim).transpose(1, 2)
            k = block.self_attn.k_proj(x).view(*x.shape[:2], -1, cfg.head_dim).transpose(1, 2)
            qk.append(apply_rotary_pos_emb(q, k, cos, sin))
    return qk


def test_dimension_wise_rows_say_when_the_model_scales_its_scores_otherwise(tmp_path, documents):
    # GPT-2 with scale_attn_by_inverse_layer_idx scales layer l's scores by 1/(sqrt(d)·(l + 1)); the
    # dimension-wise rows keep the defined 1/sqrt(d), and the summary says where the two differ
    plain = run_job(tmp_path / "plain", {"m": tiny_model("gpt2")}, documents, num_segments=1, dimension_wise=True)[0]
    assert "dimension_scale_note" not in plain.summary
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=BYTE_VOCAB_SIZE,
                        scale_attn_by_inverse_layer_idx=True)
    scaled = LoadedModel("m", AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer())
    out = run_job(tmp_path / "scaled", {"m": scaled}, documents, num_segments=1, dimension_wise=True)[0]
    head_dim = 32 // 4
    assert out.summary["dimension_scale_note"].endswith(f"layer 1: {1 / (math.sqrt(head_dim) * 2):.4g}")


@pytest.mark.parametrize("arch,causal", [("gpt2", False), ("llama", True)])
def test_dimension_entropy_matches_float64(tmp_path, documents, arch, causal):
    loaded = tiny_model(arch)
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=3, dimension_wise=True,
                     dimension_segments=2, dimension_causal=causal, near_uniform_margin=0.05)
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 2)
    arrays = np.load(tmp_path / "dimension_entropy.npz")
    n = SEQ_LEN
    visible = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    bound = np.log(visible.sum(1))
    first = 1 if causal else 0  # a causal row 0 sees one key: trivially uniform, left out
    per_layer = []
    for layer, (q, k) in enumerate(_qk_per_layer(loaded, windows)):
        q, k = q.double().numpy(), k.double().numpy()
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)  # GQA: query head h reads kv head h // group
        scale = 1 / math.sqrt(q.shape[-1])
        # s[w, h, i, t, m] = q_ti k_mi / sqrt(d), softmax over the visible keys m
        s = q.transpose(0, 1, 3, 2)[..., :, None] * k.transpose(0, 1, 3, 2)[..., None, :] * scale
        s = np.where(visible, s, -np.inf)
        logp = s - s.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        ent = -np.where(visible, np.exp(logp) * np.where(visible, logp, 0), 0).sum(-1)  # [W, H, D, N]
        ent = ent[..., first:]
        near = (ent >= bound[first:] - 0.05).mean((0, 2, 3)) * 100
        np.testing.assert_allclose(arrays["near_uniform_pct"][0, layer], near, atol=1e-9)
        counts, edges = np.histogram(ent, bins=50, range=(0, math.log(n)))
        assert np.abs(arrays["hist_counts"][0, layer].sum(0) - counts).sum() <= 2
        for head in range(q.shape[1]):
            (srs,) = series(out, "dimension_entropy.near_uniform_pct", layer=layer, head=head)
            assert srs.y[0] == pytest.approx(near[head])
        # the histogram series: density on the bin centres, density × width × rows = numpy's counts
        (srs,) = series(out, "dimension_entropy.histogram", layer=layer)
        np.testing.assert_allclose(srs.x, (edges[:-1] + edges[1:]) / 2)
        assert np.abs(np.array(srs.y) * np.diff(edges) * ent.size - counts).sum() <= 2 + 1e-6
        # the distance below the bound, on [0, 1e-4] then log-spaced bins: numpy's histogram of bound − H
        gap = np.clip(bound[first:] - ent, 0, None)
        gap_edges = arrays["gap_edges"]
        assert gap_edges[0] == 0 and gap_edges[1] == pytest.approx(1e-4) and gap_edges[-1] == pytest.approx(math.log(n))
        assert np.all(np.diff(np.log(gap_edges[1:])) == pytest.approx(np.log(gap_edges[2] / gap_edges[1])))
        gap_counts, _ = np.histogram(gap, bins=gap_edges)
        assert np.abs(arrays["gap_counts"][0, layer] - gap_counts).sum() <= 2
        (gsrs,) = series(out, "dimension_entropy.gap_histogram", layer=layer)
        assert len(gsrs.x) == len(gap_edges) - 1 and sum(gsrs.y) == pytest.approx(100.0)
        assert np.abs(np.array(gsrs.y) / 100 * gap.size - gap_counts).sum() <= 2 + 1e-6
        # every head has as many rows, so the layer's share is the mean of the heads' shares
        per_layer.append(float(near.mean()))
    assert 0 < out.summary["near_uniform_pct"] < 100  # a meaningful mix, not a degenerate case
    # what ran the dimension-wise kernel on these (CPU, float32) q, k: the reference, unless forced
    assert out.summary["dimension_backend"] == kernel_backend("cpu")
    assert out.summary["near_uniform_pct_per_layer"] == pytest.approx(per_layer, abs=1e-4)  # rounded to 4 places
    assert out.summary["near_uniform_pct"] == pytest.approx(np.mean(per_layer), abs=1e-9)  # counted, then divided in float64
    assert np.ptp(per_layer) > 1e-3  # the layers differ: a per-layer number that mixed them up would show


def test_statistics_count_like_numpy_and_read_nothing_back():
    """The per-batch statistics: histograms as np.histogram counts them, and, so that a GPU is never left
    idle between forward passes, not one value read back to the host (torch.bincount would read two)."""
    n, bins, heads = 16, 5, 3
    generator = torch.Generator().manual_seed(0)
    e = [torch.rand(4, heads, n, generator=generator) * math.log(n) for _ in range(2)]
    stats = entropy.EntropyStats(layers=1, heads=heads, seq_len=n, bins=bins)
    dims = entropy.DimensionStats(layers=1, heads=heads, seq_len=n, bins=bins, margin=0.03, causal=True)
    with HostReads() as reads:
        for batch in e:
            stats.add(0, batch)
            dims.add(0, batch[:, :, None].expand(-1, -1, 2, -1))  # two head dimensions with the same rows
    assert reads.ops == []
    rows = torch.cat(e).double().numpy()
    want = np.stack([np.histogram(rows[:, h], bins=bins, range=(0, math.log(n)))[0] for h in range(heads)])
    np.testing.assert_array_equal(stats.hist[0].numpy(), want)
    causal = torch.cat(e)[..., 1:].double().numpy()  # causal row 0 (one key) is left out
    want = np.stack([np.histogram(causal[:, h], bins=bins, range=(0, math.log(n)))[0] for h in range(heads)])
    np.testing.assert_array_equal(dims.hist[0].numpy(), 2 * want)
    assert int(dims.gap_hist[0].sum()) == 2 * causal.size


def test_checkpoints_of_a_train_job_in_step_order(tmp_path, documents):
    early, late = tiny_model("gpt2", seed=1), _zero_queries(tiny_model("gpt2", seed=2))
    models = {"r@step500": late, "r@step100": early}
    ctx_ckpt = {7: [(500, "r@step500"), (100, "r@step100")]}
    out, ctx = run_job(tmp_path, models, documents, checkpoints=ctx_ckpt, train_job=7, num_segments=2)
    assert out.summary["models"] == ["r@step100", "r@step500"] and out.summary["steps"] == [100, 500]
    ref_early = eager_entropies(early, token_windows(early.tokenizer, documents, SEQ_LEN, 2))
    bound = np.log(np.arange(SEQ_LEN) + 1.0)
    for layer in range(2):
        for head in range(4):
            (s,) = series(out, "entropy.mean", layer=layer, head=head)
            assert list(s.x) == [100, 500]
            assert s.y[0] == pytest.approx(ref_early[layer, :, head].mean(), abs=2e-5)
            assert s.y[1] == pytest.approx(bound.mean(), abs=2e-5)  # the uniform (late) checkpoint
    # the per-checkpoint series: each step's own model, not the last one's
    ref_late = eager_entropies(late, token_windows(late.tokenizer, documents, SEQ_LEN, 2))
    for step, name, ref in ((100, "r@step100", ref_early), (500, "r@step500", ref_late)):
        (s,) = series(out, "entropy.layer_mean", step=step)
        assert s.labels["model"] == name and list(s.x) == [0, 1]
        np.testing.assert_allclose(s.y, ref.mean((1, 2, 3)), atol=2e-5)
        for layer in range(2):
            (s,) = series(out, "entropy.by_position", layer=layer, step=step)
            assert s.labels["model"] == name and list(s.x) == list(range(SEQ_LEN))
            np.testing.assert_allclose(s.y, ref[layer].mean((0, 1)), atol=2e-5)
    assert np.abs(ref_early.mean((1, 2)) - ref_late.mean((1, 2))).max(-1).min() > 1e-3  # each layer tells them apart
    assert (tmp_path / "entropy_over_training.png").stat().st_size > 5000
    # One progress report per batch over both models, each stage the model being measured.
    assert ctx.progress_log == [(1, 2, "r@step100"), (2, 2, "r@step500")]


def test_models_list_form(tmp_path, documents):
    a, b = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    out, _ = run_job(tmp_path, {"a": a, "b": b}, documents, models=["b", "a"], num_segments=1)
    assert out.summary["models"] == ["b", "a"] and out.summary["steps"] == [0, 1]  # no @step suffix: list index
    (s,) = series(out, "entropy.mean", layer=1, head=3)
    ref_b = eager_entropies(b, token_windows(b.tokenizer, documents, SEQ_LEN, 1))
    assert list(s.x) == [0, 1] and s.y[0] == pytest.approx(ref_b[1, :, 3].mean(), abs=2e-5)


def test_models_of_different_shapes_fail_the_job_naming_both(tmp_path, documents):
    # a model whose shape the server did not record gets here (the API refuses the rest at submit)
    deeper = tiny_model("llama")
    deeper.model.config.num_hidden_layers = 3  # as a 3-layer checkpoint would say
    with pytest.raises(JobFailed, match=r"'b' has 3 layers × 4 heads but 'a' has 2 × 4"):
        run_job(tmp_path, {"a": tiny_model("llama"), "b": deeper}, documents, models=["a", "b"], num_segments=1)


def test_checkpoint_list_rules():
    ctx = LocalContext("/tmp/unused-entropy", checkpoints={3: [(20, "r@step20"), (10, "r@step10")]})
    mk = lambda **kw: EntropyParams(dataset="d", **kw)  # noqa: E731
    assert entropy.checkpoint_list(mk(models=["r@step500", "r@step100"]), ctx) == [(100, "r@step100"), (500, "r@step500")]
    assert entropy.checkpoint_list(mk(models=["base", "r@step100"]), ctx) == [(0, "base"), (1, "r@step100")]
    assert entropy.checkpoint_list(mk(models=["a@step5", "b@step5"]), ctx) == [(0, "a@step5"), (1, "b@step5")]
    assert entropy.checkpoint_list(mk(train_job=3), ctx) == [(10, "r@step10"), (20, "r@step20")]
    # one model: a single x, its step when it is a checkpoint (compared with the run's own curve, it lines up)
    assert entropy.checkpoint_list(mk(model="r@step10"), ctx) == [(10, "r@step10")]
    assert entropy.checkpoint_list(mk(model="tiny-gpt2"), ctx) == [(0, "tiny-gpt2")]
    with pytest.raises(JobFailed, match="no registered checkpoints"):
        entropy.checkpoint_list(mk(train_job=4), ctx)


@pytest.mark.parametrize("raw,message", [
    ({"dataset": "d"}, "exactly one of 'model'"),
    ({"dataset": "d", "model": "a", "models": ["b"]}, "got model and models"),
    ({"dataset": "d", "model": "a", "train_job": 1}, r"got model and train_job \(set all but one to null\)"),
    ({"dataset": "d", "models": []}, "at least 1"),
    ({"dataset": "d", "models": ["a", "a"]}, "twice"),
    ({"dataset": "d", "model": "a", "seq_len": 1}, "greater than or equal to 2"),
    ({"dataset": "d", "model": "a", "near_uniform_margin": 0}, "greater than 0"),
    ({"dataset": "d", "model": "a", "bins": 10}, "Extra inputs"),
])
def test_params_refuse_bad_input(raw, message):
    with pytest.raises(ValidationError, match=message):
        validate_params("entropy", raw)


def test_params_refs():
    p = validate_params("entropy", {"dataset": "d", "train_job": 5})
    assert (p.model_refs(), p.dataset_refs(), p.job_refs()) == ([], ["d"], [5])
    p = validate_params("entropy", {"dataset": "d", "models": ["a", "b"]})
    assert (p.model_refs(), p.job_refs()) == (["a", "b"], [])


def test_runtime_refusals_and_cancel(tmp_path, documents):
    loaded = tiny_model("gpt2")  # 64 positions
    with pytest.raises(JobFailed, match="at most 64"):
        run_job(tmp_path, {"m": loaded}, documents, model="m", seq_len=65)
    with pytest.raises(JobFailed, match="fewer than one window"):
        run_job(tmp_path, {"m": loaded}, ["a few bytes"], model="m")
    # Fewer tokens than num_segments windows: what exists is used and reported.
    out, _ = run_job(tmp_path, {"m": loaded}, documents[:3], model="m", num_segments=10_000, batch_size=64)
    available = len(token_windows(loaded.tokenizer, documents[:3], SEQ_LEN, None))
    assert 1 <= out.summary["num_segments_used"] == available < 10_000
    assert out.summary["note"] == (f"dataset wiki holds {available} windows of {SEQ_LEN} tokens: "
                                   "num_segments=10000 was cut to that")
    # seq_len not given: 512, or the model's context (64) when shorter.
    out, _ = run_job(tmp_path, {"m": loaded}, documents, model="m", seq_len=None, num_segments=1)
    assert out.summary["seq_len"] == 64 and len(series(out, "uniform_bound")[0].x) == 64
    assert "note" not in out.summary  # as many windows as asked for: nothing to say
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"wiki": documents}, cancel_after=1)
    with pytest.raises(JobCancelled):
        entropy.run(EntropyParams(model="m", dataset="wiki", seq_len=SEQ_LEN, num_segments=4, batch_size=1), ctx)
    assert len(ctx.progress_log) == 1


def _sliding(arch: str, window: int) -> LoadedModel:
    """Tiny Mistral (every layer slides), Qwen2 (layers ≥ max_window_layers = 1 slide) or GLM-4 (which
    ignores the window its config carries) with a short window."""
    common = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                  intermediate_size=64, max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE, bos_token_id=256,
                  eos_token_id=257, pad_token_id=258, initializer_range=0.25, sliding_window=window)
    if arch == "glm4":
        from transformers import Glm4Config

        config = Glm4Config(head_dim=8, **common)
    else:
        config = (MistralConfig(**common) if arch == "mistral"
                  else Qwen2Config(use_sliding_window=True, max_window_layers=1, **common))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # sdpa where the architecture has it
    return LoadedModel(name=f"tiny-{arch}", model=model, tokenizer=byte_tokenizer())


@pytest.mark.parametrize("arch,windowed", [("mistral", [0, 1]), ("qwen2", [1])])
def test_sliding_window_layers_are_bounded_by_their_window(tmp_path, documents, arch, windowed):
    """Query t of a layer with window W sees min(t+1, W) keys: entropies (against eager), bound and
    normalised mean follow that, while full-attention layers keep ln(t+1)."""
    loaded = _sliding(arch, window=8)
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=3)  # seq_len 24 > 8
    ref = eager_entropies(loaded, token_windows(loaded.tokenizer, documents, SEQ_LEN, 3))  # [L, W, H, N]
    arrays = np.load(tmp_path / "entropy_by_position.npz")
    np.testing.assert_allclose(arrays["by_position"][0], ref.mean(1), atol=2e-5)
    t = np.arange(SEQ_LEN)
    bounds = [np.log(np.minimum(t + 1.0, 8)) if layer in windowed else np.log(t + 1.0) for layer in range(2)]
    np.testing.assert_allclose(arrays["uniform_bound_per_layer"][0], np.stack(bounds))
    normalized = np.stack([(ref[layer][..., 1:] / bounds[layer][1:]).mean((0, 2)) for layer in range(2)])
    np.testing.assert_allclose(arrays["normalized_mean"][0], normalized, atol=2e-5)
    assert out.summary["sliding_windows"] == {str(layer): 8 for layer in windowed}
    for layer in windowed:
        assert ref[layer][..., 8:].max() <= math.log(8) + 1e-6  # the window really bounds these rows
        (s,) = series(out, "uniform_bound", layer=layer)
        assert s.labels == {"layer": layer, "window": 8}
        np.testing.assert_allclose(s.y, bounds[layer])
    if arch == "qwen2":  # layer 0 is full attention: rows past the window go above ln 8
        assert ref[0][..., 8:].max() > math.log(8) + 1e-3


def test_uniform_attention_in_a_sliding_window_gives_ln_of_the_window(tmp_path, documents):
    loaded = _zero_queries(_sliding("mistral", window=5))
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=2)
    assert out.summary["uniform_bound_max"] == pytest.approx(math.log(5))  # every layer slides: no row sees more
    by_position = np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]
    bound = np.log(np.minimum(np.arange(SEQ_LEN) + 1.0, 5))
    np.testing.assert_allclose(by_position, np.broadcast_to(bound, by_position.shape), atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "entropy_by_position.npz")["normalized_mean"][0], 1.0, atol=1e-5)


def test_the_windows_the_layers_receive_set_the_bound(tmp_path, documents, monkeypatch):
    """A config the up-front reading does not understand: the window the attention calls received counts."""
    monkeypatch.setattr(entropy, "sliding_windows", lambda config, layers: {})
    out, _ = run_job(tmp_path, {"m": _zero_queries(_sliding("mistral", window=8))}, documents, num_segments=2)
    assert out.summary["sliding_windows"] == {"0": 8, "1": 8}
    np.testing.assert_allclose(np.load(tmp_path / "entropy_by_position.npz")["normalized_mean"][0], 1.0, atol=1e-5)


def test_causal_dimension_rows_over_sliding_windows_and_one_key_windows_are_refused(tmp_path, documents):
    with pytest.raises(JobFailed, match=r"dimension_causal=true .* layer\(s\) \[0, 1\] slide over 8 keys"):
        run_job(tmp_path, {"m": _sliding("mistral", window=8)}, documents, num_segments=1, dimension_wise=True,
                dimension_causal=True)
    out, _ = run_job(tmp_path, {"m": _sliding("mistral", window=8)}, documents, num_segments=1,
                     dimension_wise=True, dimension_segments=1)  # bidirectional rows: the window plays no part
    assert out.summary["sliding_windows"] == {"0": 8, "1": 8} and 0 <= out.summary["near_uniform_pct"] <= 100
    with pytest.raises(JobFailed, match=r"layer\(s\) \[0, 1\] attend over a sliding window of 1 token"):
        run_job(tmp_path, {"m": _sliding("mistral", window=1)}, documents, num_segments=1)


def test_a_window_as_long_as_the_sequence_is_no_sliding_window(tmp_path, documents):
    """A window of seq_len keys holds every key a row of seq_len tokens can see: the rows are full causal ones,
    nothing is said about windows, and dimension_causal is not refused."""
    out, _ = run_job(tmp_path, {"m": _sliding("mistral", window=SEQ_LEN)}, documents, num_segments=1,
                     dimension_wise=True, dimension_segments=1, dimension_causal=True)
    assert out.summary["sliding_windows"] == {}
    assert all("window" not in s.labels for s in out.series if s.name == "uniform_bound")


def test_a_sliding_window_the_model_ignores_changes_nothing(tmp_path, documents):
    """GLM-4 has no sliding window, whatever its config.json says: its rows see keys 0..t, and
    dimension_causal is not refused."""
    loaded = _zero_queries(_sliding("glm4", window=8))
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=2, dimension_wise=True, dimension_segments=1,
                     dimension_causal=True)
    assert out.summary["sliding_windows"] == {}
    by_position = np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]
    bound = np.log(np.arange(SEQ_LEN) + 1.0)
    np.testing.assert_allclose(by_position, np.broadcast_to(bound, by_position.shape), atol=1e-5)


def test_bos_per_window(tmp_path, documents):
    """bos_per_window: BOS + the next seq_len − 1 stream tokens; entropies of exactly those windows."""
    loaded = tiny_model("llama")
    out, _ = run_job(tmp_path, {"m": loaded}, documents, num_segments=3, bos_per_window=True)
    stream = token_windows(loaded.tokenizer, documents, SEQ_LEN - 1, 3)  # consecutive, non-overlapping
    windows = torch.cat([torch.full((3, 1), loaded.tokenizer.bos_token_id), stream], dim=1)
    ref = eager_entropies(loaded, windows)
    got = np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]
    np.testing.assert_allclose(got, ref.mean(1), atol=2e-5)
    plain = eager_entropies(loaded, token_windows(loaded.tokenizer, documents, SEQ_LEN, 3))
    assert np.abs(got - plain.mean(1)).max() > 1e-3  # the BOS windows are really different inputs
    assert out.summary["tokens"] == 3 * SEQ_LEN

    no_bos = LoadedModel(name="m", model=loaded.model, tokenizer=byte_tokenizer())
    no_bos.tokenizer.bos_token = None
    with pytest.raises(JobFailed, match="no BOS token.*bos_per_window=false"):
        run_job(tmp_path, {"m": no_bos}, documents, bos_per_window=True)


@pytest.mark.parametrize("names,steps", [(["r@step100", "r@step200"], [100, 200]), (["tiny-gpt2", "other"], [0, 1])])
def test_every_over_training_panel_shows_its_steps(tmp_path, monkeypatch, names, steps):
    """4 layers in a 2 x 3 grid: each panel (not only the bottom row's, as sharex would) numbers its steps.
    Models without step suffixes are not a training run: the axis names the models, in list order."""
    import types

    saved = {}
    monkeypatch.setattr(entropy_plots, "save", lambda fig, path: saved.setdefault(path.name, fig))
    layers, heads, n = 4, 2, 8
    bound = np.log(np.arange(n) + 1.0)
    results = [{"mean": np.full((layers, heads), float(step)), "by_position": np.ones((layers, 3, n)),
                "bound": np.stack([bound] * layers), "sliding_windows": {}} for step in (1, 2)]
    ctx = types.SimpleNamespace(artifact_dir=tmp_path)
    entropy._plots(ctx, types.SimpleNamespace(seq_len=n, dataset="wiki", train_job=None, histogram_bins=4), steps,
                   names, results, [None, None])
    fig = saved["entropy_over_training.png"]
    fig.canvas.draw()
    shown = {ax.get_title(): [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
             for ax in fig.axes if ax.get_title()}
    assert set(shown) == {"layer 0", "layer 1", "layer 2", "layer 3"} and all(shown.values())
    trained = names[0].endswith("@step100")
    assert {ax.get_xlabel() for ax in fig.axes if ax.get_title()} == {"training step" if trained else "model"}
    if not trained:
        assert all(labels == names for labels in shown.values())
    assert ("over training" in fig._suptitle.get_text()) == trained


def test_every_over_training_panel_has_its_own_y_range(tmp_path, monkeypatch):
    """Layer 0's heads spread over 0.7 nats, layer 1's are 0.01 apart near uniform, layer 2's 0.01 apart far
    below it: each panel spans its own heads (at least NATS_IN_VIEW of the uniform value), and the uniform line
    is drawn where it fits, named in the title where it would squeeze the heads into a strip."""
    saved = {}
    monkeypatch.setattr(entropy_plots, "save", lambda fig, path: saved.setdefault(path.name, fig))
    n, steps = 64, [100, 200, 300]
    bound = np.log(np.arange(n) + 1.0)
    uniform = bound.mean()
    spread = np.linspace(0, 1, 4)
    means = [np.stack([uniform - 0.7 * spread * i / 2, uniform - 0.02 - 0.01 * spread, 1.0 - 0.01 * spread])
             for i in range(len(steps))]
    results = [{"mean": m, "bound": np.stack([bound] * 3), "sliding_windows": {}} for m in means]
    entropy_plots.over_models(tmp_path / "o.png", steps, [f"r@step{s}" for s in steps], results, "r", "wiki", True)
    panels = {ax.get_title(): ax for ax in saved["o.png"].axes if ax.get_title()}
    assert set(panels) == {"layer 0", "layer 1", f"layer 2 (uniform {uniform:.2f}: above)"}
    for layer, ax in enumerate(panels.values()):
        lo, hi = ax.get_ylim()
        heads = np.stack(means)[:, layer]
        assert lo <= heads.min() and heads.max() <= hi  # every head in view
        assert hi - lo >= entropy_plots.NATS_IN_VIEW * uniform - 1e-9  # 0.01 nats must not fill a panel
        if layer:
            assert hi - lo < 0.3  # not layer 0's 0.7 nats
        uniform_lines = [line for line in ax.get_lines() if line.get_linestyle() == "--"
                         and np.allclose(line.get_ydata(), uniform)]
        assert len(uniform_lines) == (0 if layer == 2 else 1)
        if layer < 2:
            assert lo <= uniform <= hi


@pytest.mark.parametrize("layers", [3, 32])
def test_dimension_entropy_plot_stays_readable_with_many_layers(tmp_path, monkeypatch, layers):
    """Up to 8 layers, one outline of the gap histogram each (named in a legend); past that, one heatmap row
    per layer (layer 0 on top, as in the share map beside it) with the same percentages, empty bins blank."""
    from matplotlib.collections import QuadMesh
    from matplotlib.patches import StepPatch

    saved = {}
    monkeypatch.setattr(entropy_plots, "save", lambda fig, path: saved.setdefault(path.name, fig))
    edges = entropy.gap_edges(64)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, (layers, len(edges) - 1)) * (rng.random((layers, len(edges) - 1)) < 0.7)
    gap_pct = 100.0 * counts / counts.sum(1, keepdims=True)
    share = rng.uniform(0, 100, (layers, 4))
    d = {"near_uniform_pct": share, "near_uniform_pct_layer": share.mean(1), "near_uniform_pct_all": share.mean(),
         "gap_edges": edges, "gap_counts": counts, "gap_pct": gap_pct}
    params = EntropyParams(model="m", dataset="wiki", seq_len=64)
    entropy_plots.dimension_entropy(tmp_path / "d.png", d, params, "m on wiki")
    left = saved["d.png"].axes[0]
    outlines = [p for p in left.patches if isinstance(p, StepPatch)]
    meshes = [c for c in left.collections if isinstance(c, QuadMesh)]
    if layers <= 8:
        assert not meshes and len(outlines) == layers
        for layer, outline in enumerate(outlines):
            np.testing.assert_array_equal(outline.get_data().values, gap_pct[layer])
        assert len(left.get_legend().get_texts()) == layers + 1  # the layers and the margin
    else:
        assert not outlines and len(meshes) == 1 and left.get_legend() is None
        cells = meshes[0].get_array()
        np.testing.assert_array_equal(cells.filled(0).reshape(gap_pct.shape), gap_pct)
        np.testing.assert_array_equal(cells.mask.reshape(gap_pct.shape), counts == 0)
        assert left.get_ylim() == (layers - 0.5, -0.5)  # layer 0 on top
        assert "red dotted line: near-uniform margin" in left.get_xlabel()


def test_dtype_runs_the_model_in_that_precision(tmp_path, documents):
    """`dtype="bfloat16"` loads the model in bf16 (a job that ignored it would run float32 weights)."""
    loaded = {}

    class Recording(LocalContext):
        def load_model(self, name, *, dtype="float32"):
            loaded[name] = lm = super().load_model(name, dtype=dtype)
            return lm

    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        ctx = Recording(tmp_path / dtype, datasets={"wiki": documents})
        out = entropy.run(EntropyParams(model="tiny-llama", dataset="wiki", seq_len=SEQ_LEN, num_segments=3,
                                        batch_size=3, dtype=dtype), ctx)
        assert {p.dtype for p in loaded["tiny-llama"].model.parameters()} == {torch_dtype}
        assert 0 < out.summary["mean_entropy"] <= math.log(SEQ_LEN)


def test_matrices_with_weight_on_future_keys_are_refused_not_read():
    """The matrix route of a causal LM reads only causal matrices: a model whose returned attention spreads
    over every key (a mask built for another implementation, as Falcon's sdpa mask was under eager scores)
    fails the job instead of giving entropies above ln(t + 1). The config is switched back afterwards."""
    from types import SimpleNamespace

    class EveryKey(torch.nn.Module):
        _supports_attention_backend = False  # computes attention itself, like Falcon

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(_attn_implementation="sdpa")

        def forward(self, input_ids, use_cache, output_attentions):
            b, n = input_ids.shape
            seen.append(self.config._attn_implementation)
            return SimpleNamespace(attentions=(torch.full((b, 2, n, n), 1.0 / n),))

    seen = []
    model = EveryKey()
    with pytest.raises(JobFailed, match="future keys"):
        entropy.attention_matrix_entropies(model, torch.zeros(1, 6, dtype=torch.long))
    assert seen == ["eager"] and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ["llama", "gpt_neo"])
def test_a_model_that_overflows_float16_fails_saying_so(tmp_path, documents, arch):
    """Activations past float16's 65504 (one embedding coordinate of 7e4) give inf and NaN entropies, which used
    to end in the plots' "cannot convert float NaN to integer" (and NaN counted in the first histogram bin). The
    job fails naming the layers and what to change, on the kernel route and on the attention-matrix route; the same
    model in float32 runs."""
    lm = tiny_model(arch)
    with torch.no_grad():
        lm.model.get_input_embeddings().weight[:, 0] = 7e4
    out, _ = run_job(tmp_path / "float32", {"m": lm}, documents, num_segments=3)
    assert np.isfinite(out.summary["mean_entropy"])
    lm.model.half()
    with pytest.raises(JobFailed, match=r"m: the attention entropies of layer\(s\) 0, 1 are inf or NaN in float16 "
                                        r".* run with dtype bfloat16 or float32"):
        run_job(tmp_path / "float16", {"m": lm}, documents, num_segments=3, dtype="float16")


def test_statistics_count_rows_that_are_not_finite():
    stats = entropy.EntropyStats(layers=2, heads=1, seq_len=3, bins=4)
    stats.add(0, torch.tensor([[[0.0, 0.5, 1.0]]]))
    stats.add(1, torch.tensor([[[0.0, float("nan"), float("inf")]]]))
    dims = entropy.DimensionStats(layers=2, heads=1, seq_len=3, bins=4, margin=0.03, causal=False)
    dims.add(1, torch.tensor([[[[0.0, float("nan"), 1.0]]]]))
    assert stats.nonfinite.tolist() == [0, 2] and dims.nonfinite.tolist() == [0, 1]
    with pytest.raises(JobFailed, match=r"^m: what of layer\(s\) 1 are inf or NaN in bfloat16 .* are its weights "):
        entropy.refuse_nonfinite("m", "what", stats.nonfinite, "bfloat16")
    entropy.refuse_nonfinite("m", "what", torch.zeros(2, dtype=torch.int64), "float16")  # all finite: nothing
