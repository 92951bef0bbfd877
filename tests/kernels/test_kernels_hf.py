"""The transformers integration: same logits as eager attention, same entropies as its matrices."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from lmscope.kernels.hf import (  # noqa: E402
    ATTENTION_NAME,
    EntropyCollector,
    UnsupportedAttention,
    lmscope_attention,
    lmscope_attention_unsupported,
    use_lmscope_attention,
)
from tests.conftest import computes_attention_itself

VOCAB = 128


def _eager(config):
    """A random-init causal LM of `config` on eager attention (the reference the tests compare with)."""
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# the LLaMA-family shape the builders share: 2 layers, 4 query heads over 2 key/value heads
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


def _gpt2():
    return _eager(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                                          bos_token_id=0, eos_token_id=0))


def _llama():
    return _eager(transformers.LlamaConfig(**LLAMA_LIKE))


def _gemma2():
    """Attention logit soft-capping at 1.0 on peaky random scores: the cap changes the result (checked below)."""
    return _eager(transformers.Gemma2Config(**LLAMA_LIKE, head_dim=16, pad_token_id=0, attn_logit_softcapping=1.0,
                                            query_pre_attn_scalar=1, initializer_range=0.2))


def _mistral_window():
    """A sliding window of 4 keys, shorter than the batches below."""
    return _eager(transformers.MistralConfig(**LLAMA_LIKE, sliding_window=4))


MODELS = {"gpt2": _gpt2, "llama": _llama, "gemma2": _gemma2}


def _batch(n=13, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, n - 3 :] = 0  # right padding
    return ids.to(device), mask.to(device)


def _eager_entropies(attentions):
    return [-torch.special.xlogy(a.double(), a.double()).sum(-1) for a in attentions]


@pytest.fixture(params=sorted(MODELS))
def model(request, device):
    torch.manual_seed(0)
    return MODELS[request.param]().to(device)


def test_logits_and_entropies_match_eager(model, device):
    ids, mask = _batch(device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_attentions=True)
        with EntropyCollector(model) as col:
            got = model(ids, attention_mask=mask)
    valid = mask.bool()  # eager gives padded queries with no visible key arbitrary rows: compare real tokens
    torch.testing.assert_close(got.logits[valid], ref.logits[valid], atol=1e-5, rtol=1e-5)
    heads = model.config.num_attention_heads
    assert col.layers == list(range(model.config.num_hidden_layers))
    for ent, want in zip(col.entropy, _eager_entropies(ref.attentions)):
        assert ent.shape == (3, heads, ids.shape[1]) and ent.dtype == torch.float32
        rows = valid[:, None, :].expand_as(ent)
        torch.testing.assert_close(ent.double()[rows], want[rows], atol=2e-5, rtol=0)
    # sanity: real entropies are not trivially zero, and bounded by ln(visible keys)
    assert col.entropy[0][0, :, -1].min() > 0.1
    assert (col.entropy[0][0] <= torch.log(torch.arange(1, ids.shape[1] + 1, device=device)) + 1e-5).all()


def test_unpadded_batch_without_mask(model, device):
    ids, _ = _batch(seed=1, device=device)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        with EntropyCollector(model) as col:
            got = model(ids)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for ent, want in zip(col.entropy, _eager_entropies(ref.attentions)):
        torch.testing.assert_close(ent.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("build", [_llama, _gemma2, _mistral_window], ids=["llama", "gemma2-softcap", "mistral-window"])
def test_triton_backend_through_the_model(triton_backend, device, build):
    """Padding, Gemma 2's soft-capping and sliding windows all go through the fused kernel."""
    torch.manual_seed(1)
    model = build().to(device)
    ids, mask = _batch(n=11, seed=2, device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_attentions=True)
        with EntropyCollector(model, backend=triton_backend) as col:
            got = model(ids, attention_mask=mask)
    assert col.backends == {"triton"}  # not a fallback to the reference path
    valid = mask.bool()
    torch.testing.assert_close(got.logits[valid], ref.logits[valid], atol=1e-5, rtol=1e-5)
    for ent, want in zip(col.entropy, _eager_entropies(ref.attentions)):
        rows = valid[:, None, :].expand_as(ent)
        torch.testing.assert_close(ent.double()[rows], want[rows], atol=2e-5, rtol=0)


def test_implementation_is_restored_and_collector_is_scoped(model, device):
    ids, _ = _batch(seed=3, device=device)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad(), EntropyCollector(model) as col:
        assert model.config._attn_implementation == ATTENTION_NAME
        model(ids)
    assert model.config._attn_implementation == "eager"
    assert len(col.entropy) == model.config.num_hidden_layers
    before = [e.clone() for e in col.entropy]
    with torch.no_grad():
        model(ids[:, :5])  # outside the block: nothing recorded
    assert all(torch.equal(a, b) for a, b in zip(before, col.entropy))


