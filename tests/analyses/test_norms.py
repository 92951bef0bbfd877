"""The `norms` job kind against independent computations (docs/analyses/norms.md).

Oracles: each sample run alone through the model (no batching, no padding) with
``output_hidden_states``; a hand-built GPT-2 whose blocks add a known vector to the residual stream
(so the trajectories and percentages are worked out by hand); a one-block copy of the model fed
``inputs_embeds = h_l`` for the inner loss; and the linearised layer W assembled head by head from
the modules' behaviour on basis vectors for the Gram condition (‖Wx‖ ≥ ‖x‖); and the whole last
block re-run on all positions (float64) for the job's cheaper current-token route.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen3Config

from lmscope.analyses import linearised_layer, norms
from lmscope.analyses.base import JobCancelled, JobFailed, LoadedModel
from lmscope.analyses.host_reads import HostReads
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, read_documents
from lmscope.config import Settings
from lmscope.modeling.loading import model_info
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.params import validate_params
from lmscope.params.norms import NormsParams
from tests.conftest import computes_attention_itself, need_module

WIKITEXT = Settings.from_env().wikitext2_path  # the shared copy beside the checkout, else data/ (config.py)
MAX_TOKENS = 96
MIN_WORDS = 10


@pytest.fixture(scope="module")
def documents():
    """WikiText sentences: real English of varied lengths (so batches need padding)."""
    docs = [s.strip() + " ." for line in read_documents(WIKITEXT, "lines")[:20] for s in line.split(" . ")
            if s.strip()]
    assert any(len(d.split()) < MIN_WORDS for d in docs), "want some documents the word filter drops"
    return docs


def tiny(arch: str, seed: int = 0) -> LoadedModel:
    if arch == "gpt2":
        config = GPT2Config(n_layer=3, n_head=2, n_embd=32, n_positions=128, vocab_size=BYTE_VOCAB_SIZE,
                            bos_token_id=256, eos_token_id=257, initializer_range=0.05)
    else:  # LLaMA with grouped-query attention
        config = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             intermediate_size=64, max_position_embeddings=128, vocab_size=BYTE_VOCAB_SIZE,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258, initializer_range=0.05)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return LoadedModel(f"tiny-{arch}", model, byte_tokenizer(), model_info(model))


def run_job(path, lm: LoadedModel, documents, **params):
    ctx = LocalContext(path, models={"m": lm}, datasets={"wiki": documents})
    params = NormsParams(model="m", dataset="wiki", **{"max_tokens": MAX_TOKENS, "min_words": MIN_WORDS,
                                                       "batch_size": 4, **params})
    return norms.run(params, ctx), ctx


# ---------------------------------------------------------------- independent references

def reference_samples(tokenizer, documents, max_samples=None):
    """The definition: documents with ≥ min_words words, in order, cut to max_tokens + 1 tokens."""
    out = []
    for i, d in enumerate(documents):
        if len(d.split()) >= MIN_WORDS:
            out.append((i, tokenizer(d)["input_ids"][: MAX_TOKENS + 1]))
    return out[:max_samples]


_STATES: dict = {}


def unbatched_states(model, tokens):
    """h_0 … h_L for one sample read alone (no padding); h_L taken before the final norm. Cached."""
    key = (id(model), tuple(tokens))
    if key not in _STATES:
        _STATES[key] = _unbatched_states(model, tokens)
    return _STATES[key]


@torch.no_grad()
def _unbatched_states(model, tokens):
    final_norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
    seen = {}
    hook = final_norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("pre_norm", args[0]))
    try:
        out = model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    finally:
        hook.remove()
    L = model.config.num_hidden_layers
    states = [h[0].double() for h in out.hidden_states[:L]] + [seen["pre_norm"][0].double()]
    return states, out.logits[0].double()


def one_block_copy(model):
    """A 1-block model with the last block, final norm and LM head of `model`: logits of block(h_l).

    Built from the state dict with the last block renamed to block 0, so it works for any
    architecture whose blocks are `.h.<i>.` or `.layers.<i>.`."""
    L = model.config.num_hidden_layers
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[-1:]
    small = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to(model.dtype)
    state = model.state_dict()
    last = re.compile(r"\.(h|layers)\.0\.")
    small.load_state_dict({k: state[last.sub(lambda m: f".{m.group(1)}.{L - 1}.", k)].clone()
                           for k in small.state_dict()})
    if hasattr(small, "transformer"):  # GPT-2: no position embeddings on top of inputs_embeds = h_l
        small.transformer.wpe.weight.data.zero_()
    return small


@torch.no_grad()
def reference_inner_loss(small, states, tokens, positions):
    """[len(positions), L]: CE at each position of lm_head(norm(last block(h_l)))."""
    labels = torch.tensor(tokens[1:])[positions]
    out = []
    for h in states[:-1]:  # h_0 … h_{L-1}
        logits = small(inputs_embeds=h[None].float()).logits[0]
        out.append(F.cross_entropy(logits[positions].double(), labels, reduction="none"))
    return torch.stack(out, 1).numpy()


def percentages(norms_):
    steps = np.diff(norms_, axis=1) >= 0
    return 100 * steps.all(1).mean(), 100 * steps.mean()


# ---------------------------------------------------------------- the job on real text

@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory, documents):
    lm = tiny("gpt2")
    out, ctx = run_job(tmp_path_factory.mktemp("gpt2"), lm, documents, max_samples=20, loss_filter=None,
                       gram_samples=12, pca_samples=10)
    return lm, out, ctx


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, documents):
    """Through lmscope's attention kernel (its reference path on CPU), as on a GPU worker."""
    lm = tiny("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMSCOPE_KERNEL_BACKEND", "reference")
        out, ctx = run_job(tmp_path_factory.mktemp("llama"), lm, documents, max_samples=20, loss_filter=None,
                           include_last_layer=True, pca_samples=10)
    assert ctx.environment["kernel_backend"] == "reference"
    assert lm.model.config._attn_implementation == "sdpa", "the shared model gets its attention back"
    return lm, out, ctx


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_trajectories_match_each_sample_run_alone(arch, request, documents):
    lm, out, ctx = request.getfixturevalue(f"{arch}_run")
    L = lm.model.config.num_hidden_layers
    include_last = arch == "llama"
    saved = np.load(ctx.artifact_dir / "trajectories.npz")
    samples = reference_samples(lm.tokenizer, documents, 20)
    assert len(samples) == 20 and out.summary["samples"] == 20 and out.summary["trajectories"] == 20
    assert saved["doc_ids"].tolist() == [i for i, _ in samples]
    assert saved["positions"].tolist() == [len(t) - 2 for _, t in samples]
    assert len({len(t) for _, t in samples}) > 1, "samples of different lengths: batches are padded"

    expected = []
    for _, tokens in samples:
        states, _ = unbatched_states(lm.model, tokens)
        states = states if include_last else states[:L]  # never the post-final-norm state
        expected.append([h[-1].norm().item() for h in states])
    expected = np.array(expected)
    assert saved["norms"].shape == (20, L + include_last)
    np.testing.assert_allclose(saved["norms"], expected, rtol=1e-5)

    seq, pair = percentages(expected)
    assert out.summary["sequence_pct"] == pytest.approx(seq) and out.summary["pair_pct"] == pytest.approx(pair)
    assert out.summary["null_sequence_pct"] == pytest.approx(100 * 2.0 ** -(expected.shape[1] - 1))
    assert out.summary["layers"] == L and out.summary["trajectory_points"] == L + include_last
    series = {s.name: s for s in out.series}
    assert series["norm.mean"].x == list(range(L + include_last))
    np.testing.assert_allclose(series["norm.mean"].y, expected.mean(0), rtol=1e-5)
    np.testing.assert_allclose(series["norm.std"].y, expected.std(0), rtol=1e-4)
    np.testing.assert_allclose(series["norm.median"].y, np.median(expected, 0), rtol=1e-5)
    for q in (10, 90):  # the band around the mean
        np.testing.assert_allclose(series[f"norm.q{q}"].y, np.quantile(np.asarray(expected), q / 100, axis=0), rtol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_inner_loss_is_the_last_block_rerun_on_each_layer(arch, request, documents):
    lm, out, ctx = request.getfixturevalue(f"{arch}_run")
    L = lm.model.config.num_hidden_layers
    small = one_block_copy(lm.model)
    saved = np.load(ctx.artifact_dir / "trajectories.npz")
    expected = []
    for _, tokens in reference_samples(lm.tokenizer, documents, 20):
        states, logits = unbatched_states(lm.model, tokens)
        row = reference_inner_loss(small, states, tokens, [len(tokens) - 2])[0]
        # at l = L-1 the "inner" model is the model itself: its own loss on the final token
        assert row[-1] == pytest.approx(F.cross_entropy(logits[-1], torch.tensor(tokens[-1])).item(), rel=1e-4)
        expected.append(row)
    expected = np.array(expected)
    np.testing.assert_allclose(saved["inner_loss"], expected, rtol=1e-4)
    assert out.summary["inner_loss_kept"] == 20 and out.summary["inner_loss_total"] == 20  # loss_filter=None
    series = {s.name: s for s in out.series}
    assert series["inner_loss.mean"].x == list(range(L))
    np.testing.assert_allclose(series["inner_loss.mean"].y, expected.mean(0), rtol=1e-4)
    np.testing.assert_allclose(series["inner_loss.std"].y, expected.std(0), rtol=1e-3, atol=1e-6)


def test_a_non_finite_inner_loss_is_never_kept_nor_averaged():
    """An fp16 overflow gives inf/NaN at some layer: that trajectory is counted in
    inner_loss_nonfinite and left out of the kept set and of the series, with or without loss_filter."""
    losses = np.array([[3.0, 2.0, 1.0], [4.0, np.inf, 0.5], [5.0, 3.0, np.nan], [2.0, 2.0, 2.0]])
    m = norms.Measurements(norms=np.ones((4, 3)), losses=losses, pca_points=np.zeros((0, 3, 2)),
                           pca=norms.RunningPCA(2, "cpu"))
    samples = norms.Samples([[1, 2, 3]] * 4, np.arange(4), np.arange(4), np.ones(4, int), np.arange(5))
    for loss_filter, kept_rows in ((None, [0, 3]), (1.5, [0])):
        params = NormsParams(model="m", dataset="d", loss_filter=loss_filter)
        summary, series, kept = norms.summarise(params, m, samples, layers=3)
        assert kept.tolist() == [i in kept_rows for i in range(4)]
        assert summary["inner_loss_nonfinite"] == 2 and summary["inner_loss_kept"] == len(kept_rows)
        assert summary["inner_loss_final_mean"] == pytest.approx((1.0 + 2.0) / 2)  # rows 0 and 3
        mean = {s.name: s for s in series}["inner_loss.mean"].y
        np.testing.assert_allclose(mean, losses[kept_rows].mean(0))
        assert "inner_loss_note" not in summary
    # A filter nothing passes (an untrained model's loss is about ln(vocab)): the curves are still
    # there, over the finite trajectories, and labelled so.
    summary, series, kept = norms.summarise(NormsParams(model="m", dataset="d", loss_filter=0.1), m, samples, layers=3)
    assert not kept.any() and summary["inner_loss_kept"] == 0
    by = {s.name: s for s in series}
    np.testing.assert_allclose(by["inner_loss.mean"].y, losses[[0, 3]].mean(0))
    np.testing.assert_allclose(by["inner_loss.std"].y, losses[[0, 3]].std(0))
    assert by["inner_loss.mean"].labels["kept"] == 0 and by["inner_loss.mean"].labels["trajectories"] == 2
    assert "loss_filter=0.1" in summary["inner_loss_note"]


def test_an_inner_loss_that_overflows_everywhere_says_so():
    """The last block attends over positions that overflowed float16: every loss is NaN. No series, and a note
    that says why and what to change, rather than inner_loss_nonfinite alone."""
    m = norms.Measurements(norms=np.ones((3, 3)), losses=np.full((3, 3), np.nan), pca_points=np.zeros((0, 3, 2)),
                           pca=norms.RunningPCA(2, "cpu"))
    samples = norms.Samples([[1, 2, 3]] * 3, np.arange(3), np.arange(3), np.ones(3, int), np.arange(4))
    summary, series, _ = norms.summarise(NormsParams(model="m", dataset="d", loss_filter=None, dtype="float16"),
                                         m, samples, layers=3)
    assert summary["inner_loss_nonfinite"] == 3 and summary["inner_loss_final_mean"] is None
    assert not any(s.name.startswith("inner_loss") for s in series)
    assert summary["inner_loss_note"].startswith("every trajectory's inner loss is inf or NaN in float16")
    assert summary["inner_loss_note"].endswith("run with dtype bfloat16 or float32")


def test_loss_filter_keeps_samples_whose_final_loss_is_small(gpt2_run, tmp_path, documents):
    lm, _, first = gpt2_run
    final = np.load(first.artifact_dir / "trajectories.npz")["inner_loss"][:, -1]
    threshold = float(np.sort(final)[6])  # 7 of the 20 samples are at or below it
    out, ctx = run_job(tmp_path, lm, documents, max_samples=20, loss_filter=threshold, gram_condition=False,
                       pca_samples=0)
    assert out.summary["inner_loss_kept"] == 7 and out.summary["inner_loss_total"] == 20
    # pca_samples=0: no trajectory to draw, so no (empty) pca3d.png, and the summary says why
    assert not (ctx.artifact_dir / "pca3d.png").exists()
    assert out.summary["plots_note"].startswith("no pca3d.png: pca_samples=0")
    assert (ctx.artifact_dir / "norms.png").exists() and (ctx.artifact_dir / "inner_loss.png").exists()
    assert np.load(ctx.artifact_dir / "pca.npz")["coords"].shape == (0, 3, 3)
    done, total, _ = ctx.progress_log[-1]
    assert done == total  # the skipped plot still counts its step
    saved = np.load(ctx.artifact_dir / "trajectories.npz")
    assert saved["inner_loss_kept"].tolist() == (final <= threshold).tolist()
    series = {s.name: s for s in out.series}
    kept_losses = saved["inner_loss"][final <= threshold]
    np.testing.assert_allclose(series["inner_loss.mean"].y, kept_losses.mean(0), rtol=1e-5)
    assert series["inner_loss.mean"].labels["kept"] == 7


def test_summary_series_artifacts_plots_and_progress(gpt2_run):
    lm, out, ctx = gpt2_run
    for key in ("samples", "documents_too_short", "layers", "sequence_pct", "pair_pct", "null_sequence_pct", "inner_loss_kept",
                "gram_condition_pct"):
        assert key in out.summary, key
    assert {s.name for s in out.series} >= {"norm.mean", "norm.std", "norm.median", "inner_loss.mean", "inner_loss.std"}
    for name in ("norms.png", "inner_loss.png", "pca3d.png"):
        assert (ctx.artifact_dir / name).stat().st_size > 20_000, name  # a drawn figure, not an empty canvas
    assert "plots_note" not in out.summary  # every plot drawn
    pca = np.load(ctx.artifact_dir / "pca.npz")
    assert pca["coords"].shape == (10, 3, 3) and pca["components"].shape == (3, 32)
    np.testing.assert_allclose(pca["components"] @ pca["components"].T, np.eye(3), atol=1e-8)
    assert (np.diff(pca["explained_variance_ratio"]) <= 0).all() and 0 < pca["explained_variance_ratio"].sum() <= 1
    # One count over the whole job: every report moves it on (a total counted short would stall at 100 % before
    # the PCA, the Gram condition or the plots) and it ends at its total.
    done = [d for d, _, _ in ctx.progress_log]
    totals = {t for _, t, _ in ctx.progress_log}
    assert len(totals) == 1 and all(b > a for a, b in zip(done, done[1:])) and done[-1] == totals.pop()
    stages = [stage for _, _, stage in ctx.progress_log]
    assert stages.count("forward + inner loss") == 5  # 20 samples in batches of 4
    for stage in ("pca", "gram condition", "plots"):
        assert stage in stages
    assert ctx.environment["kernel_backend"] == "transformers-sdpa"  # CPU: PyTorch's SDPA, not the slow reference


def test_pca_of_all_trajectory_points(gpt2_run, documents):
    """PCA coordinates = projections of the drawn trajectories on the top eigenvectors of the covariance
    of every trajectory point, recomputed here with numpy."""
    lm, out, ctx = gpt2_run
    L = lm.model.config.num_hidden_layers
    points = []
    for _, tokens in reference_samples(lm.tokenizer, documents, 20):
        states, _ = unbatched_states(lm.model, tokens)
        points.append([h[-1].numpy() for h in states[:L]])
    points = np.array(points)  # [20, L, D]
    flat = points.reshape(-1, points.shape[-1])
    var, vecs = np.linalg.eigh(np.cov(flat.T))
    top = vecs[:, ::-1][:, :3].T
    pca = np.load(ctx.artifact_dir / "pca.npz")
    np.testing.assert_allclose(pca["explained_variance_ratio"], var[::-1][:3] / var.sum(), rtol=1e-4)
    signs = np.sign((top * pca["components"]).sum(1))  # eigenvectors are defined up to sign
    expected = (points[pca["sample_ids"]] - flat.mean(0)) @ top.T * signs
    np.testing.assert_allclose(pca["coords"], expected, rtol=1e-3, atol=1e-5)
    # The summary's pca_explained_variance: the first 3 explained-variance ratios of an SVD of the centred
    # points (σ_i² / Σσ², the same ratios as the covariance's eigenvalues, computed another way), descending.
    centred = flat.astype(np.float64) - flat.astype(np.float64).mean(0)
    sigma2 = np.linalg.svd(centred, compute_uv=False) ** 2
    ratio = sigma2 / sigma2.sum()
    assert (np.diff(ratio[:4]) < -1e-3).all()  # distinct components: the order is meaningful
    summary = np.array(out.summary["pca_explained_variance"])
    assert summary.shape == (3,) and (np.diff(summary) < 0).all()
    np.testing.assert_allclose(summary, ratio[:3], rtol=1e-4)


# ---------------------------------------------------------------- the last block at the current tokens only

SMALL = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
             max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE, initializer_range=0.1)
