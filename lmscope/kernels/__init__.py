"""lmscope.kernels: attention kernels with entropy, each beside a plain-PyTorch reference.

Importing this package needs only torch; Triton is imported when a Triton kernel first runs, and
the HF integration lives in :mod:`lmscope.kernels.hf` (imports transformers). See docs/kernels.md.
"""

from .attention_entropy import AttentionEntropy, attention_with_entropy
from .dimension_entropy import dimension_entropy, dimension_entropy_backend
from .dispatch import kernel_backend
from .favor import draw_favor_projection, favor_attention, favor_backend
from .linformer import draw_linformer_projections, linformer_attention, linformer_backend

__all__ = [
    "AttentionEntropy",
    "attention_with_entropy",
    "dimension_entropy",
    "dimension_entropy_backend",
    "draw_favor_projection",
    "draw_linformer_projections",
    "favor_attention",
    "favor_backend",
    "kernel_backend",
    "linformer_attention",
    "linformer_backend",
]