def test_capture_qkv_is_post_rope_and_reproduces_eager(device):
    torch.manual_seed(2)
    model = _llama().to(device)
    ids, _ = _batch(seed=4, device=device)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        with EntropyCollector(model, capture_qkv=True, to_cpu=True) as col:
            model(ids)
    n, d = ids.shape[1], model.config.head_dim
    for layer, attn in enumerate(ref.attentions):
        q, k, v = col.qkv[layer]
        assert q.device.type == "cpu" and not q.requires_grad
        assert q.shape == (3, 4, n, d) and k.shape == v.shape == (3, 2, n, d)  # k, v keep H_kv heads
        k = k.repeat_interleave(2, dim=1).double()
        s = q.double() @ k.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(torch.softmax(s, -1), attn.double().cpu(), atol=1e-5, rtol=0)


def test_collector_records_each_layers_own_scale(device):
    """GPT-2 with scale_attn_by_inverse_layer_idx: layer l scales by 1/(√D·(l+1)), not 1/√D."""
    cfg = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, scale_attn_by_inverse_layer_idx=True,
                                  initializer_range=0.2)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(cfg).eval().to(device)
    ids, _ = _batch(seed=6, device=device)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        with EntropyCollector(model, capture_qkv=True) as col:
            model(ids)
    d = cfg.n_embd // cfg.n_head
    n = ids.shape[1]
    for layer, attn in enumerate(ref.attentions):
        assert col.scaling[layer] == pytest.approx(1 / (math.sqrt(d) * (layer + 1)))
        # the recorded scale reproduces the model's own attention matrix from the captured q, k
        q, k, _ = (t.double() for t in col.qkv[layer])
        s = (q @ k.transpose(-1, -2)) * col.scaling[layer]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        torch.testing.assert_close(torch.softmax(s, -1), attn.double(), atol=1e-5, rtol=0)
    assert col.sliding_window == {}
    col.clear()
    assert col.scaling == {}


def test_collector_records_sliding_windows(backend, device):
    """Mistral with sliding_window < N: every layer reports its window, and entropies match eager."""
    torch.manual_seed(4)
    model = _mistral_window().to(device)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        with EntropyCollector(model, backend=backend) as col:
            model(ids)
    assert col.sliding_window == {0: 4, 1: 4} and col.backends == {backend}
    for got, want in zip(col.entropy, _eager_entropies(ref.attentions)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    assert float(col.entropy[0][..., 8:].max()) <= math.log(4) + 1e-5  # four visible keys, not t + 1


def test_use_lmscope_attention(model, device):
    ids, mask = _batch(seed=5, device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        use_lmscope_attention(model)
        assert model.config._attn_implementation == ATTENTION_NAME
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama-gqa"])
def test_generation_with_kv_cache(backend, device, build):
    """Decoding with a dynamic cache: each step is one query against the longer cache (aligned bottom-right:
    the query sees every cached key that is not padding). Every step's logits are eager attention's, and
    its entropies (recorded after each forward pass: a pass overwrites the last) are those of the last
    row of eager's attention matrices for that step, per layer and head, with a left-padded prompt too."""
    torch.manual_seed(3)
    model = build().to(device)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the decode steps' mask is "every key but the first two"
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, output_attentions=True, **kw)
        with EntropyCollector(model, backend=backend) as col:
            steps = []
            hook = model.register_forward_hook(lambda *_: steps.append([e.clone() for e in col.entropy]))
            try:
                got = model.generate(ids, **kw)
            finally:
                hook.remove()
    assert col.backends == {backend}
    assert torch.equal(got.sequences, ref.sequences)
    assert len(steps) == len(got.logits) == len(ref.attentions) == 4
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    heads = model.config.num_attention_heads
    for t, (entropies, attentions) in enumerate(zip(steps[1:], ref.attentions[1:]), start=1):
        for ent, attn in zip(entropies, attentions):
            # one query over the prompt and the t tokens generated before it
            assert ent.shape == (2, heads, 1) and attn.shape == (2, heads, 1, 6 + t)
            torch.testing.assert_close(ent.double(), _eager_entropies([attn])[0], atol=2e-5, rtol=0)
            # more than one key seen: a top-left aligned query would see one key (entropy 0), or none
            assert ent.min() > 0.1


@pytest.mark.parametrize("padded", [False, True], ids=["one", "left-padded"])
@pytest.mark.parametrize("build", [_llama, _gemma2, _mistral_window], ids=["llama", "gemma2", "mistral-window"])
def test_generation_with_a_static_cache(backend, device, build, padded):
    """A static cache's prefill comes with no mask and Nk = the cache length > Nq: sdpa's top-left
    is_causal, so the empty slots after the prompt are not keys (they were, bottom-right aligned).
    With padding the masks cover the whole cache: the slots no query sees are cut off, and the rest
    still goes through the fused kernel."""
    torch.manual_seed(5)
    model = build().to(device)
    ids = torch.randint(1, VOCAB, (2 if padded else 1, 9), generator=torch.Generator().manual_seed(9)).to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
              cache_implementation="static", attention_mask=mask)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        with EntropyCollector(model, backend=backend) as col:
            got = model.generate(ids, **kw)
    assert col.backends == {backend}
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_training_mode_dropout_is_refused(device):
    model = _gpt2().to(device).train()
    ids, _ = _batch(seed=7, device=device)
    with EntropyCollector(model), pytest.raises(ValueError, match="eval"):
        model(ids)