BLOCK_CONFIGS = {
    "gpt2": lambda: GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=BYTE_VOCAB_SIZE,
                               initializer_range=0.1),
    "llama-gqa": lambda: LlamaConfig(**SMALL),
    "mistral-sliding-window": lambda: MistralConfig(**SMALL, sliding_window=6),  # a window shorter than the text
    "qwen3-qk-norm": lambda: Qwen3Config(**SMALL, head_dim=8),
    "gpt-neox": lambda: GPTNeoXConfig(num_hidden_layers=3, num_attention_heads=4, hidden_size=32,
                                      intermediate_size=64, max_position_embeddings=64, vocab_size=BYTE_VOCAB_SIZE),
}


@pytest.mark.parametrize("arch", list(BLOCK_CONFIGS))
def test_last_block_outputs_equal_a_one_block_copy_fed_each_layer(arch):
    """block_L(h_l) (the last block) at the current tokens, for every l, against an independent model: a one-block
    copy of the model fed inputs_embeds = h_l with the same padding mask (float64). This is the only
    independent check of the generic route (GPT-NeoX re-runs the whole block)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BLOCK_CONFIGS[arch](), attn_implementation="sdpa").eval().double()
    parts = norms.model_parts(model)
    lengths = torch.tensor([20, 13, 7, 16])
    mask = (torch.arange(20)[None] < lengths[:, None]).long()
    hidden, call = norms.hidden_states(parts, torch.randint(0, 256, (4, 20)), mask)
    rows, cols = torch.tensor([0, 1, 2, 3, 3, 0]), torch.tensor([19, 12, 6, 15, 4, 9])
    got = norms.last_block_outputs(parts, hidden, call, mask, rows, cols)
    small = one_block_copy(model)
    seen = []
    hook = norms.model_parts(small).blocks[0].register_forward_hook(
        lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            for h in hidden:
                small(inputs_embeds=h, attention_mask=mask)
    finally:
        hook.remove()
    expected = torch.stack([y[rows, cols] for y in seen])
    assert got.shape == expected.shape == (3, 6, 32)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", list(BLOCK_CONFIGS))
def test_last_block_at_current_tokens_equals_the_whole_block(arch):
    """In float64, the last block computed at the current tokens only (K, V everywhere, the rest there)
    gives what re-running it on all positions of h_l gives, read at those tokens: padded rows,
    current tokens in the middle of a row (real tokens after them) and several in one row."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BLOCK_CONFIGS[arch](), attn_implementation="sdpa").eval().double()
    parts = norms.model_parts(model)
    lengths = torch.tensor([20, 13, 7, 16])  # right-padded to 20
    mask = (torch.arange(20)[None] < lengths[:, None]).long()
    hidden, call = norms.hidden_states(parts, torch.randint(0, 256, (4, 20)), mask)
    rows = torch.tensor([3, 0, 1, 2, 3, 3, 1, 0])
    cols = torch.tensor([15, 19, 12, 6, 2, 9, 5, 4])  # each row's last real token, then mid-row ones
    cheap = norms.current_token_block(parts.blocks[-1], call)
    assert (cheap is None) == (arch == "gpt-neox"), "GPT-2 and LLaMA-family blocks take the cheap route"
    fast = norms.last_block_outputs(parts, hidden, call, mask, rows, cols)
    whole = norms.last_block_outputs(parts, hidden, call, mask, rows, cols, route="full")
    assert fast.shape == whole.shape == (3, 8, 32)
    torch.testing.assert_close(fast, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast[-1], call.output[rows, cols], rtol=0, atol=0)  # l = L-1: the model's own pass
    # many current tokens per row (position="all"): GPT-2 then forms K and V rather than attending without them
    cols = [torch.arange(max(0, int(n) - 8), int(n)) for n in lengths]  # up to the last 8 real tokens of each row
    rows, cols = torch.cat([torch.full((len(c),), i) for i, c in enumerate(cols)]), torch.cat(cols)
    torch.testing.assert_close(norms.last_block_outputs(parts, hidden, call, mask, rows, cols),
                               norms.last_block_outputs(parts, hidden, call, mask, rows, cols, route="full"),
                               rtol=0, atol=1e-12)
    if arch == "mistral-sliding-window":  # the window matters here: without it row 3, token 15 sees 0 … 15
        block_at, rope, window = cheap
        position = torch.tensor([[15]])
        no_window = block_at(parts.blocks[-1], hidden[0][3:4], position, norms.keys_visible_from(position, mask[3:4], None),
                             tuple(r.expand(1, 20, -1) for r in rope))
        assert window == 6 and (no_window[0, 0] - whole[0, 0]).abs().max() > 1e-3


