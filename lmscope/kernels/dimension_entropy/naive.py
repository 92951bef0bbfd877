"""Plain-PyTorch dimension-wise attention entropy (reference and CPU path).

For every head dimension i the score matrix is the rank-1 outer product
S_i = scale * q[:, i] k[:, i]ᵀ; we return the entropy of each row of softmax(S_i).
"""

from __future__ import annotations

import math

import torch

from ..attention_entropy.naive import block_rows_for, keys_seen_by, softmax_entropy, visible_keys
from ..dispatch import repeat_kv


def dimension_entropy_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    chunk: int = 8,
    block_rows: int | None = None,
) -> torch.Tensor:
    """Entropy [B, H, D, N] (float32, nats).

    Builds [B, H, chunk, rows, keys] scores at a time: ``chunk`` dimensions, a block of query rows (about
    ``SCORES_PER_BLOCK`` scores unless ``block_rows``) and the keys those rows see.
    """
    b, h, n, d = q.shape
    k = repeat_kv(k, h)  # grouped-query attention
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qf = q.float().transpose(-1, -2)  # [B, H, D, N]
    kf = k.float().transpose(-1, -2)
    entropy = torch.zeros(b, h, d, n, device=q.device)  # written block by block, as in the attention's
    if block_rows is None:
        block_rows = block_rows_for(q.device, b * h * min(chunk, d) * n)
    for i in range(0, d, chunk):
        for start in reversed(range(0, n, block_rows)):  # shrinking causal blocks reuse the memory freed
            rows = range(start, min(n, start + block_rows))
            keys = keys_seen_by(rows, n, n, causal=causal, window=None)
            s = (qf[:, :, i:i + chunk, rows.start:rows.stop, None]
                 * kf[:, :, i:i + chunk, None, keys.start:keys.stop] * scale)
            allowed = visible_keys(n, n, causal=True, device=q.device, rows=rows, keys=keys) if causal else None
            entropy[:, :, i:i + chunk, rows.start:rows.stop] = softmax_entropy(s, allowed)[2]
    return entropy
