"""load_model, ModelCache, token_windows and document_samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmscope.modeling.loading import ModelCache, ModelLoadError, load_model
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.modeling.windows import document_samples, token_windows

TEXT = "Robert Boulter is an English film , television and theatre actor ."


def _logits(lm, text=TEXT):
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return lm.model(input_ids=ids).logits


def _unique_numel(model) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_builtin_is_identical_in_every_load_and_leaves_the_callers_rng_alone(name):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = load_model(name, "builtin", None)
    assert torch.equal(torch.rand(3), expected_next)  # the fixed seed was used in a forked RNG
    b = load_model(name, "builtin", None)
    assert a.model is not b.model
    assert torch.equal(_logits(a), _logits(b))
    assert not a.model.training


def test_builtin_is_identical_in_a_fresh_process():
    code = ("import torch, json; from lmscope.modeling.loading import load_model;"
            "m = load_model('tiny-llama', 'builtin', None).model;"
            "print(json.dumps([p.double().sum().item() for p in m.parameters()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(_repo_root())})
    here = [p.double().sum().item() for p in load_model("tiny-llama", "builtin", None).model.parameters()]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def _repo_root():

    return Path(__file__).resolve().parents[2]


def test_builtin_info_describes_the_model():
    gpt2 = load_model("tiny-gpt2", "builtin", None)
    llama = load_model("tiny-llama", "builtin", None)
    assert gpt2.info["architecture"] == "gpt2" and not gpt2.info["gated_ffn"]
    assert llama.info["architecture"] == "llama" and llama.info["gated_ffn"]
    assert (llama.info["num_layers"], llama.info["num_heads"], llama.info["num_kv_heads"]) == (4, 4, 2)
    assert llama.model.model.layers[0].self_attn.k_proj.out_features == 2 * 16  # 2 KV heads of size 64/4
    for lm in (gpt2, llama):
        assert lm.info["num_parameters"] == _unique_numel(lm.model)
        assert lm.info["vocab_size"] == 259 and lm.info["hidden_size"] == 64
        assert lm.info["dtype"] == "float32"


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_builtin_parameter_count_without_torch_matches_the_loaded_model(name):
    # The API registers the built-ins without torch, so `lmscope models` lists a count from the shapes.
    from lmscope.catalog import BUILTIN_MODELS, builtin_parameter_count

    assert builtin_parameter_count(BUILTIN_MODELS[name]) == _unique_numel(load_model(name, "builtin", None).model)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_a_saved_directory_reloads_with_the_same_logits(name, tmp_path):
    original = load_model(name, "builtin", None)
    original.model.save_pretrained(tmp_path)
    original.tokenizer.save_pretrained(tmp_path)
    for source in ("directory", "checkpoint"):
        again = load_model("copy", source, str(tmp_path))
        assert again.tokenizer(TEXT)["input_ids"] == original.tokenizer(TEXT)["input_ids"]
        assert torch.equal(_logits(again), _logits(original))
        assert again.info["num_parameters"] == original.info["num_parameters"]
        # the model's own layers: transformers >= 5.25 swaps in kernels from the Hub unless asked not to
        assert getattr(again.model, "use_kernels", False) is False
    half = load_model("copy", "directory", str(tmp_path), dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.info["dtype"] == "bfloat16"
    torch.testing.assert_close(_logits(half).float(), _logits(original), atol=2e-2, rtol=2e-2)  # bf16 weights: ~5e-3 off


def test_a_bf16_model_keeps_rope_frequencies_in_float32(tmp_path):
    """Position p rotates by p * inv_freq: rounded to bf16, inv_freq puts position 4096 radians off."""
    full = load_model("tiny-llama", "builtin", None)
    full.model.save_pretrained(tmp_path)
    full.tokenizer.save_pretrained(tmp_path)
    head_dim = full.model.config.hidden_size // full.model.config.num_attention_heads
    # the textbook frequencies, theta = 10000 (LLaMA's default), in float64
    expected = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    for half in (load_model("tiny-llama", "builtin", None, dtype="bfloat16"),
                 load_model("copy", "directory", str(tmp_path), dtype="bfloat16")):
        assert next(half.model.parameters()).dtype == torch.bfloat16
        freqs = [b for n, b in half.model.named_buffers() if n.endswith("inv_freq")]
        assert freqs and all(b.dtype == torch.float32 for b in freqs)
        for b in freqs:
            torch.testing.assert_close((4096 * b).double(), 4096 * expected, rtol=1e-6, atol=1e-5)


def test_architectures_without_sdpa_load_with_eager_attention(tmp_path):
    """Bloom has no SDPA attention in transformers: asking for it refused to load; GPT-2 still gets sdpa."""
    from transformers import AutoModelForCausalLM, BloomConfig

    torch.manual_seed(0)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=259, hidden_size=32, n_layer=2, n_head=2))
    bloom.save_pretrained(tmp_path / "bloom")
    lm = load_model("b", "directory", str(tmp_path / "bloom"))
    assert lm.model.config._attn_implementation == "eager"
    assert torch.equal(_logits(lm), bloom.eval()(input_ids=byte_tokenizer()(TEXT, return_tensors="pt")["input_ids"]).logits)
    assert load_model("tiny-gpt2", "builtin", None).model.config._attn_implementation == "sdpa"


def test_directory_without_tokenizer(tmp_path):
    lm = load_model("tiny-gpt2", "builtin", None)
    lm.model.save_pretrained(tmp_path / "bytes")  # vocabulary 259: the byte tokenizer is implied
    assert load_model("m", "directory", str(tmp_path / "bytes")).tokenizer(TEXT)["input_ids"] == \
        byte_tokenizer()(TEXT)["input_ids"]
    lm.model.resize_token_embeddings(300)
    lm.model.save_pretrained(tmp_path / "other")
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_model("m", "directory", str(tmp_path / "other"))


def test_bad_requests_say_what_to_change(tmp_path):
    with pytest.raises(ModelLoadError, match="built-ins: tiny-gpt2"):
        load_model("tiny-nope", "builtin", None)
    with pytest.raises(ModelLoadError, match="use one of"):
        load_model("tiny-gpt2", "builtin", None, dtype="float8")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model("m", "directory", str(tmp_path))


def test_model_cache_is_lru_by_name_dtype_device():
    cache = ModelCache(capacity=2)
    a = cache.get("tiny-gpt2", "builtin", None)
    assert cache.get("tiny-gpt2", "builtin", None) is a  # hit: no reload
    b = cache.get("tiny-llama", "builtin", None)
    cache.get("tiny-gpt2", "builtin", None)  # a is now the most recently used
    c = cache.get("tiny-gpt2", "builtin", None, dtype="bfloat16")  # a different key evicts the LRU (b)
    assert len(cache) == 2 and c is not a
    assert ("tiny-llama", "float32", "cpu") not in cache and ("tiny-gpt2", "float32", "cpu") in cache
    assert cache.get("tiny-llama", "builtin", None) is not b  # reloaded after eviction


def test_a_name_registered_again_with_other_weights_is_not_served_from_the_cache(tmp_path):
    """`lmscope models delete --run R` and a new run R: R@step0 names other files now, and the worker that
    cached the old ones must load the new ones."""
    cache = ModelCache(capacity=2)
    for name in ("old", "new"):
        lm = load_model("tiny-gpt2", "builtin", None)
        with torch.no_grad():
            lm.model.lm_head.weight.fill_(1.0 if name == "old" else 2.0)  # tied: the embeddings too
        lm.model.save_pretrained(tmp_path / name)
        lm.tokenizer.save_pretrained(tmp_path / name)
        for entry in os.scandir(tmp_path / name):  # the same file times: only the path tells them apart
            os.utime(entry.path, ns=(10**18, 10**18))
    first = cache.get("R@step0", "checkpoint", str(tmp_path / "old"))
    assert cache.get("R@step0", "checkpoint", str(tmp_path / "old")) is first  # same files: a hit
    again = cache.get("R@step0", "checkpoint", str(tmp_path / "new"))
    assert again is not first and again.model.lm_head.weight[0, 0].item() == 2.0 and len(cache) == 1
    # a retried run rewrites its checkpoint in place: the same path, newer files
    for entry in os.scandir(tmp_path / "new"):
        os.utime(entry.path, ns=(entry.stat().st_atime_ns, entry.stat().st_mtime_ns + 10**9))
    assert cache.get("R@step0", "checkpoint", str(tmp_path / "new")) is not again


def test_model_cache_evicts_until_a_big_model_fits(tmp_path, monkeypatch):
    """On a GPU, a model that fits once the cached ones are gone is loaded after evicting them, not
    spread over devices beside them. A fake device with room for 3 units: each model is one unit,
    except "big", which is two."""
    from lmscope.modeling import loading

    lm = load_model("tiny-gpt2", "builtin", None)
    for name in ("small1", "small2", "big"):
        lm.model.save_pretrained(tmp_path / name)
    cache = ModelCache(capacity=3)
    units = {"small1": 1, "small2": 1, "big": 2}
    asked = []

    def fake_fit(source, path, dtype, device):
        asked.append(Path(path).name)
        return sum(units[name] for name, _, _ in cache._models) + units[Path(path).name] <= 3

    monkeypatch.setattr(loading, "weights_fit", fake_fit)
    cache.get("small1", "directory", str(tmp_path / "small1"))
    cache.get("small2", "directory", str(tmp_path / "small2"))
    assert len(cache) == 2  # both fit: nothing was evicted
    cache.get("big", "directory", str(tmp_path / "big"))  # 1 + 1 + 2 > 3: the oldest (small1) goes
    assert [k[0] for k in cache._models] == ["small2", "big"]
    asked.clear()
    cache.get("small2", "directory", str(tmp_path / "small2"))  # a hit asks nothing
    assert [k[0] for k in cache._models] == ["big", "small2"] and asked == []
    # a model that fits nowhere: the models cached on this device go (they might have been the room),
    # those on another device stay (they free nothing here), and it loads anyway (spread, on a GPU)
    cache._models[("elsewhere", "float32", "cuda:1")] = object()
    monkeypatch.setattr(loading, "weights_fit", lambda source, path, dtype, device: False)
    cache.get("small1", "directory", str(tmp_path / "small1"))
    assert list(cache._models) == [("elsewhere", "float32", "cuda:1"), ("small1", "float32", "cpu")]


def test_token_windows_hand_example():
    tok = byte_tokenizer()  # id = byte value, EOS = 257
    docs = ["ab", "cde", "f"]  # stream: a b EOS c d e EOS f  (EOS between documents only)
    a, b, c, d, e, f, eos = 97, 98, 99, 100, 101, 102, 257
    assert token_windows(tok, docs, 3, None).tolist() == [[a, b, eos], [c, d, e]]  # trailing "EOS f" dropped
    assert token_windows(tok, docs, 2, None).tolist() == [[a, b], [eos, c], [d, e], [eos, f]]
    assert token_windows(tok, docs, 2, 3).tolist() == [[a, b], [eos, c], [d, e]]
    assert token_windows(tok, docs, 2, 99).shape == (4, 2)
    assert token_windows(tok, docs, 2, 1).dtype == torch.long
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tok, docs, 9, None)
    # bos_first: BOS (256), then the next seq_len − 1 tokens of the same stream, still without overlap
    bos = 256
    assert token_windows(tok, docs, 3, None, bos_first=True).tolist() == [
        [bos, a, b], [bos, eos, c], [bos, d, e], [bos, eos, f]]
    assert token_windows(tok, docs, 4, 1, bos_first=True).tolist() == [[bos, a, b, eos]]
    with pytest.raises(ValueError, match="seq_len must be ≥ 2"):
        token_windows(tok, docs, 1, None, bos_first=True)
    tok.bos_token = None
    with pytest.raises(ValueError, match="no BOS token"):
        token_windows(tok, docs, 3, None, bos_first=True)


def test_special_token_text_in_a_document_is_text():
    """A document quoting "<eos>" made a fake document boundary (id 257) instead of its 5 bytes."""
    tok = byte_tokenizer()
    text = "a<eos>b<bos>"
    assert token_windows(tok, [text, "c"], 14, None).tolist() == [list(text.encode()) + [257, ord("c")]]
    assert document_samples(tok, [text], min_words=1, max_tokens=50, max_samples=None) == [[256] + list(text.encode())]


def test_token_windows_cover_real_text_in_order(wikitext_docs):
    tok = byte_tokenizer()
    docs = wikitext_docs[:300]  # more than one tokenization chunk
    stream = []
    for i, doc in enumerate(docs):
        stream += ([257] if i else []) + list(doc.encode())
    windows = token_windows(tok, docs, 64, None)
    assert windows.flatten().tolist() == stream[: len(stream) // 64 * 64]


def test_document_samples_filter_truncate_and_keep_special_tokens():
    tok = byte_tokenizer()
    docs = ["one two three", "short", "four five six seven", "x y z"]
    samples = document_samples(tok, docs, min_words=3, max_tokens=5, max_samples=None)
    assert samples == [[256] + list(b"one t"), [256] + list(b"four "), [256] + list(b"x y z")]
    assert document_samples(tok, docs, min_words=3, max_tokens=5, max_samples=2) == samples[:2]
    assert document_samples(tok, docs, min_words=4, max_tokens=100, max_samples=None) == [[256] + list(b"four five six seven")]


def test_a_tokenizer_with_more_ids_than_embeddings_is_refused_at_load(tmp_path):
    """Registration reads tokenizer.json; a directory it could not judge (here: tokenizer files changed
    afterwards) is checked when loaded, before any job indexes past the embeddings with an IndexError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=200)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)  # 259 ids
    with pytest.raises(ModelLoadError, match=r"the tokenizer \(259 tokens\) produces token ids up to 258, but the "
                                             r"model has 200 token embeddings.*resize_token_embeddings"):
        load_model("m", "directory", str(tmp_path))