def test_mixed_qkv_dtypes_attend_in_the_value_dtype_like_sdpa(backend, device):
    """Under GPU autocast RoPE hands over float32 q, k with a bf16 v; sdpa would attend in bf16, so must we."""
    from lmscope.kernels.hf import lmscope_attention_forward

    module = _llama().to(device).model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, n_heads, 9, 16, generator=g).to(device) for n_heads in (4, 2))
    v = torch.randn(2, 2, 9, 16, generator=g).to(device=device, dtype=torch.bfloat16)
    with EntropyCollector(module, backend=backend) as col:
        out, _ = lmscope_attention_forward(module, q, k, v, None, scaling=0.25)
    assert out.dtype == torch.bfloat16 and col.backends == {backend}
    want = torch.nn.functional.scaled_dot_product_attention(
        q.bfloat16(), k.bfloat16().repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25)
    torch.testing.assert_close(out.float(), want.transpose(1, 2).float(), atol=2e-2, rtol=2e-2)


def test_soft_capped_scores_are_capped(backend, device):
    """Gemma 2's soft-capping matters here (uncapped, the logits differ), on either path."""
    torch.manual_seed(0)
    model = _gemma2().to(device)
    ids, mask = _batch(device=device)
    with torch.no_grad(), EntropyCollector(model, backend=backend) as col:
        capped = model(ids, attention_mask=mask).logits
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(ids, attention_mask=mask).logits
    assert col.backends == {backend}
    assert (capped - uncapped)[mask.bool()].abs().max() > 1e-2


def test_models_that_compute_attention_themselves_are_refused_by_name(device):
    """GPT-Neo computes its attention in its own module, not through transformers' AttentionInterface."""
    cfg = transformers.GPTNeoConfig(num_layers=1, attention_types=[[["global"], 1]], num_heads=2, hidden_size=32,
                                    vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.GPTNeoForCausalLM(cfg).eval().to(device)
    assert computes_attention_itself(model)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedAttention, match="GPTNeoForCausalLM computes its attention itself"):
        with lmscope_attention(model):
            pass
    assert "AttentionInterface" in lmscope_attention_unsupported(model)
    assert model.config._attn_implementation == before
    assert lmscope_attention_unsupported(_gpt2().to(device)) is None


def test_attention_sinks_are_refused():
    """gpt-oss adds a learnt sink logit to every row (s_aux): neither path computes that softmax."""
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                    num_experts_per_tok=1, max_position_embeddings=64, layer_types=["full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert "s_aux" in lmscope_attention_unsupported(model)


def test_a_forward_pass_reads_its_mask_once_not_once_per_layer(device, monkeypatch):
    """Every layer gets the same mask tensor; reading it costs host syncs and passes over [B,1,N,N]."""
    from lmscope.kernels import hf

    reads = []
    real = hf._split_mask
    monkeypatch.setattr(hf, "_split_mask", lambda *a: reads.append(a[0]) or real(*a))
    torch.manual_seed(0)
    model = _eager(transformers.LlamaConfig(**{**LLAMA_LIKE, "num_hidden_layers": 4})).to(device)
    ids, mask = _batch(device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_attentions=True)
        with EntropyCollector(model) as col:
            got = model(ids, attention_mask=mask)
            assert len(reads) == 1  # 4 layers, one reading
            again = model(ids, attention_mask=mask)  # a new pass builds a new mask: read again
            assert len(reads) == 2
            # a mask changed in place is read again (its version counter moved)
            stored = reads[-1]
            before = hf._split_mask_once(stored, 3, ids.shape[1], ids.shape[1], None)
            stored[0, ..., 0] = ~stored[0, ..., 0] if stored.dtype == torch.bool else torch.finfo(stored.dtype).min
            assert hf._split_mask_once(stored, 3, ids.shape[1], ids.shape[1], None) is not before
            assert len(reads) == 3
    valid = mask.bool()
    torch.testing.assert_close(got.logits[valid], ref.logits[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.logits, got.logits, atol=0, rtol=0)
    for ent, want in zip(col.entropy, _eager_entropies(ref.attentions)):
        rows = valid[:, None, :].expand_as(ent)
        torch.testing.assert_close(ent.double()[rows], want[rows], atol=2e-5, rtol=0)


def test_inference_mode_masks_are_read_without_a_version_counter(device):
    """Inference tensors have no version counter: the mask cache raised under torch.inference_mode()."""
    torch.manual_seed(0)
    model = _llama().to(device)
    ids, mask = _batch(device=device)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    with torch.inference_mode(), EntropyCollector(model) as col:
        got = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)
    assert len(col.entropy) == model.config.num_hidden_layers
