"""The Gram condition's linearised layer on every architecture it reads (GPT-2, GPTBigCode with and
without multi-query attention, BLOOM, StarCoder2 with grouped-query heads, RoPE and a sliding window;
GPT-NeoX with parallel and with sequential residuals and Phi with grouped-query heads, both with partial
RoPE).

The oracle is the model itself, made linear: a float64 copy with its layer norms and activations
replaced by the identity, its biases zeroed, and attention without softmax, scale or ALiBi
(Σ_{i visible} v_i (k_i · q), through transformers' attention interface, or BLOOM's own module with
its softmax patched out). Block l + 1 of that copy, fed the sample's h_l, outputs W x at every
position t: no weight layout (fused, per-head interleaved, multi-query) is read by hand here.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as T

from lmscope.analyses import linearised_layer, norms
from lmscope.analyses.base import LoadedModel
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, read_documents
from lmscope.config import Settings
from lmscope.modeling.loading import model_info
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.params.norms import NormsParams

V = BYTE_VOCAB_SIZE
IDS = dict(bos_token_id=256, eos_token_id=257, initializer_range=0.2)  # weights large enough that W is far from I
WINDOW = 6  # StarCoder2's sliding window: shorter than the samples, so that it matters
CONFIGS = {
    "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64, **IDS),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64, **IDS),
    "gpt_bigcode_mha": lambda: T.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                                  multi_query=False, **IDS),
    "bloom": lambda: T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=3, n_head=4, pad_token_id=258, **IDS),
    "starcoder2": lambda: T.Starcoder2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                             sliding_window=WINDOW, **IDS),
    # partial rotary: 4 of each head's 8 dimensions rotated
    "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=48, max_position_embeddings=64, rotary_pct=0.5, **IDS),
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                                   num_attention_heads=4, intermediate_size=48,
                                                   max_position_embeddings=64, rotary_pct=0.5,
                                                   use_parallel_residual=False, **IDS),
    "phi": lambda: T.PhiConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                               partial_rotary_factor=0.5, **IDS),
}
PARALLEL = {"gpt_neox", "phi"}
ORACLE_ATTENTION = "lmscope_test_eq10"


def eq10_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Σ_i v_i (k_i · q) over the visible keys: attention without softmax or scale. query [B, H, T, d],
    key/value [B, H_kv, T, d]; the mask is transformers' boolean one (True: visible), or None for causal."""
    B, H, N, d = query.shape
    group = H // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    if attention_mask is None:
        visible = torch.ones(N, N, dtype=torch.bool, device=query.device).tril()
        window = kwargs.get("sliding_window")
        if window is not None:
            visible &= ~torch.ones(N, N, dtype=torch.bool, device=query.device).tril(-window)
    else:
        visible = attention_mask[..., :N, :N]
    scores = (query @ key.transpose(-1, -2)) * visible
    return (scores @ value).transpose(1, 2), None


def register_oracle_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ORACLE_ATTENTION, eq10_attention)
    AttentionMaskInterface.register(ORACLE_ATTENTION, AttentionMaskInterface._global_mapping["sdpa"])


class Linear(torch.nn.Module):
    """What replaces layer norms and activations: the identity (extra arguments ignored)."""

    def forward(self, x, *args, **kwargs):
        return x


def linear_copy(model):
    """The float64 model of eq. 10: norms and activations the identity, no biases, no softmax."""
    m = copy.deepcopy(model).double().eval()
    for name, module in list(m.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.LayerNorm) or child_name in ("act", "gelu_impl", "activation_fn"):
                setattr(module, child_name, Linear())
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias") and "ln" not in name and "layernorm" not in name:
                p.zero_()
    if type(m).__name__ == "BloomForCausalLM":  # own attention module: ALiBi off, scale 1 (softmax: see below)
        for block in m.transformer.h:
            block.self_attention.beta, block.self_attention.inv_norm_factor = 0.0, 1.0
    else:
        register_oracle_attention()
        m.set_attn_implementation(ORACLE_ATTENTION)
    return m


