"""`pruning`: each head's term against the explicit map W'(x)·x built in float64 from eager attention matrices;
removing heads against a copy of the model with those heads' columns of W_O zeroed; a worked example where some
heads add nothing; the job through the service."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as T

from lmscope.analyses import pruning
from lmscope.analyses.base import LoadedModel
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, read_documents
from lmscope.config import Settings
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.modeling.windows import token_windows
from lmscope.params.pruning import PruningParams
from tests.analyses.conftest import train_tiny_run
from tests.analyses.test_architectures import CONFIGS

SEQ_LEN = 24


@pytest.fixture(scope="module")
def documents():
    return read_documents(Settings.from_env().wikitext2_path, "lines")[:60]


def tiny(arch: str, seed: int = 0) -> LoadedModel:
    if arch == "gpt2":
        config = T.GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=BYTE_VOCAB_SIZE,
                              bos_token_id=256, eos_token_id=257, initializer_range=0.25)
    else:  # grouped-query: 4 query heads read 2 key/value heads
        config = T.LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                               intermediate_size=64, max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE,
                               bos_token_id=256, eos_token_id=257, pad_token_id=258, initializer_range=0.25)
    torch.manual_seed(seed)
    return LoadedModel(f"tiny-{arch}", T.AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer())


def run_job(tmp_path, loaded, documents, **params):
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"wiki": documents})
    params = {"model": "m", "dataset": "wiki", "seq_len": SEQ_LEN, "num_segments": 4, "eval_segments": 4,
              "batch_size": 3, **params}
    return pruning.run(PruningParams(**params), ctx), ctx


def explicit_values(block, x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a GPT-2 or LLaMA block's input x [W, N, D] through its own projections: the values [W, H, N, d] (key/value
    heads repeated for their query heads), W_O per head [H, d, D_out] and the output projection's bias."""
    H = heads
    if hasattr(block, "attn"):  # GPT-2: Conv1D, y = x @ weight
        D = x.shape[-1]
        v = block.attn.c_attn(block.ln_1(x))[..., 2 * D:]
        v = v.view(*v.shape[:2], H, D // H).transpose(1, 2)  # [W, H, N, d]
        return v, block.attn.c_proj.weight.view(H, D // H, D), block.attn.c_proj.bias  # head h: rows h·d … (h+1)·d
    attn = block.self_attn  # LLaMA: query head h reads key/value head h // (H / KV)
    d = attn.head_dim
    v = attn.v_proj(block.input_layernorm(x))
    v = v.view(*v.shape[:2], -1, d).transpose(1, 2).repeat_interleave(H // (v.shape[-1] // d), dim=1)
    return v, attn.o_proj.weight.T.reshape(H, d, -1), torch.zeros((), dtype=torch.float64)


@torch.no_grad()
def explicit_head_terms(loaded: LoadedModel, windows: torch.Tensor, heads_per_unit: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Float64, from the model's eager attention matrices A_h: o_{l,h,t} = Σ_j A_h[t,j] (x̃_j W_V^h + b_V^h) W_O^h.

    Returns [L, W, N, U] norms of the units' terms (the sum over each run of `heads_per_unit` adjacent heads)
    and [L, W, N] residual norms; checks Σ_h o_h + b_O is the attention output."""
    model = copy.deepcopy(loaded.model).double()
    model.set_attn_implementation("eager")
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    outputs = []
    hooks = [(b.attn.c_proj if hasattr(b, "attn") else b.self_attn.o_proj).register_forward_hook(
        lambda m, a, out: outputs.append(out)) for b in blocks]
    run = model(input_ids=windows, output_attentions=True, output_hidden_states=True, use_cache=False)
    for h in hooks:
        h.remove()
    terms, residual = [], []
    for layer, block in enumerate(blocks):
        x, A = run.hidden_states[layer], run.attentions[layer]  # [W, N, D], [W, H, N, N]
        H = A.shape[1]
        v, w_o, bias = explicit_values(block, x, H)
        o = torch.einsum("whtj,whjd,hde->wthe", A, v, w_o)  # [W, N, H, D_out]
        torch.testing.assert_close(o.sum(2) + bias, outputs[layer], rtol=1e-9, atol=1e-9)  # MHA = Σ_h terms + b_O
        terms.append(o.view(*o.shape[:2], H // heads_per_unit, heads_per_unit, -1).sum(3).norm(dim=-1).numpy())
        residual.append(x.norm(dim=-1).numpy())
    return np.stack(terms), np.stack(residual)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_head_terms_are_the_explicit_input_dependent_map(arch, documents, tmp_path):
    loaded = tiny(arch)
    out, _ = run_job(tmp_path, loaded, documents)
    saved = np.load(tmp_path / "pruning.npz")
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 4)  # the measured ones: the first 4
    terms, residual = explicit_head_terms(loaded, windows)
    expected = terms.mean((1, 2)) / residual.mean((1, 2))[:, None]  # E‖o_{l,h}‖ / E‖h_l‖
    np.testing.assert_allclose(saved["contribution"], expected, rtol=2e-5)
    np.testing.assert_allclose(saved["term_norm_mean"], terms.mean((1, 2)), rtol=2e-5)
    L, H = expected.shape
    assert (out.summary["layers"], out.summary["heads"], out.summary["tokens_measured"]) == (L, H, 4 * SEQ_LEN)
    smallest = out.summary["smallest_heads"][0]
    assert (smallest["layer"], smallest["head"]) == np.unravel_index(expected.argmin(), expected.shape)
    by_layer = {s.labels["layer"]: s.y for s in out.series if s.name == "head_contribution"}
    np.testing.assert_allclose([by_layer[layer] for layer in range(L)], expected, rtol=2e-5)


def zeroed_heads_copy(model, removed: list[tuple[int, int]], heads: int):
    """A copy of the model whose removed heads' columns of W_O are zero (their terms are then zero)."""
    clone = copy.deepcopy(model)
    blocks = pruning.model_parts(clone).blocks
    with torch.no_grad():
        for layer, head in removed:
            proj = pruning.output_projection(blocks[layer])
            conv = type(proj).__name__ == "Conv1D"  # weight [in, out]
            d = (proj.weight.shape[0] if conv else proj.weight.shape[1]) // heads
            if conv:
                proj.weight[head * d:(head + 1) * d] = 0
            else:
                proj.weight[:, head * d:(head + 1) * d] = 0
    return clone


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_removing_heads_is_zeroing_their_columns_of_the_output_projection(arch):
    """Every supported architecture: the job's hooks remove exactly the asked heads' terms."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    heads = model.config.num_attention_heads
    ids = torch.randint(0, 250, (2, 12))
    removed = [(0, 1), (1, 0), (1, heads - 1), (2, 2)]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        hooks = pruning.HeadHooks(pruning.model_parts(model).blocks, heads, model.config)
        try:
            hooks.remove_heads(removed)
            pruned = model(input_ids=ids).logits
            hooks.remove_heads([])
            restored = model(input_ids=ids).logits
        finally:
            hooks.close()
        expected = zeroed_heads_copy(model, removed, heads)(input_ids=ids).logits
    torch.testing.assert_close(pruned, expected, rtol=1e-5, atol=1e-5)
    assert (pruned - full).abs().max() > 1e-4  # the heads did something: the check can fail
    torch.testing.assert_close(restored, full, rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_measured_residual_stream_is_what_enters_each_block(arch):
    """Every supported architecture: the block pre-hooks sum the norms of the model's own hidden states
    h_0 … h_{L−1} (output_hidden_states), and the measuring pass's loss is the model's next-token loss."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    ids = torch.randint(0, 250, (3, 10))
    hooks = pruning.HeadHooks(pruning.model_parts(model).blocks, model.config.num_attention_heads,
                                 model.config)
    try:
        terms = pruning.measure_terms(model, hooks, ids, 2, lambda stage: None)
    finally:
        hooks.close()
    with torch.no_grad():
        run = model(input_ids=ids, output_hidden_states=True)
    layers = len(hooks.projections)
    expected = [h.double().norm(dim=-1).sum().item() for h in run.hidden_states[:layers]]
    np.testing.assert_allclose(terms.residual_norm, expected, rtol=1e-5)
    assert terms.loss == pytest.approx(mean_next_token_loss(model, ids), rel=1e-5)


# Written out from the models' code (not read from the job): the RMS norm each of these blocks applies to its
# attention output before the residual add, and the offset of its gain (Gemma's norms scale by 1 + weight).
POST_ATTENTION_NORM = {"gemma2": ("post_attention_layernorm", 1.0), "gemma3_text": ("post_attention_layernorm", 1.0),
                       "olmo2": ("post_attention_layernorm", 0.0), "olmo3": ("post_attention_layernorm", 0.0),
                       "glm4": ("post_self_attn_layernorm", 0.0)}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_each_head_term_is_its_share_of_what_the_attention_adds_to_the_stream(arch):
    """Every supported architecture, MLPs silenced (all their weights zero), so that h_{l+1} − h_l is what the
    attention adds to the stream. Each head's part of it, o_{h,t} = z_h W_O^hᵀ through the block's post-attention
    RMS norm (gain g = offset + weight, drawn at random here; s_t = 1/√(mean(y_t²) + config.rms_norm_eps)) or
    Granite's residual_multiplier, with the projection bias's part, sums to h_{l+1} − h_l; the job's c is their
    mean norm over the mean ‖h_l‖."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    if arch == "granite":
        config.residual_multiplier = 0.37  # its default, 1, would not tell
    model = T.AutoModelForCausalLM.from_config(config).eval()
    blocks = pruning.model_parts(model).blocks
    with torch.no_grad():
        for block in blocks:
            for param in block.mlp.parameters():
                param.zero_()
            if arch in POST_ATTENTION_NORM:  # initialised so that g = 1, which would not tell
                name, offset = POST_ATTENTION_NORM[arch]
                getattr(block, name).weight.normal_(1.0 - offset, 0.5)
    heads = model.config.num_attention_heads
    ids = torch.randint(0, 250, (2, 9))
    seen = {}
    recorders = [pruning.output_projection(b).register_forward_hook(
        lambda m, a, out, i=i: seen.__setitem__(i, (a[0].double(), out.double()))) for i, b in enumerate(blocks)]
    with torch.no_grad():
        run = model(input_ids=ids, output_hidden_states=True)
    for r in recorders:
        r.remove()
    hooks = pruning.HeadHooks(blocks, heads, model.config)
    try:
        terms = pruning.measure_terms(model, hooks, ids, 2, lambda stage: None)
    finally:
        hooks.close()
    for layer in range(len(blocks) - 1):  # the last hidden state is after the final norm
        z, y = seen[layer]
        projection = pruning.output_projection(blocks[layer])
        w = pruning.head_weights(projection, heads).double()  # [H, D, d]
        o = torch.einsum("bnhd,hed->bnhe", z.view(*z.shape[:2], heads, -1), w)  # [B, N, H, D]
        bias = torch.zeros(o.shape[-1], dtype=torch.float64) if projection.bias is None else projection.bias.detach().double()
        if arch in POST_ATTENTION_NORM:
            name, offset = POST_ATTENTION_NORM[arch]
            gain = getattr(blocks[layer], name).weight.detach().double() + offset
            s = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)  # [B, N, 1]
        else:
            gain = torch.ones(o.shape[-1], dtype=torch.float64)
            s = torch.full_like(y[..., :1], config.residual_multiplier if arch == "granite" else 1.0)
        stream = o * gain * s[..., None, :]  # [B, N, H, D]
        added = (run.hidden_states[layer + 1] - run.hidden_states[layer]).double()
        torch.testing.assert_close(stream.sum(2) + bias * gain * s, added, rtol=1e-4, atol=1e-5)
        expected = stream.norm(dim=-1).mean((0, 1)) / run.hidden_states[layer].double().norm(dim=-1).mean()
        np.testing.assert_allclose(terms.contribution[layer], expected.numpy(), rtol=1e-4)
    assert added.abs().max() > 1e-3  # the attention adds something: the check can fail
    kind = "post_attention_norm" if arch in POST_ATTENTION_NORM else "residual_multiplier" if arch == "granite" else "identity"
    assert {m.kind for m in hooks.maps} == {kind}


def mean_next_token_loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=windows).logits.double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


def test_heads_that_add_nothing_go_first_and_cost_nothing(documents, tmp_path):
    """Worked example of UAT's reading of pruning: three heads whose W_O is zero have no term; smallest-first
    removes them first and the loss does not move, while largest-first's first three heads cost loss. Every
    point of the curves is the loss of a copy of the model with those heads' W_O columns zeroed."""
    loaded = tiny("gpt2")
    silent = [(0, 2), (1, 0), (2, 3)]
    loaded = LoadedModel(loaded.name, zeroed_heads_copy(loaded.model, silent, 4), loaded.tokenizer)
    fractions = [0.0, 0.25, 0.5, 1.0]  # 0, 3, 6 and all 12 heads
    out, ctx = run_job(tmp_path, loaded, documents, fractions=fractions, random_orders=2, seed=7)
    saved = np.load(tmp_path / "pruning.npz")
    for layer, head in silent:
        assert saved["contribution"][layer, head] == 0.0
    assert sorted(saved["order_smallest_first"][0][:3].tolist()) == sorted(layer * 4 + head for layer, head in silent)
    assert out.summary["heads_removed"] == [0, 3, 6, 12]

    eval_windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)[4:]  # the 4 after the measured ones
    baseline = mean_next_token_loss(loaded.model, eval_windows)
    assert out.summary["baseline_loss"] == pytest.approx(baseline, rel=1e-6)
    curves = {s.labels["order"]: s.y for s in out.series if s.name == "pruned_loss"}
    assert set(curves) == {"smallest_first", "largest_first", "random"}
    for order in ("smallest_first", "largest_first"):
        perm = saved[f"order_{order}"][0]
        for k, loss in zip([0, 3, 6, 12], curves[order]):
            removed = [divmod(int(i), 4) for i in perm[:k]]
            assert loss == pytest.approx(mean_next_token_loss(zeroed_heads_copy(loaded.model, removed, 4),
                                                              eval_windows), rel=1e-6), (order, k)
    assert curves["smallest_first"][1] == pytest.approx(baseline, rel=1e-6)
    assert curves["largest_first"][1] > baseline * 1.001
    assert out.summary["prunable_fraction"]["smallest_first"] >= 0.25
    draws = [s for s in out.series if s.name == "pruned_loss.random_draw"]
    assert len(draws) == 2 and np.allclose(np.mean([d.y for d in draws], 0), curves["random"])
    assert out.summary["loss_all_heads_removed"] == curves["smallest_first"][-1] == curves["random"][-1]
    # each distinct set of removed heads is evaluated once; progress counts every batch
    done, total, _ = ctx.progress_log[-1]
    assert done == total
    assert {"pruning.png", "head_contributions.png", "pruning.npz"} <= {p.name for p in tmp_path.iterdir()}


def test_the_pruning_plot_counts_the_tokens_the_summary_counts(monkeypatch, documents, tmp_path):
    """pruning.png said "loss on 128 tokens" where the loss is over the 124 predicted ones the summary counts; its
    legend sits in the upper left, off the baseline lines."""
    from lmscope.analyses import pruning_plots
    from lmscope.analyses.plotting import pyplot

    saved = {}
    monkeypatch.setattr(pruning_plots, "save", lambda fig, path: saved.setdefault(path.name, fig))
    out, _ = run_job(tmp_path, tiny("gpt2"), documents, fractions=[0.0, 0.5, 1.0], single_head_ablation=True)
    evaluated = out.summary["tokens_evaluated"]
    assert evaluated == 4 * (SEQ_LEN - 1)
    ax = saved["pruning.png"].axes[0]
    assert f"loss on {evaluated:,} predicted tokens not used to rank them" in ax.get_title()
    assert ax.get_legend()._loc == 2  # upper left
    assert f"{4 * (SEQ_LEN - 1):,} predicted tokens" in saved["contribution_vs_ablation.png"].axes[0].get_title()
    for fig in saved.values():
        pyplot().close(fig)


def test_head_counts_round_the_written_share_half_up():
    assert pruning.head_counts([0.7], 45) == [32]  # 31.5 → 32 (as a float product 31.4999…)
    assert pruning.head_counts([0.0, 0.1, 0.12, 0.5, 1.0], 16) == [0, 2, 8, 16]  # 1.6 and 1.92 are both 2: once
    assert pruning.head_counts([0.25], 6) == [2]  # 1.5 → 2


def test_prunable_fraction_stops_at_the_first_point_past_the_tolerance():
    counts, baseline = [0, 2, 4, 6, 8], 2.0
    assert pruning.prunable_fraction(counts, [2.0, 2.01, 2.03, 2.0, 2.5], baseline, 0.01, 8) == 0.25  # 2.03 > 2.02
    assert pruning.prunable_fraction(counts, [2.0, 2.0, 2.0, 2.0, 2.02], baseline, 0.01, 8) == 1.0
    assert pruning.prunable_fraction([2, 4], [2.5, 2.0], baseline, 0.01, 8) == 0.0  # the first point already past


def test_a_projection_the_model_does_not_call_as_a_module_fails_the_job(documents, tmp_path):
    """A model that applies its output projection's weight itself would give zero terms and no removal."""
    loaded = tiny("gpt2")
    attn = loaded.model.transformer.h[1].attn
    weight, bias = attn.c_proj.weight, attn.c_proj.bias
    # a module whose call skips torch's hook machinery, as a model applying the weight itself would
    attn.c_proj = type("Bypassed", (torch.nn.Module,), {"__call__": lambda self, x: x @ self.weight + self.bias})()
    attn.c_proj.weight, attn.c_proj.bias = weight, bias
    with pytest.raises(pruning.JobFailed, match=r"layer\(s\) 1 was not called as a module"):
        run_job(tmp_path, loaded, documents)


def test_random_orders_follow_the_seed(documents, tmp_path):
    loaded = tiny("llama")
    run_job(tmp_path / "a", loaded, documents, orders=["random"], random_orders=3, seed=1, fractions=[0.5])
    run_job(tmp_path / "b", loaded, documents, orders=["random"], random_orders=3, seed=1, fractions=[0.5])
    run_job(tmp_path / "c", loaded, documents, orders=["random"], random_orders=3, seed=2, fractions=[0.5])
    a, b, c = (np.load(tmp_path / x / "pruning.npz")["order_random"] for x in "abc")
    assert a.shape == (3, 12) and (a == b).all() and not (a == c).all()
    assert all(sorted(row) == list(range(12)) for row in a)  # each a permutation of the 12 heads


@pytest.mark.parametrize("fractions, said", [([0.5, 0.2], "increasing order"), ([0.0, 1.5], "outside"),
                                             ([], "at least 1")])
def test_fractions_are_checked(fractions, said):
    with pytest.raises(ValueError, match=said):
        PruningParams(model="m", dataset="d", fractions=fractions)


def test_a_dataset_of_few_windows_is_split_between_measuring_and_evaluating(tmp_path):
    loaded = tiny("gpt2")
    text = ["a few words of text that make some tokens " * 6]
    available = len(token_windows(loaded.tokenizer, text, SEQ_LEN, None))
    assert 2 < available < 40
    out, _ = run_job(tmp_path, loaded, text, num_segments=30, eval_segments=10)
    s = out.summary
    assert s["windows_measured"] + s["windows_evaluated"] == available
    assert s["windows_measured"] == round(available * 30 / 40) and s["windows_evaluated"] >= 1
    with pytest.raises(pruning.JobFailed, match="one window"):
        run_job(tmp_path, loaded, ["too short " * 3])


def test_the_job_through_the_service(service):
    """Submitted over HTTP, run by the embedded worker: summary, series, plots, progress, a bad parameter's 422."""
    client, worker, _ = service
    r = client.post("/v1/jobs", json={"kind": "pruning", "params": {"model": "tiny-llama", "dataset": "wikitext-2",
                                                                    "seq_len": 32, "num_segments": 3,
                                                                    "eval_segments": 3, "fractions": [0, 0.5, 1]}})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]
    assert worker.run_once()
    job = client.get(f"/v1/jobs/{job_id}").get_json()
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"]["done"] == job["progress"]["total"]
    assert job["environment"]["kernel_backend"].startswith("transformers-")
    s = job["summary"]
    assert s["tokens_evaluated"] == 3 * 31 and set(s["prunable_fraction"]) == {"smallest_first", "largest_first", "random"}
    series = client.get(f"/v1/jobs/{job_id}/results?series=pruned_loss").get_json()["series"]
    assert {x["labels"]["order"] for x in series} == {"smallest_first", "largest_first", "random"}
    assert all(x["y"][0] == pytest.approx(s["baseline_loss"]) for x in series)
    names = {a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").get_json()["items"]}
    assert {"pruning.png", "head_contributions.png", "pruning.npz"} <= names
    from lmscope import demo  # what `make demo` prints of it

    [line] = demo.headline(job)
    assert line == (f"at tiny-llama: unpruned loss {s['baseline_loss']:.3f} nats; of its {s['units']} heads, removable "
                    "with the loss within +1%: " + ", ".join(f"{o} {round(v * s['units'])}"
                                                             for o, v in s["prunable_fraction"].items()))

    bad = client.post("/v1/jobs", json={"kind": "pruning", "params": {"model": "tiny-llama", "dataset": "wikitext-2",
                                                                      "fractions": [0.5, 0.1]}})
    assert bad.status_code == 422 and "increasing order" in bad.get_data(as_text=True)
    long = client.post("/v1/jobs", json={"kind": "pruning", "params": {"model": "tiny-gpt2", "dataset": "wikitext-2",
                                                                       "seq_len": 100_000}})
    assert long.status_code == 422 and "seq_len" in long.get_data(as_text=True)
    harm = client.post("/v1/jobs", json={"kind": "pruning", "params": {"model": "tiny-gpt2", "dataset": "wikitext-2",
                                                                       "orders": ["least_harm_first"]}})
    assert harm.status_code == 422 and "single_head_ablation" in harm.get_data(as_text=True)
    grad = client.post("/v1/jobs", json={"kind": "pruning", "params": {"model": "tiny-gpt2", "dataset": "wikitext-2",
                                                                       "orders": ["least_important_first"]}})
    assert grad.status_code == 422 and "gradient_importance" in grad.get_data(as_text=True)
    assert len(client.get("/v1/jobs?kind=pruning").get_json()["items"]) == 1  # the refused ones left nothing behind


def test_single_head_ablation_is_each_head_alone_removed(documents, tmp_path):
    """Δ_{l,h} is the float64 loss, on the measured windows, of a copy with only that head's W_O columns zeroed,
    minus the unpruned loss there; heads with no term cost exactly nothing and go first in least_harm_first, whose
    curve is checked against zeroed copies too."""
    loaded = tiny("gpt2")
    silent = [(0, 2), (1, 0), (2, 3)]
    loaded = LoadedModel(loaded.name, zeroed_heads_copy(loaded.model, silent, 4), loaded.tokenizer)
    out, ctx = run_job(tmp_path, loaded, documents, fractions=[0.0, 0.25, 0.5], single_head_ablation=True,
                       orders=["smallest_first", "least_harm_first"])
    saved = np.load(tmp_path / "pruning.npz")
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)
    measured, evaluated = windows[:4], windows[4:]
    unpruned = mean_next_token_loss(loaded.model, measured)
    expected = np.array([[mean_next_token_loss(zeroed_heads_copy(loaded.model, [(layer, head)], 4), measured) - unpruned
                          for head in range(4)] for layer in range(3)])
    np.testing.assert_allclose(saved["single_head_loss_increase"], expected, rtol=1e-4, atol=1e-6)
    for layer, head in silent:
        assert saved["single_head_loss_increase"][layer, head] == 0.0
    assert np.abs(expected).max() > 1e-3  # the other heads do cost (or gain) loss: the check can fail
    single = out.summary["single_head"]
    assert single["measured_loss"] == pytest.approx(unpruned, rel=1e-6)
    assert single["rank_correlation"] == pytest.approx(pruning.rank_correlation(saved["contribution"], expected))
    worst = np.unravel_index(expected.argmax(), expected.shape)
    assert (single["most_harmful_heads"][0]["layer"], single["most_harmful_heads"][0]["head"]) == worst
    assert single["heads_within_tolerance"] == int((expected <= 0.01 * unpruned).sum())

    perm = saved["order_least_harm_first"][0]
    assert perm.tolist() == np.argsort(expected.ravel(), kind="stable").tolist()
    curve = next(s.y for s in out.series if s.name == "pruned_loss" and s.labels["order"] == "least_harm_first")
    for k, loss in zip([0, 3, 6], curve):
        removed = [divmod(int(i), 4) for i in perm[:k]]
        assert loss == pytest.approx(mean_next_token_loss(zeroed_heads_copy(loaded.model, removed, 4), evaluated),
                                     rel=1e-6)
    by_layer = {s.labels["layer"]: s.y for s in out.series if s.name == "single_head_loss_increase"}
    np.testing.assert_allclose([by_layer[layer] for layer in range(3)], expected, rtol=1e-4, atol=1e-6)
    done, total, _ = ctx.progress_log[-1]
    assert done == total
    assert (tmp_path / "contribution_vs_ablation.png").stat().st_size > 0


def scaled_units_copy(model, layer: int, heads: list[int], factor: float, total_heads: int):
    """A float64 copy whose given heads' columns of W_O in one layer are multiplied by `factor` (their terms too)."""
    clone = copy.deepcopy(model).double()
    proj = pruning.output_projection(pruning.model_parts(clone).blocks[layer])
    conv = type(proj).__name__ == "Conv1D"  # weight [in, out]
    d = (proj.weight.shape[0] if conv else proj.weight.shape[1]) // total_heads
    with torch.no_grad():
        for head in heads:
            if conv:
                proj.weight[head * d:(head + 1) * d] *= factor
            else:
                proj.weight[:, head * d:(head + 1) * d] *= factor
    return clone


def window_losses(model, windows: torch.Tensor) -> np.ndarray:
    """Each window's mean next-token loss, float64."""
    with torch.no_grad():
        logits = model(input_ids=windows).logits.double()
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), windows[:, 1:], reduction="none")
    return per_token.mean(1).numpy()


