"""The byte tokenizer and BPE training: exact round trips on real text, ids as specified, offline reload."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lmscope.catalog import BUILTIN_MODELS, BYTE_VOCAB_SIZE
from lmscope.modeling.tokenization import byte_tokenizer, train_bpe_tokenizer

ODD_TEXT = "naïve café — 日本語 😀\ttab\x00nul  two spaces\nnewline"


def _non_ascii_docs(docs, n=20):
    picked = [d for d in docs if any(ord(c) > 127 for c in d)][:n]
    assert picked, "WikiText should contain non-ASCII text (é, –, …)"
    return picked


def test_byte_tokenizer_ids_are_the_utf8_bytes_after_bos(wikitext_docs):
    tok = byte_tokenizer()
    for text in _non_ascii_docs(wikitext_docs) + [ODD_TEXT]:
        ids = tok(text)["input_ids"]
        assert ids == [256] + list(text.encode("utf-8"))  # BOS, then one id per byte
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))


def test_byte_tokenizer_special_ids_match_the_builtin_models():
    tok = byte_tokenizer()
    assert len(tok) == BYTE_VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    for cfg in BUILTIN_MODELS.values():
        assert cfg["bos_token_id"] == tok.bos_token_id and cfg["eos_token_id"] == tok.eos_token_id


def test_byte_tokenizer_reloads_offline(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert again(ODD_TEXT)["input_ids"] == [256] + list(ODD_TEXT.encode())
    assert again.eos_token_id == 257


def test_bpe_round_trips_held_out_text_and_compresses(wikitext_docs, tmp_path):
    train, held_out = wikitext_docs[:400], wikitext_docs[400:600]
    tok = train_bpe_tokenizer(train, 512)
    assert len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in ("<bos>", "<eos>", "<pad>")] == [0, 1, 2]
    n_tokens = n_bytes = 0
    for text in held_out + [ODD_TEXT]:  # ODD_TEXT has bytes never seen in training
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        n_tokens += len(ids)
        n_bytes += len(text.encode())
    assert n_tokens < 0.6 * n_bytes  # 512 tokens already halve the length: merges learned on WikiText apply to unseen WikiText

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in held_out[:20]:
        assert again(text)["input_ids"] == tok(text)["input_ids"]
        assert again(text)["input_ids"][0] == 0  # BOS in front, like the byte tokenizer


def test_bpe_refuses_a_vocabulary_smaller_than_the_bytes(wikitext_docs):
    with pytest.raises(ValueError, match="too small"):
        train_bpe_tokenizer(wikitext_docs[:10], 200)