def test_a_sentencepiece_only_directory_loads(tmp_path):
    """tokenizer.model (SentencePiece) with no tokenizer.json, as older LLaMA-family checkpoints ship: the
    docs list it, and it needs the sentencepiece and protobuf packages the worker installs."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([TEXT, "He had a guest starring role on the television series The Bill ."] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    model_dir = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=60, bos_token_id=1, eos_token_id=2)).save_pretrained(model_dir)
    (tmp_path / "sp.model").rename(model_dir / "tokenizer.model")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                                "eos_token": "</s>", "unk_token": "<unk>"}))
    lm = load_model("sp", "directory", str(model_dir))
    ids = lm.tokenizer(TEXT)["input_ids"]
    assert len(lm.tokenizer) == 60 and 3 < len(ids) < len(TEXT) and max(ids) < 60
    assert lm.tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == TEXT.replace(" ", "")


def test_the_memory_a_job_may_fill_is_bounded_by_its_container(tmp_path):
    """A container's cgroup limit bounds what a job may fill, whatever the host has free (MemAvailable):
    limit less usage, for cgroup v2 and v1; no limit ("max", v1's ~2^63) is none."""
    from lmscope.modeling.memory import _cgroup_room

    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert _cgroup_room(tmp_path) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory/memory.limit_in_bytes").write_text("2048")
    (v1 / "memory/memory.usage_in_bytes").write_text("4096")  # over its limit: no room at all
    assert _cgroup_room(v1) == 0
    (v1 / "memory/memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert _cgroup_room(v1) is None and _cgroup_room(tmp_path / "absent") is None