@pytest.mark.parametrize("arch, unit, per_unit", [("gpt2", "head", 1), ("llama", "kv_group", 2)])
def test_gradient_importance_is_each_windows_loss_derivative_in_the_units_gate(arch, unit, per_unit, documents,
                                                                               tmp_path):
    """I = E_w |∂L_w/∂ξ| and −E_w ∂L_w/∂ξ against central differences of each window's loss in a float64 copy with
    the unit's W_O columns scaled by 1 + kε (not through the job's hooks); units with no term have I = 0 and go first
    in least_important_first, whose curve is checked against zeroed copies; the summary's rank correlations
    against the oracle's."""
    loaded = tiny(arch)
    silent = [(0, 1), (2, 0)]  # units whose W_O columns are zero
    loaded = LoadedModel(loaded.name, zeroed_heads_copy(loaded.model, [(layer, u * per_unit + i) for layer, u in silent
                                                                       for i in range(per_unit)], 4), loaded.tokenizer)
    units = 4 // per_unit
    out, ctx = run_job(tmp_path, loaded, documents, unit=unit, fractions=[0.0, 0.25, 0.5], gradient_importance=True,
                       single_head_ablation=True, orders=["smallest_first", "least_important_first"])
    saved = np.load(tmp_path / "pruning.npz")
    measured = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)[:4]
    # LLaMA's RMS norms and rotary tables compute in float32 even in a float64 copy, so the step is not tiny:
    # the five-point stencil's error is O(ε⁴)
    eps = 1e-2
    derivative = np.empty((3, units, len(measured)))
    for layer in range(3):
        for u in range(units):
            heads = list(range(u * per_unit, (u + 1) * per_unit))
            at = {k: window_losses(scaled_units_copy(loaded.model, layer, heads, 1 + k * eps, 4), measured)
                  for k in (-2, -1, 1, 2)}
            derivative[layer, u] = (at[-2] - 8 * at[-1] + 8 * at[1] - at[2]) / (12 * eps)
    importance, first_order = np.abs(derivative).mean(-1), -derivative.mean(-1)
    assert importance.min() < 1e-9 and importance.max() > 1e-2  # silent units, and others the check can see
    np.testing.assert_allclose(saved["importance"], importance, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(saved["first_order_loss_increase"], first_order, rtol=1e-4, atol=1e-6)
    for layer, u in silent:
        assert saved["importance"][layer, u] == 0.0
    perm = saved["order_least_important_first"][0]
    assert sorted(perm[:2].tolist()) == sorted(layer * units + u for layer, u in silent)
    assert perm.tolist() == np.argsort(saved["importance"].ravel(), kind="stable").tolist()
    evaluated = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)[4:]
    curve = next(s.y for s in out.series if s.name == "pruned_loss" and s.labels["order"] == "least_important_first")
    for k, loss in zip(out.summary["heads_removed"], curve):
        removed = [(int(i) // units, int(i) % units * per_unit + h) for i in perm[:k] for h in range(per_unit)]
        assert loss == pytest.approx(mean_next_token_loss(zeroed_heads_copy(loaded.model, removed, 4), evaluated),
                                     rel=1e-6)
    said = out.summary["gradient_importance"]
    assert said["rank_correlation"] == pytest.approx(pruning.rank_correlation(saved["contribution"], importance))
    harm = saved["single_head_loss_increase"]
    assert said["rank_correlation_with_ablation"] == pytest.approx(pruning.rank_correlation(importance, harm))
    assert said["first_order_rank_correlation"] == pytest.approx(pruning.rank_correlation(first_order, harm))
    most = np.unravel_index(importance.argmax(), importance.shape)
    assert (said["most_important_heads"][0]["layer"], said["most_important_heads"][0][unit]) == most
    by_layer = {s.labels["layer"]: s.y for s in out.series if s.name == "head_importance"}
    np.testing.assert_allclose([by_layer[layer] for layer in range(3)], importance, rtol=1e-4, atol=1e-6)
    done, total, _ = ctx.progress_log[-1]
    assert done == total and any(stage == "taking the gradient importance" for _, _, stage in ctx.progress_log)
    assert (tmp_path / "contribution_vs_importance.png").stat().st_size > 0
    assert not any(p.grad is not None for p in loaded.model.parameters())  # only the gates' gradients were formed
    assert all(p.requires_grad for p in loaded.model.parameters())  # and the weights are left as they were


def finite_difference_importance(model, removed: list[int], windows: torch.Tensor, heads: int = 4) -> np.ndarray:
    """[L, H] E_w |∂L_w/∂ξ| by five-point central differences in float64 copies with the removed heads' W_O zero and
    each other head's W_O scaled by 1 + kε (removed heads: 0)."""
    base = zeroed_heads_copy(model, [divmod(i, heads) for i in removed], heads)
    layers = len(pruning.model_parts(base).blocks)
    importance = np.zeros((layers, heads))
    eps = 1e-2
    for layer in range(layers):
        for head in range(heads):
            if layer * heads + head in removed:
                continue
            at = {k: window_losses(scaled_units_copy(base, layer, [head], 1 + k * eps, heads), windows)
                  for k in (-2, -1, 1, 2)}
            importance[layer, head] = np.abs((at[-2] - 8 * at[-1] + 8 * at[1] - at[2]) / (12 * eps)).mean()
    return importance


@pytest.mark.parametrize("normalize", [False, True])
def test_the_iterative_order_takes_the_importance_again_with_the_removed_heads_gone(normalize, documents, tmp_path):
    """Michel et al.'s procedure, checked step by step against central differences on copies with the heads so far
    removed zeroed: 3 of 12 heads at each of 0.25, 0.5, 0.75, the least important of the rest (by I / ‖I_layer‖₂
    with normalize_importance, in both importance orders); the reported importance is the unpruned, unnormalised
    one; its curve is the loss of those zeroed copies."""
    loaded = tiny("gpt2")
    out, ctx = run_job(tmp_path, loaded, documents, fractions=[0.0, 0.25, 0.5, 0.75, 1.0], gradient_importance=True,
                       orders=["least_important_first", "least_important_iterative"], normalize_importance=normalize)
    saved = np.load(tmp_path / "pruning.npz")
    measured = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)[:4]
    rank = pruning.normalized_by_layer if normalize else (lambda i: i)
    first = finite_difference_importance(loaded.model, [], measured)
    np.testing.assert_allclose(saved["importance"], first, rtol=1e-4, atol=1e-6)
    one_shot = np.argsort(rank(first).ravel(), kind="stable")
    assert saved["order_least_important_first"][0].tolist() == one_shot.tolist()
    expected: list[int] = []
    for _ in range(3):
        importance = finite_difference_importance(loaded.model, expected, measured)
        expected += [int(i) for i in np.argsort(rank(importance).ravel(), kind="stable") if i not in expected][:3]
    perm = saved["order_least_important_iterative"][0]
    assert sorted(perm.tolist()) == list(range(12))
    for k in (3, 6, 9):
        assert sorted(perm[:k].tolist()) == sorted(expected[:k]), k
    assert perm[:9].tolist() != one_shot[:9].tolist()  # re-taking the importance changes the order
    evaluated = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)[4:]
    curve = next(s.y for s in out.series if s.name == "pruned_loss" and s.labels["order"] == "least_important_iterative")
    assert len(curve) == 5
    for k, loss in zip([0, 3, 6, 9, 12], curve):
        zeroed = zeroed_heads_copy(loaded.model, [divmod(int(i), 4) for i in perm[:k]], 4)
        assert loss == pytest.approx(mean_next_token_loss(zeroed, evaluated), rel=1e-6)
    assert out.summary["gradient_importance"]["normalized_by_layer"] is normalize
    done, total, _ = ctx.progress_log[-1]
    # the progress total counted the re-taken passes: the unpruned one and two more, 2 batches each; none before
    # removing all 12 (nothing left to rank)
    assert done == total
    stages = [stage for _, _, stage in ctx.progress_log]
    assert stages.count("taking the gradient importance") == 2
    assert [s for s in stages if s.startswith("taking the gradient importance again")] == (
        ["taking the gradient importance again, 3 of 12 heads removed"] * 2
        + ["taking the gradient importance again, 6 of 12 heads removed"] * 2)


