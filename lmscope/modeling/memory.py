"""Giving device memory back (torch only: the worker calls it after an out-of-memory failure without
importing transformers)."""

from __future__ import annotations

import gc

import torch


def free_memory() -> None:
    """Give memory no tensor uses back: collect cycles, and empty torch's CUDA cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