class NoSoftmax:
    """torch.nn.functional for modeling_bloom with softmax replaced: masked scores (the finfo.min mask
    added) become 0, the others stay as they are."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def softmax(w, dim=-1, dtype=None):
        return torch.where(w < torch.finfo(w.dtype).min / 2, torch.zeros((), dtype=w.dtype), w)  # dtype: kept


@torch.no_grad()
def oracle_Wx(linear_model, block_index: int, tokens: list[int], context: torch.Tensor) -> torch.Tensor:
    """Block ``block_index`` of the linear model applied to ``context`` [T, D] (the sample's h_l): W x at
    every position [T, D]."""
    blocks = norms.model_parts(linear_model).blocks
    seen = {}

    def replace(module, args, kwargs):
        if args:
            return (context[None].double(),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": context[None].double()}

    def grab(module, args, kwargs, output):
        seen["out"] = output[0] if isinstance(output, tuple) else output

    handles = [blocks[block_index].register_forward_pre_hook(replace, with_kwargs=True),
               blocks[block_index].register_forward_hook(grab, with_kwargs=True)]
    try:
        linear_model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["out"][0]


@pytest.fixture(scope="module")
def documents():
    return [d for d in read_documents(Settings.from_env().wikitext2_path, "lines")[:40] if len(d.split()) >= 10]


@pytest.fixture(params=sorted(CONFIGS))
def loaded(request):
    torch.manual_seed(1)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    return LoadedModel(request.param, model, byte_tokenizer(), model_info(model))


def test_the_gram_condition_is_the_linearised_model_on_every_pair(loaded, documents, tmp_path, monkeypatch):
    """The job's ‖Wx‖²/‖x‖² for every (trajectory, layer) pair — padded batches, several layers, the
    current token's h_l — against the linear model run on that sample alone."""
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"d": documents})
    out = norms.run(NormsParams(model="m", dataset="d", max_samples=6, max_tokens=16, batch_size=3, gram_samples=5,
                                inner_loss=False, pca_samples=0), ctx)
    assert out.summary["gram_condition_pct"] is not None, out.summary.get("gram_condition_reason")
    saved = np.load(tmp_path / "gram_condition.npz")
    traj = np.load(tmp_path / "trajectories.npz")
    L = loaded.model.config.num_hidden_layers
    assert len(np.unique(saved["trajectory_ids"])) == 5 and set(saved["layers"].tolist()) == set(range(L - 1))

    pairs = []  # (layer, t, the sample's h_l [T, D], its tokens), states from the model as it is
    for tr, layer in zip(saved["trajectory_ids"], saved["layers"]):
        tokens = loaded.tokenizer(documents[traj["doc_ids"][traj["sample_ids"][tr]]])["input_ids"][:17][:-1]
        with torch.no_grad():
            h = loaded.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[layer][0]
        pairs.append((int(layer), int(traj["positions"][tr]), h, tokens))

    import transformers.models.bloom.modeling_bloom as modeling_bloom
    with monkeypatch.context() as patched:  # BLOOM without softmax: its linear copy only
        patched.setattr(modeling_bloom, "F", NoSoftmax())
        linear_model = linear_copy(loaded.model)
        expected = [float(oracle_Wx(linear_model, layer, tokens, h)[t].square().sum() / h[t].double().square().sum())
                    for layer, t, h, tokens in pairs]
    expected = np.array(expected)
    assert np.ptp(expected) > 0.01, "pairs should differ"
    np.testing.assert_allclose(saved["ratio"], expected, rtol=1e-4)
    clear = np.abs(expected - 1) > 1e-3  # away from the tie, where float32 states may round either way
    assert saved["holds"][clear].tolist() == (expected[clear] >= 1).tolist()
    assert out.summary["gram_condition_pct"] == pytest.approx(100 * saved["holds"].mean())
    assert out.summary["gram_condition_form"] == norms.GRAM_FORMS[loaded.name in PARALLEL]


def first_block_on_a_random_context(name: str, T_: int = 12, D: int = 32):
    """Block 0's matrices of a random-init CONFIGS[name] model; a random float64 context [1, T_, D] with its
    last position as the query; the keys that query sees under a window (None: all); the model's rope there."""
    torch.manual_seed(1)
    base = T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval().base_model
    m = linearised_layer.block_matrices(base.layers[0], "cpu")
    context, t = torch.randn(1, T_, D, dtype=torch.float64), torch.tensor([T_ - 1])

    def visible(window):
        return norms.keys_visible_from(t[:, None], torch.ones(1, T_, dtype=torch.bool), window)[:, 0, 0]

    cos, sin = base.rotary_emb(context, torch.arange(T_)[None])
    return m, context, t, visible, (cos.double(), sin.double())