def test_iterative_passes_count_the_retaken_importances():
    assert pruning.iterative_passes([0, 3, 6, 9], 12) == 2  # before 6 and before 9; 3 uses the unpruned importance
    assert pruning.iterative_passes([0, 3, 6, 12], 12) == 1  # removing all needs no ranking
    assert pruning.iterative_passes([0, 12], 12) == 0 and pruning.iterative_passes([5], 12) == 0


def test_least_important_first_needs_the_gradient_importance():
    with pytest.raises(ValueError, match="set gradient_importance to true"):
        PruningParams(model="m", dataset="d", orders=["least_important_first"])
    assert PruningParams(model="m", dataset="d", orders=["least_important_first"], gradient_importance=True)
    with pytest.raises(ValueError, match="least_important_iterative ranks heads by their gradient importance"):
        PruningParams(model="m", dataset="d", orders=["least_important_iterative"])
    with pytest.raises(ValueError, match="unit='layer' there is one per layer"):
        PruningParams(model="m", dataset="d", orders=["least_important_first"], gradient_importance=True,
                      unit="layer", normalize_importance=True)
    with pytest.raises(ValueError, match="normalize_importance changes only the importance orders"):
        PruningParams(model="m", dataset="d", gradient_importance=True, normalize_importance=True)
    with pytest.raises(ValueError, match=r"add least_important_first or least_important_iterative to orders \(they "
                                         r"need gradient_importance=true\)"):
        PruningParams(model="m", dataset="d", normalize_importance=True)