def test_gpt2_attention_without_keys_equals_attention_over_keys_and_values():
    """The GPT-2 route for few current tokens never forms K and V: in float64 it gives what softmax
    attention over K = z W_K + b_K and V = z W_V + b_V gives (b_K included: the identity drops it),
    with padding and several queries in a row; in float32 and half precision within their rounding."""
    torch.manual_seed(1)
    N, T, D, H = 3, 9, 16, 4
    z, w = torch.randn(N, T, D, dtype=torch.float64), torch.randn(D, 3 * D, dtype=torch.float64) / 4
    b = torch.randn(3 * D, dtype=torch.float64)
    positions, lengths = torch.tensor([[8, 3], [5, 5], [2, 0]]), torch.tensor([9, 6, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # right padding after each row's length
    # built here: query at position p of row n sees key t when t ≤ p (causal) and t < length (not padding)
    t = torch.arange(T)
    by_hand = (t[None, None] <= positions[..., None]) & (t[None, None] < lengths[:, None, None])  # [N, Q, T]
    assert by_hand.sum(-1).tolist() == [[9, 4], [6, 6], [3, 1]]
    visible = norms.keys_visible_from(positions, mask, None)  # the job's mask, what the route is given
    assert torch.equal(visible, by_hand[:, None])
    # the oracle: q at the query positions by plain indexing, K and V formed, softmax over visible keys, float64
    q = (z[torch.arange(N)[:, None], positions] @ w[:, :D] + b[:D]).unflatten(-1, (H, D // H))  # [N, Q, H, d]
    k, v = (z @ w[:, D:] + b[D:]).unflatten(-1, (2, H, D // H)).unbind(2)  # [N, T, H, d]
    scores = torch.einsum("nqhd,nthd->nhqt", q, k) * 0.5
    p = torch.softmax(scores.masked_fill(~by_hand[:, None], float("-inf")), dim=-1)
    want = torch.einsum("nhqt,nthd->nqhd", p, v).flatten(2)
    torch.testing.assert_close(norms.attend(q, k, v, visible, 0.5), want, rtol=1e-12, atol=1e-12)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        cast = (t.to(dtype) for t in (q, z, w[:, D:2 * D], w[:, 2 * D:], b[2 * D:]))
        got = norms.attend_without_keys(*cast, visible, 0.5)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_padding_needs_no_pad_id_in_the_model(tmp_path, documents):
    """A tokenizer whose pad id (258) is past the model's 258 embeddings, as when a pad token was added to a
    tokenizer without resizing the model: the padded batches run (padding is masked, whatever id fills it),
    and the trajectories are those of the same samples run one at a time, without padding."""
    config = GPT2Config(n_layer=3, n_head=2, n_embd=32, n_positions=128, vocab_size=258, initializer_range=0.05)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    tokenizer = byte_tokenizer(add_bos=False)  # ids 0..257 (EOS), pad 258
    assert tokenizer.pad_token_id == 258
    out, _ = run_job(tmp_path, LoadedModel("m", model, tokenizer, model_info(model)), documents[:12],
                     max_samples=8, inner_loss=False, gram_condition=False, pca_samples=0)
    got = np.load(tmp_path / "trajectories.npz")["norms"]
    samples = [tokens for _, tokens in reference_samples(tokenizer, documents[:12], max_samples=8)]
    assert len(got) == len(samples) == 8 and len({len(t) for t in samples}) > 1  # the batches were padded
    for row, tokens in zip(got, samples):
        states, _ = unbatched_states(model, tokens)
        want = [float(h[-1].norm()) for h in states[:3]]  # h_0 .. h_2 at the current token
        np.testing.assert_allclose(row, want, rtol=1e-5)


def test_documents_too_short_for_a_current_token_are_counted():
    """position="all", min_position=5: a sample needs 7 tokens (BOS + 6 bytes with the byte tokenizer).
    Documents with enough words but fewer tokens are skipped and counted, up to max_samples."""
    docs = ["ab cd", "abcdefgh ij", "x y", "hello world", "a b c d e f g h"]  # 5, 11, 3, 11, 15 bytes
    tok = byte_tokenizer()
    assert [len(tok(d)["input_ids"]) for d in docs] == [6, 12, 4, 12, 16]  # BOS + bytes
    params = NormsParams(model="m", dataset="d", min_words=2, position="all", min_position=5)
    samples = norms.select_samples(tok, docs, params)
    assert samples.doc_ids.tolist() == [1, 3, 4] and samples.too_short == 2
    first_only = norms.select_samples(tok, docs, params.model_copy(update={"max_samples": 1}))
    assert first_only.doc_ids.tolist() == [1] and first_only.too_short == 1  # "x y" was never reached


def test_a_model_the_kernel_cannot_run_keeps_its_own_attention(tmp_path, documents, monkeypatch):
    """GPT-Neo computes its attention itself: where the kernel would run, the job keeps the model's own and says so."""
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "triton")
    config = GPTNeoConfig(num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=2, hidden_size=32,
                          max_position_embeddings=128, vocab_size=BYTE_VOCAB_SIZE, bos_token_id=256, eos_token_id=257,
                          initializer_range=0.05)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert computes_attention_itself(model)
    lm = LoadedModel("tiny-gpt-neo", model, byte_tokenizer(), model_info(model))
    out, ctx = run_job(tmp_path, lm, documents, max_samples=6, gram_condition=False, pca_samples=3)
    assert ctx.environment["kernel_backend"].startswith(
        "transformers-eager (the lmscope kernel cannot run this model: GPTNeoForCausalLM computes its attention itself")
    expected = [[h[-1].norm().item() for h in unbatched_states(model, tokens)[0][:2]]
                for _, tokens in reference_samples(lm.tokenizer, documents, 6)]
    np.testing.assert_allclose(np.load(tmp_path / "trajectories.npz")["norms"], expected, rtol=1e-5)
    assert out.summary["samples"] == 6


def test_a_head_dim_past_the_kernels_keeps_the_models_own_attention(tmp_path, documents, monkeypatch):
    """head_dim 288 (> 256): where the Triton kernel would run, the job keeps the model's own attention
    and says why, rather than a record of "triton" over attention that ran elsewhere."""
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "triton")
    config = GPT2Config(n_layer=2, n_head=1, n_embd=288, n_positions=128, vocab_size=BYTE_VOCAB_SIZE,
                        bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    lm = LoadedModel("wide-head", model, byte_tokenizer(), model_info(model))
    out, ctx = run_job(tmp_path, lm, documents, max_samples=4, gram_condition=False, pca_samples=2)
    assert ctx.environment["kernel_backend"] == ("transformers-sdpa (the lmscope kernel cannot run this model: "
                                                 "the Triton kernel supports head dims up to 256; got 288)")
    assert out.summary["samples"] == 4


@pytest.mark.gpu
def test_the_kernel_route_on_the_device_matches_the_reference(llama_run, tmp_path, documents, device, monkeypatch):
    """What a GPU worker runs: the forward pass through lmscope's Triton kernel on the device (the
    interpreter on a CPU), GQA LLaMA, against the reference route's run of the same job."""
    need_module("triton")
    lm, ref_out, ref_ctx = llama_run
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "triton")
    on_device = LoadedModel(lm.name, copy.deepcopy(lm.model).to(device), lm.tokenizer, lm.info)
    ctx = LocalContext(tmp_path, models={"m": on_device}, datasets={"wiki": documents}, device=device)
    params = NormsParams(model="m", dataset="wiki", max_tokens=MAX_TOKENS, min_words=MIN_WORDS, batch_size=4,
                         max_samples=20, loss_filter=None, include_last_layer=True, pca_samples=10)
    out = norms.run(params, ctx)
    assert ctx.environment["kernel_backend"] == "triton"
    got, ref = (np.load(c.artifact_dir / "trajectories.npz") for c in (ctx, ref_ctx))
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-4)
    for key in ("sequence_pct", "pair_pct", "inner_loss_kept"):
        assert out.summary[key] == ref_out.summary[key], key
    (loss,), (ref_loss,) = ([s for s in o.series if s.name == "inner_loss.mean"] for o in (out, ref_out))
    np.testing.assert_allclose(loss.y, ref_loss.y, rtol=1e-4)


def test_inner_loss_routes_agree_in_float32(llama_run, documents):
    """The job's dtype: the cheap route's losses match the whole-block route's to float32 rounding."""
    lm = llama_run[0]
    parts = norms.model_parts(lm.model)
    params = NormsParams(model="m", dataset="wiki", max_tokens=MAX_TOKENS, min_words=MIN_WORDS, max_samples=8,
                         position="all", min_position=40)
    samples = norms.select_samples(lm.tokenizer, documents, params)
    batch, trajs = next(norms.batches(samples, 8))
    ids, mask = norms.pad_batch(samples, batch, 0, "cpu")
    rows, cols = norms.current_tokens(samples, batch, trajs, "cpu")
    labels = torch.tensor([samples.tokens[s][p + 1]
                           for s, p in zip(samples.traj_sample[trajs], samples.traj_pos[trajs])])
    hidden, call = norms.hidden_states(parts, ids, mask)
    fast = norms.inner_losses(parts, hidden, call, mask, rows, cols, labels)
    whole = norms.inner_losses(parts, hidden, call, mask, rows, cols, labels, route="full")
    assert fast.shape == (len(trajs), 3) and len(trajs) > len(batch)
    torch.testing.assert_close(fast, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_measuring_loop_reads_nothing_back_from_the_device(arch, tmp_path, documents):
    """On a GPU the host should queue batch after batch without waiting: besides the model's own forward
    passes, the loop (indices, norms, PCA points, the inner loss at the current tokens) reads no value
    back and runs no op whose output size depends on the data."""
    lm = tiny(arch)
    parts = norms.model_parts(lm.model)
    params = NormsParams(model="m", dataset="wiki", max_tokens=MAX_TOKENS, min_words=MIN_WORDS, max_samples=6,
                         batch_size=3, position="all", min_position=20, pca_samples=4)
    samples = norms.select_samples(lm.tokenizer, documents, params)
    ctx = LocalContext(tmp_path, models={"m": lm}, datasets={"wiki": documents})
    pca_trajs = np.array([0, 3, len(samples.traj_sample) - 1])
    with HostReads() as job:
        m = norms.measure(params, ctx, parts, samples, 0, "cpu", parts.num_layers, pca_trajs, norms.Progress(ctx, 99))
    with HostReads() as model_alone:
        for batch, _ in norms.batches(samples, params.batch_size):
            norms.hidden_states(parts, *norms.pad_batch(samples, batch, 0, "cpu"))
    assert job.ops == model_alone.ops
    # and the loop did its work: every trajectory has its norms and inner losses, the drawn ones their points
    assert (m.norms > 0).all() and np.isfinite(m.losses).all()
    np.testing.assert_allclose(np.linalg.norm(m.pca_points, axis=-1), m.norms[pca_trajs], rtol=1e-5)


def test_the_whole_block_route_repeats_per_sample_arguments_only():
    """Re-running a block for c layers at once repeats what is per sample (first dim = batch), layer-major,
    and leaves what is per position alone, even when the sequence is as long as the batch."""
    B, T, c = 4, 4, 3
    x, mask = torch.randn(B, T, 8), torch.ones(B, 1, T, T)
    tiled = norms._tile({"hidden": x, "attention_mask": mask, "cache_position": torch.arange(T),
                         "position_embeddings": (torch.randn(B, T, 2), torch.randn(1, T, 2))}, B, c)
    assert torch.equal(tiled["hidden"], torch.cat([x] * c)) and tiled["attention_mask"].shape == (c * B, 1, T, T)
    assert torch.equal(tiled["cache_position"], torch.arange(T))
    cos, sin = tiled["position_embeddings"]
    assert cos.shape == (c * B, T, 2) and sin.shape == (1, T, 2)  # a [1, T, …] tensor broadcasts as it is


# ---------------------------------------------------------------- Gram condition (Proposition 1)

def linear_map(module, dim):
    """The matrix M of x ↦ module(x) − module(0), read off the module's outputs on basis vectors."""
    with torch.no_grad():
        eye = torch.eye(dim, dtype=torch.float64)
        m = copy.deepcopy(module).double()
        return (m(eye) - m(torch.zeros(1, dim, dtype=torch.float64))).T  # column j = M e_j


def block_maps(block, D):
    qkv = linear_map(block.attn.c_attn, D)  # [3D, D]
    W1 = linear_map(block.mlp.c_fc, D)  # [4D, D]
    return dict(Wq=qkv[:D], Wk=qkv[D:2 * D], Wv=qkv[2 * D:], Wo=linear_map(block.attn.c_proj, D),
                W1=W1, W2=linear_map(block.mlp.c_proj, W1.shape[0]), H=block.attn.num_heads)


def direct_linearised_layer(maps, context, t):
    """W = (I + W2 W1)(I + Σ_h Σ_{i≤t} W_O^h W_V^h z_i z_iᵀ W_K^hᵀ W_Q^h), term by term."""
    D = context.shape[-1]
    H = maps["H"]
    dh = D // H
    Wq, Wk, Wv, Wo, W1, W2 = (maps[k] for k in ("Wq", "Wk", "Wv", "Wo", "W1", "W2"))
    mhsa = torch.zeros(D, D, dtype=torch.float64)
    for h in range(H):
        s = slice(h * dh, (h + 1) * dh)
        for i in range(t + 1):
            z = context[i][:, None]
            mhsa += Wo[:, s] @ Wv[s] @ z @ z.T @ Wk[s].T @ Wq[s]
    eye = torch.eye(D, dtype=torch.float64)
    return (eye + W2 @ W1) @ (eye + mhsa)


@pytest.mark.parametrize("include_last_layer", [False, True])
def test_gram_condition_matches_direct_norm_comparison(gpt2_run, documents, tmp_path, include_last_layer):
    """Every step of a trajectory: h_l with block l + 1, for l < L − 1, and with include_last_layer also
    h_{L-1} with the last block (the step to h_L)."""
    lm, out, ctx = gpt2_run
    if include_last_layer:
        out, ctx = run_job(tmp_path, lm, documents, max_samples=20, loss_filter=None, gram_samples=12,
                           pca_samples=10, include_last_layer=True, inner_loss=False)
    L = lm.model.config.num_hidden_layers
    steps = L if include_last_layer else L - 1
    saved = np.load(ctx.artifact_dir / "gram_condition.npz")
    samples = reference_samples(lm.tokenizer, documents, 20)
    traj = np.load(ctx.artifact_dir / "trajectories.npz")
    assert len(np.unique(saved["trajectory_ids"])) == 12 and set(saved["layers"].tolist()) == set(range(steps))
    pairs = list(zip(saved["trajectory_ids"].tolist(), saved["layers"].tolist()))
    assert pairs == sorted(pairs)  # in (trajectory, layer) order, whatever the batches' order
    maps = [block_maps(b, lm.model.config.n_embd) for b in lm.model.transformer.h]
    direct, ratios = [], []
    for tr, layer in zip(saved["trajectory_ids"], saved["layers"]):
        tokens = samples[traj["sample_ids"][tr]][1]
        t = traj["positions"][tr]
        states, _ = unbatched_states(lm.model, tokens)
        W = direct_linearised_layer(maps[layer], states[layer], t)
        x = states[layer][t]
        direct.append(bool((W @ x).norm() >= x.norm()))
        ratios.append(float((W @ x).norm() ** 2 / x.norm() ** 2))
    direct = np.array(direct)
    assert 0 < direct.mean() < 1, "the check must see both outcomes"
    assert saved["holds"].tolist() == direct.tolist()
    np.testing.assert_allclose(saved["ratio"], ratios, rtol=1e-6)  # Σλab / Σab = ‖Wx‖² / ‖x‖²
    assert out.summary["gram_condition_pct"] == pytest.approx(100 * direct.mean())
    assert out.summary["gram_condition_pairs"] == 12 * steps


def test_gram_condition_in_chunks_of_one_pair_gives_the_same_pairs(gpt2_run, documents, tmp_path, monkeypatch):
    """The default memory budget fits a test batch in one chunk per layer; one pair per chunk must
    write the same (trajectory, layer, holds, ratio) rows, in the same order."""
    lm, _, ctx = gpt2_run
    monkeypatch.setattr(norms, "GRAM_CONTEXT_BYTES", 1)
    _, small_ctx = run_job(tmp_path, lm, documents, max_samples=20, loss_filter=None, gram_samples=12, pca_samples=10)
    whole, chunked = (np.load(c.artifact_dir / "gram_condition.npz") for c in (ctx, small_ctx))
    assert set(whole.files) == set(chunked.files)
    for name in whole.files:
        if whole[name].dtype.kind == "f":  # batched matmuls round in another order: an ulp apart
            np.testing.assert_allclose(whole[name], chunked[name], rtol=1e-12, err_msg=name)
        else:
            np.testing.assert_array_equal(whole[name], chunked[name], err_msg=name)


def gram_condition_holds(W: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposition 1 as the paper states it, for a batch: W [P, D, D], x [P, D] → (holds [P], Σλab / Σab [P]),
    with WᵀW = UΛU⁻¹ from eigh, a = Uᵀx, b = U⁻¹x (= Uᵀx: U is orthogonal)."""
    W, x = W.to(torch.float64), x.to(torch.float64)
    lam, U = torch.linalg.eigh(W.transpose(1, 2) @ W)
    a = (U.transpose(1, 2) @ x[..., None])[..., 0]
    b = (torch.linalg.inv(U) @ x[..., None])[..., 0]
    stretched, plain = (lam * a * b).sum(-1), (a * b).sum(-1)
    return stretched >= plain, stretched / plain


def test_gram_eigen_form_is_the_norm_comparison():
    torch.manual_seed(0)
    D = 6
    Q, _ = torch.linalg.qr(torch.randn(3, D, D, dtype=torch.float64))
    x = torch.randn(3, D, dtype=torch.float64)
    stretch, _ = gram_condition_holds(1.1 * Q, x)  # ‖1.1·Qx‖ = 1.1‖x‖
    shrink, ratio = gram_condition_holds(0.9 * Q, x)
    assert stretch.all() and not shrink.any()
    np.testing.assert_allclose(ratio.numpy(), 0.81, rtol=1e-10)  # Σλab/Σab = ‖Wx‖²/‖x‖²
    W = torch.eye(D, dtype=torch.float64) + 0.4 * torch.randn(200, D, D, dtype=torch.float64)
    x = torch.randn(200, D, dtype=torch.float64)
    holds, ratio = gram_condition_holds(W, x)
    direct = (W @ x[..., None])[..., 0].norm(dim=1) >= x.norm(dim=1)
    assert 0.1 < direct.double().mean() < 0.9
    assert torch.equal(holds, direct)
    np.testing.assert_allclose(ratio.numpy(), ((W @ x[..., None])[..., 0].norm(dim=1) / x.norm(dim=1)).numpy() ** 2,
                               rtol=1e-9)


def test_llama_gram_condition_not_applicable(llama_run):
    _, out, ctx = llama_run
    assert out.summary["gram_condition_pct"] is None
    assert "gated" in out.summary["gram_condition_reason"]
    assert not (ctx.artifact_dir / "gram_condition.npz").exists()


def test_a_model_handed_over_without_its_facts_gets_them(tmp_path):
    """LoadedModel(name, model, tokenizer), as docs/analyses show for use without the service: the local
    context fills in model_info, so a LLaMA's Gram reason names its gated FFN (it named parallel-residual
    blocks, from an empty info)."""
    model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                                         intermediate_size=32, vocab_size=BYTE_VOCAB_SIZE)).eval()
    ctx = LocalContext(tmp_path, models={"m": LoadedModel("m", model, byte_tokenizer())})
    assert ctx.load_model("m").info == model_info(model) and model_info(model)["gated_ffn"]
    parts = norms.model_parts(model)
    reason = norms.gram_not_applicable(NormsParams(model="m", dataset="d"), parts, ctx.load_model("m").info)
    assert "a gated FFN (LLaMA family)" in reason


# ---------------------------------------------------------------- a model with a worked-out answer

CLASS_START = {0: 1.0, 1: -1.0, 2: -0.7}  # h_0 = start·e_1 by token class (token id mod 3)
STEP = 0.5  # every block adds 0.5·e_1


def hand_built_gpt2() -> LoadedModel:
    """Attention output 0, MLP output = its c_proj bias (0.5·e_1): h_{l+1} = h_l + 0.5·e_1 exactly."""
    config = GPT2Config(n_layer=3, n_head=2, n_embd=8, n_positions=128, vocab_size=BYTE_VOCAB_SIZE)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for block in model.transformer.h:
            block.ln_1.weight.fill_(1)
            block.ln_2.weight.fill_(1)
            block.mlp.c_proj.bias[0] = STEP
        model.transformer.ln_f.weight.fill_(1)
        ids = torch.arange(BYTE_VOCAB_SIZE)
        model.transformer.wte.weight[:, 0] = torch.tensor([CLASS_START[int(i) % 3] for i in ids])
    return LoadedModel("hand-built", model, byte_tokenizer(), model_info(model))


@pytest.mark.parametrize("include_last_layer", [False, True])
def test_hand_built_model_gives_known_percentages(include_last_layer, tmp_path, documents):
    # class 0: 1 → 1.5 → 2 → 2.5 (always up); class 1: 1 → 0.5 → 0 → 0.5; class 2: 0.7 → 0.2 → 0.3 → 0.8
    worked = {c: [abs(s + STEP * l) for l in range(4)] for c, s in CLASS_START.items()}
    points = 4 if include_last_layer else 3
    lm = hand_built_gpt2()
    out, ctx = run_job(tmp_path, lm, documents, max_samples=30, inner_loss=False, gram_condition=False,
                       include_last_layer=include_last_layer, pca_samples=5)
    classes = np.array([tokens[-2] % 3 for _, tokens in reference_samples(lm.tokenizer, documents, 30)])
    assert len(set(classes.tolist())) == 3, "the text exercises every class"
    expected = np.array([worked[c][:points] for c in classes])
    np.testing.assert_allclose(np.load(ctx.artifact_dir / "trajectories.npz")["norms"], expected, atol=1e-6)
    up_pairs = {c: sum(b >= a for a, b in zip(w[:points], w[1:points])) for c, w in worked.items()}
    assert up_pairs == ({0: 2, 1: 0, 2: 1} if points == 3 else {0: 3, 1: 1, 2: 2})
    assert out.summary["sequence_pct"] == pytest.approx(100 * np.mean(classes == 0))
    assert out.summary["pair_pct"] == pytest.approx(100 * np.mean([up_pairs[c] for c in classes]) / (points - 1))
    assert out.summary["null_sequence_pct"] == pytest.approx(100 / 2 ** (points - 1))
    # every point lies on the e_1 axis: one principal component explains everything
    pca = np.load(ctx.artifact_dir / "pca.npz")
    assert pca["explained_variance_ratio"][0] == pytest.approx(1.0, abs=1e-9)
    assert abs(pca["components"][0][0]) == pytest.approx(1.0, abs=1e-9)


# ---------------------------------------------------------------- position="all", edge cases

def test_every_position_is_a_current_token(llama_run, tmp_path, documents):
    lm = llama_run[0]
    min_position = 30
    documents = ["a line the word filter drops ."] + documents  # so that no sample id is its document's id
    out, ctx = run_job(tmp_path, lm, documents, max_samples=6, position="all", min_position=min_position,
                       gram_condition=False, loss_filter=None, pca_samples=4)
    saved = np.load(ctx.artifact_dir / "trajectories.npz")
    small = one_block_copy(lm.model)
    L = lm.model.config.num_hidden_layers
    norms_, losses, positions, owners = [], [], [], []
    for sample, (doc, tokens) in enumerate(reference_samples(lm.tokenizer, documents, 6)):
        states, _ = unbatched_states(lm.model, tokens)
        pos = list(range(min_position, len(tokens) - 1))  # every position with a next token
        positions += pos
        owners += [(sample, doc)] * len(pos)  # trajectory i is (owners[i], positions[i])
        norms_.append(torch.stack([h[pos].norm(dim=-1) for h in states[:L]], 1).numpy())
        losses.append(reference_inner_loss(small, states, tokens, pos))
    assert saved["positions"].tolist() == positions
    # many trajectories per sample, so a trajectory id is no sample id; the skipped first document makes a
    # sample id no document id
    ref_samples, ref_docs = (np.array(column) for column in zip(*owners))
    assert saved["sample_ids"].tolist() == ref_samples.tolist()
    assert saved["doc_ids"].tolist() == ref_docs.tolist() and (ref_docs != ref_samples).all()
    pca = np.load(ctx.artifact_dir / "pca.npz")
    assert pca["sample_ids"].tolist() == ref_samples[pca["trajectory_ids"]].tolist()
    assert (pca["trajectory_ids"] != pca["sample_ids"]).all()
    assert out.summary["samples"] == 6 and out.summary["trajectories"] == len(positions) > 6
    np.testing.assert_allclose(saved["norms"], np.concatenate(norms_), rtol=1e-5)
    np.testing.assert_allclose(saved["inner_loss"], np.concatenate(losses), rtol=1e-4)


def test_no_long_enough_document_is_a_clear_error(tmp_path):
    short = ["too short", "three words here", "", "four words are here"]
    with pytest.raises(JobFailed, match=r"min_words=10 words.*lower min_words"):
        run_job(tmp_path, tiny("gpt2"), short)


def test_logits_the_inner_loss_cannot_rebuild_are_refused(tmp_path, documents):
    """A model that changes its LM head's output in a way ModelParts does not know (here a hook scaling
    the logits by 3): the inner loss would be silently wrong, so the job says so and how to go on."""
    lm = tiny("gpt2")
    lm.model.lm_head.register_forward_hook(lambda module, args, output: 3 * output)
    with pytest.raises(JobFailed, match=r"differ from the model's own by .* nats .* set inner_loss=false"):
        run_job(tmp_path / "a", lm, documents, max_samples=4)
    out, _ = run_job(tmp_path / "b", lm, documents, max_samples=4, inner_loss=False, gram_condition=False)
    assert out.summary["samples"] == 4


def test_an_fp16_overflow_in_the_checked_input_does_not_refuse_the_job(tmp_path, documents):
    """The logits check skips positions whose logits overflowed in fp16: such a model is not refused."""
    lm = tiny("gpt2")
    lm.model.lm_head.weight = torch.nn.Parameter(lm.model.lm_head.weight.detach().clone())  # untied
    lm.model.half()
    first = next(d for d in documents if len(d.split()) >= MIN_WORDS)
    with torch.no_grad():  # one early token of the first sample overflows to inf in fp16 at the last block
        lm.model.transformer.wte.weight[lm.tokenizer(first)["input_ids"][3], 0] = 60000.0
        lm.model.transformer.h[-1].mlp.c_proj.bias[0] = 10000.0
    with torch.no_grad():  # the setup does overflow in the input the check reads
        ids = torch.tensor(lm.tokenizer(first)["input_ids"][:16])[None]
        assert not torch.isfinite(lm.model(input_ids=ids).logits).all()
    out, _ = run_job(tmp_path, lm, documents, max_samples=8, loss_filter=None, gram_condition=False)
    assert out.summary["samples"] == 8 and out.summary["inner_loss_total"] == 8


def test_max_samples_smaller_than_a_batch(gpt2_run, tmp_path, documents):
    lm, _, first = gpt2_run
    out, ctx = run_job(tmp_path, lm, documents, max_samples=3, batch_size=16, inner_loss=False,
                       gram_condition=False, pca_samples=50)
    assert out.summary["samples"] == 3 and out.summary["inner_loss_kept"] is None
    np.testing.assert_allclose(np.load(ctx.artifact_dir / "trajectories.npz")["norms"],
                               np.load(first.artifact_dir / "trajectories.npz")["norms"][:3], rtol=1e-5)
    assert np.load(ctx.artifact_dir / "pca.npz")["coords"].shape[0] == 3
    assert not (ctx.artifact_dir / "inner_loss.png").exists()


def test_max_tokens_beyond_the_model_is_cut_to_its_positions(gpt2_run, tmp_path, documents):
    lm = gpt2_run[0]  # n_positions = 128
    out, ctx = run_job(tmp_path, lm, documents, max_samples=4, max_tokens=500, inner_loss=False,
                       gram_condition=False, pca_samples=0)
    assert out.summary["max_tokens"] == 128 and "128" in out.summary["note"]
    long_docs = [d for d in documents if len(d.split()) >= MIN_WORDS][:4]
    expected = [min(len(lm.tokenizer(d)["input_ids"]), 129) - 2 for d in long_docs]
    assert np.load(ctx.artifact_dir / "trajectories.npz")["positions"].tolist() == expected and max(expected) == 127


def test_cancel_between_batches(tmp_path, documents):
    ctx = LocalContext(tmp_path, models={"m": tiny("gpt2")}, datasets={"wiki": documents}, cancel_after=2)
    with pytest.raises(JobCancelled):
        norms.run(NormsParams(model="m", dataset="wiki", max_tokens=MAX_TOKENS, batch_size=2, max_samples=20), ctx)
    assert len(ctx.progress_log) == 2


def test_bad_parameters_are_refused_at_submit():
    with pytest.raises(ValidationError, match="min_position"):
        validate_params("norms", {"model": "m", "dataset": "d", "position": "all", "min_position": 300})
    with pytest.raises(ValidationError, match="positon"):
        validate_params("norms", {"model": "m", "dataset": "d", "positon": "all"})
    with pytest.raises(ValidationError):
        validate_params("norms", {"model": "m", "dataset": "d", "loss_filter": -1})
    assert validate_params("norms", {"model": "m", "dataset": "d", "loss_filter": None}).loss_filter is None


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_inner_loss_logits_are_float32_for_a_bfloat16_model(arch):
    """In bf16 the loss must still match a float64 computation from the same (bf16) weights."""
    config = (GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=BYTE_VOCAB_SIZE) if arch == "gpt2" else
              LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=64,
                          intermediate_size=128, vocab_size=BYTE_VOCAB_SIZE))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    parts = norms.model_parts(model)
    h = (4 * torch.randn(32, 64)).to(torch.bfloat16)
    labels = torch.randint(0, BYTE_VOCAB_SIZE, (32,))

    norm64 = copy.deepcopy(parts.final_norm).double()
    logits64 = F.linear(norm64(h.double()), parts.lm_head.weight.double())
    expected = F.cross_entropy(logits64, labels, reduction="none")
    got = norms.token_losses(parts, h, labels)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, atol=2e-4, rtol=0)


def test_the_linearised_layer_applied_without_forming_w_is_w_times_x():
    """The job computes W x by matrix-vector products; W itself (eq. 10, term by term) is the oracle."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50))
    linear = [linearised_layer.block_matrices(b, "cpu") for b in model.transformer.h]
    P, T = 5, 7
    context = torch.randn(P, T, 32)
    positions = [0, 2, 3, 6, 6]
    mask = torch.arange(T)[None, :] <= torch.tensor(positions)[:, None]
    x = torch.randn(P, 32)
    layer = torch.tensor([0, 1, 0, 1, 1])
    maps = [block_maps(b, 32) for b in model.transformer.h]
    W = torch.stack([direct_linearised_layer(maps[l], context[p].double(), positions[p])
                     for p, l in enumerate(layer.tolist())])
    Wx = torch.empty(P, 32, dtype=torch.float64)
    for l in (0, 1):  # the job applies one layer at a time
        at = layer == l
        Wx[at] = linearised_layer.apply(linear[l], context[at], mask[at], x[at])
    torch.testing.assert_close(Wx, (W @ x.double()[..., None])[..., 0], rtol=1e-10, atol=1e-10)
    holds, ratio = linearised_layer.stretch_ratio(Wx, x)
    eigen_holds, eigen_ratio = gram_condition_holds(W, x)  # the paper's eigen form
    assert torch.equal(holds, eigen_holds)
    torch.testing.assert_close(ratio, eigen_ratio, rtol=1e-9, atol=0)


def test_a_tie_between_layers_counts_as_non_decreasing():
    """Equal consecutive norms (bf16 and fp16 round close ones together) are a step that does not decrease."""
    from lmscope.analyses.norms import monotone_percentages

    sequence_pct, pair_pct = monotone_percentages(np.array([[1.0, 1.0, 2.0], [3.0, 2.0, 2.0]]))
    assert (sequence_pct, pair_pct) == (50.0, 75.0)  # the first trajectory; 3 of its 4 steps


def test_the_seed_picks_which_trajectories_are_drawn(gpt2_run, tmp_path, documents):
    """`seed` draws the PCA sample: the same seed the same trajectories (reproducible), another seed others
    (10 of 20: the chance that two draws agree is 1 in 184756)."""
    lm, _, ctx = gpt2_run
    first = np.load(ctx.artifact_dir / "pca.npz")["trajectory_ids"]
    run_job(tmp_path / "same", lm, documents, max_samples=20, loss_filter=None, gram_samples=12,
            pca_samples=10, seed=0)
    run_job(tmp_path / "other", lm, documents, max_samples=20, loss_filter=None, gram_samples=12,
            pca_samples=10, seed=1)
    same_ids = np.load(tmp_path / "same" / "pca.npz")["trajectory_ids"]
    other_ids = np.load(tmp_path / "other" / "pca.npz")["trajectory_ids"]
    assert len(first) == len(other_ids) == 10 and list(first) == list(same_ids)
    assert list(first) != list(other_ids)


# ---------------------------------------------------------------- half precision

def test_gpt2_attention_without_keys_computes_half_precision_scores_in_float32():
    """Scores past float16's 65504 (large query and key weights) are fine for SDPA, which computes in float32:
    the route without keys does so too, where it used to give inf and NaN. Oracle: float64 from the same
    float16 inputs."""
    torch.manual_seed(3)
    N, T, D, H = 2, 7, 16, 2
    z = torch.randn(N, T, D).half()
    w = (torch.randn(D, 3 * D) * torch.tensor([40.0] * 2 * D + [0.3] * D)).half()  # q, k large; v not
    b = (torch.randn(3 * D) / 4).half()
    positions, mask = torch.tensor([[6], [4]]), torch.ones(N, T, dtype=torch.long)
    visible = norms.keys_visible_from(positions, mask, None)
    z64, w64, b64 = z.double(), w.double(), b.double()
    q = (z64[torch.arange(N)[:, None], positions] @ w64[:, :D] + b64[:D]).unflatten(-1, (H, D // H))
    k, v = (z64 @ w64[:, D:] + b64[D:]).unflatten(-1, (2, H, D // H)).unbind(2)
    scores = torch.einsum("nqhd,nthd->nhqt", q.half().double(), k)
    assert scores.masked_fill(~visible, 0).max() > 65504  # a visible key's score float16 cannot hold
    p = torch.softmax((scores * 0.25).masked_fill(~visible, float("-inf")), dim=-1)
    want = torch.einsum("nhqt,nthd->nqhd", p, v).flatten(2)
    got = norms.attend_without_keys(q.half(), z, w[:, D:2 * D], w[:, 2 * D:], b[2 * D:], visible, 0.25)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


def overflowing_gpt2(documents, min_share=0.1):
    """The tiny GPT-2 in float16 with one byte whose embedding's first coordinate is 4e4: block 1's MLP adds 3e4
    there, so h_1 at that byte is 7e4, past float16's 65504, and attention carries inf and NaN on to the positions
    after it. Weights stay finite; float32 runs the same model without an overflow."""
    from collections import Counter

    lm = tiny("gpt2")
    samples = [t for _, t in reference_samples(lm.tokenizer, documents, 20)]
    counts = Counter(b for t in samples for b in set(t[:-1]))
    byte = min((b for b, c in counts.items() if min_share * len(samples) <= c < len(samples) / 2), key=counts.get)
    with torch.no_grad():
        lm.model.transformer.wte.weight[byte, 0] = 4e4
        lm.model.transformer.h[0].mlp.c_proj.bias[0] = 3e4
    lm.model.half()
    return lm, samples


def test_trajectories_that_overflow_float16_are_left_out_and_counted(tmp_path, documents):
    """A model whose activations overflow float16 in some samples (not in others): those trajectories are counted
    and left out of the percentages, the curves, PCA and the Gram condition, which are those of the finite ones,
    computed here in float64 from each sample run alone; the plots are drawn."""
    lm, samples = overflowing_gpt2(documents)
    L = lm.model.config.num_hidden_layers
    expected = np.array([[h[-1].norm().item() for h in unbatched_states(lm.model, t)[0][:L]] for t in samples])
    finite = np.isfinite(expected).all(1)
    assert 0 < (~finite).sum() < len(samples) / 2  # some overflow, most do not
    # one sample a batch: the job's states are then those of each sample run alone, to the bit
    out, ctx = run_job(tmp_path, lm, documents, max_samples=20, batch_size=1, dtype="float16", loss_filter=None,
                       gram_samples=20, pca_samples=20)
    s = out.summary
    assert s["trajectories"] == 20 and s["nonfinite_trajectories"] == int((~finite).sum())
    assert f"{(~finite).sum()} of 20 trajectories" in s["nonfinite_note"] and "bfloat16 or float32" in s["nonfinite_note"]
    seq, pair = percentages(expected[finite])
    assert s["sequence_pct"] == pytest.approx(seq) and s["pair_pct"] == pytest.approx(pair)
    series = {x.name: x for x in out.series}
    np.testing.assert_allclose(series["norm.mean"].y, expected[finite].mean(0), rtol=2e-3)
    assert all(np.isfinite(x.y).all() for x in out.series)
    assert s["inner_loss_nonfinite"] >= (~finite).sum() and s["inner_loss_final_mean"] is not None
    assert all(np.isfinite(s["pca_explained_variance"]))
    # PCA over the points of the finite trajectories only: an overflowed one's finite points (h_0) are left out too
    points = np.stack([h[-1].numpy() for t, ok in zip(samples, finite) if ok
                       for h in unbatched_states(lm.model, t)[0][:L]])
    np.testing.assert_allclose(np.load(ctx.artifact_dir / "pca.npz")["mean"], points.mean(0), rtol=1e-9, atol=1e-9)
    # the Gram condition over the finite trajectories' pairs: an overflowed one's pairs are neither kept nor failed,
    # its finite first step included
    gram = np.load(ctx.artifact_dir / "gram_condition.npz")
    overflowed = np.isin(gram["trajectory_ids"], np.flatnonzero(~finite))
    assert overflowed.any() and np.isfinite(gram["ratio"][~overflowed]).all()
    assert np.isfinite(gram["ratio"][overflowed & (gram["layers"] == 0)]).any()  # a step before the overflow
    assert s["gram_condition_nonfinite"] == int(overflowed.sum()) and s["gram_condition_pairs"] == int((~overflowed).sum())
    assert s["gram_condition_pct"] == pytest.approx(100 * (gram["ratio"][~overflowed] >= 1).mean())
    assert {"norms.png", "inner_loss.png", "pca3d.png"} <= {p.name for p in ctx.artifact_dir.iterdir()}
    saved = np.load(ctx.artifact_dir / "trajectories.npz")["norms"]  # the file keeps every trajectory as measured
    assert (np.isfinite(saved).all(1) == finite).all()


def test_a_model_that_overflows_float16_everywhere_is_refused_saying_what_to_change(tmp_path, documents):
    lm = tiny("gpt2")
    with torch.no_grad():
        lm.model.transformer.wte.weight[:, 0] = 7e4  # every token: inf in float16
    lm.model.half()
    with pytest.raises(JobFailed, match=r"every trajectory's hidden states reach inf or NaN in float16 .* run with "
                                        r"dtype bfloat16 or float32"):
        run_job(tmp_path, lm, documents, max_samples=6, dtype="float16", inner_loss=False)


def test_norms_are_float64_norms_of_the_models_half_precision_states(tmp_path, documents):
    """One large coordinate (3000, a 'massive activation') beside small ones: float32 sums of squares have no
    digits left for the small ones, and every layer's norm used to tie with the next (100 % non-decreasing). The
    job's norms are the float64 norms of the model's own bfloat16 states, and so are its percentages."""
    lm = tiny("gpt2", seed=3)  # (a seed whose float64 norms fall at some steps)
    with torch.no_grad():
        lm.model.transformer.wte.weight[:, 0] = 3000.0
    lm.model.to(torch.bfloat16)
    samples = [t for _, t in reference_samples(lm.tokenizer, documents, 12)]
    expected = np.array([[h[-1].norm().item() for h in unbatched_states(lm.model, t)[0]] for t in samples])
    float32_norms = np.array([[h[-1].float().norm().item() for h in unbatched_states(lm.model, t)[0]]
                              for t in samples])
    assert (np.diff(float32_norms, axis=1) == 0).mean() > 0.5  # what float32 made of them
    out, ctx = run_job(tmp_path, lm, documents, max_samples=12, batch_size=1, dtype="bfloat16", inner_loss=False,
                       gram_condition=False, include_last_layer=True)
    np.testing.assert_allclose(np.load(ctx.artifact_dir / "trajectories.npz")["norms"], expected, rtol=1e-12)
    seq, pair = percentages(expected)
    assert pair < 100 and (out.summary["sequence_pct"], out.summary["pair_pct"]) == pytest.approx((seq, pair))


def test_the_logits_check_allows_bfloat16_rounding_of_large_logits_and_still_refuses_a_transform(tmp_path, documents):
    """Logits around 100 round by ~0.4 in bfloat16: a plain GPT-2 with such logits is not refused (it was, as
    "changes its logits"); the same model whose LM head output is scaled by 3 still is."""
    config = GPT2Config(n_layer=3, n_head=2, n_embd=32, n_positions=128, vocab_size=BYTE_VOCAB_SIZE,
                        initializer_range=0.25)
    torch.manual_seed(0)
    lm = LoadedModel("gpt2", AutoModelForCausalLM.from_config(config).eval(), byte_tokenizer(), {})
    with torch.no_grad():
        lm.model.transformer.ln_f.weight *= 30
    lm.model.to(torch.bfloat16)
    ids = torch.tensor(lm.tokenizer(documents[0])["input_ids"][:17])
    with torch.no_grad():
        assert lm.model(ids[None]).logits.abs().max() > 90
    parts = norms.model_parts(lm.model)
    norms.check_logits_reproduced(lm.model, parts, ids)  # no refusal
    lm.model.lm_head.register_forward_hook(lambda module, args, output: 3 * output)
    with pytest.raises(JobFailed, match=r"nats \(more than bfloat16 rounding explains: "):
        norms.check_logits_reproduced(lm.model, parts, ids)


def test_pca_leaves_out_points_that_are_not_finite_and_those_not_kept():
    """Moments over the finite points `keep` marks only, as numpy's covariance of those points gives them; the
    caller's points are left as they were."""
    rng = np.random.default_rng(0)
    points = rng.normal(size=(50, 4)) * [3, 2, 1, 0.5]
    bad = points.copy()
    bad[[3, 17]] = [np.inf, 0, 0, 0], [np.nan] * 4
    keep = np.ones(50, bool)
    keep[[30, 31]] = False
    pca = norms.RunningPCA(4, "cpu")
    first = torch.from_numpy(bad[:25])
    pca.add(first)
    pca.add(torch.from_numpy(bad[25:]), torch.from_numpy(keep[25:]))
    assert torch.isinf(first[3, 0])  # not zeroed in place
    mean, components, ratio = pca.fit(3)
    good = np.delete(points, [3, 17, 30, 31], axis=0)
    np.testing.assert_allclose(mean.numpy(), good.mean(0), rtol=1e-10)
    var, vecs = np.linalg.eigh(np.cov(good.T))
    np.testing.assert_allclose(ratio.numpy(), var[::-1][:3] / var.sum(), rtol=1e-8)
    np.testing.assert_allclose(np.abs(components.numpy()), np.abs(vecs[:, ::-1][:, :3].T), atol=1e-8)
