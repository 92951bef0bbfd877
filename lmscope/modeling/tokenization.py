"""Tokenizers lmscope builds itself: the byte tokenizer of the built-ins, and byte-level BPE training.

Both are Hugging Face fast tokenizers (``tokenizers`` library underneath), so they save with
``save_pretrained`` and load back with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``.
The built-ins' byte tokenizer, like LLaMA's, puts ``<bos>`` in front of every encoded text
(``add_special_tokens=True``). The tokenizers a ``train`` job makes (``add_bos=False``) add nothing,
GPT-2's convention: its models learn from documents joined by ``<eos>`` and never see ``<bos>``, so
an analysis of their checkpoints must not feed them one.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmscope.catalog import BYTE_VOCAB_SIZE

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # control bytes, space, etc. move to unused code points 256, 257, ...
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _wrap(tok: Tokenizer, special_tokens: Sequence[str], add_bos: bool) -> PreTrainedTokenizerFast:
    bos, eos, pad = (list(special_tokens) + [None, None, None])[:3]
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   clean_up_tokenization_spaces=False)


def byte_tokenizer(*, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """256 byte tokens (id = byte value) + ``<bos>``=256, ``<eos>``=257, ``<pad>``=258; round-trips any UTF-8.

    ``add_bos``: whether encoding with special tokens puts ``<bos>`` first."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # BPE without merges = one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() == BYTE_VOCAB_SIZE and tok.token_to_id(PAD) == BYTE_VOCAB_SIZE - 1
    return _wrap(tok, SPECIAL_TOKENS, add_bos)


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int, *,
                        special_tokens: Sequence[str] = tuple(SPECIAL_TOKENS),
                        min_frequency: int = 2, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) trained on ``documents``; special tokens (bos, eos, pad) get ids 0, 1, 2.

    Every byte is in the initial alphabet, so any text encodes (no unknown token) and decodes back exactly.
    """
    if vocab_size < 256 + len(special_tokens) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least "
                         f"{256 + len(special_tokens) + 1} (256 bytes + special tokens + one merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's word/space split
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return _wrap(tok, special_tokens, add_bos)