def test_rank_correlation_worked_examples():
    assert pruning.rank_correlation(np.array([1, 2, 3, 4.]), np.array([1, 3, 2, 4.])) == pytest.approx(0.8)  # 1 − 6·2/60
    # ties share their mean rank: [1.5, 1.5, 3] against [1, 2, 3] → 1.5 / √(1.5 · 2)
    assert pruning.rank_correlation(np.array([5, 5, 9.]), np.array([0, 1, 2.])) == pytest.approx(1.5 / np.sqrt(3.0))
    assert pruning.rank_correlation(np.array([1, 2, 3.]), np.array([30, 20, 10.])) == pytest.approx(-1.0)
    assert pruning.rank_correlation(np.ones(4), np.arange(4.)) is None  # one side constant: no correlation


def test_least_harm_first_needs_the_ablation():
    with pytest.raises(ValueError, match="set single_head_ablation to true"):
        PruningParams(model="m", dataset="d", orders=["least_harm_first"])
    assert PruningParams(model="m", dataset="d", orders=["least_harm_first"], single_head_ablation=True)


@pytest.mark.parametrize("arch, unit, per_unit", [("llama", "kv_group", 2), ("gpt2", "layer", 4)])
def test_a_unit_of_several_heads_is_measured_and_removed_as_one(arch, unit, per_unit, documents, tmp_path):
    """unit=kv_group (the 2 query heads that read one of LLaMA's 2 key/value heads) and unit=layer (all 4 heads):
    c is the norm of the units' summed terms from the explicit float64 map, and removing a unit is zeroing all its
    heads' columns of W_O."""
    loaded = tiny(arch)
    out, _ = run_job(tmp_path, loaded, documents, unit=unit, fractions=[0.0, 0.5, 1.0], random_orders=1)
    saved = np.load(tmp_path / "pruning.npz")
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 8)
    terms, residual = explicit_head_terms(loaded, windows[:4], per_unit)
    expected = terms.mean((1, 2)) / residual.mean((1, 2))[:, None]
    assert expected.shape == (3, 4 // per_unit)
    np.testing.assert_allclose(saved["contribution"], expected, rtol=2e-5)
    s = out.summary
    assert (s["unit"], s["heads_per_unit"], s["units"]) == (unit, per_unit, 3 * 4 // per_unit)
    assert s["heads_removed"] == [0, round(0.5 * s["units"] + 1e-9), s["units"]]
    assert s["query_heads_removed"] == [k * per_unit for k in s["heads_removed"]]
    assert ("kv_group" in s["smallest_heads"][0]) == (unit == "kv_group") and "head" not in s["smallest_heads"][0]
    perm = saved["order_smallest_first"][0]
    k = s["heads_removed"][1]
    removed = [(int(i) // (4 // per_unit), (int(i) % (4 // per_unit)) * per_unit + j) for i in perm[:k] for j in range(per_unit)]
    curve = next(x.y for x in out.series if x.name == "pruned_loss" and x.labels["order"] == "smallest_first")
    assert curve[1] == pytest.approx(mean_next_token_loss(zeroed_heads_copy(loaded.model, removed, 4), windows[4:]),
                                     rel=1e-6)


GROUPED = sorted(a for a in CONFIGS if a not in ("falcon", "bloom")
                 and 1 < getattr(CONFIGS[a](), "num_key_value_heads", 0) < CONFIGS[a]().num_attention_heads)


@pytest.mark.parametrize("arch", GROUPED)
def test_a_key_value_group_is_the_query_heads_that_read_that_key_value_head(arch):
    """Every grouped-query architecture: with key/value head 1's value rows zeroed, exactly group 1's term is zero
    in every layer (so the adjacent-heads grouping is the model's own)."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    blocks = pruning.model_parts(model).blocks
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    with torch.no_grad():
        for block in blocks:
            attn = block.self_attn
            if hasattr(attn, "v_proj"):
                v, first = attn.v_proj, 0
            else:  # Phi-3: one qkv_proj, rows q (heads · d), k (kv · d), v (kv · d)
                v, first = attn.qkv_proj, (heads + kv) * attn.head_dim
            d = attn.head_dim
            v.weight[first + d:first + 2 * d] = 0
            if v.bias is not None:
                v.bias[first + d:first + 2 * d] = 0
    hooks = pruning.HeadHooks(blocks, kv, model.config)
    try:
        terms = pruning.measure_terms(model, hooks, torch.randint(0, 250, (2, 9)), 2, lambda stage: None)
    finally:
        hooks.close()
    assert (terms.contribution[:, 1] == 0).all()
    assert (terms.contribution[:, [g for g in range(kv) if g != 1]] > 1e-4).all()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_the_job_on_the_device_matches_the_cpu(arch, device, documents, tmp_path):
    """What a GPU worker runs (the hooks' Gram matrices, a post-attention norm's gain and the masks on the model's
    device), against the same job on the CPU."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    params = dict(model="m", dataset="wiki", seq_len=SEQ_LEN, num_segments=4, eval_segments=4, batch_size=2,
                  fractions=[0.0, 0.5, 1.0], orders=["smallest_first", "least_harm_first"], single_head_ablation=True,
                  gradient_importance=True)
    runs = []
    for where, on in (("cpu", "cpu"), ("device", device)):
        loaded = LoadedModel("m", copy.deepcopy(model).to(on), byte_tokenizer())
        ctx = LocalContext(tmp_path / where, models={"m": loaded}, datasets={"wiki": documents}, device=on)
        runs.append((pruning.run(PruningParams(**params), ctx), np.load(tmp_path / where / "pruning.npz")))
    (cpu, cpu_saved), (dev, dev_saved) = runs
    np.testing.assert_allclose(dev_saved["contribution"], cpu_saved["contribution"], rtol=1e-4)
    np.testing.assert_allclose(dev_saved["single_head_loss_increase"], cpu_saved["single_head_loss_increase"],
                               rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(dev_saved["importance"], cpu_saved["importance"], rtol=1e-3, atol=1e-6)
    assert dev.summary["baseline_loss"] == pytest.approx(cpu.summary["baseline_loss"], rel=1e-5)
    assert dev.summary["stream_map"] == ("post_attention_norm" if arch == "gemma2" else "identity")


@pytest.mark.parametrize("arch", ["gemma2", "gpt2"])
def test_the_hooks_are_built_on_the_models_device(arch):
    """The Gram matrices and a post-attention norm's gain live where the weights do (on the CPU this is checked
    with the meta device, which refuses a tensor from elsewhere as CUDA does)."""
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).to("meta")
    hooks = pruning.HeadHooks(pruning.model_parts(model).blocks, model.config.num_attention_heads, model.config)
    hooks.close()
    assert {g.device.type for g in hooks.grams} == {"meta"}


def test_several_models_are_pruned_each_and_followed_across_steps(documents, tmp_path):
    """models=[run@step0, run@step50] (two GPT-2s, one with three silent heads): each model's c against the explicit
    float64 map, its unpruned loss against the model's, the over-training summary and series in step order,
    the summary of the last model, one progress count over both."""
    first = tiny("gpt2", seed=1)
    trained = tiny("gpt2", seed=2)
    trained = LoadedModel("run@step50", zeroed_heads_copy(trained.model, [(0, 2), (1, 0), (2, 3)], 4),
                          trained.tokenizer)
    ctx = LocalContext(tmp_path, models={"run@step50": trained, "run@step0": first}, datasets={"wiki": documents})
    params = PruningParams(models=["run@step50", "run@step0"], dataset="wiki", seq_len=SEQ_LEN, num_segments=4,
                           eval_segments=4, batch_size=3, fractions=[0.0, 0.25, 1.0], random_orders=2,
                           single_head_ablation=True, gradient_importance=True)
    out = pruning.run(params, ctx)
    over = out.summary["over_training"]
    assert over["steps"] == [0, 50] and over["models"] == ["run@step0", "run@step50"]
    assert out.summary["summary_of"] == out.summary["model"] == "run@step50"
    windows = token_windows(first.tokenizer, documents, SEQ_LEN, 8)
    saved = np.load(tmp_path / "pruning_over_training.npz")
    for i, loaded in enumerate([first, trained]):
        terms, residual = explicit_head_terms(loaded, windows[:4])
        np.testing.assert_allclose(saved["contribution"][i], terms.mean((1, 2)) / residual.mean((1, 2))[:, None],
                                   rtol=2e-5)
        assert over["baseline_loss"][i] == pytest.approx(mean_next_token_loss(loaded.model, windows[4:]), rel=1e-6)
    # removing the trained model's three silent heads (a quarter of 12) costs nothing: its smallest-first
    # fraction reaches at least 0.25, and the single model's summary agrees with the over-training one
    assert over["prunable_fraction"]["smallest_first"][1] >= 0.25
    # the summary is the last model's (the one with silent heads)
    assert out.summary["prunable_fraction"]["smallest_first"] == over["prunable_fraction"]["smallest_first"][1]
    assert len(over["rank_correlation"]) == 2
    assert over["importance_rank_correlation"] == [pruning.rank_correlation(saved["contribution"][i], saved["importance"][i])
                                                   for i in range(2)]
    assert all(saved["importance"][1][layer, head] == 0.0 for layer, head in [(0, 2), (1, 0), (2, 3)])
    assert (saved["importance"][0] > 0).all()
    fractions = {s.labels["order"]: s for s in out.series if s.name == "prunable_fraction"}
    assert set(fractions) == {"smallest_first", "largest_first", "random"} and fractions["random"].x == [0, 50]
    c = [s for s in out.series if s.name == "head_contribution.over_training"]
    assert len(c) == 12 and all(s.x == [0, 50] for s in c)
    one = next(s for s in c if s.labels == {"layer": 1, "head": 0})
    assert one.y[1] == 0.0 and one.y[0] > 0  # a silent head in the trained model only
    done, total, _ = ctx.progress_log[-1]
    assert done == total and all(d <= t for d, t, _ in ctx.progress_log)
    assert [d for d, _, _ in ctx.progress_log] == list(range(1, done + 1))
    assert {"pruning_over_training.png", "pruning.png", "head_contributions.png"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("layers, heads, unit", [(2, 4, "head"), (3, 2, "layer")])
def test_models_of_different_shapes_are_refused(layers, heads, unit, documents, tmp_path):
    """Fewer layers; or as many layers and (with unit=layer) as many units, but other heads."""
    small = tiny("gpt2")
    torch.manual_seed(0)
    other = LoadedModel("b", T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_head=heads, n_embd=32, n_positions=64,
                                                           vocab_size=BYTE_VOCAB_SIZE)).eval(), byte_tokenizer())
    ctx = LocalContext(tmp_path, models={"a": small, "b": other}, datasets={"wiki": documents})
    with pytest.raises(pruning.JobFailed, match="one pruning job follows the same heads"):
        pruning.run(PruningParams(models=["a", "b"], dataset="wiki", seq_len=SEQ_LEN, num_segments=2,
                                  eval_segments=2, fractions=[0.5], unit=unit), ctx)


@pytest.mark.parametrize("given, said", [({}, "got none"), ({"model": "m", "train_job": 3}, "model and train_job")])
def test_exactly_one_model_source(given, said):
    with pytest.raises(ValueError, match=said):
        PruningParams(dataset="d", **given)


@pytest.mark.gpu
def test_pruning_over_a_train_jobs_checkpoints(service):
    """`train_job=<id>` through the API and the embedded worker: every checkpoint in step order, the last one's
    unpruned loss against the checkpoint loaded from disk."""
    from lmscope.modeling.loading import load_model

    client, worker, settings = service
    train_id = train_tiny_run(client, worker, settings, "pr")["id"]
    r = client.post("/v1/jobs", json={"kind": "pruning", "params": {
        "train_job": train_id, "dataset": "wiki-slice", "seq_len": 32, "num_segments": 2, "eval_segments": 2,
        "batch_size": 2, "fractions": [0, 0.5, 1], "unit": "kv_group"}})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]
    assert worker.run_once()
    job = client.get(f"/v1/jobs/{job_id}").get_json()
    assert job["status"] == "succeeded", job["error"]
    over = job["summary"]["over_training"]
    assert over["models"] == ["pr@step0", "pr@step2", "pr@step4"] and over["steps"] == [0, 2, 4]
    assert job["summary"]["units"] == 2 * 2 and job["progress"]["done"] == job["progress"]["total"]
    series = client.get(f"/v1/jobs/{job_id}/results?series=prunable_fraction").get_json()["series"]
    assert {x["labels"]["order"] for x in series} == {"smallest_first", "largest_first", "random"}
    assert all(x["x"] == [0, 2, 4] for x in series)
    names = {a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").get_json()["items"]}
    assert {"pruning_over_training.png", "pruning_over_training.npz", "pruning.png"} <= names

    lm = load_model("pr@step4", "checkpoint", str(settings.job_dir(train_id) / "checkpoints" / "step-4"))
    windows = token_windows(lm.tokenizer, read_documents(settings.wikitext2_path, "lines")[:400], 32, 4)
    assert over["baseline_loss"][-1] == pytest.approx(mean_next_token_loss(lm.model, windows[2:]), rel=1e-5)


def test_a_falcon_key_value_group_is_the_query_heads_that_read_that_key_value_head():
    """Falcon's new decoder architecture with 2 key/value heads: its fused query_key_value holds, per key/value
    head g, that group's queries, then its key, then its value (rows (g·(H/KV + 2) + H/KV + 1)·d onwards are
    g's value); with group 1's value rows zeroed exactly group 1's term is zero."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["falcon"](new_decoder_architecture=True, num_kv_heads=2)).eval()
    blocks = pruning.model_parts(model).blocks
    heads, kv = model.config.num_attention_heads, 2
    d, per = model.config.hidden_size // heads, heads // kv
    first = (1 * (per + 2) + per + 1) * d
    with torch.no_grad():
        for block in blocks:
            qkv = block.self_attention.query_key_value
            qkv.weight[first:first + d] = 0
            if qkv.bias is not None:
                qkv.bias[first:first + d] = 0
    hooks = pruning.HeadHooks(blocks, kv, model.config)
    try:
        terms = pruning.measure_terms(model, hooks, torch.randint(0, 250, (2, 9)), 2, lambda stage: None)
    finally:
        hooks.close()
    assert (terms.contribution[:, 1] == 0).all() and (terms.contribution[:, 0] > 1e-4).all()
