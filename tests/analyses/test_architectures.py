"""Every registrable architecture runs `norms` and `entropy`, checked against the model's own outputs.

For each `model_type` in lmscope.catalog.SUPPORTED_ARCHITECTURES a tiny random-init model: the norms
job's trajectories against `output_hidden_states` of each sample read alone (no padding, so batching
and padding are checked too, ALiBi included), and the entropy job's per-layer, per-head, per-position
means against eager attention matrices turned into -Σ p ln p in float64; and, for the architectures
that go through transformers' attention interface, a padded batch through the Triton kernel alone
with the logits of eager attention (the route a GPU worker takes).
"""

from __future__ import annotations

import copy

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
    "falcon": lambda: T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     initializer_range=0.2, bos_token_id=256, eos_token_id=257),
    "gptj": lambda: T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=128,
                                 initializer_range=0.2, bos_token_id=256, eos_token_id=257),
    "bloom": lambda: T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=3, n_head=4, initializer_range=0.2,
                                   bos_token_id=256, eos_token_id=257, pad_token_id=258),
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
    if loaded.name in {"falcon", "gptj", "bloom"}:  # attention computed in their own modules
        assert ctx.environment["kernel_backend"] == entropy.MATRIX_ROUTE
    else:
        assert ctx.environment["kernel_backend"] in ("reference", "triton")


@pytest.mark.gpu
def test_the_fused_kernel_runs_every_interface_architecture_like_eager(loaded, device):
    """The GPU route of both jobs: every layer through the Triton kernel (compiled on a GPU, the
    interpreter on CPU), never the reference fallback, with the logits of eager attention on a padded batch."""
    pytest.importorskip("triton")
    from lmscope.kernels.hf import EntropyCollector, lmscope_attention_unsupported

    model = loaded.model.to(device)
    if lmscope_attention_unsupported(model) is not None:
        assert loaded.name in {"falcon", "gptj", "bloom"}  # and no other architecture
        return
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
