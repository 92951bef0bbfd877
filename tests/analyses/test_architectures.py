"""Every registrable architecture runs `norms` and `entropy`, checked against the model's own outputs.

For each `model_type` in lmscope.catalog.SUPPORTED_ARCHITECTURES a tiny random-init model: the norms
job's trajectories against `output_hidden_states` of each sample read alone (no padding, so batching
and padding are checked too, ALiBi included), and the entropy job's per-layer, per-head, per-position
means against eager attention matrices turned into -Σ p ln p in float64 (for Falcon and BLOOM, whose
entropy the job reads from those same matrices, also against closed forms with every query zeroed);
and, for the architectures that go through transformers' attention interface, a padded batch through
the Triton kernel alone with the logits of eager attention (the route a GPU worker takes).
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import numpy as np
import pytest
import torch
import transformers as T

from lmscope.analyses import entropy, norms
from lmscope.analyses.base import LoadedModel
from lmscope.analyses.local import LocalContext
from lmscope.catalog import BYTE_VOCAB_SIZE, SUPPORTED_ARCHITECTURES, read_documents
from lmscope.config import Settings
from lmscope.modeling.loading import model_info
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.modeling.windows import token_windows
from lmscope.params.entropy import EntropyParams
from lmscope.params.norms import NormsParams
from tests.analyses.conftest import eager_entropies
from tests.conftest import need_module, runs_through_lmscope_attention

V = BYTE_VOCAB_SIZE
IDS = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=128, initializer_range=0.2, **IDS)
CONFIGS = {
    "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=128,
                                 initializer_range=0.2, bos_token_id=256, eos_token_id=257),
    "llama": lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2),
    "mistral": lambda: T.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None),
    "qwen2": lambda: T.Qwen2Config(**SMALL, num_key_value_heads=2),
    "qwen3": lambda: T.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8),
    "gemma": lambda: T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=8),
    # caps and scales small enough to change these tiny models' logits: the inner loss must apply them
    "gemma2": lambda: T.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=0.5),
    "gpt_neox": lambda: T.GPTNeoXConfig(**SMALL),
    "phi3": lambda: T.Phi3Config(**SMALL, num_key_value_heads=2),
    "olmo2": lambda: T.Olmo2Config(**SMALL),
    "granite": lambda: T.GraniteConfig(**SMALL, logits_scaling=4.0),
    "gemma3_text": lambda: T.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                              final_logit_softcapping=0.5),  # local layers see 8 keys
    "cohere": lambda: T.CohereConfig(**SMALL, num_key_value_heads=2, logit_scale=0.25),
    "glm4": lambda: T.Glm4Config(**SMALL, num_key_value_heads=2, head_dim=8),
    "olmo3": lambda: T.Olmo3Config(**SMALL),
    "smollm3": lambda: T.SmolLM3Config(**SMALL, num_key_value_heads=2),
    "phi": lambda: T.PhiConfig(**SMALL),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=128,
                                              initializer_range=0.2, bos_token_id=256, eos_token_id=257),
    "starcoder2": lambda: T.Starcoder2Config(**SMALL, num_key_value_heads=2),
    "falcon": lambda **variant: T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                               num_attention_heads=4, initializer_range=0.2, bos_token_id=256,
                                               eos_token_id=257, **variant),  # multi-query by default
    "gptj": lambda: T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=128,
                                 initializer_range=0.2, bos_token_id=256, eos_token_id=257),
    "bloom": lambda hidden_size=32, n_head=4: T.BloomConfig(vocab_size=V, hidden_size=hidden_size, n_layer=3,
                                                            n_head=n_head, initializer_range=0.2, bos_token_id=256,
                                                            eos_token_id=257, pad_token_id=258),
}
SEQ_LEN = 20


def test_every_supported_architecture_is_tested_here():
    assert set(CONFIGS) == set(SUPPORTED_ARCHITECTURES)


@pytest.fixture(scope="module")
def documents():
    return [d for d in read_documents(Settings.from_env().wikitext2_path, "lines")[:30] if len(d.split()) >= 10]


@pytest.fixture(params=sorted(CONFIGS))
def loaded(request):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    assert type(model).__name__ == SUPPORTED_ARCHITECTURES[request.param]
    return LoadedModel(request.param, model, byte_tokenizer(), model_info(model))


def _run_last_block_on(model, ids, h):
    """The model's logits with the last block's input replaced by h [1, T, D]: LM-head(final-norm(
    block_L(h))) with everything the model does there (logit caps and scales, ALiBi, rotary, masks)."""
    base = model.base_model
    last = (base.h if hasattr(base, "h") else base.layers)[-1]

    def replace(module, args, kwargs):
        if args:
            return (h,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h}

    handle = last.register_forward_pre_hook(replace, with_kwargs=True)
    try:
        return model(input_ids=ids).logits[0, -1]
    finally:
        handle.remove()


def test_norms_match_each_sample_read_alone(loaded, documents, tmp_path):
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"d": documents})
    out = norms.run(NormsParams(model="m", dataset="d", max_samples=6, max_tokens=24, batch_size=3,
                                gram_samples=3, pca_samples=3), ctx)
    saved = np.load(tmp_path / "trajectories.npz")
    L = loaded.model.config.num_hidden_layers
    expected, losses = [], []
    with torch.no_grad():
        for doc_id in saved["doc_ids"]:
            tokens = loaded.tokenizer(documents[doc_id])["input_ids"][:25]  # max_tokens + 1
            ids, label = torch.tensor([tokens[:-1]]), torch.tensor(tokens[-1])
            hidden = loaded.model(input_ids=ids, output_hidden_states=True).hidden_states
            expected.append([h[0, -1].norm().item() for h in hidden[:L]])  # h_0 … h_{L-1}
            # eq. 14 at every layer l: the last block run on h_l (several layers share one batched
            # call in the job: per-sample tensors such as BLOOM's ALiBi must follow)
            losses.append([torch.nn.functional.cross_entropy(_run_last_block_on(loaded.model, ids, hidden[layer]),
                                                             label).item() for layer in range(L)])
    np.testing.assert_allclose(saved["norms"], expected, rtol=1e-4)
    assert out.summary["samples"] == 6 and np.isfinite(out.summary["inner_loss_final_mean"])
    np.testing.assert_allclose(saved["inner_loss"], losses, rtol=1e-4, atol=1e-5)


def test_entropy_matches_eager_attention_matrices(loaded, documents, tmp_path):
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"d": documents})
    entropy.run(EntropyParams(model="m", dataset="d", seq_len=SEQ_LEN, num_segments=4, batch_size=2), ctx)
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 4)
    ref = eager_entropies(loaded, windows).mean(1)  # [L, H, N]
    got = np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]  # [L, H, N]
    np.testing.assert_allclose(got, ref, atol=5e-5)
    assert ref[..., 1:].std() > 0.01, "heads should differ from one another and from uniform"
    if runs_through_lmscope_attention(loaded.model):
        assert ctx.environment["kernel_backend"] in ("reference", "triton")
    else:  # Falcon, BLOOM; GPT-J before transformers 5.24
        assert ctx.environment["kernel_backend"] == entropy.MATRIX_ROUTE


# ------------------------------------------------- the attention-matrix route (Falcon, BLOOM) on worked examples
# The test above checks the job's entropies of these models against the same eager matrices the job reads:
# a wrong eager mask or ALiBi bias would be in both. With every query zeroed the scores no longer depend on
# the tokens, and the rows have closed forms.

def _zero_fused_queries(model) -> None:
    """q = 0 in every layer of a Falcon or BLOOM model: the query rows (weight and bias) of each fused
    query_key_value, in the layout transformers splits it by (Falcon's attention forward, its _split_heads
    before transformers 5.25; BLOOM's _reshape): [head][q | k | v] (BLOOM, multi-head Falcon), [q heads | k | v]
    (multi-query Falcon) and per KV group [its q heads | k | v] (Falcon's new_decoder_architecture)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    hd = cfg.hidden_size // heads
    if cfg.model_type == "bloom" or not (cfg.multi_query or cfg.new_decoder_architecture):
        groups, slots, queries = heads, 3, 1
    elif cfg.new_decoder_architecture:
        groups, slots, queries = cfg.num_kv_heads, heads // cfg.num_kv_heads + 2, heads // cfg.num_kv_heads
    else:
        groups, slots, queries = 1, heads + 2, heads
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("query_key_value"):
                assert module.weight.shape[0] == groups * slots * hd
                module.weight.view(groups, slots, hd, -1)[:, :queries].zero_()
                if module.bias is not None:
                    module.bias.view(groups, slots, hd)[:, :queries].zero_()


def _split_by_the_model(model, x):
    """(q, k) of the first layer as the model splits its fused projection: BLOOM's ``_reshape`` of it on x
    [1, T, D]; for (rotary) Falcon, whose split is inline from transformers 5.25 on, what its first layer
    hands to ``apply_rotary_pos_emb`` in a forward pass on the embeddings x."""
    if model.config.model_type == "bloom":
        attn = model.base_model.h[0].self_attention
        return attn._reshape(attn.query_key_value(x))[:2]
    from transformers.models.falcon import modeling_falcon

    seen = []
    rotate = modeling_falcon.apply_rotary_pos_emb

    def record(q, k, *args, **kwargs):
        seen.append((q, k))
        return rotate(q, k, *args, **kwargs)

    with mock.patch.object(modeling_falcon, "apply_rotary_pos_emb", record):
        model(inputs_embeds=x)
    assert len(seen) == model.config.num_hidden_layers
    return seen[0]


def _entropy_by_position(model, documents, tmp_path):
    """The job's mean entropy per layer, head and position [L, H, N] (by_position), via the matrix route."""
    loaded = LoadedModel("m", model, byte_tokenizer(), model_info(model))
    ctx = LocalContext(tmp_path, models={"m": loaded}, datasets={"d": documents})
    entropy.run(EntropyParams(model="m", dataset="d", seq_len=SEQ_LEN, num_segments=2, batch_size=2), ctx)
    assert ctx.environment["kernel_backend"] == entropy.MATRIX_ROUTE
    return np.load(tmp_path / "entropy_by_position.npz")["by_position"][0]


@pytest.mark.parametrize("variant", [{}, {"multi_query": False}, {"new_decoder_architecture": True, "num_kv_heads": 2}],
                         ids=["multi-query", "multi-head", "new-decoder-2-kv-heads"])
def test_falcon_with_zero_queries_has_the_entropy_of_uniform_causal_rows(variant, documents, tmp_path):
    """Falcon (rotary, no bias on the scores) with q = 0: every score is 0, so the row at position t is
    uniform over the t + 1 visible keys and its entropy ln(t + 1), in every layer and head."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["falcon"](**variant)).eval()
    _zero_fused_queries(model)
    with torch.no_grad():  # the rows zeroed are the queries, and only they, as the model splits them
        q, k = _split_by_the_model(model, torch.randn(1, 5, 32))
    assert float(q.abs().max()) == 0.0 and float(k.abs().min(-1).values.min()) > 0
    got = _entropy_by_position(model, documents, tmp_path)
    assert got.shape == (3, 4, SEQ_LEN)
    bound = np.log(np.arange(SEQ_LEN) + 1.0)
    np.testing.assert_allclose(got, np.broadcast_to(bound, got.shape), atol=1e-5)


def _alibi_slopes(n: int) -> list[float]:
    """ALiBi's head slopes (Press et al. 2022; transformers' build_alibi_tensor): for n a power of 2 the
    geometric sequence 2^(−8h/n), h = 1..n; otherwise those of the largest power of 2 below n, c, then every
    other slope of the 2c sequence, 2^(−8h/2c) for h = 1, 3, 5, … (n − c of them)."""
    c = 2 ** int(math.floor(math.log2(n)))
    return [2 ** (-8 * h / c) for h in range(1, c + 1)] + [2 ** (-8 * h / (2 * c)) for h in range(1, 2 * (n - c), 2)]


def test_alibi_slopes_by_hand():
    assert _alibi_slopes(4) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    assert _alibi_slopes(6) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]  # 8-head slopes 1, 3


@pytest.mark.parametrize("heads,hidden", [(4, 32), (6, 48)], ids=["4-heads", "6-heads-not-a-power-of-2"])
def test_bloom_with_zero_queries_has_the_entropy_of_its_alibi_rows(heads, hidden, documents, tmp_path):
    """BLOOM with q = 0: the only score left is ALiBi's bias, slope_h·j for key j (transformers adds
    slope_h·j, the paper slope_h·(j − t): a constant per row, the same softmax). So the row at position t is
    p_j ∝ e^(s·j), j = 0..t, whose entropy is ln Z − s·Σ_j p_j·j: checked per layer, head and position."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["bloom"](hidden_size=hidden, n_head=heads)).eval()
    _zero_fused_queries(model)
    with torch.no_grad():
        q, k = _split_by_the_model(model, torch.randn(1, 5, hidden))
    assert float(q.abs().max()) == 0.0 and float(k.abs().min(-1).values.min()) > 0
    got = _entropy_by_position(model, documents, tmp_path)
    want = np.zeros((heads, SEQ_LEN))
    for h, s in enumerate(_alibi_slopes(heads)):
        for t in range(SEQ_LEN):
            logits = torch.arange(t + 1, dtype=torch.float64) * s
            p = torch.softmax(logits, 0)
            want[h, t] = float(torch.logsumexp(logits, 0) - (p * logits).sum())
    assert got.shape == (3, heads, SEQ_LEN)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=2e-5)
    # the bias shows: the steepest head (slope 1/2 or 1/4) sits well below ln(t + 1) at the last position
    assert want[:, -1].min() < np.log(SEQ_LEN) - 0.5


@pytest.mark.gpu
def test_the_fused_kernel_runs_every_interface_architecture_like_eager(loaded, device):
    """The GPU route of both jobs: every layer through the Triton kernel (compiled on a GPU, the
    interpreter on CPU), never the reference fallback, with the logits of eager attention on a padded batch."""
    need_module("triton")
    from lmscope.kernels.hf import EntropyCollector, lmscope_attention_unsupported

    model = loaded.model.to(device)
    if lmscope_attention_unsupported(model) is not None:
        assert not runs_through_lmscope_attention(model)  # and no other architecture
        pytest.skip(f"{loaded.name} does not run through lmscope's attention: no kernel route; its attention-matrix "
                    "route is checked by test_entropy_matches_eager_attention_matrices and the zero-query tests here "
                    "(GPT-Neo's in test_entropy.py)")
    ids = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 10:] = 0  # right padding
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        with EntropyCollector(model, backend="triton") as col:
            got = model(input_ids=ids, attention_mask=mask).logits
    assert col.backends == {"triton"} and col.layers == [0, 1, 2]
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