def test_the_window_and_grouped_heads_matter():
    """StarCoder2's sliding window and key/value groups are read from the model: dropping either changes W x
    (so the test above would notice a linearisation that ignored them)."""
    m, context, t, visible, rope = first_block_on_a_random_context("starcoder2")
    assert (m.heads, m.kv_heads, m.window, m.rotary) == (4, 2, WINDOW, True)
    windowed = linearised_layer.apply(m, context, visible(WINDOW), context[:, -1], rope, t)
    full = linearised_layer.apply(m, context, visible(None), context[:, -1], rope, t)
    one_group = SimpleNamespace(**{**vars(m), "kv_heads": 1, "W_K": m.W_K[:8], "W_V": m.W_V[:8]})
    grouped = linearised_layer.apply(one_group, context, visible(WINDOW), context[:, -1], rope, t)
    assert not torch.allclose(windowed, full) and not torch.allclose(windowed, grouped)


def test_partial_rotary_and_the_residual_form_matter():
    """GPT-NeoX's partial rotary and its residual form are read from the model: rotating every dimension, or
    the other residual form, changes W x (so the oracle test above would notice either mistake)."""
    m, context, t, visible, rope = first_block_on_a_random_context("gpt_neox")
    assert (m.heads, m.kv_heads, m.rotary, m.parallel) == (4, 4, True, True)
    assert rope[0].shape[-1] == 4  # half of each head's 8 dimensions
    partial = linearised_layer.apply(m, context, visible(None), context[:, -1], rope, t)
    full_rope = tuple(torch.cat((e, e), -1) for e in rope)  # every dimension rotated
    full = linearised_layer.apply(m, context, visible(None), context[:, -1], full_rope, t)
    sequential = linearised_layer.apply(SimpleNamespace(**{**vars(m), "parallel": False}), context, visible(None),
                                        context[:, -1], rope, t)
    assert not torch.allclose(partial, full) and not torch.allclose(partial, sequential)


def test_gated_and_unread_blocks_are_not_linearised():
    for config in (T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
                   T.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=48)):
        model = T.AutoModelForCausalLM.from_config(config)
        parts = norms.model_parts(model)
        assert not linearised_layer.linearisable(parts.blocks[0])
        reason = norms.gram_not_applicable(NormsParams(model="m", dataset="d"), parts, model_info(model))
        assert reason.startswith("not applicable")


def test_blocks_read_again_per_batch_give_the_same_pairs(documents, tmp_path, monkeypatch):
    """A model whose float64 blocks do not fit GRAM_WEIGHT_BYTES reads them per batch: same results."""
    torch.manual_seed(1)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["starcoder2"]()).eval()
    loaded = LoadedModel("starcoder2", model, byte_tokenizer(), model_info(model))
    params = NormsParams(model="m", dataset="d", max_samples=6, max_tokens=16, batch_size=2, gram_samples=5,
                         inner_loss=False, pca_samples=0)
    results, read = [], norms.block_matrices
    for budget in (norms.GRAM_WEIGHT_BYTES, 0):
        monkeypatch.setattr(norms, "GRAM_WEIGHT_BYTES", budget)
        out = tmp_path / str(budget)
        reads = []
        monkeypatch.setattr(norms, "block_matrices", lambda block, device: reads.append(block) or read(block, device))
        norms.run(params, LocalContext(out, models={"m": loaded}, datasets={"d": documents}))
        results.append((np.load(out / "gram_condition.npz"), len(reads)))
    (kept, kept_reads), (again, again_reads) = results
    assert kept_reads == 2 and again_reads > kept_reads  # L − 1 = 2 blocks; then once per batch and block
    for name in kept.files:
        np.testing.assert_array_equal(kept[name], again[name], err_msg=name)


def test_offloaded_weights_are_reported_not_read():
    """device_map="auto" leaves the blocks it offloads to the CPU or disk as meta tensors until their forward:
    the Gram condition says why it is not computed instead of failing on them."""
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(CONFIGS["gpt2"]())
    parts = norms.model_parts(model)
    reason = norms.gram_not_applicable(NormsParams(model="m", dataset="d"), parts, {"gated_ffn": False})
    assert reason.startswith("not computed: the model's weights are offloaded")
