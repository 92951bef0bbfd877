"""Documents → model inputs: fixed-length token windows, or one sample per document.

``token_windows`` is what training and the attention analyses read: the corpus as one token stream
(documents joined with EOS) cut into consecutive, non-overlapping windows. ``document_samples`` is
what the norms analysis reads: each long-enough document on its own, with the tokenizer's usual
special tokens (e.g. BOS for LLaMA), cut to ``max_tokens + 1`` tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

_CHUNK = 256  # documents tokenized per call: fast (Rust, batched) and we stop as soon as we have enough


def _encode(tokenizer, docs: Sequence[str], *, special: bool) -> list[list[int]]:
    # split_special_tokens: a document's text "<eos>" or "<|endoftext|>" is text, not a document boundary
    return tokenizer(list(docs), add_special_tokens=special, split_special_tokens=True)["input_ids"]


def token_stream(tokenizer, documents: Sequence[str], *, limit: int | None = None,
                 special: bool = False) -> torch.LongTensor:
    """Token ids of ``doc0 EOS doc1 EOS doc2 …`` (EOS between documents), at most ``limit`` of them.

    ``special``: each document as the tokenizer usually encodes it (e.g. ``<s>`` first for LLaMA's),
    which is what a model trained on the stream will later be given."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to join documents with; set tokenizer.eos_token")
    pieces: list[torch.Tensor] = []
    produced = 0
    for start in range(0, len(documents), _CHUNK):
        chunk: list[int] = []
        for i, ids in enumerate(_encode(tokenizer, documents[start:start + _CHUNK], special=special)):
            if start + i > 0:
                chunk.append(eos)
            chunk.extend(ids)
        pieces.append(torch.tensor(chunk, dtype=torch.long))
        produced += len(chunk)
        if limit is not None and produced >= limit:
            break
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return stream if limit is None else stream[:limit]


def token_windows(tokenizer, documents: Sequence[str], seq_len: int, num_windows: int | None, *,
                  special: bool = False, bos_first: bool = False) -> torch.LongTensor:
    """``[n, seq_len]`` consecutive non-overlapping windows of the joined token stream, in order.

    ``n = min(num_windows, available)``; ``num_windows=None`` takes every full window. A trailing
    partial window is dropped. ``bos_first``: each window is the tokenizer's BOS followed by the next
    seq_len − 1 tokens of the stream (still cut without overlap), as pretrained LLaMA-family models saw
    their inputs start. Raises ValueError when not even one window fits, or there is no BOS to put first.
    """
    if seq_len < 1 + bos_first:
        raise ValueError(f"seq_len must be ≥ {1 + bos_first}, got {seq_len}")
    bos = tokenizer.bos_token_id
    if bos_first and bos is None:
        raise ValueError("the tokenizer has no BOS token to start each window with")
    stream_len = seq_len - bos_first
    limit = None if num_windows is None else stream_len * num_windows
    ids = token_stream(tokenizer, documents, limit=limit, special=special)
    n = len(ids) // stream_len
    if n == 0:
        raise ValueError(f"the documents hold {len(ids)} tokens, fewer than one window of {stream_len}; "
                         "use a shorter seq_len or a larger dataset")
    windows = ids[: n * stream_len].view(n, stream_len)
    if bos_first:
        windows = torch.cat([torch.full((n, 1), bos, dtype=windows.dtype), windows], dim=1)
    return windows


def document_samples(tokenizer, documents: Sequence[str], *, min_words: int, max_tokens: int,
                     max_samples: int | None) -> list[list[int]]:
    """One token-id list per document with ≥ ``min_words`` words: its first ``max_tokens + 1`` tokens.

    Encoded with the tokenizer's usual special tokens (BOS for LLaMA-style tokenizers, none for
    GPT-2), so a sample looks like what the model saw in training. Documents keep their order.
    """
    kept = [d for d in documents if len(d.split()) >= min_words]
    samples: list[list[int]] = []
    for start in range(0, len(kept), _CHUNK):
        for ids in _encode(tokenizer, kept[start:start + _CHUNK], special=True):
            samples.append(ids[: max_tokens + 1])
            if max_samples is not None and len(samples) >= max_samples:
                return samples
    return samples
